// rms_norm on the CPU: one pass over memory forward, one backward, split over row blocks.
//
// Forward, per row: the sum of squares (row_sums.h), then out = x * rstd * weight from the
// row, now in L1. Memory sees one read of x and one write of out, plus an rstd per row.
//
// Backward, per row: a first pass sums g * x, where g = dy * weight, and adds dy * x * rstd
// into per-block column sums (the first stage of the weight gradient); a second pass over
// the same row, in L1, writes dx = rstd * (g - x * rstd^2 * mean(g * x)). Memory sees one
// read of dy and x and one write of dx.
//
// float16 rows are converted in bulk to float rows and back (widen_row, narrow_row).
#include "kernel.h"

#ifdef FUSEDLM_ISA
#include <cmath>
#include <memory>

#include "math.h"
#include "row_sums.h"
#else

#include "checks.h"
#include "common.h"
#include "ops/compiled_kernel.h"
#endif

// out = x * rstd * weight over rows x cols, row-major, with rstd = 1 / sqrt(mean(x^2) +
// eps) per row, written in the accumulation type; weight may be null.
FUSEDLM_CPU_KERNEL(rms_norm_forward, void(DType, const void* x, const void* weight, void* out,
                                          void* rstd, int64_t rows, int64_t cols, double eps))

// dx = the gradient of x from grad_out, and, when dweight_partial is not null, the column
// sums of grad_out * x * rstd over these rows in the accumulation type (the first stage of
// the weight gradient). weight may be null.
FUSEDLM_CPU_KERNEL(rms_norm_backward, void(DType, const void* grad_out, const void* x,
                                           const void* rstd, const void* weight, void* dx,
                                           void* dweight_partial, int64_t rows, int64_t cols))

#ifdef FUSEDLM_ISA

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

template <typename T>
void forward_rows(const T* __restrict__ x, const acc_t<T>* __restrict__ weight,
                  T* __restrict__ out, acc_t<T>* __restrict__ rstd, int64_t rows, int64_t cols,
                  acc_t<T> eps) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T* outr = out + r * cols;
    const auto [squares] = row_sums<A, 1>(cols, [&](int64_t c) {
      const A v = load(xr[c]);
      return std::array<A, 1>{v * v};
    });
    const A rs = A(1) / std::sqrt(squares / A(cols) + eps);
    for (int64_t c = 0; c < cols; ++c) store(outr[c], load(xr[c]) * rs * weight[c]);
    rstd[r] = rs;
  }
}

// dweight accumulates: the caller zeroes it.
template <typename T>
void backward_rows(const T* __restrict__ dy, const T* __restrict__ x,
                   const acc_t<T>* __restrict__ rstd, const acc_t<T>* __restrict__ weight,
                   T* __restrict__ dx, acc_t<T>* __restrict__ dweight, int64_t rows,
                   int64_t cols) {
  using A = acc_t<T>;
  const A inv_n = A(1) / A(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const T* dyr = dy + r * cols;
    const T* xr = x + r * cols;
    T* dxr = dx + r * cols;
    const A rs = rstd[r];
    const auto [sum_gx] = row_sums<A, 1>(cols, [&](int64_t c) {
      const A d = load(dyr[c]), v = load(xr[c]);
      dweight[c] += d * v * rs;
      return std::array<A, 1>{d * weight[c] * v};
    });
    // x * rstd^2 * mean(g * x) as xhat * mean(g * xhat), xhat = x * rstd: rstd^2 alone
    // overflows for rows of tiny values under a tiny eps.
    const A mean_gxhat = rs * sum_gx * inv_n;
    // The row's dy and x are in L1 now: read again rather than buffered.
    for (int64_t c = 0; c < cols; ++c)
      store(dxr[c], rs * (load(dyr[c]) * weight[c] - load(xr[c]) * rs * mean_gxhat));
  }
}

// An optional [cols] vector widened to the accumulation type, or ones when absent.
template <typename T>
void widen_weight(const T* v, int64_t cols, acc_t<T>* out) {
  for (int64_t c = 0; c < cols; ++c) out[c] = v ? load(v[c]) : acc_t<T>(1);
}

}  // namespace

void rms_norm_forward(DType dtype, const void* x, const void* weight, void* out, void* rstd,
                      int64_t rows, int64_t cols, double eps) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = acc_t<T>;
    std::unique_ptr<A[]> w(new A[(std::is_same_v<T, f16> ? 3 : 1) * cols]);
    widen_weight(static_cast<const T*>(weight), cols, w.get());
    const T* xs = static_cast<const T*>(x);
    T* outs = static_cast<T*>(out);
    A* rs = static_cast<A*>(rstd);
    if constexpr (std::is_same_v<T, f16>) {  // a row at a time through float rows
      float *xf = w.get() + cols, *of = xf + cols;
      for (int64_t r = 0; r < rows; ++r) {
        widen_row(xs + r * cols, xf, cols);
        forward_rows<float>(xf, w.get(), of, rs + r, 1, cols, float(eps));
        narrow_row(of, outs + r * cols, cols);
      }
    } else {
      forward_rows<T>(xs, w.get(), outs, rs, rows, cols, A(eps));
    }
  });
}

