// What an attention call asks for, whichever backend runs it: the shapes of q, k and v
// checked against each other (and against the key padding mask or the sequence offsets),
// so that every row a kernel walks lies inside the tensors. Each backend's problem
// (csrc/cpu/attention.cpp, kernels/cuda/attention.cu) adds its own layout to it.
#pragma once
#include <ATen/ATen.h>

#include <optional>

#include "checks.h"

namespace fusedlm {

struct AttentionProblem {
  bool varlen = false;
  int64_t batch = 0, heads = 0;
  int64_t kv_heads = 0;  // of k and v: query head h reads key/value head h / (heads / kv_heads)
  int64_t seq_q = 0, seq_k = 0;  // varlen: max_seqlen_q and max_seqlen_k
  int64_t dk = 0, dv = 0;        // head_dim of q and k, and of v
  bool causal = false;
  // Query i of a sequence sees key j when i + off - window_left <= j <= i + off + window_right,
  // off = seq_k - seq_q (bottom right); -1: no bound on that side.
  int64_t window_left = -1, window_right = -1;
  double dropout_p = 0.0, scale = 1.0;
};

// Whether the problem has grouped key/value heads or a window: what a kernel that takes
// neither refuses.
bool grouped_or_windowed(const AttentionProblem& pb);

// q [batch, heads, seq, head_dim], k and v [batch, kv_heads, seq_k, head_dim] with kv_heads
// dividing heads (v's head_dim may differ), one dtype, on one device; key_padding_mask, when
// present, bool [batch, seq_k] there too.
AttentionProblem padded_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& key_padding_mask, bool causal,
                                  int64_t window_left, int64_t window_right, double dropout_p,
                                  double scale, DeviceCheck device);

// q [total_q, heads, head_dim], k and v [total_k, kv_heads, head_dim], and cu_seqlens_q and
// cu_seqlens_k int32 [batch + 1], on one device. Their values are the backend's to check.
AttentionProblem varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                  int64_t window_left, int64_t window_right, double dropout_p,
                                  double scale, DeviceCheck device);

// The backward's saved output and log-sum-exp and the incoming gradient: grad and out
// [batch, heads, seq_q, dv] ([total_q, heads, dv] for varlen) of q's dtype, lse [batch,
// heads, seq_q] ([heads, total_q]) of lse_dtype with unit stride along its rows, on q's device.
void check_saved(const AttentionProblem& pb, const at::Tensor& q, const at::Tensor& grad,
                 const at::Tensor& out, const at::Tensor& lse, at::ScalarType lse_dtype,
                 DeviceCheck device);

}  // namespace fusedlm
