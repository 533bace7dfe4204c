// add_layer_norm (fusedlm/ops/layer_norm.py): its schemas, its kernels' routing and its autograd.
#include "ops/register.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;
using Outputs = std::tuple<Tensor, Tensor, Tensor, Tensor>;
using Forward = Outputs(const Tensor&, const OptionalTensor&, const OptionalTensor&,
                        const OptionalTensor&, double, double, const Tensor&);
using Backward = Outputs(const Tensor&, const OptionalTensor&, const Tensor&, const Tensor&,
                         const Tensor&, const OptionalTensor&, bool, bool, double, const Tensor&);

constexpr char kOp[] = "fusedlm::add_layer_norm";
constexpr char kBackwardOp[] = "fusedlm::add_layer_norm_backward";

// Only summed, a mean and an rstd per row are saved; the dropout mask is regenerated from its seed.
struct AddLayerNormNode : OpNode {
  SavedVariable summed, mean, rstd, weight, seed;
  bool has_residual = false, has_bias = false;
  double dropout_p = 0.0;

  std::string name() const override { return "fusedlm::AddLayerNormBackward"; }

  void release_variables() override { release(summed, mean, rstd, weight, seed); }

  // (grad of out, grad of summed) -> (x, residual, weight, bias)'s.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const auto self = getptr();
    const Tensor s = summed.unpack(self), m = mean.unpack(), r = rstd.unpack(), sd = seed.unpack();
    const auto w = optional(weight.unpack());
    // Only summed was used: nothing flows back through the norm.
    const Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(s);
    const auto grad_summed = optional(grads[1]);
    const auto [dsummed, dx, dweight, dbias] = backward_of<kBackwardOp, Backward>(
        *this, grads, {"add_layer_norm", dropout_p}, grad_out, grad_summed, s, m, r, w, has_bias,
        has_residual, dropout_p, sd);
    // Without dropout x's gradient is summed's: one tensor serves both inputs.
    return {dropout_p > 0 ? dx : dsummed, has_residual ? dsummed : Tensor(), w ? dweight : Tensor(),
            has_bias ? dbias : Tensor()};
  }
};

Outputs add_layer_norm_autograd(const Tensor& x, const OptionalTensor& residual,
                                const OptionalTensor& weight, const OptionalTensor& bias,
                                double eps, double dropout_p, const Tensor& seed,
                                c10::string_view backend) {
  auto outputs = below_autograd<kOp, Forward>(x, residual, weight, bias, eps, dropout_p, seed,
                                              backend);
  if (!recorded(x, residual, weight, bias)) return outputs;
  auto& [out, summed, mean, rstd] = outputs;
  auto node = recording_node<AddLayerNormNode>(x, residual, weight, bias);
  record_outputs(node, out, summed);  // (mean and rstd have no gradient)
  node->summed = SavedVariable(summed, true);
  node->mean = SavedVariable(mean, false);
  node->rstd = SavedVariable(rstd, false);
  if (weight) node->weight = SavedVariable(*weight, false);
  node->seed = SavedVariable(seed, false);
  node->has_residual = residual.has_value(), node->has_bias = bias.has_value();
  node->dropout_p = dropout_p, node->backend = std::string(backend);
  return outputs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("add_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
        "float dropout_p, Tensor seed, str backend) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("add_layer_norm_backward(Tensor grad_out, Tensor? grad_summed, Tensor summed, "
        "Tensor mean, Tensor rstd, Tensor? weight, bool has_bias, bool has_residual, "
        "float dropout_p, Tensor seed, str backend) -> (Tensor, Tensor, Tensor, Tensor)");
}

FUSEDLM_OP(add_layer_norm, Forward, add_layer_norm_autograd);
FUSEDLM_BACKWARD_OP(add_layer_norm_backward, Backward)

}  // namespace fusedlm
