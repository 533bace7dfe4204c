// add_layer_norm (fusedlm/ops/layer_norm.py): its schemas, its kernels' routing and its autograd.
#include <torch/library.h>

#include "ops/autograd.h"
#include "ops/route.h"

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
constexpr char kForwardKernel[] = "add_layer_norm_forward";
constexpr char kBackwardKernel[] = "add_layer_norm_backward";

// Only summed, a mean and an rstd per row are saved; the dropout mask is regenerated from its seed.
struct AddLayerNorm : torch::autograd::Function<AddLayerNorm> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptionalTensor& residual,
                               const OptionalTensor& weight, const OptionalTensor& bias, double eps,
                               double dropout_p, const Tensor& seed, c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, summed, mean, rstd] = dispatched<kOp, Forward>().call(
        x, residual, weight, bias, eps, dropout_p, seed, backend);
    ctx->save_for_backward({summed, mean, rstd, weight.value_or(Tensor()), seed});
    ctx->saved_data["has_residual"] = residual.has_value() && residual->defined();
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["backend"] = std::string(backend);
    ctx->mark_non_differentiable({mean, rstd});
    // An output nobody used has no gradient (undefined), rather than zeros to read: post-LN
    // stacks (BERT) never use summed's.
    ctx->set_materialize_grads(false);
    return {out, summed, mean, rstd};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &summed = saved[0], &mean = saved[1], &rstd = saved[2], &seed = saved[4];
    const auto weight = optional(saved[3]);
    const bool has_residual = ctx->saved_data["has_residual"].toBool();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const double p = ctx->saved_data["dropout_p"].toDouble();
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    // Only summed was used: nothing flows back through the norm.
    const Tensor grad_out = grads[0].defined() ? grads[0] : at::zeros_like(summed);
    const auto grad_summed = optional(grads[1]);
    Tensor dsummed, dx, dweight, dbias;
    if (needs_reference_backward(grads)) {
      const auto taken = reference_backward("add_layer_norm", backend, p, "add_layer_norm",
                                            grad_out, grad_summed, summed, mean, rstd, weight,
                                            has_bias, has_residual, p, seed);
      dsummed = taken[0], dx = taken[1], dweight = taken[2], dbias = taken[3];
    } else {
      std::tie(dsummed, dx, dweight, dbias) = dispatched<kBackwardOp, Backward>().call(
          grad_out, grad_summed, summed, mean, rstd, weight, has_bias, has_residual, p, seed,
          backend);
    }
    // Without dropout x's gradient is summed's: one tensor serves both inputs.
    return {p > 0 ? dx : dsummed, has_residual ? dsummed : Tensor(), weight ? dweight : Tensor(),
            has_bias ? dbias : Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Outputs add_layer_norm_autograd(const Tensor& x, const OptionalTensor& residual,
                                const OptionalTensor& weight, const OptionalTensor& bias,
                                double eps, double dropout_p, const Tensor& seed,
                                c10::string_view backend) {
  if (!recorded(x, residual, weight, bias)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kOp, Forward>().call(x, residual, weight, bias, eps, dropout_p, seed, backend);
  }
  auto out = AddLayerNorm::apply(x, residual, weight, bias, eps, dropout_p, seed, backend);
  return {out[0], out[1], out[2], out[3]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("add_layer_norm(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
        "float dropout_p, Tensor seed, str backend) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("add_layer_norm_backward(Tensor grad_out, Tensor? grad_summed, Tensor summed, "
        "Tensor mean, Tensor rstd, Tensor? weight, bool has_bias, bool has_residual, "
        "float dropout_p, Tensor seed, str backend) -> (Tensor, Tensor, Tensor, Tensor)");
}

FUSEDLM_ROUTE(add_layer_norm, kForwardKernel, Forward)
FUSEDLM_ROUTE(add_layer_norm_backward, kBackwardKernel, Backward)

TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) { m.impl("add_layer_norm", &add_layer_norm_autograd); }

}  // namespace fusedlm
