// The CPU kernel table: every CPU kernel, as a plain function on raw pointers.
//
// The sources in csrc/cpu/ are compiled once per instruction set (sources.txt,
// group "isa") with FUSEDLM_ISA set to baseline, avx2 or avx512, and never see a
// torch header. Each compilation fills one KernelTable; the host code asks
// cpu_kernels() for the table that matches the processor (csrc/cpu_dispatch.cpp).
//
// Kernels are single-threaded over the range they are given: the host splits
// the work with at::parallel_for, so threading stays in ATen's pool.
#pragma once
#include <cstdint>

namespace fusedlm::cpu {

// Element types of the tensors a kernel reads and writes. Arithmetic is always
// float32 (float64 for kF64, which exists for gradcheck).
enum class DType : int { kF32, kF64, kBF16, kF16 };

enum class Gelu : int { kErf, kTanh };

struct KernelTable {
  const char* isa;

  // Philox-4x32-10 keep mask: keep[i] = 1 for element (offset + i) with
  // probability 1 - p. The same stream every dropout in fusedlm's CPU backend uses.
  void (*dropout_mask)(uint64_t seed, uint64_t offset, int64_t n, double p, uint8_t* keep);

  // y = gelu(x + bias) [* keep / (1 - p)] over rows x cols, row-major; bias may be null.
  void (*bias_gelu_forward)(DType, const void* x, const void* bias, void* y, int64_t rows,
                            int64_t cols, Gelu, const uint8_t* keep, double p);
  // dx = dy [* keep / (1 - p)] * gelu'(x + bias); when dbias_partial is not null it receives
  // the column sums of dx over these rows (the first stage of the bias gradient), in the
  // accumulation type: float64 for kF64, float32 otherwise.
  void (*bias_gelu_backward)(DType, const void* dy, const void* x, const void* bias, void* dx,
                             void* dbias_partial, int64_t rows, int64_t cols, Gelu,
                             const uint8_t* keep, double p);

  // Softmax cross-entropy over the rows of row-major [rows, classes] logits, with the
  // gradient in the same pass. Row r with labels[r] != ignore_index gets
  //   loss[r] = (1 - eps) * (lse - x[y]) + eps * (lse - mean_j x[j])    (eps: label_smoothing)
  //   grad[r, j] = s_r * (softmax_j - eps / classes - (1 - eps) * [j == y]),
  //   s_r = grad_scale * row_scale[r] (row_scale may be null: 1);
  // a row whose label is ignore_index gets loss 0 and a zero gradient row. Labels must be
  // in [0, classes) otherwise. grad may be null (loss only) or equal logits (in place).
  // When col_sum is not null it receives the column sums of grad over these rows.
  // loss, col_sum and row_scale are in the accumulation type (float64 for kF64, else float32).
  void (*cross_entropy_forward)(DType, const void* logits, const int64_t* labels, void* loss,
                                void* grad, void* col_sum, int64_t rows, int64_t classes,
                                int64_t ignore_index, double label_smoothing, double grad_scale,
                                const void* row_scale);
  // dst[r, c] = src[r, c] * scale[r * scale_stride], scale in the accumulation type
  // (scale_stride 0: one scale for every row). The backward of cross_entropy.
  void (*cross_entropy_scale_grad)(DType, const void* src, void* dst, int64_t rows,
                                   int64_t cols, const void* scale, int64_t scale_stride);
};

#define FUSEDLM_DECLARE_TABLE(isa) const KernelTable& kernel_table_##isa();
FUSEDLM_DECLARE_TABLE(baseline)
FUSEDLM_DECLARE_TABLE(avx2)
FUSEDLM_DECLARE_TABLE(avx512)
#undef FUSEDLM_DECLARE_TABLE

}  // namespace fusedlm::cpu
