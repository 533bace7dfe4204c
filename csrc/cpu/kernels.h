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
  // Attention (csrc/cpu/attention.cpp): the steps between the host's matrix products.
  // "acc" buffers are dense, row-major, in the accumulation type of the DType.
  //
  // dst[r] = scale * src[rows[r]] (rows null: r), a dense [n, cols] acc buffer from a strided matrix.
  void (*attn_pack)(DType, const void* src, int64_t row_stride, int64_t col_stride,
                    const int32_t* rows, int64_t n, int64_t cols, double scale, void* dst);
  // dst[r] = scale * src[from[r]] (from null: r) into a strided matrix; zeros where from[r] < 0.
  void (*attn_unpack)(DType, const void* src, const int32_t* from, int64_t n, int64_t cols,
                      double scale, void* dst, int64_t row_stride, int64_t col_stride);
  // s[r, j] += bias[r * row_stride + key_pos[j] * col_stride] over a [rows, cols] acc tile.
  void (*attn_add_bias)(DType, void* s, int64_t rows, int64_t cols, const void* bias,
                        int64_t row_stride, int64_t col_stride, const int32_t* key_pos);
  // keep[r, j] = element offset + r * row_pitch + key_pos[j] of the dropout stream; scratch
  // holds key_pos[cols - 1] - key_pos[0] + 1 bytes.
  void (*attn_dropout_keep)(uint64_t seed, double p, uint64_t offset, int64_t row_pitch,
                            int64_t rows, const int32_t* key_pos, int64_t cols, uint8_t* scratch,
                            uint8_t* keep);
  // One key block of the online softmax over scores s [rows, cols]; columns >= limit[r] are
  // masked. Updates the row max m and sum l, rescales o [rows, o_cols], and leaves in s the
  // weights of V: exp(s - m) [* keep / (1 - p)], zero where masked.
  void (*attn_forward_block)(DType, int64_t rows, int64_t cols, const int32_t* limit,
                             const uint8_t* keep, double p, void* s, void* m, void* l, void* o,
                             int64_t o_cols);
  // o /= l and lse = m + log(l); rows with l == 0 get o = 0 and lse = +inf.
  void (*attn_forward_finish)(DType, int64_t rows, int64_t o_cols, const void* m, const void* l,
                              void* o, void* lse);
  // delta[r] = sum over c of o[r, c] * dout[r, c]; o strided in the DType, dout an acc buffer.
  void (*attn_delta)(DType, const void* o, int64_t row_stride, int64_t col_stride,
                     const void* dout, int64_t rows, int64_t cols, void* delta);
  // From scores s and dp = dO V^T over a tile: s <- P [* keep / (1 - p)] with P = exp(s - lse),
  // dp <- dS = P * (dp [* keep / (1 - p)] - delta); both zero where masked.
  void (*attn_backward_block)(DType, int64_t rows, int64_t cols, const int32_t* limit,
                              const uint8_t* keep, double p, const void* lse, const void* delta,
                              void* s, void* dp);
  // dbias[r * row_stride + key_pos[j] * col_stride] += ds[r, j], in order; a stride of 0 sums
  // over that dimension (a broadcast bias).
  void (*attn_bias_grad)(DType, const void* ds, int64_t rows, int64_t cols,
                         const int32_t* key_pos, void* dbias, int64_t row_stride,
                         int64_t col_stride);
  // summed = x [* keep / (1 - p)] + residual and out = layer_norm(summed) * weight + bias over
  // rows x cols, row-major; residual, weight, bias and keep may be null. out is normalised
  // from summed before rounding; mean and rstd receive, in the accumulation type, the
  // statistics of each row of summed as stored (what the backward reads back).
  void (*add_layer_norm_forward)(DType, const void* x, const void* residual, const void* weight,
                                 const void* bias, void* out, void* summed, void* mean,
                                 void* rstd, int64_t rows, int64_t cols, double eps,
                                 const uint8_t* keep, double p);
  // dsummed = the gradient of summed from grad_out through the norm plus grad_summed (which
  // may be null), and dx = dsummed [* keep / (1 - p)]. Without keep only dsummed is written;
  // with it dx is, and dsummed too unless null. weight may be null. When not null,
  // dweight_partial and dbias_partial receive the column sums of grad_out * xhat and of
  // grad_out over these rows (the first stage of those gradients), in the accumulation type.
  void (*add_layer_norm_backward)(DType, const void* grad_out, const void* grad_summed,
                                  const void* summed, const void* mean, const void* rstd,
                                  const void* weight, void* dsummed, void* dx,
                                  void* dweight_partial, void* dbias_partial, int64_t rows,
                                  int64_t cols, const uint8_t* keep, double p);
};

#define FUSEDLM_DECLARE_TABLE(isa) const KernelTable& kernel_table_##isa();
FUSEDLM_DECLARE_TABLE(baseline)
FUSEDLM_DECLARE_TABLE(avx2)
FUSEDLM_DECLARE_TABLE(avx512)
#undef FUSEDLM_DECLARE_TABLE

}  // namespace fusedlm::cpu
