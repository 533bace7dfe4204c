#include "attention_problem.h"

#include <vector>

namespace fusedlm {
namespace {

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t ndim,
               DeviceCheck device) {
  device(q, "q");
  for (auto [t, name] : {std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    device(*t, name);
    check_same_device(*t, q, name, "q");
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), name, " must have q's dtype");
  }
  TORCH_CHECK_VALUE(q.dim() == ndim && k.dim() == ndim && v.dim() == ndim, "q, k and v must have ",
                    ndim, " dimensions");
}

// kv_heads must divide heads; a window bound is -1 (none) or >= 0.
void check_groups_and_window(const AttentionProblem& pb, const char* k_shape) {
  TORCH_CHECK_VALUE(pb.kv_heads >= 1 ? pb.heads % pb.kv_heads == 0 : pb.heads == 0,
                    "k and v must have a number of heads that divides q's (", pb.heads, "); k is ",
                    k_shape);
  TORCH_CHECK_VALUE(pb.window_left >= -1 && pb.window_right >= -1,
                    "window_size must be (left, right) with each -1 (no bound) or >= 0");
}

}  // namespace

bool grouped_or_windowed(const AttentionProblem& pb) {
  return pb.kv_heads != pb.heads || pb.window_left >= 0 || pb.window_right >= 0;
}

AttentionProblem padded_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const std::optional<at::Tensor>& key_padding_mask, bool causal,
                                  int64_t window_left, int64_t window_right, double dropout_p,
                                  double scale, DeviceCheck device) {
  check_qkv(q, k, v, 4, device);
  AttentionProblem pb{false,     q.size(0), q.size(1),    k.size(1),     q.size(2),
                      k.size(2), q.size(3), v.size(3),    causal,        window_left,
                      window_right, dropout_p, scale};
  TORCH_CHECK_VALUE(k.size(0) == pb.batch && k.size(3) == pb.dk,
                    "k must have shape [batch, kv_heads, seq_k, head_dim] = ",
                    at::IntArrayRef{pb.batch, pb.kv_heads, pb.seq_k, pb.dk}, ", got ", k.sizes());
  check_groups_and_window(pb, c10::str(k.sizes()).c_str());
  TORCH_CHECK_VALUE(v.sizes().slice(0, 3).equals(k.sizes().slice(0, 3)),
                    "v must match k in batch, heads and seq");
  if (present(key_padding_mask)) {
    const auto& mask = *key_padding_mask;
    device(mask, "key_padding_mask");
    check_same_device(mask, q, "key_padding_mask", "q");
    TORCH_CHECK_VALUE(mask.scalar_type() == at::kBool && mask.dim() == 2 &&
                          mask.size(0) == pb.batch && mask.size(1) == pb.seq_k,
                      "key_padding_mask must be bool [batch, seq_k]");
  }
  return pb;
}

AttentionProblem varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                  int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                                  int64_t window_left, int64_t window_right, double dropout_p,
                                  double scale, DeviceCheck device) {
  check_qkv(q, k, v, 3, device);
  for (auto [cu, name] : {std::pair{&cu_seqlens_q, "cu_seqlens_q"},
                          std::pair{&cu_seqlens_k, "cu_seqlens_k"}}) {
    device(*cu, name);
    check_same_device(*cu, q, name, "q");
    TORCH_CHECK_TYPE(cu->scalar_type() == at::kInt, name, " must be int32");
    TORCH_CHECK_VALUE(cu->dim() == 1 && cu->size(0) >= 1, name, " must be [batch + 1]");
  }
  TORCH_CHECK_VALUE(cu_seqlens_k.size(0) == cu_seqlens_q.size(0),
                    "cu_seqlens_k must have as many entries as cu_seqlens_q");
  TORCH_CHECK_VALUE(max_seqlen_q >= 0 && max_seqlen_k >= 0, "max_seqlen_q and max_seqlen_k must be >= 0");
  AttentionProblem pb{true,         cu_seqlens_q.size(0) - 1, q.size(1), k.size(1),
                      max_seqlen_q, max_seqlen_k,             q.size(2), v.size(2),
                      causal,       window_left,              window_right, dropout_p,
                      scale};
  TORCH_CHECK_VALUE(k.size(2) == pb.dk && v.size(0) == k.size(0) && v.size(1) == pb.kv_heads,
                    "k and v must be [total_k, kv_heads, head_dim] with q's head_dim");
  check_groups_and_window(pb, c10::str(k.sizes()).c_str());
  return pb;
}

void check_saved(const AttentionProblem& pb, const at::Tensor& q, const at::Tensor& grad,
                 const at::Tensor& out, const at::Tensor& lse, at::ScalarType lse_dtype,
                 DeviceCheck device) {
  const auto out_shape = pb.varlen ? std::vector<int64_t>{q.size(0), pb.heads, pb.dv}
                                   : std::vector<int64_t>{pb.batch, pb.heads, pb.seq_q, pb.dv};
  const auto lse_shape = pb.varlen ? std::vector<int64_t>{pb.heads, q.size(0)}
                                   : std::vector<int64_t>{pb.batch, pb.heads, pb.seq_q};
  for (auto [t, name] : {std::pair{&grad, "grad"}, std::pair{&out, "out"}}) {
    device(*t, name);
    check_same_device(*t, q, name, "q");
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef(out_shape) && t->scalar_type() == q.scalar_type(),
                      name, " must be of the attention output's shape and dtype");
  }
  device(lse, "lse");
  check_same_device(lse, q, "lse", "q");
  TORCH_CHECK_VALUE(lse.sizes() == at::IntArrayRef(lse_shape) && lse.scalar_type() == lse_dtype &&
                        lse.stride(-1) == 1,
                    "lse must be the forward's log-sum-exp");
}

}  // namespace fusedlm
