// fusedlm._C: the compiled extension. Binds the C++ entry points of csrc/ to
// Python; python/fusedlm/ops registers them as torch ops with autograd and
// fake (meta) implementations.
#include <torch/extension.h>

#include "../csrc/ops.h"
#ifdef FUSEDLM_WITH_CUDA
#include "../csrc/cuda/ops.h"
#endif
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

  m.def("bias_gelu_forward", &fusedlm::bias_gelu_forward);
  m.def("bias_gelu_backward", &fusedlm::bias_gelu_backward);
  m.def("gelu_ffn_forward", &fusedlm::gelu_ffn_forward);
  m.def("gelu_ffn_backward", &fusedlm::gelu_ffn_backward);

  m.def("cross_entropy_forward", &fusedlm::cross_entropy_forward);
  m.def("cross_entropy_backward", &fusedlm::cross_entropy_backward);
  m.def("masked_lm_loss_forward", &fusedlm::masked_lm_loss_forward);
  m.def("masked_lm_loss_backward", &fusedlm::masked_lm_loss_backward);
  m.def("attention_forward", &fusedlm::attention_forward);
  m.def("attention_backward", &fusedlm::attention_backward);
  m.def("attention_varlen_forward", &fusedlm::attention_varlen_forward);
  m.def("attention_varlen_backward", &fusedlm::attention_varlen_backward);
  m.def("attention_with_kvcache_forward", &fusedlm::attention_kvcache_forward);
  m.def("unpad_forward", &fusedlm::unpad_forward);
  m.def("pad_forward", &fusedlm::pad_forward);
  m.def("pad_backward", &fusedlm::pad_backward);
  m.def("add_layer_norm_forward", &fusedlm::add_layer_norm_forward);
  m.def("add_layer_norm_backward", &fusedlm::add_layer_norm_backward);
  m.def("lstm_cell_forward", &fusedlm::lstm_cell_forward);
  m.def("lstm_cell_backward", &fusedlm::lstm_cell_backward);

#ifdef FUSEDLM_WITH_CUDA
  // The cuda backend's entry points: the same signatures as the CPU ones above.
  auto cuda = m.def_submodule("cuda", "fusedlm's hand-written CUDA kernels (kernels/cuda)");
  cuda.def("dropout_mask", &fusedlm::cuda::dropout_mask, py::arg("seed"), py::arg("offset"),
           py::arg("shape"), py::arg("p"), py::arg("device_index"));
  cuda.def("add_layer_norm_forward", &fusedlm::cuda::add_layer_norm_forward);
  cuda.def("add_layer_norm_backward", &fusedlm::cuda::add_layer_norm_backward);
  cuda.def("bias_gelu_forward", &fusedlm::cuda::bias_gelu_forward);
  cuda.def("bias_gelu_backward", &fusedlm::cuda::bias_gelu_backward);
  cuda.def("gelu_ffn_forward", &fusedlm::cuda::gelu_ffn_forward);
  cuda.def("gelu_ffn_backward", &fusedlm::cuda::gelu_ffn_backward);
  cuda.def("cross_entropy_forward", &fusedlm::cuda::cross_entropy_forward);
  cuda.def("cross_entropy_backward", &fusedlm::cuda::cross_entropy_backward);
  cuda.def("masked_lm_loss_forward", &fusedlm::cuda::masked_lm_loss_forward);
  cuda.def("masked_lm_loss_backward", &fusedlm::cuda::masked_lm_loss_backward);
  cuda.def("attention_forward", &fusedlm::cuda::attention_forward);
  cuda.def("attention_backward", &fusedlm::cuda::attention_backward);
  cuda.def("attention_varlen_forward", &fusedlm::cuda::attention_varlen_forward);
  cuda.def("attention_varlen_backward", &fusedlm::cuda::attention_varlen_backward);
#if defined(FUSEDLM_EMULATE)
  // The GPU the emulator acts as: "sm_80" or "sm_90a" (FUSEDLM_EMULATE_ARCH).
  cuda.def("emulated_arch", &fusedlm::emu::arch_name);
#endif
#endif
}
