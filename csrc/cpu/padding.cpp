// unpad and pad on the CPU: moving the tokens of padded [batch, seq, ...] tensors to
// and from the packed [tokens, ...] layout of attention_varlen.
//
// Both are row copies (memcpy of one token's features), split over threads by rows;
// each reads and writes every byte once. unpad also derives the indices, cu_seqlens
// and longest length from the mask in one pass over it.
// Host code only: the file compiles to nothing in the kernel role (csrc/cpu/kernel.h).
#ifndef FUSEDLM_ISA
#include <cstring>
#include <limits>
#include <vector>

#include "ops/compiled_kernel.h"
#include "common.h"

namespace fusedlm {
namespace {

// `t` as [rows, features] over its first `lead` dimensions, each row a contiguous run
// of bytes at any pitch (a copy is made only when a row's features are not one).
at::Tensor as_rows(const at::Tensor& t, int64_t lead) {
  auto rows = t.flatten(0, lead - 1);
  rows = rows.dim() == 1 ? rows.unsqueeze(1) : rows.flatten(1);
  return rows.size(1) <= 1 || rows.stride(1) == 1 ? rows : rows.contiguous();
}

// Rows per task: about 64 KiB of copying.
int64_t grain(int64_t row_bytes) { return std::max<int64_t>(1, 65536 / std::max<int64_t>(row_bytes, 1)); }

// out[r] = src[index[r]] for r in [0, n), rows of row_bytes bytes.
void gather(const at::Tensor& src, const int64_t* index, int64_t n, at::Tensor& out) {
  const int64_t row_bytes = src.size(1) * src.element_size();
  const int64_t src_pitch = src.stride(0) * src.element_size();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, n, grain(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      std::memcpy(to + r * row_bytes, from + index[r] * src_pitch, row_bytes);
  });
}

}  // namespace

// (packed [tokens, ...], indices int64 [tokens] into batch * seq, cu_seqlens int32
// [batch + 1], longest sequence) of the non-padding tokens of hidden [batch, seq, ...].
std::tuple<at::Tensor, at::Tensor, at::Tensor, int64_t> unpad_forward(
    const at::Tensor& hidden, const at::Tensor& key_padding_mask) {
  check_cpu(hidden, "hidden");
  check_cpu(key_padding_mask, "key_padding_mask");
  TORCH_CHECK_VALUE(hidden.dim() >= 2, "hidden must be [batch, seq, ...]");
  const int64_t batch = hidden.size(0), seq = hidden.size(1);
  TORCH_CHECK_VALUE(key_padding_mask.scalar_type() == at::kBool && key_padding_mask.dim() == 2 &&
                        key_padding_mask.size(0) == batch && key_padding_mask.size(1) == seq,
                    "key_padding_mask must be bool [batch, seq] matching hidden");
  TORCH_CHECK_VALUE(batch * seq < std::numeric_limits<int32_t>::max(),
                    "unpad supports fewer than 2^31 tokens (cu_seqlens is int32)");
  const bool* mask = key_padding_mask.data_ptr<bool>();
  const int64_t ms0 = key_padding_mask.stride(0), ms1 = key_padding_mask.stride(1);
  auto cu_seqlens = at::empty({batch + 1}, at::dtype(at::kInt));
  int32_t* cu = cu_seqlens.data_ptr<int32_t>();
  std::vector<int64_t> index;
  index.reserve(batch * seq);
  int64_t longest = 0;
  cu[0] = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first = static_cast<int64_t>(index.size());
    for (int64_t s = 0; s < seq; ++s)
      if (!mask[b * ms0 + s * ms1]) index.push_back(b * seq + s);
    longest = std::max(longest, static_cast<int64_t>(index.size()) - first);
    cu[b + 1] = static_cast<int32_t>(index.size());
  }
  const int64_t tokens = static_cast<int64_t>(index.size());
  auto indices = at::empty({tokens}, at::dtype(at::kLong));
  std::copy(index.begin(), index.end(), indices.data_ptr<int64_t>());
  auto shape = hidden.sizes().vec();
  shape.erase(shape.begin());
  shape[0] = tokens;
  // Outputs are allocated in their final shapes (gather writes rows into their contiguous
  // memory): an op's output must not be a view.
  auto packed = at::empty(shape, hidden.options());
  gather(as_rows(hidden, 2), index.data(), tokens, packed);
  return {packed, indices, cu_seqlens, longest};
}
FUSEDLM_KERNEL(unpad_forward);

// [batch, seqlen, ...]: packed's rows at `indices`, zeros elsewhere (also unpad's backward).
at::Tensor pad_forward(const at::Tensor& packed, const at::Tensor& indices, int64_t batch,
                       int64_t seqlen) {
  check_cpu(packed, "packed");
  check_cpu(indices, "indices");
  TORCH_CHECK_VALUE(packed.dim() >= 1, "packed must be [tokens, ...]");
  TORCH_CHECK_VALUE(indices.scalar_type() == at::kLong && indices.dim() == 1 &&
                        indices.size(0) == packed.size(0),
                    "indices must be int64 [tokens] with packed's tokens");
  TORCH_CHECK_VALUE(batch >= 0 && seqlen >= 0, "batch and seqlen must be non-negative");
  // Every output row is written once: the packed row that lands there, or zeros.
  const int64_t slots = batch * seqlen, tokens = packed.size(0);
  std::vector<int64_t> source(slots, -1);
  const int64_t* idx = indices.data_ptr<int64_t>();
  const int64_t is = indices.stride(0);
  for (int64_t r = 0; r < tokens; ++r) {
    const int64_t at = idx[r * is];
    // (the messages are fusedlm.ops.pad's: the cpu backend checks the indices here alone)
    TORCH_CHECK_VALUE(at >= 0 && at < slots, "indices must lie in [0, batch * seqlen = ", slots, ")");
    TORCH_CHECK_VALUE(source[at] < 0, "indices must not repeat a position");
    source[at] = r;
  }
  auto shape = packed.sizes().vec();
  shape[0] = seqlen;
  shape.insert(shape.begin(), batch);
  auto rows = as_rows(packed, 1);
  auto out = at::empty(shape, packed.options());
  const int64_t row_bytes = rows.size(1) * rows.element_size();
  const int64_t pitch = rows.stride(0) * rows.element_size();
  const char* from = static_cast<const char*>(rows.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, slots, grain(row_bytes), [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      if (source[s] >= 0) std::memcpy(to + s * row_bytes, from + source[s] * pitch, row_bytes);
      else std::memset(to + s * row_bytes, 0, row_bytes);
    }
  });
  return out;
}
FUSEDLM_KERNEL(pad_forward);

// pad's backward: the rows of grad [batch, seqlen, ...] at `indices`.
at::Tensor pad_backward(const at::Tensor& grad, const at::Tensor& indices) {
  check_cpu(grad, "grad");
  TORCH_CHECK_VALUE(grad.dim() >= 2, "grad must be [batch, seq, ...]");
  auto index = indices.contiguous();
  const int64_t tokens = index.size(0);
  auto shape = grad.sizes().vec();
  shape.erase(shape.begin());
  shape[0] = tokens;
  auto out = at::empty(shape, grad.options());
  gather(as_rows(grad, 2), index.data_ptr<int64_t>(), tokens, out);
  return out;
}
FUSEDLM_KERNEL(pad_backward);

}  // namespace fusedlm

#endif  // FUSEDLM_ISA
