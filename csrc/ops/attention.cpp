// attention and attention_varlen (fusedlm/ops/attention.py): their schemas, their kernels'
// routing and their autograd. Both save q, k, v, the output and each row's log-sum-exp, and
// regenerate the dropout mask from its seed.
#include <torch/library.h>

#include "ops/autograd.h"
#include "ops/route.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

// --- attention --------------------------------------------------------------------------------

using Forward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                           const OptionalTensor&, const OptionalTensor&, bool,
                                           double, double, const Tensor&);
using Backward = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const OptionalTensor&, const OptionalTensor&, bool, double, double, const Tensor&, bool);
constexpr char kAttention[] = "fusedlm::attention";
constexpr char kAttentionBackward[] = "fusedlm::attention_backward";
constexpr char kForwardKernel[] = "attention_forward";
constexpr char kBackwardKernel[] = "attention_backward";

struct Attention : torch::autograd::Function<Attention> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const OptionalTensor& mask,
                               const OptionalTensor& bias, bool causal, double dropout_p,
                               double scale, const Tensor& seed, c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, lse] = dispatched<kAttention, Forward>().call(q, k, v, mask, bias, causal, dropout_p,
                                                             scale, seed, backend);
    ctx->save_for_backward({q, k, v, out, lse, mask.value_or(Tensor()), bias.value_or(Tensor()), seed});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["backend"] = std::string(backend);
    // needs_input_grad counts the tensors given: q, k, v, then the mask where there is one.
    ctx->saved_data["bias_input"] = int64_t(mask && mask->defined() ? 4 : 3);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const auto mask = optional(s[5]), bias = optional(s[6]);
    const bool causal = ctx->saved_data["causal"].toBool();
    const double p = ctx->saved_data["dropout_p"].toDouble();
    const double scale = ctx->saved_data["scale"].toDouble();
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    const bool bias_grad = bias && ctx->needs_input_grad(ctx->saved_data["bias_input"].toInt());
    Tensor dq, dk, dv, dbias;
    if (needs_reference_backward(grads)) {
      const auto taken = reference_backward("attention", backend, p, "attention", grads[0], s[0],
                                            s[1], s[2], s[3], s[4], mask, bias, causal, p, scale,
                                            s[7], bias_grad);
      dq = taken[0], dk = taken[1], dv = taken[2], dbias = taken[3];
    } else {
      std::tie(dq, dk, dv, dbias) = dispatched<kAttentionBackward, Backward>().call(
          grads[0], s[0], s[1], s[2], s[3], s[4], mask, bias, causal, p, scale, s[7], bias_grad,
          backend);
    }
    variable_list out(10);
    out[0] = dq, out[1] = dk, out[2] = dv, out[4] = bias_grad ? dbias : Tensor();
    return out;
  }
};

std::tuple<Tensor, Tensor> attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const OptionalTensor& mask, const OptionalTensor& bias,
                                              bool causal, double dropout_p, double scale,
                                              const Tensor& seed, c10::string_view backend) {
  if (!recorded(q, k, v, bias)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kAttention, Forward>().call(q, k, v, mask, bias, causal, dropout_p, scale,
                                                  seed, backend);
  }
  auto out = Attention::apply(q, k, v, mask, bias, causal, dropout_p, scale, seed, backend);
  return {out[0], out[1]};
}

// --- attention_varlen -------------------------------------------------------------------------

using VarlenForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&, int64_t, int64_t,
                                                 bool, double, double, const Tensor&);
using VarlenBackward = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, int64_t, int64_t, bool, double, double, const Tensor&);
// The same with the maximum lengths as the schema's SymInts (unbacked under torch.compile,
// from unpad): what autograd passes on.
using SymVarlenForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                    const Tensor&, const Tensor&, c10::SymInt,
                                                    c10::SymInt, bool, double, double, const Tensor&);
