// attention and attention_varlen (fusedlm/ops/attention.py): their schemas, their kernels'
// routing and their autograd. Both save q, k, v, the output and each row's log-sum-exp, and
// regenerate the dropout mask from its seed.
#include "ops/register.h"

namespace fusedlm {
namespace {

using at::Tensor;
using OptionalTensor = std::optional<Tensor>;

// --- attention --------------------------------------------------------------------------------

using Forward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                           const OptionalTensor&, const OptionalTensor&, bool,
                                           int64_t, int64_t, double, double, const Tensor&);
using Backward = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const OptionalTensor&, const OptionalTensor&, bool, int64_t, int64_t, double, double,
    const Tensor&, bool);
constexpr char kAttention[] = "fusedlm::attention";
constexpr char kAttentionBackward[] = "fusedlm::attention_backward";

struct AttentionNode : OpNode {
  SavedVariable q, k, v, out, lse, mask, bias, seed;
  bool causal = false;
  c10::SymInt window_left = -1, window_right = -1;
  double dropout_p = 0.0, scale = 1.0;

  std::string name() const override { return "fusedlm::AttentionBackward"; }

  void release_variables() override { release(q, k, v, out, lse, mask, bias, seed); }

  // (grad of out) -> (q, k, v, attn_bias)'s.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor tq = q.unpack(), tk = k.unpack(), tv = v.unpack(), to = out.unpack(getptr());
    const Tensor tl = lse.unpack(), sd = seed.unpack();
    const auto m = optional(mask.unpack()), b = optional(bias.unpack());
    const bool bias_grad = b && task_should_compute_output(3);
    const auto [dq, dk, dv, dbias] = backward_of<kAttentionBackward, Backward>(
        *this, grads, {"attention", dropout_p}, grads[0], tq, tk, tv, to, tl, m, b, causal,
        window_left, window_right, dropout_p, scale, sd, bias_grad);
    return {dq, dk, dv, bias_grad ? dbias : Tensor()};
  }
};

std::tuple<Tensor, Tensor> attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                              const OptionalTensor& mask, const OptionalTensor& bias,
                                              bool causal, c10::SymInt window_left,
                                              c10::SymInt window_right, double dropout_p,
                                              double scale, const Tensor& seed,
                                              c10::string_view backend) {
  auto outputs = below_autograd<kAttention, Forward>(q, k, v, mask, bias, causal, window_left,
                                                     window_right, dropout_p, scale, seed, backend);
  if (!recorded(q, k, v, bias)) return outputs;
  auto& [out, lse] = outputs;
  auto node = recording_node<AttentionNode>(q, k, v, bias);
  record_outputs(node, out);  // (lse has no gradient)
  node->q = SavedVariable(q, false), node->k = SavedVariable(k, false), node->v = SavedVariable(v, false);
  node->out = SavedVariable(out, true), node->lse = SavedVariable(lse, false);
  if (mask) node->mask = SavedVariable(*mask, false);
  if (bias) node->bias = SavedVariable(*bias, false);
  node->seed = SavedVariable(seed, false);
  node->causal = causal, node->window_left = window_left, node->window_right = window_right;
  node->dropout_p = dropout_p, node->scale = scale;
  node->backend = std::string(backend);
  return outputs;
}

// --- attention_varlen -------------------------------------------------------------------------

using VarlenForward = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                 const Tensor&, const Tensor&, int64_t, int64_t,
                                                 bool, int64_t, int64_t, double, double,
                                                 const Tensor&);
using VarlenBackward = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const Tensor&, const Tensor&, int64_t, int64_t, bool, int64_t, int64_t, double, double,
    const Tensor&);
constexpr char kVarlen[] = "fusedlm::attention_varlen";
constexpr char kVarlenBackward[] = "fusedlm::attention_varlen_backward";

struct AttentionVarlenNode : OpNode {
  SavedVariable q, k, v, out, lse, cu_q, cu_k, seed;
  c10::SymInt max_q, max_k;
  bool causal = false;
  c10::SymInt window_left = -1, window_right = -1;
  double dropout_p = 0.0, scale = 1.0;

  std::string name() const override { return "fusedlm::AttentionVarlenBackward"; }

  void release_variables() override { release(q, k, v, out, lse, cu_q, cu_k, seed); }

  // (grad of out) -> (q, k, v)'s.
  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (no_gradient(grads)) return variable_list(num_outputs());
    const Tensor tq = q.unpack(), tk = k.unpack(), tv = v.unpack(), to = out.unpack(getptr());
    const Tensor tl = lse.unpack(), cq = cu_q.unpack(), ck = cu_k.unpack(), sd = seed.unpack();
    const auto [dq, dk, dv] = backward_of<kVarlenBackward, VarlenBackward>(
        *this, grads, {"attention_varlen", dropout_p}, grads[0], tq, tk, tv, to, tl, cq, ck, max_q,
        max_k, causal, window_left, window_right, dropout_p, scale, sd);
    return {dq, dk, dv};
  }
};

std::tuple<Tensor, Tensor> attention_varlen_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
    c10::SymInt max_q, c10::SymInt max_k, bool causal, c10::SymInt window_left,
    c10::SymInt window_right,
    double dropout_p, double scale, const Tensor& seed, c10::string_view backend) {
  auto outputs = below_autograd<kVarlen, VarlenForward>(q, k, v, cu_q, cu_k, max_q, max_k, causal,
                                                        window_left, window_right, dropout_p,
                                                        scale, seed, backend);
  if (!recorded(q, k, v)) return outputs;
  auto& [out, lse] = outputs;
  auto node = recording_node<AttentionVarlenNode>(q, k, v);
  record_outputs(node, out);  // (lse has no gradient)
  node->q = SavedVariable(q, false), node->k = SavedVariable(k, false), node->v = SavedVariable(v, false);
  node->out = SavedVariable(out, true), node->lse = SavedVariable(lse, false);
  node->cu_q = SavedVariable(cu_q, false), node->cu_k = SavedVariable(cu_k, false);
  node->seed = SavedVariable(seed, false);
  node->max_q = max_q, node->max_k = max_k, node->causal = causal, node->dropout_p = dropout_p;
  node->window_left = window_left, node->window_right = window_right;
  node->scale = scale, node->backend = std::string(backend);
  return outputs;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(fusedlm, m) {
  m.def("attention(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? attn_bias, "
        "bool causal, SymInt window_left, SymInt window_right, float dropout_p, float scale, "
        "Tensor seed, str backend) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor? key_padding_mask, Tensor? attn_bias, bool causal, SymInt window_left, "
        "SymInt window_right, float dropout_p, float scale, Tensor seed, bool bias_grad, "
        "str backend) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
        "SymInt max_seqlen_q, SymInt max_seqlen_k, bool causal, SymInt window_left, "
        "SymInt window_right, float dropout_p, float scale, Tensor seed, str backend) "
        "-> (Tensor, Tensor)");
  m.def("attention_varlen_backward(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
        "SymInt max_seqlen_k, bool causal, SymInt window_left, SymInt window_right, "
        "float dropout_p, float scale, Tensor seed, str backend) -> (Tensor, Tensor, Tensor)");
}

FUSEDLM_OP(attention, Forward, attention_autograd);
FUSEDLM_BACKWARD_OP(attention_backward, Backward)
FUSEDLM_OP(attention_varlen, VarlenForward, attention_varlen_autograd);
FUSEDLM_BACKWARD_OP(attention_varlen_backward, VarlenBackward)

}  // namespace fusedlm
