// Host-side helpers shared by the op entry points in csrc/.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "cpu/kernel.h"

namespace fusedlm {

inline cpu::DType kernel_dtype(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return cpu::DType::kF32;
    case at::kDouble: return cpu::DType::kF64;
    case at::kBFloat16: return cpu::DType::kBF16;
    case at::kHalf: return cpu::DType::kF16;
    default:
      TORCH_CHECK_TYPE(false, "fusedlm CPU kernels take float32, float64, bfloat16 or float16, got ",
                       dtype);
  }
}

inline cpu::DType kernel_dtype(const at::Tensor& t) { return kernel_dtype(t.scalar_type()); }

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
}

// Rows per block of a deterministic two-stage reduction: the partial sums are
// per block of this many rows (never per thread), so results do not depend on
// the number of threads.
constexpr int64_t kReduceBlockRows = 64;

// The dtype kernels accumulate in for inputs of `dtype`: float64 for float64, else float32.
inline at::ScalarType acc_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

// A [rows, cols] buffer of `dtype` for the partial sums of the first stage of such a
// reduction (CPU). Up to 1 MiB it is this thread's scratch, reused by every call and valid
// until this thread's next call: allocated per call instead, a buffer of tens of KiB taken
// and freed between a backward's large outputs splits the free space glibc would reuse for
// them, its heap creeps upwards, and the trimmed top is faulted back in 4 KiB at a time by
// the next output (hundreds of page faults a call at BERT sizes).
at::Tensor partial_sums(int64_t rows, int64_t cols, at::ScalarType dtype);

// Sums rows [first, first + blocks) of a [*, cols] buffer of partial sums (in acc_dtype), in
// block order, and returns the sum in `dtype`.
at::Tensor sum_partials(const at::Tensor& partial, int64_t first, int64_t blocks,
                        at::ScalarType dtype);

// The dropout seed, drawn from torch's generator by the Python layer.
inline uint64_t seed_value(const at::Tensor& seed) {
  TORCH_CHECK_VALUE(seed.numel() == 1 && seed.scalar_type() == at::kLong,
                    "seed must be a one-element int64 tensor");
  return static_cast<uint64_t>(seed.item<int64_t>());
}

// A new tensor of `sizes` whose dimensions lie in memory in the order of ref's strides
// (so an output of a [batch, seq, heads, dim] view is laid out the same way). The
// Python fake implementations compute the same order. Allocated with those strides
// rather than permuted, so that it is no view (FSDP2 cannot follow views a module returns).
inline at::Tensor empty_like_layout(const at::Tensor& ref, at::IntArrayRef sizes,
                                    at::ScalarType dtype) {
  std::vector<int64_t> order(ref.dim());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ref.stride(a) > ref.stride(b); });
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (auto d = order.rbegin(); d != order.rend(); ++d) {
    strides[*d] = stride;
    stride *= std::max<int64_t>(sizes[*d], 1);
  }
  return at::empty_strided(sizes, strides, ref.options().dtype(dtype));
}

}  // namespace fusedlm
