// bias_gelu and gelu_ffn (fusedlm/ops/gelu.py): their schemas, their kernels' routing and their
// autograd.
#include <torch/library.h>

#include "ops/autograd.h"
#include "ops/route.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

// --- bias_gelu --------------------------------------------------------------------------------

using BiasGeluForward = Tensor(const Tensor&, const OptionalTensor&, const std::string&);
using BiasGeluBackward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&,
                                                    const OptionalTensor&, const std::string&);
constexpr char kBiasGelu[] = "fusedlm::bias_gelu";
constexpr char kBiasGeluBackward[] = "fusedlm::bias_gelu_backward";
constexpr char kBiasGeluForwardKernel[] = "bias_gelu_forward";
constexpr char kBiasGeluBackwardKernel[] = "bias_gelu_backward";

// Saves x and bias; the backward recomputes the activation's slope.
struct BiasGelu : torch::autograd::Function<BiasGelu> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const OptionalTensor& bias,
                        const std::string& approximate, c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    ctx->save_for_backward({x, bias.value_or(Tensor())});
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["backend"] = std::string(backend);
    return dispatched<kBiasGelu, BiasGeluForward>().call(x, bias, approximate, backend);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto bias = optional(saved[1]);
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    Tensor dx, dbias;
    if (needs_reference_backward(grads)) {
      const auto taken = reference_backward("bias_gelu", backend, 0.0, "bias_gelu", grads[0],
                                            saved[0], bias, approximate);
      dx = taken[0], dbias = taken[1];
    } else {
      std::tie(dx, dbias) = dispatched<kBiasGeluBackward, BiasGeluBackward>().call(
          grads[0], saved[0], bias, approximate, backend);
    }
    return {dx, bias ? dbias : Tensor(), Tensor(), Tensor()};
  }
};

Tensor bias_gelu_autograd(const Tensor& x, const OptionalTensor& bias, const std::string& approximate,
                          c10::string_view backend) {
  if (!recorded(x, bias)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kBiasGelu, BiasGeluForward>().call(x, bias, approximate, backend);
  }
  return BiasGelu::apply(x, bias, approximate, backend);
}

// --- gelu_ffn ---------------------------------------------------------------------------------

using GeluFfnForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptionalTensor&,
                                                  const Tensor&, const OptionalTensor&,
                                                  const std::string&, double, const Tensor&);
using GeluFfnBackward = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptionalTensor&,
    const Tensor&, const OptionalTensor&, const std::string&, double, const Tensor&);
constexpr char kGeluFfn[] = "fusedlm::gelu_ffn";
constexpr char kGeluFfnBackward[] = "fusedlm::gelu_ffn_backward";
constexpr char kGeluFfnForwardKernel[] = "gelu_ffn_forward";
constexpr char kGeluFfnBackwardKernel[] = "gelu_ffn_backward";

// Saves the pre-activation (the second output) rather than the activation, which the backward
// recomputes; the dropout mask is regenerated from its seed.
struct GeluFfn : torch::autograd::Function<GeluFfn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1,
                               const OptionalTensor& b1, const Tensor& w2, const OptionalTensor& b2,
                               const std::string& approximate, double dropout_p, const Tensor& seed,
                               c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, pre] = dispatched<kGeluFfn, GeluFfnForward>().call(x, w1, b1, w2, b2, approximate,
                                                                  dropout_p, seed, backend);
    ctx->save_for_backward({x, pre, w1, b1.value_or(Tensor()), w2, b2.value_or(Tensor()), seed});
    ctx->saved_data["approximate"] = approximate;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["backend"] = std::string(backend);
    ctx->mark_non_differentiable({pre});
    // The pre-activation never has a gradient: no zero-filled tensor for it.
    ctx->set_materialize_grads(false);
    return {out, pre};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list none(9);
    if (!grads[0].defined()) return none;  // the output was not used either
    const auto s = ctx->get_saved_variables();
    const auto b1 = optional(s[3]), b2 = optional(s[5]);
    const std::string approximate = ctx->saved_data["approximate"].toStringRef();
    const double p = ctx->saved_data["dropout_p"].toDouble();
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    Tensor dx, dw1, db1, dw2, db2;
    if (needs_reference_backward(grads)) {
      const auto taken = reference_backward("gelu_ffn", backend, p, "gelu_ffn", grads[0], s[0],
                                            s[1], s[2], b1, s[4], b2, approximate, p, s[6]);
      dx = taken[0], dw1 = taken[1], db1 = taken[2], dw2 = taken[3], db2 = taken[4];
    } else {
      std::tie(dx, dw1, db1, dw2, db2) = dispatched<kGeluFfnBackward, GeluFfnBackward>().call(
          grads[0], s[0], s[1], s[2], b1, s[4], b2, approximate, p, s[6], backend);
    }
    none[0] = dx, none[1] = dw1, none[2] = b1 ? db1 : Tensor(), none[3] = dw2;
    none[4] = b2 ? db2 : Tensor();
    return none;
  }
};

std::tuple<Tensor, Tensor> gelu_ffn_autograd(const Tensor& x, const Tensor& w1,
                                             const OptionalTensor& b1, const Tensor& w2,
                                             const OptionalTensor& b2, const std::string& approximate,
                                             double dropout_p, const Tensor& seed,
                                             c10::string_view backend) {
  if (!recorded(x, w1, b1, w2, b2)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kGeluFfn, GeluFfnForward>().call(x, w1, b1, w2, b2, approximate, dropout_p,
                                                       seed, backend);
  }
  auto out = GeluFfn::apply(x, w1, b1, w2, b2, approximate, dropout_p, seed, backend);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("bias_gelu(Tensor x, Tensor? bias, str approximate, str backend) -> Tensor");
  m.def("bias_gelu_backward(Tensor grad, Tensor x, Tensor? bias, str approximate, str backend) "
        "-> (Tensor, Tensor)");
  m.def("gelu_ffn(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str approximate, "
        "float dropout_p, Tensor seed, str backend) -> (Tensor, Tensor)");
  m.def("gelu_ffn_backward(Tensor grad, Tensor x, Tensor pre, Tensor w1, Tensor? b1, Tensor w2, "
        "Tensor? b2, str approximate, float dropout_p, Tensor seed, str backend) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

FUSEDLM_ROUTE(bias_gelu, kBiasGeluForwardKernel, BiasGeluForward)
FUSEDLM_ROUTE(bias_gelu_backward, kBiasGeluBackwardKernel, BiasGeluBackward)
FUSEDLM_ROUTE(gelu_ffn, kGeluFfnForwardKernel, GeluFfnForward)
FUSEDLM_ROUTE(gelu_ffn_backward, kGeluFfnBackwardKernel, GeluFfnBackward)

TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) {
  m.impl("bias_gelu", &bias_gelu_autograd);
  m.impl("gelu_ffn", &gelu_ffn_autograd);
}

}  // namespace fusedlm
