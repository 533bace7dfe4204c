// rms_norm (fusedlm/ops/rms_norm.py): its schemas, its kernels' routing and its autograd.
#include "ops/register.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;
using Forward = std::tuple<Tensor, Tensor>(const Tensor&, const OptionalTensor&, double);
using Backward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                            const OptionalTensor&, double);

constexpr char kOp[] = "fusedlm::rms_norm";
constexpr char kBackwardOp[] = "fusedlm::rms_norm_backward";

// Saves x, its rstd per row and the weight.
struct RmsNormNode : OpNode {
  SavedVariable x, rstd, weight;
  double eps = 0.0;

  std::string name() const override { return "fusedlm::RmsNormBackward"; }

  void release_variables() override { release(x, rstd, weight); }

  // (grad of out) -> (x, weight)'s.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor input = x.unpack(), r = rstd.unpack();
    const auto w = optional(weight.unpack());
    const auto [dx, dweight] =
        backward_of<kBackwardOp, Backward>(*this, grads, {"rms_norm"}, grads[0], input, r, w, eps);
    return {dx, w ? dweight : Tensor()};
  }
};

std::tuple<Tensor, Tensor> rms_norm_autograd(const Tensor& x, const OptionalTensor& weight,
                                             double eps, c10::string_view backend) {
  auto outputs = below_autograd<kOp, Forward>(x, weight, eps, backend);
  if (!recorded(x, weight)) return outputs;
  auto& [out, rstd] = outputs;
  auto node = recording_node<RmsNormNode>(x, weight);
  record_outputs(node, out);  // (rstd has no gradient)
  node->x = SavedVariable(x, false);
  node->rstd = SavedVariable(rstd, false);
  if (weight) node->weight = SavedVariable(*weight, false);
  node->eps = eps, node->backend = std::string(backend);
  return outputs;
}

}  // namespace

// The backward takes the forward's eps, from which the reference backward recomputes rstd
// when a gradient is differentiated again; the kernels read the saved rstd.
TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("rms_norm(Tensor x, Tensor? weight, float eps, str backend) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad_out, Tensor x, Tensor rstd, Tensor? weight, float eps, "
        "str backend) -> (Tensor, Tensor)");
}

FUSEDLM_OP(rms_norm, Forward, rms_norm_autograd);
FUSEDLM_BACKWARD_OP(rms_norm_backward, Backward)

}  // namespace fusedlm
