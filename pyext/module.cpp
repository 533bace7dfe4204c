// fusedlm._C: the compiled extension. Binds the C++ entry points of csrc/ to
// Python; python/fusedlm/ops registers them as torch ops with autograd and
// fake (meta) implementations.
#include <torch/extension.h>

#include "../csrc/ops.h"
#if defined(FUSEDLM_EMULATE)
#include "emulator/runtime.h"
#endif

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusedlm's compiled kernels (CPU, and CUDA when built with it)";
#ifdef FUSEDLM_WITH_CUDA
  m.attr("with_cuda") = true;
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

  m.def("cpu_capability", &fusedlm::cpu_capability);
  m.def("set_cpu_capability", &fusedlm::set_cpu_capability, py::arg("isa"));
  m.def("supported_cpu_capabilities", &fusedlm::supported_cpu_capabilities);
  m.def("dropout_mask", &fusedlm::dropout_mask, py::arg("seed"), py::arg("offset"),
        py::arg("shape"), py::arg("p"));

#define FUSEDLM_BIND(name) m.def(#name, &fusedlm::name);
  FUSEDLM_CPU_OPS(FUSEDLM_BIND)
#undef FUSEDLM_BIND

#ifdef FUSEDLM_WITH_CUDA
  // The cuda backend's entry points: the same signatures as the CPU ones above, and the
  // switches between its kernel paths.
  auto cuda = m.def_submodule("cuda", "fusedlm's hand-written CUDA kernels (kernels/cuda)");
  cuda.def("dropout_mask", &fusedlm::cuda::dropout_mask, py::arg("seed"), py::arg("offset"),
           py::arg("shape"), py::arg("p"), py::arg("device_index"));
#define FUSEDLM_BIND(name) cuda.def(#name, &fusedlm::cuda::name);
  FUSEDLM_CUDA_OPS(FUSEDLM_BIND)
#undef FUSEDLM_BIND
  cuda.def("set_path", &fusedlm::cuda::set_path, py::arg("name"), py::arg("enabled"));
  cuda.def("paths", &fusedlm::cuda::paths);
#if defined(FUSEDLM_EMULATE)
  // The GPU the emulator acts as: "sm_80" or "sm_90a" (FUSEDLM_EMULATE_ARCH).
  cuda.def("emulated_arch", &fusedlm::emu::arch_name);
#endif
#endif
}
