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
