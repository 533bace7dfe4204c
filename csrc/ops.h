// The op entry points of both backends, bound to Python in pyext/module.cpp: the CPU
// backend's in namespace fusedlm (csrc/*.cpp), the cuda backend's in fusedlm::cuda
// (csrc/cuda/*.cu, their kernels in kernels/cuda/*.cuh; bound as fusedlm._C.cuda when the
// extension is built with CUDA).
//
// Each signature is written once, as a function type `<name>_t`; the lists below declare
// the entry points of that name in each backend's namespace and bind them. An entry point
// of the cuda backend takes and returns exactly what the CPU one of the same name does,
// for CUDA tensors of float32, bfloat16 or float16; the statistics and losses it returns
// are float32, and its kernels run on the inputs' device, on PyTorch's current stream.
//
// Argument checking with names and messages for users happens first, in the Python layer
// (python/fusedlm/ops); the entry points check only what keeps their kernels' reads and
// writes in bounds, and split the work (over ATen's thread pool on the CPU).
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace fusedlm {

// --- signatures -----------------------------------------------------------------------------

// The keep mask (bool, `shape`) of the dropout stream (seed, offset).
using dropout_mask_t = at::Tensor(const at::Tensor& seed, int64_t offset, at::IntArrayRef shape,
                                  double p);
// The same on CUDA device `device_index`, as the CUDA kernels draw it.
using device_dropout_mask_t = at::Tensor(const at::Tensor& seed, int64_t offset,
                                         at::IntArrayRef shape, double p, int64_t device_index);

// gelu(x + bias) over the last dimension; bias may be absent.
using bias_gelu_forward_t = at::Tensor(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                                       const std::string& approximate);
// (dx, dbias); dbias is undefined when bias is absent.
using bias_gelu_backward_t = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& grad, const at::Tensor& x, const std::optional<at::Tensor>& bias,
    const std::string& approximate);

// Linear -> GELU -> dropout -> Linear. Returns (y, pre_activation), the one activation the
// backward needs: on the CPU x @ w1^T without its bias; on CUDA with b1 (each backend's
// backward reads its own). CUDA: bfloat16 and float16, d_in, d_ff and d_out multiples of 8.
using gelu_ffn_forward_t = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& x, const at::Tensor& w1, const std::optional<at::Tensor>& b1,
    const at::Tensor& w2, const std::optional<at::Tensor>& b2, const std::string& approximate,
    double dropout_p, const at::Tensor& seed);
// (dx, dw1, db1, dw2, db2); the bias gradients are undefined when a bias is absent.
using gelu_ffn_backward_t = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad, const at::Tensor& x, const at::Tensor& pre_activation,
    const at::Tensor& w1, const std::optional<at::Tensor>& b1, const at::Tensor& w2,
    const std::optional<at::Tensor>& b2, const std::string& approximate, double dropout_p,
    const at::Tensor& seed);

// Softmax cross-entropy over the last dimension of logits. Returns (loss, grad): loss
// per reduction ("none": labels' shape), in float32 (float64 for float64 logits); grad,
// a new tensor shaped like logits, is d(loss)/d(logits) for grad_output 1 when with_grad,
// else empty.
using cross_entropy_forward_t = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& logits, const at::Tensor& labels, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, bool with_grad);
// d(logits): saved_grad scaled by grad (one value, or one per row for reduction "none").
using cross_entropy_backward_t = at::Tensor(const at::Tensor& grad, const at::Tensor& saved_grad,
                                            const std::string& reduction);

// DistilBERT's soft-target loss over the last dimension of student_logits and teacher_logits
// (one shape and dtype): T^2 * KL(softmax(teacher / T) || softmax(student / T)) per row.
// Returns (loss, grad) as cross_entropy_forward does ("mean": over the rows); grad is of the
// student logits only, and cross_entropy_backward scales it.
using distillation_loss_forward_t = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& student_logits, const at::Tensor& teacher_logits, double temperature,
    const std::string& reduction, bool with_grad);

// cross_entropy(hidden @ weight^T + bias, labels), projecting only the rows whose label is
// not ignore_index, chunk_rows of them at a time. Returns (loss, dhidden, dweight, dbias):
// for reduction "mean"/"sum" the gradients asked for by need_* (for grad_output 1), the
// others empty; for "none" every gradient is empty (the backward computes them).
using masked_lm_loss_forward_t = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
    const at::Tensor& labels, int64_t ignore_index, double label_smoothing,
    const std::string& reduction, int64_t chunk_rows, bool need_dhidden, bool need_dweight,
    bool need_dbias);
// (dhidden, dweight, dbias): the forward's gradients scaled by grad for "mean"/"sum"; for
// "none", recomputed chunk by chunk with each row scaled by its grad.
using masked_lm_loss_backward_t = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& labels, const at::Tensor& dhidden,
    const at::Tensor& dweight, const at::Tensor& dbias, int64_t ignore_index,
    double label_smoothing, const std::string& reduction, int64_t chunk_rows, bool need_dhidden,
    bool need_dweight, bool need_dbias);

// Attention over q/k/v [batch, heads, seq, head_dim] (any strides). key_padding_mask is
// bool [batch, seq_k], True = padding; attn_bias is broadcastable to [batch, heads, seq_q,
// seq_k]. Returns (out, lse): lse [batch, heads, seq_q] is the rows' log-sum-exp in the
// accumulation type (+inf for rows that attend to nothing), kept for backward.
// CUDA: bfloat16 and float16, head_dim 64 or 128 for q, k and v alike, no attn_bias (the
// Python limits route other calls elsewhere); lse is float32.
using attention_forward_t = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_bias,
    bool causal, double dropout_p, double scale, const at::Tensor& seed);