using SymVarlenBackward = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, c10::SymInt, c10::SymInt, bool, double, double, const Tensor&);
constexpr char kVarlen[] = "fusedlm::attention_varlen";
constexpr char kVarlenBackward[] = "fusedlm::attention_varlen_backward";
constexpr char kVarlenForwardKernel[] = "attention_varlen_forward";
constexpr char kVarlenBackwardKernel[] = "attention_varlen_backward";

struct AttentionVarlen : torch::autograd::Function<AttentionVarlen> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
                               c10::SymInt max_q, c10::SymInt max_k, bool causal, double dropout_p,
                               double scale, const Tensor& seed, c10::string_view backend) {
    at::AutoDispatchBelowADInplaceOrView below;
    auto [out, lse] = dispatched<kVarlen, SymVarlenForward>().call(
        q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, scale, seed, backend);
    ctx->save_for_backward({q, k, v, out, lse, cu_q, cu_k, seed});
    ctx->saved_data["max_seqlen_q"] = max_q;
    ctx->saved_data["max_seqlen_k"] = max_k;
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["dropout_p"] = dropout_p;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["backend"] = std::string(backend);
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const c10::SymInt max_q = ctx->saved_data["max_seqlen_q"].toSymInt();
    const c10::SymInt max_k = ctx->saved_data["max_seqlen_k"].toSymInt();
    const bool causal = ctx->saved_data["causal"].toBool();
    const double p = ctx->saved_data["dropout_p"].toDouble();
    const double scale = ctx->saved_data["scale"].toDouble();
    const std::string backend = ctx->saved_data["backend"].toStringRef();
    Tensor dq, dk, dv;
    if (needs_reference_backward(grads)) {
      const auto taken = reference_backward("attention_varlen", backend, p, "attention_varlen",
                                            grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6],
                                            max_q, max_k, causal, p, scale, s[7]);
      dq = taken[0], dk = taken[1], dv = taken[2];
    } else {
      std::tie(dq, dk, dv) = dispatched<kVarlenBackward, SymVarlenBackward>().call(
          grads[0], s[0], s[1], s[2], s[3], s[4], s[5], s[6], max_q, max_k, causal, p, scale,
          s[7], backend);
    }
    variable_list out(12);
    out[0] = dq, out[1] = dk, out[2] = dv;
    return out;
  }
};

std::tuple<Tensor, Tensor> attention_varlen_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
    c10::SymInt max_q, c10::SymInt max_k, bool causal, double dropout_p, double scale,
    const Tensor& seed, c10::string_view backend) {
  if (!recorded(q, k, v)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return dispatched<kVarlen, SymVarlenForward>().call(q, k, v, cu_q, cu_k, max_q, max_k, causal,
                                                        dropout_p, scale, seed, backend);
  }
  auto out = AttentionVarlen::apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, dropout_p, scale,
                                    seed, backend);
  return {out[0], out[1]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? attn_bias, "
        "bool causal, float dropout_p, float scale, Tensor seed, str backend) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? attn_bias, bool causal, float dropout_p, float scale, "
        "Tensor seed, bool bias_grad, str backend) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, float dropout_p, float scale, "
        "Tensor seed, str backend) -> (Tensor, Tensor)");
  m.def("attention_varlen_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
        "SymInt max_seqlen_k, bool causal, float dropout_p, float scale, Tensor seed, "
        "str backend) -> (Tensor, Tensor, Tensor)");
}

FUSEDLM_ROUTE(attention, kForwardKernel, Forward)
FUSEDLM_ROUTE(attention_backward, kBackwardKernel, Backward)
FUSEDLM_ROUTE(attention_varlen, kVarlenForwardKernel, VarlenForward)
FUSEDLM_ROUTE(attention_varlen_backward, kVarlenBackwardKernel, VarlenBackward)

TORCH_LIBRARY_IMPL(fusedlm, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("attention_varlen", &attention_varlen_autograd);
}

}  // namespace fusedlm