void rms_norm_backward(DType dtype, const void* grad_out, const void* x, const void* rstd,
                       const void* weight, void* dx, void* dweight_partial, int64_t rows,
                       int64_t cols) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = acc_t<T>;
    // Scratch: the widened weight, the weight gradient's column sums when not asked for
    // (computed anyway: one loop shape), and three float rows for float16.
    std::unique_ptr<A[]> scratch(new A[(std::is_same_v<T, f16> ? 5 : 2) * cols]);
    A *w = scratch.get(), *spare = w + cols;
    widen_weight(static_cast<const T*>(weight), cols, w);
    A* dw = dweight_partial ? static_cast<A*>(dweight_partial) : spare;
    for (int64_t c = 0; c < cols; ++c) dw[c] = A(0);
    const T *dys = static_cast<const T*>(grad_out), *xs = static_cast<const T*>(x);
    const A* rs = static_cast<const A*>(rstd);
    T* dxs = static_cast<T*>(dx);
    if constexpr (std::is_same_v<T, f16>) {
      float *dyf = spare + cols, *xf = dyf + cols, *dxf = xf + cols;
      for (int64_t r = 0; r < rows; ++r) {
        widen_row(dys + r * cols, dyf, cols);
        widen_row(xs + r * cols, xf, cols);
        backward_rows<float>(dyf, xf, rs + r, w, dxf, dw, 1, cols);
        narrow_row(dxf, dxs + r * cols, cols);
      }
    } else {
      backward_rows<T>(dys, xs, rs, w, dxs, dw, rows, cols);
    }
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA

#else  // the host role: entry points

namespace fusedlm {
namespace {

// Blocks of rows per task: about 64 KiB of each input, and whole blocks, so a block's row of
// the weight gradient's partial sums has exactly one writer.
template <typename F>
void for_blocks(int64_t rows, int64_t cols, F&& f) {
  const int64_t blocks = (rows + kReduceBlockRows - 1) / kReduceBlockRows;
  const int64_t grain = std::max<int64_t>(1, 16384 / (cols * kReduceBlockRows));
  at::parallel_for(0, blocks, grain, [&](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kReduceBlockRows;
      f(blk, begin, std::min(rows, begin + kReduceBlockRows));
    }
  });
}

}  // namespace

// (out, rstd): out = rms_norm(x) * weight over the last dimension, in x's shape; rstd [rows]
// in float32 (float64 for float64 inputs), saved for the backward.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const std::optional<at::Tensor>& weight,
                                                    double eps) {
  const auto in = row_inputs(x, weight, check_cpu);
  const at::Tensor& w = in.weight;
  const int64_t rows = in.rows, cols = in.cols;
  auto out = at::empty(x.sizes(), in.x.options());
  auto rstd = at::empty({rows}, in.x.options().dtype(acc_dtype(x.scalar_type())));
  const auto dtype = kernel_dtype(x);
  const size_t row_bytes = cols * x.element_size(), stat_bytes = rstd.element_size();
  const char* xp = static_cast<const char*>(in.x.data_ptr());
  char *op = static_cast<char*>(out.data_ptr()), *rp = static_cast<char*>(rstd.data_ptr());
  const void* wp = w.defined() ? w.data_ptr() : nullptr;
  for_blocks(rows, cols, [&](int64_t, int64_t begin, int64_t end) {
    cpu::rms_norm_forward(dtype, xp + begin * row_bytes, wp, op + begin * row_bytes,
                          rp + begin * stat_bytes, end - begin, cols, eps);
  });
  return {out, rstd};
}
FUSEDLM_KERNEL(rms_norm_forward);

// (dx, dweight), dweight undefined without a weight. eps is the forward's (the kernels read
// the saved rstd).
std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_out,
                                                     const at::Tensor& x, const at::Tensor& rstd,
                                                     const std::optional<at::Tensor>& weight,
                                                     double /*eps*/) {
  const auto in = row_grad_inputs(grad_out, x, weight, check_cpu);
  const at::Tensor& w = in.weight;
  const int64_t rows = in.rows, cols = in.cols;
  const auto acc = acc_dtype(x.scalar_type());
  check_statistics(rstd, "rstd", rows, acc, x, "x", check_cpu);
  auto dx = at::empty(x.sizes(), in.x.options());
  const int64_t blocks = (rows + kReduceBlockRows - 1) / kReduceBlockRows;
  auto partials = partial_sums(w.defined() ? blocks : 0, cols, acc);
  const auto dtype = kernel_dtype(x);
  const size_t row_bytes = cols * x.element_size(), stat_bytes = rstd.element_size();
  const size_t part_bytes = cols * partials.element_size();
  const char *gp = static_cast<const char*>(in.grad_out.data_ptr()),
             *xp = static_cast<const char*>(in.x.data_ptr()),
             *rp = static_cast<const char*>(rstd.data_ptr());
  char* dxp = static_cast<char*>(dx.data_ptr());
  char* dwp = w.defined() ? static_cast<char*>(partials.data_ptr()) : nullptr;
  const void* wp = w.defined() ? w.data_ptr() : nullptr;
  for_blocks(rows, cols, [&](int64_t blk, int64_t begin, int64_t end) {
    const size_t at = begin * row_bytes;
    cpu::rms_norm_backward(dtype, gp + at, xp + at, rp + begin * stat_bytes, wp, dxp + at,
                           dwp ? dwp + blk * part_bytes : nullptr, end - begin, cols);
  });
  return {dx, w.defined() ? sum_partials(partials, 0, blocks, x.scalar_type()) : at::Tensor()};
}
FUSEDLM_KERNEL(rms_norm_backward);

}  // namespace fusedlm

#endif  // FUSEDLM_ISA
