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

struct AttnTile;  // csrc/cpu/attention.h

// The kernels' signatures, one function type `<name>_fn` each.

// Philox-4x32-10 keep mask: keep[i] = 1 for element (offset + i) with
// probability 1 - p. The same stream every dropout in fusedlm's CPU backend uses.
using dropout_mask_fn = void(uint64_t seed, uint64_t offset, int64_t n, double p, uint8_t* keep);

// y = gelu(x + bias) [* keep / (1 - p)] over rows x cols, row-major; bias may be null.
using bias_gelu_forward_fn = void(DType, const void* x, const void* bias, void* y, int64_t rows,
                                  int64_t cols, Gelu, const uint8_t* keep, double p);
// dx = dy [* keep / (1 - p)] * gelu'(x + bias); when dbias_partial is not null it receives
// the column sums of dx over these rows (the first stage of the bias gradient), in the
// accumulation type: float64 for kF64, float32 otherwise.
using bias_gelu_backward_fn = void(DType, const void* dy, const void* x, const void* bias, void* dx,
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
using cross_entropy_forward_fn = void(DType, const void* logits, const int64_t* labels, void* loss,
                                      void* grad, void* col_sum, int64_t rows, int64_t classes,
                                      int64_t ignore_index, double label_smoothing,
                                      double grad_scale, const void* row_scale);
// DistilBERT's soft-target loss of rows x classes (row-major student and teacher logits, one
// dtype), p = softmax(teacher / T) and q = softmax(student / T) per row:
//   loss[r] = T^2 * sum_j p_j (log p_j - log q_j)      (accumulation type)
//   grad[r, j] = grad_scale * T * (q_j - p_j)           (grad may be null: loss only)
using distillation_loss_forward_fn = void(DType, const void* student, const void* teacher,
                                          void* loss, void* grad, int64_t rows, int64_t classes,
                                          double temperature, double grad_scale);
// dst[r, c] = src[r, c] * scale[r * scale_stride], scale in the accumulation type
// (scale_stride 0: one scale for every row). The backward of cross_entropy.
using cross_entropy_scale_grad_fn = void(DType, const void* src, void* dst, int64_t rows,
                                         int64_t cols, const void* scale, int64_t scale_stride);
// Attention (csrc/cpu/attention.cpp); a tile is described by an AttnTile
// (csrc/cpu/attention.h). "acc" buffers are in the accumulation type of the DType.
//
// dst[r] = src[rows[r]] (rows null: r), a dense [n, cols] acc buffer from a strided matrix.
using attn_pack_fn = void(DType, const void* src, int64_t row_stride, int64_t col_stride,
                          const int32_t* rows, int64_t n, int64_t cols, void* dst);
// dst[r] = scale * src[from[r]] (from null: r) into a strided matrix; zeros where from[r] < 0.
// For each of `heads` heads, their src and dst the given head strides (elements) apart.
using attn_unpack_fn = void(DType, const void* src, const int32_t* from, int64_t n, int64_t cols,
                            double scale, void* dst, int64_t row_stride, int64_t col_stride,
                            int64_t heads, int64_t src_head_stride, int64_t dst_head_stride);
// keep[r, j] = element offset + r * row_pitch + key_pos[j] of the dropout stream; scratch
// holds key_pos[cols - 1] - key_pos[0] + 1 bytes.
using attn_dropout_keep_fn = void(uint64_t seed, double p, uint64_t offset, int64_t row_pitch,
                                  int64_t rows, const int32_t* key_pos, int64_t cols,
                                  uint8_t* scratch, uint8_t* keep);
// One key block of the online softmax over the tile's product s: scales, adds the bias,
// masks, updates the row max m and sum l (which `first` initialises), rescales the output
// accumulator o [rows, o_cols] (unless first), and leaves in s the weights of V:
// exp(score - m) [* keep / (1 - p)], zero where masked.
using attn_forward_block_fn = void(const AttnTile* tile, bool first, void* s, void* m, void* l,
                                   void* o, int64_t o_cols);
// out = o / l (zeros where l == 0), stored strided in the DType, and lse = m + log(l)
// (+inf where l == 0).
using attn_forward_finish_fn = void(DType, int64_t rows, int64_t o_cols, const void* m,
                                    const void* l, const void* o, void* lse, void* out,
                                    int64_t out_row_stride, int64_t out_col_stride);
// delta[r] = sum over c of o[r, c] * dout[r, c]; o strided in the DType, dout acc rows
// dout_row_stride apart.
using attn_delta_fn = void(DType, const void* o, int64_t row_stride, int64_t col_stride,
                           const void* dout, int64_t dout_row_stride, int64_t rows, int64_t cols,
                           void* delta);
// From the tile's product s and dp = dO V^T: s <- P [* keep / (1 - p)] with
// P = exp(score - lse), dp <- dS = P * (dp [* keep / (1 - p)] - delta); zero where masked.
// delta = rowsum(dO * O) is read, or with own_delta (the tile holds every allowed key of
// its rows) computed here as rowsum(P * dp [* keep / (1 - p)]) and written.
using attn_backward_block_fn = void(const AttnTile* tile, void* s, void* dp, const void* lse,
                                    void* delta, bool own_delta);
// dbias[r * row_stride + key_pos[j] * col_stride] += ds[r, j] over the tile, in order; a
// stride of 0 sums over that dimension (a broadcast bias).
using attn_bias_grad_fn = void(const AttnTile* tile, const void* ds, void* dbias,
                               int64_t row_stride, int64_t col_stride);
// summed = x [* keep / (1 - p)] + residual and out = layer_norm(summed) * weight + bias over
// rows x cols, row-major; residual, weight, bias and keep may be null. out is normalised
// from summed before rounding; mean and rstd receive, in the accumulation type, the
// statistics of each row of summed as stored (what the backward reads back).
using add_layer_norm_forward_fn = void(DType, const void* x, const void* residual,
                                       const void* weight, const void* bias, void* out,
                                       void* summed, void* mean, void* rstd, int64_t rows,
                                       int64_t cols, double eps, const uint8_t* keep, double p);
// dsummed = the gradient of summed from grad_out through the norm plus grad_summed (which
// may be null), and dx = dsummed [* keep / (1 - p)]. Without keep only dsummed is written;
// with it dx is, and dsummed too unless null. weight may be null. When not null,
// dweight_partial and dbias_partial receive the column sums of grad_out * xhat and of
// grad_out over these rows (the first stage of those gradients), in the accumulation type.
using add_layer_norm_backward_fn = void(DType, const void* grad_out, const void* grad_summed,
                                        const void* summed, const void* mean, const void* rstd,
                                        const void* weight, void* dsummed, void* dx,
                                        void* dweight_partial, void* dbias_partial, int64_t rows,
                                        int64_t cols, const uint8_t* keep, double p);
// The pointwise part of an LSTM step over rows x cell, row-major: gates [rows, 4 * cell]
// holds the pre-activations of the input, forget, cell and output gates in that order;
// c = clamp(i * g + f * c_prev, -clip, clip) and h = o * tanh(c) (clip may be +inf).
using lstm_cell_forward_fn = void(DType, const void* gates, const void* c_prev, void* h, void* c,
                                  int64_t rows, int64_t cell, double clip);
// dgates and dc_prev from dh and dc (the gradient of the returned c), recomputing the
// activations from gates and c_prev; the clip passes gradient only inside [-clip, clip].
using lstm_cell_backward_fn = void(DType, const void* dh, const void* dc, const void* gates,
                                   const void* c_prev, void* dgates, void* dc_prev, int64_t rows,
                                   int64_t cell, double clip);

// X(name) for every kernel of the table.
#define FUSEDLM_CPU_KERNELS(X)                                                                 \
  X(dropout_mask) X(bias_gelu_forward) X(bias_gelu_backward) X(cross_entropy_forward)          \
  X(cross_entropy_scale_grad) X(distillation_loss_forward) X(attn_pack) X(attn_unpack) X(attn_dropout_keep)                 \
  X(attn_forward_block) X(attn_forward_finish) X(attn_delta) X(attn_backward_block)            \
  X(attn_bias_grad) X(add_layer_norm_forward) X(add_layer_norm_backward)                       \
  X(lstm_cell_forward) X(lstm_cell_backward)

struct KernelTable {
  const char* isa;
#define FUSEDLM_KERNEL_MEMBER(name) name##_fn* name;
  FUSEDLM_CPU_KERNELS(FUSEDLM_KERNEL_MEMBER)
#undef FUSEDLM_KERNEL_MEMBER
};

#define FUSEDLM_DECLARE_TABLE(isa) const KernelTable& kernel_table_##isa();
FUSEDLM_DECLARE_TABLE(baseline)
FUSEDLM_DECLARE_TABLE(avx2)
FUSEDLM_DECLARE_TABLE(avx512)
#undef FUSEDLM_DECLARE_TABLE

}  // namespace fusedlm::cpu
