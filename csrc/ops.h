// The CPU backend's op entry points, bound to Python in pyext/module.cpp.
//
// Each takes and returns at::Tensor, validates what the kernels rely on, and
// splits the work over ATen's thread pool. Argument checking with names and
// messages for users happens first in the Python layer (python/fusedlm/ops).
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fusedlm {

// Which kernel table is in use, and the ones this processor can run.
std::string cpu_capability();
void set_cpu_capability(const std::string& isa);
std::vector<std::string> supported_cpu_capabilities();

// The keep mask (bool, `shape`) of the dropout stream (seed, offset).
at::Tensor dropout_mask(const at::Tensor& seed, int64_t offset, at::IntArrayRef shape, double p);

// gelu(x + bias) over the last dimension; bias may be absent.
at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate);
// (dx, dbias); dbias is undefined when bias is absent.
std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate);

// Linear -> GELU -> dropout -> Linear. Returns (y, pre_activation), the latter
// x @ w1^T without its bias, the one activation the backward needs.
std::tuple<at::Tensor, at::Tensor> gelu_ffn_forward(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const std::string& approximate,
    double dropout_p, const at::Tensor& seed);
// (dx, dw1, db1, dw2, db2); the bias gradients are undefined when a bias is absent.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> gelu_ffn_backward(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre_activation,
    const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const std::string& approximate, double dropout_p,
    const at::Tensor& seed);

// Softmax cross-entropy over the last dimension of logits. Returns (loss, grad): loss
// per reduction ("none": labels' shape), in float32 (float64 for float64 logits); grad,
// a new tensor shaped like logits, is d(loss)/d(logits) for grad_output 1 when with_grad,
// else empty.
std::tuple<at::Tensor, at::Tensor> cross_entropy_forward(const at::Tensor& logits,
                                                         const at::Tensor& labels,
                                                         int64_t ignore_index,
                                                         double label_smoothing,
                                                         const std::string& reduction,
                                                         bool with_grad);
// d(logits): saved_grad scaled by grad (one value, or one per row for reduction "none").
at::Tensor cross_entropy_backward(const at::Tensor& grad, const at::Tensor& saved_grad,
                                  const std::string& reduction);

// cross_entropy(hidden @ weight^T + bias, labels), projecting only the rows whose label is
// not ignore_index, chunk_rows of them at a time. Returns (loss, dhidden, dweight, dbias):
// for reduction "mean"/"sum" the gradients asked for by need_* (for grad_output 1), the
// others empty; for "none" every gradient is empty (the backward computes them).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_forward(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, int64_t ignore_index, double label_smoothing,
    const std::string& reduction, int64_t chunk_rows, bool need_dhidden, bool need_dweight,
    bool need_dbias);
// (dhidden, dweight, dbias): the forward's gradients scaled by grad for "mean"/"sum"; for
// "none", recomputed chunk by chunk with each row scaled by its grad.
std::tuple<at::Tensor, at::Tensor, at::Tensor> masked_lm_loss_backward(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& dhidden,
    const at::Tensor& dweight, const at::Tensor& dbias, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, int64_t chunk_rows, bool need_dhidden,
    bool need_dweight, bool need_dbias);
// Attention over q/k/v [batch, heads, seq, head_dim] (any strides). key_padding_mask is
// bool [batch, seq_k], True = padding; attn_bias is broadcastable to [batch, heads, seq_q,
// seq_k]. Returns (out, lse): lse [batch, heads, seq_q] is the rows' log-sum-exp in the
// accumulation type (+inf for rows that attend to nothing), kept for backward.
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_bias,
    bool causal, double dropout_p, double scale, const at::Tensor& seed);
// (dq, dk, dv, dbias); dbias, in attn_bias's shape, is undefined unless bias_grad.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_bias, bool causal, double dropout_p, double scale,
    const at::Tensor& seed, bool bias_grad);

// Attention over packed sequences, q [total_q, heads, head_dim], k/v [total_k, heads, head_dim];
// sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1]. Returns (out, lse [heads, total_q]).
std::tuple<at::Tensor, at::Tensor> attention_varlen_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed);
// (dq, dk, dv).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed);

// Decoding attention over a KV cache: q [batch, seqlen_q, heads, head_dim], caches
// [batch, max_cache_len, heads, head_dim]. k_new/v_new [batch, seqlen_new, ...] are first
// written into the caches at positions cache_seqlens[b] (int32 [batch]) onwards; query i
// then attends causally (bottom right) to keys [cache_leftpad[b], cache_seqlens[b] +
// seqlen_new). Returns out [batch, seqlen_q, heads, v's head_dim].
at::Tensor attention_kvcache_forward(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                     const std::optional<at::Tensor>& k_new,
                                     const std::optional<at::Tensor>& v_new,
                                     const std::optional<at::Tensor>& cache_leftpad, double scale);

// (packed [tokens, ...], indices int64 [tokens] into batch * seq, cu_seqlens int32
// [batch + 1], longest sequence) of the non-padding tokens of hidden [batch, seq, ...].
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> unpad_forward(
    const at::Tensor& hidden, const at::Tensor& key_padding_mask);
// [batch, seqlen, ...]: packed's rows at `indices`, zeros elsewhere (also unpad's backward).
at::Tensor pad_forward(const at::Tensor& packed, const at::Tensor& indices, int64_t batch,
                       int64_t seqlen);
// pad's backward: the rows of grad [batch, seqlen, ...] at `indices`.
at::Tensor pad_backward(const at::Tensor& grad, const at::Tensor& indices);
// summed = dropout(x) + residual and out = layer_norm(summed) over the last dimension;
// residual, weight and bias may be absent. Returns (out, summed, mean, rstd), the
// latter two [rows] in float32 (float64 for float64 inputs): the statistics of summed
// as returned, saved for the backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed);
// (dsummed, dx, dweight, dbias). dsummed is the gradient of summed (grad_summed, which may be
// absent, plus what flows back through the norm): the residual's gradient, and x's too
// without dropout, when dx is undefined. Under dropout dx = dsummed through the mask, and
// dsummed is defined only when has_residual. dweight and dbias are undefined when absent.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed);

// The pointwise part of an LSTM step: gates [..., 4 * cell] (input, forget, cell, output
// pre-activations), c_prev [..., cell]. Returns (h, c), c clipped to [-cell_clip, cell_clip]
// (cell_clip +inf: no clip).
std::tuple<at::Tensor, at::Tensor> lstm_cell_forward(const at::Tensor& gates,
                                                     const at::Tensor& c_prev, double cell_clip);
// (dgates, dc_prev) from the gradients of h and c.
std::tuple<at::Tensor, at::Tensor> lstm_cell_backward(const at::Tensor& grad_h,
                                                      const at::Tensor& grad_c,
                                                      const at::Tensor& gates,
                                                      const at::Tensor& c_prev, double cell_clip);

}  // namespace fusedlm
