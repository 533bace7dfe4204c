// fusedlm._C: the compiled extension. Binds the C++ entry points of csrc/ and kernels/cuda,
// each of which declares its own binding (csrc/bind.h); python/fusedlm/ops registers them
// as torch ops with autograd and fake (meta) implementations.
#include <torch/extension.h>

#include "../csrc/bind.h"

namespace fusedlm {
std::vector<Binding>& bindings() {
  static std::vector<Binding> all;
  return all;
}
}  // namespace fusedlm

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusedlm's compiled kernels (CPU, and CUDA when built with it)";
#ifdef FUSEDLM_WITH_CUDA
  m.attr("with_cuda") = true;
  // The cuda backend's entry points: the same signatures as the CPU ones, and the switches
  // between its kernel paths.
  m.def_submodule("cuda", "fusedlm's hand-written CUDA kernels (kernels/cuda)");
#else
  m.attr("with_cuda") = false;
#endif
  // FUSEDLM_CUDA=emulate: the CUDA kernels compiled as C++ against the CPU emulator of
  // CUDA; the cuda backend then runs on CPU tensors.
#if defined(FUSEDLM_EMULATE)
  m.attr("cuda_emulated") = true;
#else
  m.attr("cuda_emulated") = false;
#endif
  for (const auto& binding : fusedlm::bindings()) {
    auto target = *binding.submodule ? m.attr(binding.submodule).cast<pybind11::module_>() : m;
    binding.bind(target);
  }
}
