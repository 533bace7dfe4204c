// The backward of a CPU autograd node whose gradient is to be differentiated again (taken
// with create_graph=True): fusedlm.ops._op.differentiable_backward, the reference backend's
// kernel, in plain PyTorch that autograd records. The C++ kernels' backward records nothing,
// so a gradient penalty through them would silently lose its second-order terms.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <utility>
#include <vector>

namespace fusedlm {

// The gradients (undefined where None) of op's reference backward on these arguments, for a
// forward that ran on the cpu backend with this dropout probability; raises what Python raises.
template <typename... Args>
std::vector<at::Tensor> differentiable_backward(const char* op, double dropout_p, Args&&... args) {
  pybind11::gil_scoped_acquire gil;
  const auto grads = pybind11::module_::import("fusedlm.ops._op")
                         .attr("differentiable_backward")(op, "cpu", dropout_p,
                                                           std::forward<Args>(args)...);
  std::vector<at::Tensor> out;
  for (const auto grad : grads) {
    out.push_back(grad.is_none() ? at::Tensor() : pybind11::cast<at::Tensor>(grad));
  }
  return out;
}

}  // namespace fusedlm