// (dq, dk, dv, dbias); dbias, in attn_bias's shape, is undefined unless bias_grad. The CUDA
// backward is deterministic: every gradient element is written by one block, without atomics.
using attention_backward_t = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_bias, bool causal, double dropout_p, double scale,
    const at::Tensor& seed, bool bias_grad);

// Attention over packed sequences, q [total_q, heads, head_dim], k/v [total_k, heads, head_dim];
// sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1]. Returns (out, lse [heads, total_q]).
using attention_varlen_forward_t = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed);
// (dq, dk, dv).
using attention_varlen_backward_t = std::tuple<at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed);

// Decoding attention over a KV cache: q [batch, seqlen_q, heads, head_dim], caches
// [batch, max_cache_len, heads, head_dim]. k_new/v_new [batch, seqlen_new, ...] are first
// written into the caches at positions cache_seqlens[b] (int32 [batch]) onwards; query i
// then attends causally (bottom right) to keys [cache_leftpad[b], cache_seqlens[b] +
// seqlen_new). Returns out [batch, seqlen_q, heads, v's head_dim].
using attention_with_kvcache_forward_t = at::Tensor(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cache_leftpad,
    double scale);

// (packed [tokens, ...], indices int64 [tokens] into batch * seq, cu_seqlens int32
// [batch + 1], longest sequence) of the non-padding tokens of hidden [batch, seq, ...].
using unpad_forward_t = std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t>(
    const at::Tensor& hidden, const at::Tensor& key_padding_mask);
// [batch, seqlen, ...]: packed's rows at `indices`, zeros elsewhere (also unpad's backward).
using pad_forward_t = at::Tensor(const at::Tensor& packed, const at::Tensor& indices,
                                 int64_t batch, int64_t seqlen);
// pad's backward: the rows of grad [batch, seqlen, ...] at `indices`.
using pad_backward_t = at::Tensor(const at::Tensor& grad, const at::Tensor& indices);

// summed = dropout(x) + residual and out = layer_norm(summed) over the last dimension;
// residual, weight and bias may be absent. Returns (out, summed, mean, rstd), the
// latter two [rows] in float32 (float64 for float64 inputs): the statistics of summed
// as returned, saved for the backward.
using add_layer_norm_forward_t = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed);
// (dsummed, dx, dweight, dbias). dsummed is the gradient of summed (grad_summed, which may be
// absent, plus what flows back through the norm): the residual's gradient, and x's too
// without dropout, when dx is undefined. Under dropout dx = dsummed through the mask, and
// dsummed is defined only when has_residual. dweight and dbias are undefined when absent.
using add_layer_norm_backward_t = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed);

// The pointwise part of an LSTM step: gates [..., 4 * cell] (input, forget, cell, output
// pre-activations), c_prev [..., cell]. Returns (h, c), c clipped to [-cell_clip, cell_clip]
// (cell_clip +inf: no clip).
using lstm_cell_forward_t = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& gates, const at::Tensor& c_prev, double cell_clip);
// (dgates, dc_prev) from the gradients of h and c.
using lstm_cell_backward_t = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor& grad_h, const at::Tensor& grad_c, const at::Tensor& gates,
    const at::Tensor& c_prev, double cell_clip);

// --- the entry points of each backend ---------------------------------------------------------

// X(name) for each op entry point both backends have, then those of the CPU backend alone.
#define FUSEDLM_SHARED_OPS(X)                                                              \
  X(bias_gelu_forward) X(bias_gelu_backward) X(gelu_ffn_forward) X(gelu_ffn_backward)      \
  X(cross_entropy_forward) X(cross_entropy_backward) X(masked_lm_loss_forward)             \
  X(masked_lm_loss_backward) X(attention_forward) X(attention_backward)                    \
  X(attention_varlen_forward) X(attention_varlen_backward) X(add_layer_norm_forward)       \
  X(add_layer_norm_backward)
#define FUSEDLM_CPU_OPS(X)                                                                 \
  FUSEDLM_SHARED_OPS(X)                                                                    \
  X(attention_with_kvcache_forward) X(unpad_forward) X(pad_forward) X(pad_backward)        \
  X(lstm_cell_forward) X(lstm_cell_backward) X(distillation_loss_forward)
#define FUSEDLM_CUDA_OPS(X) FUSEDLM_SHARED_OPS(X)

#define FUSEDLM_DECLARE_OP(name) name##_t name;
FUSEDLM_CPU_OPS(FUSEDLM_DECLARE_OP)
dropout_mask_t dropout_mask;

// Which kernel table is in use, and the ones this processor can run.
std::string cpu_capability();
void set_cpu_capability(const std::string& isa);
std::vector<std::string> supported_cpu_capabilities();

namespace cuda {
FUSEDLM_CUDA_OPS(FUSEDLM_DECLARE_OP)
device_dropout_mask_t dropout_mask;

// The kernel-path switches (csrc/cuda/paths.cu): "attention_resident" (the attention
// kernels keep a short sequence's tiles in shared memory), "attention_wgmma" and "ffn_wgmma"
// (the sm_90a kernels where the device and the build have them). Each is on unless its
// environment variable (FUSEDLM_ATTENTION_RESIDENT, FUSEDLM_ATTENTION_WGMMA,
// FUSEDLM_FFN_WGMMA) is "0" when the process first asks; set_path changes one at run time.
void set_path(const std::string& name, bool enabled);
std::map<std::string, bool> paths();
}  // namespace cuda
#undef FUSEDLM_DECLARE_OP

}  // namespace fusedlm
