// The backward of a CPU autograd node where its kernel cannot serve: for a gradient that is
// to be differentiated again (taken with create_graph=True), which the kernel would not
// record, and for one taken under a torch.func transform or autograd's own vmap
// (autograd.grad's is_grads_batched), whose wrapped tensors the kernel cannot read. Both run
// fusedlm.ops._op.reference_backward: the reference backend's kernel, in plain PyTorch that
// autograd records and transforms take.
#pragma once
#include <ATen/LegacyBatchedTensorImpl.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/utils/pybind.h>

#include <utility>
#include <vector>

namespace fusedlm {

// Whether the backward being run, of these output gradients, is one the kernel cannot serve.
inline bool needs_reference_backward(const std::vector<at::Tensor>& grads) {
  if (at::GradMode::is_enabled() ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode)) {
    return true;
  }
  for (const auto& grad : grads) {
    if (grad.defined() && at::isBatchedTensor(grad)) return true;
  }
  return false;
}

// The gradients (undefined where None) of op's reference backward on these arguments, for a
// forward that ran on the cpu backend with this dropout probability; raises what Python raises.
template <typename... Args>
std::vector<at::Tensor> reference_backward(const char* op, double dropout_p, Args&&... args) {
  pybind11::gil_scoped_acquire gil;
  const auto grads = pybind11::module_::import("fusedlm.ops._op")
                         .attr("reference_backward")(op, "cpu", dropout_p,
                                                     std::forward<Args>(args)...);
  std::vector<at::Tensor> out;
  for (const auto grad : grads) {
    out.push_back(grad.is_none() ? at::Tensor() : pybind11::cast<at::Tensor>(grad));
  }
  return out;
}

}  // namespace fusedlm
