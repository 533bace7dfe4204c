// add_layer_norm on the CPU: (dropout(x) + residual) and its LayerNorm in one
// pass over memory, and the backward in one more, split over row blocks.
//
// Forward, per row: summed = x [* keep / (1 - p)] + residual is written out as
// its sum accumulates; a second pass over the row, now in L1, gives the
// variance (corrected two-pass algorithm), and a third writes the normalised
// row. Memory sees one read of x and residual and one write of out and summed
// (2 bytes per element each in bf16/fp16) plus a mean and rstd per row: four
// of the five passes over memory of F.layer_norm(x + r), which writes the sum
// and reads it back. In float32 it is bound by memory bandwidth (including the
// read-for-ownership of the written lines); in bf16/fp16 partly by the element
// conversions and the second set of statistics (see forward_rows). fp16 rows are
// converted in bulk, with F16C where the instruction set has it (see forward_rows).
//
// Backward, per row: a first pass sums g and g * xhat, where xhat = (summed -
// mean) * rstd and g = dy * weight, and adds dy * xhat and dy into per-block
// column sums (the first stage of the weight and bias gradients); a second pass
// over the same row, in L1, writes
//   dsummed = rstd * (g - mean(g) - xhat * mean(g * xhat)) + grad_summed
// and dx = dsummed * keep / (1 - p). Memory sees one read of dy, summed and
// grad_summed and one write of dsummed (and dx under dropout).
//
// Row sums keep float's precision at any width, in a fixed order (row_sums.h).
#include "kernel.h"

#ifdef FUSEDLM_ISA
#include <algorithm>
#include <array>
#include <memory>

#include "math.h"
#include "row_sums.h"
#else

#include <vector>

#include "checks.h"
#include "common.h"
#include "ops/compiled_kernel.h"
#endif

// summed = x [* keep / (1 - p)] + residual and out = layer_norm(summed) * weight + bias over
// rows x cols, row-major; residual, weight, bias and keep may be null. out is normalised
// from summed before rounding; mean and rstd receive, in the accumulation type, the
// statistics of each row of summed as stored (what the backward reads back).
FUSEDLM_CPU_KERNEL(add_layer_norm_forward, void(DType, const void* x, const void* residual,
                                                const void* weight, const void* bias, void* out,
                                                void* summed, void* mean, void* rstd, int64_t rows,
                                                int64_t cols, double eps, const uint8_t* keep,
                                                double p))

// dsummed = the gradient of summed from grad_out through the norm plus grad_summed (which
// may be null), and dx = dsummed [* keep / (1 - p)]. Without keep only dsummed is written;
// with it dx is, and dsummed too unless null. weight may be null. When not null,
// dweight_partial and dbias_partial receive the column sums of grad_out * xhat and of
// grad_out over these rows (the first stage of those gradients), in the accumulation type.
FUSEDLM_CPU_KERNEL(add_layer_norm_backward, void(DType, const void* grad_out,
                                                 const void* grad_summed, const void* summed,
                                                 const void* mean, const void* rstd,
                                                 const void* weight, void* dsummed, void* dx,
                                                 void* dweight_partial, void* dbias_partial,
                                                 int64_t rows, int64_t cols, const uint8_t* keep,
                                                 double p))

#ifdef FUSEDLM_ISA

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

// The mean and 1 / sqrt(variance + eps) of the row value(0), ..., value(n-1),
// given its sum: a second pass sums (v - m) and (v - m)^2, and the first pass's
// rounding error in the mean, sum(v - m), is removed from both the mean and the
// sum of squares (Chan, Golub and LeVeque's corrected two-pass algorithm).
template <typename A, typename Value>
inline void row_stats(Value&& value, int64_t n, A sum, A eps, A& mean, A& rstd) {
  const A inv_n = A(1) / A(n), m = sum * inv_n;
  const auto [d1, d2] = row_sums<A, 2>(n, [&](int64_t c) {
    const A d = value(c) - m;
    return std::array<A, 2>{d, d * d};
  });
  const A var = std::max((d2 - d1 * d1 * inv_n) * inv_n, A(0));
  mean = m + d1 * inv_n;
  rstd = A(1) / std::sqrt(var + eps);
}

// The inner loops have no branches (residual, dropout and grad_summed are
// template parameters; weight and bias are always arrays) so that they vectorise.
// Passes after the first over memory re-read rows that are in L1 rather than
// buffer what they need: extra stores cost more than the loads.
//
// out is normalised from summed before rounding, as the reference does. The
// saved mean and rstd, though, are those of summed as stored: the backward
// rebuilds xhat from the stored summed, and xhat must then have mean 0 and
// variance 1 exactly, or rows of near-zero variance (constant rows, hidden
// size 1) turn bf16/fp16 rounding into gradients of 1 / sqrt(eps) times it.
// In float32 and float64 the two coincide and are computed once, from the
// stored row.
//
// float16 rows go through float ones (widen_row, narrow_row), a row at a time: `exact`
// then holds four rows. The float sum is rounded as summed is stored, and the saved
// statistics are again those of the stored row.
template <typename T, bool residual, bool dropout>
void forward_rows(const T* __restrict__ x, const T* __restrict__ res,
                  const acc_t<T>* __restrict__ weight, const acc_t<T>* __restrict__ bias,
                  T* __restrict__ out, T* __restrict__ summed, acc_t<T>* __restrict__ mean,
                  acc_t<T>* __restrict__ rstd, int64_t rows, int64_t cols, acc_t<T> eps,
                  const uint8_t* __restrict__ keep, acc_t<T> scale,
                  acc_t<T>* __restrict__ exact) {
  using A = acc_t<T>;
  if constexpr (std::is_same_v<T, f16>) {
    float *xf = exact, *rf = xf + cols, *sf = rf + cols, *of = sf + cols;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = r * cols;
      widen_row(x + at, xf, cols);
      if (residual) widen_row(res + at, rf, cols);
      float m, rs;
      forward_rows<float, residual, dropout>(xf, rf, weight, bias, of, sf, &m, &rs, 1, cols, eps,
                                             keep + (dropout ? at : 0), scale, nullptr);
      narrow_row(of, out + at, cols);
      narrow_row(sf, summed + at, cols);
      widen_row(summed + at, sf, cols);
      const auto [sum] = row_sums<float, 1>(cols, [&](int64_t c) {
        return std::array<float, 1>{sf[c]};
      });
      row_stats([&](int64_t c) { return sf[c]; }, cols, sum, eps, mean[r], rstd[r]);
    }
    return;
  }
  constexpr bool rounds = !std::is_same_v<T, A>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    const T* rr = res + (residual ? r * cols : 0);
    const uint8_t* kr = keep + (dropout ? r * cols : 0);
    T* sr = summed + r * cols;
    T* outr = out + r * cols;
    // The row's sum, and when it rounds the sum of the row as stored.
    constexpr int sums = rounds ? 2 : 1;
    const std::array<A, sums> sum = row_sums<A, sums>(cols, [&](int64_t c) {
      A s = load(xr[c]);
      if (dropout) s *= A(kr[c]) * scale;  // keep is 0 or 1: a multiply, not a branch
      if (residual) s += load(rr[c]);
      T t;
      store(t, s);
      sr[c] = t;
      if constexpr (rounds) {
        exact[c] = s;
        return std::array<A, sums>{s, load(t)};
      } else {
        return std::array<A, sums>{s};
      }
    });
    auto stored = [&](int64_t c) { return load(sr[c]); };
    A m, rs;
    if constexpr (rounds) {
      row_stats([&](int64_t c) { return exact[c]; }, cols, sum[0], eps, m, rs);
      for (int64_t c = 0; c < cols; ++c) store(outr[c], (exact[c] - m) * rs * weight[c] + bias[c]);
      row_stats(stored, cols, sum[1], eps, m, rs);
    } else {
      row_stats(stored, cols, sum[0], eps, m, rs);
      for (int64_t c = 0; c < cols; ++c) store(outr[c], (sr[c] - m) * rs * weight[c] + bias[c]);
    }
    mean[r] = m;
    rstd[r] = rs;
  }
}

// dweight and dbias accumulate: the caller zeroes them.
template <typename T, bool grad_summed, bool dropout>
void backward_rows(const T* __restrict__ dy, const T* __restrict__ gs,
                   const T* __restrict__ summed, const acc_t<T>* __restrict__ mean,
                   const acc_t<T>* __restrict__ rstd, const acc_t<T>* __restrict__ weight,
                   T* __restrict__ ds, T* __restrict__ dx, acc_t<T>* __restrict__ dweight,
                   acc_t<T>* __restrict__ dbias, int64_t rows, int64_t cols,
                   const uint8_t* __restrict__ keep, acc_t<T> scale) {
  using A = acc_t<T>;
  if constexpr (std::is_same_v<T, f16>) {  // through float rows, as forward_rows
    std::unique_ptr<float[]> scratch(new float[5 * cols]);
    float *dyf = scratch.get(), *gsf = dyf + cols, *sf = gsf + cols, *dsf = sf + cols,
          *dxf = dsf + cols;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at = r * cols;
      widen_row(dy + at, dyf, cols);
      if (grad_summed) widen_row(gs + at, gsf, cols);
      widen_row(summed + at, sf, cols);
      backward_rows<float, grad_summed, dropout>(dyf, gsf, sf, mean + r, rstd + r, weight,
                                                 ds ? dsf : nullptr, dxf, dweight, dbias, 1, cols,
                                                 keep + (dropout ? at : 0), scale);
      if (ds) narrow_row(dsf, ds + at, cols);
      if (dropout) narrow_row(dxf, dx + at, cols);
    }
    return;
  }
  const A inv_n = A(1) / A(cols);
  for (int64_t r = 0; r < rows; ++r) {
    const T* dyr = dy + r * cols;
    const T* gsr = gs + (grad_summed ? r * cols : 0);
    const T* sr = summed + r * cols;
    const A m = mean[r], rs = rstd[r];
    const auto [sum_g, sum_gx] = row_sums<A, 2>(cols, [&](int64_t c) {
      A d = load(dyr[c]), xh = (load(sr[c]) - m) * rs, g = d * weight[c];
      dweight[c] += d * xh;
      dbias[c] += d;
      return std::array<A, 2>{g, g * xh};
    });
    const A a = sum_g * inv_n, b = sum_gx * inv_n;
    // The row's dy and summed are in L1 now: read again rather than buffered.
    auto dsummed = [&](int64_t c) {
      A xh = (load(sr[c]) - m) * rs;
      A v = rs * (load(dyr[c]) * weight[c] - a - xh * b);
      if (grad_summed) v += load(gsr[c]);
      return v;
    };
    if (!dropout) {
      T* dsr = ds + r * cols;
      for (int64_t c = 0; c < cols; ++c) store(dsr[c], dsummed(c));
      continue;
    }
    // Under dropout dx is dsummed through the mask, and dsummed is needed only
    // for a residual (ds may be null).
    const uint8_t* kr = keep + r * cols;
    T* dxr = dx + r * cols;
    if (ds) {
      T* dsr = ds + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        A v = dsummed(c);
        store(dsr[c], v);
        store(dxr[c], v * (A(kr[c]) * scale));
      }
    } else {
      for (int64_t c = 0; c < cols; ++c) store(dxr[c], dsummed(c) * (A(kr[c]) * scale));
    }
  }
}

// An optional [cols] vector widened to the accumulation type, or `fill` when absent.
template <typename T>
void widen(const T* v, int64_t cols, acc_t<T> fill, acc_t<T>* out) {
  for (int64_t c = 0; c < cols; ++c) out[c] = v ? load(v[c]) : fill;
}

template <typename T, bool residual>
auto forward_for(bool dropout) {
  return dropout ? forward_rows<T, residual, true> : forward_rows<T, residual, false>;
}

template <typename T, bool grad_summed>
auto backward_for(bool dropout) {
  return dropout ? backward_rows<T, grad_summed, true> : backward_rows<T, grad_summed, false>;
}

}  // namespace

void add_layer_norm_forward(DType dtype, const void* x, const void* residual, const void* weight,
                            const void* bias, void* out, void* summed, void* mean, void* rstd,
                            int64_t rows, int64_t cols, double eps, const uint8_t* keep,
                            double p) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = acc_t<T>;
    // Scratch: the widened weight and bias, and the unrounded row (bf16) or a row's four
    // float rows (fp16).
    std::unique_ptr<A[]> scratch(new A[(std::is_same_v<T, f16> ? 6 : 3) * cols]);
    A *w = scratch.get(), *b = w + cols, *rest = b + cols;
    widen(static_cast<const T*>(weight), cols, A(1), w);
    widen(static_cast<const T*>(bias), cols, A(0), b);
    const bool dropout = keep != nullptr;
    auto run = residual ? forward_for<T, true>(dropout) : forward_for<T, false>(dropout);
    run(static_cast<const T*>(x), static_cast<const T*>(residual), w, b, static_cast<T*>(out),
        static_cast<T*>(summed), static_cast<A*>(mean), static_cast<A*>(rstd), rows, cols, A(eps),
        keep, A(1) / (A(1) - A(p)), rest);
  });
}

void add_layer_norm_backward(DType dtype, const void* grad_out, const void* grad_summed,
                             const void* summed, const void* mean, const void* rstd,
                             const void* weight, void* dsummed, void* dx, void* dweight_partial,
                             void* dbias_partial, int64_t rows, int64_t cols,
                             const uint8_t* keep, double p) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = acc_t<T>;
    // Scratch: the widened weight, and the column sums of the gradients that
    // were not asked for (computed anyway: one loop shape).
    std::unique_ptr<A[]> scratch(new A[3 * cols]);
    A *w = scratch.get(), *spare = w + cols;
    widen(static_cast<const T*>(weight), cols, A(1), w);
    A* dw = dweight_partial ? static_cast<A*>(dweight_partial) : spare;
    A* db = dbias_partial ? static_cast<A*>(dbias_partial) : spare + cols;
    for (int64_t c = 0; c < cols; ++c) dw[c] = db[c] = A(0);
    const bool dropout = keep != nullptr;
    auto run = grad_summed ? backward_for<T, true>(dropout) : backward_for<T, false>(dropout);
    run(static_cast<const T*>(grad_out), static_cast<const T*>(grad_summed),
        static_cast<const T*>(summed), static_cast<const A*>(mean), static_cast<const A*>(rstd), w,
        static_cast<T*>(dsummed), static_cast<T*>(dx), dw, db, rows, cols, keep,
        A(1) / (A(1) - A(p)));
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA

#else  // the host role: entry points

namespace fusedlm {
namespace {

// Rows per kernel call. A block's keep mask (64 x 768 bytes at BERT-base) is
// drawn just before the kernel reads it, so it is still in cache; in the
// backward each block also owns one row of partial sums.
constexpr int64_t kBlockRows = kReduceBlockRows;

// The keep mask for rows [begin, end) of a [rows, cols] dropout stream, or null without dropout.
const uint8_t* keep_rows(std::vector<uint8_t>& buffer, uint64_t seed, int64_t begin, int64_t end,
                         int64_t cols, double p) {
  if (p <= 0.0) return nullptr;
  buffer.resize((end - begin) * cols);
  cpu::dropout_mask(seed, static_cast<uint64_t>(begin * cols), (end - begin) * cols, p,
                             buffer.data());
  return buffer.data();
}

// Blocks per task: about 64 KiB of each input, and whole blocks.
int64_t grain_blocks(int64_t cols) {
  return std::max<int64_t>(1, 16384 / (std::max<int64_t>(cols, 1) * kBlockRows));
}

// Calls f(blk, begin, end, keep) for each block blk of rows [begin, end), keep being its
// dropout mask (null without dropout). Tasks cover whole blocks, so a block's row of
// partial sums has exactly one writer.
template <typename F>
void for_blocks(int64_t rows, int64_t cols, uint64_t seed, double p, F&& f) {
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, grain_blocks(cols), [&](int64_t first, int64_t last) {
    std::vector<uint8_t> keep;
    for (int64_t blk = first; blk < last; ++blk) {
      const int64_t begin = blk * kBlockRows, end = std::min(rows, begin + kBlockRows);
      f(blk, begin, end, keep_rows(keep, seed, begin, end, cols, p));
    }
  });
}

const char* bytes(const at::Tensor& t) { return static_cast<const char*>(t.data_ptr()); }
char* bytes_mut(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

}  // namespace

// summed = dropout(x) + residual and out = layer_norm(summed) over the last dimension;
// residual, weight and bias may be absent. Returns (out, summed, mean, rstd), the
// latter two [rows] in float32 (float64 for float64 inputs): the statistics of summed
// as returned, saved for the backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed) {
  const auto in = add_layer_norm_inputs(x, residual, weight, bias, check_cpu);
  const auto dtype = kernel_dtype(x);
  const uint64_t s = dropout_p > 0 ? seed_value(seed) : 0;

  const int64_t rows = in.rows, cols = in.cols;
  // Outputs in x's shape, contiguous, so they are written as [rows, cols] and returned as
  // they are: an op's output must not be a view.
  auto out = at::empty(x.sizes(), in.x.options()), summed = at::empty(x.sizes(), in.x.options());
  auto stats = in.x.options().dtype(acc_dtype(x.scalar_type()));
  auto mean = at::empty({rows}, stats), rstd = at::empty({rows}, stats);

  const size_t row_bytes = cols * in.x.element_size(), stat_bytes = mean.element_size();
  const char *xp = bytes(in.x), *rp = in.residual.defined() ? bytes(in.residual) : nullptr;
  char *op = bytes_mut(out), *sp = bytes_mut(summed), *mp = bytes_mut(mean), *vp = bytes_mut(rstd);
  const void *wp = in.weight.defined() ? in.weight.data_ptr() : nullptr;
  const void *bp = in.bias.defined() ? in.bias.data_ptr() : nullptr;
  for_blocks(rows, cols, s, dropout_p, [&](int64_t, int64_t begin, int64_t end,
                                           const uint8_t* keep) {
    const size_t at = begin * row_bytes;
    cpu::add_layer_norm_forward(dtype, xp + at, rp ? rp + at : nullptr, wp, bp, op + at,
                                         sp + at, mp + begin * stat_bytes, vp + begin * stat_bytes,
                                         end - begin, cols, eps, keep, dropout_p);
  });
  return {out, summed, mean, rstd};
}
FUSEDLM_KERNEL(add_layer_norm_forward);

// (dsummed, dx, dweight, dbias). dsummed is the gradient of summed (grad_summed, which may be
// absent, plus what flows back through the norm): the residual's gradient, and x's too
// without dropout, when dx is undefined. Under dropout dx = dsummed through the mask, and
// dsummed is defined only when has_residual. dweight and dbias are undefined when absent.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed) {
  const auto acc = acc_dtype(summed.scalar_type());
  const bool dropout = dropout_p > 0;
  const auto in = add_layer_norm_grad_inputs(grad_out, grad_summed, summed, mean, rstd, weight,
                                             acc, dropout, has_residual, check_cpu);
  const auto dtype = kernel_dtype(summed);
  const uint64_t s = dropout ? seed_value(seed) : 0;

  const int64_t rows = in.summed.size(0), cols = in.summed.size(1);
  const int64_t blocks = (rows + kBlockRows - 1) / kBlockRows;
  const bool has_weight = in.weight.defined();
  const int64_t dw_blocks = has_weight ? blocks : 0, db_blocks = has_bias ? blocks : 0;
  // dweight's partial sums, then dbias's.
  auto partials = partial_sums(dw_blocks + db_blocks, cols, acc);

  const size_t row_bytes = cols * in.summed.element_size(), stat_bytes = mean.element_size();
  const size_t part_bytes = cols * partials.element_size();
  const char *gp = bytes(in.grad_out), *sp = bytes(in.summed);
  const char* gsp = in.grad_summed.defined() ? bytes(in.grad_summed) : nullptr;
  const char *mp = bytes(mean), *vp = bytes(rstd);
  char* dsp = in.dsummed.defined() ? bytes_mut(in.dsummed) : nullptr;
  char* dxp = in.dx.defined() ? bytes_mut(in.dx) : nullptr;
  char* dwp = has_weight ? bytes_mut(partials) : nullptr;
  char* dbp = has_bias ? bytes_mut(partials) + dw_blocks * part_bytes : nullptr;
  const void* wp = has_weight ? in.weight.data_ptr() : nullptr;
  for_blocks(rows, cols, s, dropout_p, [&](int64_t blk, int64_t begin, int64_t end,
                                           const uint8_t* keep) {
    const size_t at = begin * row_bytes;
    cpu::add_layer_norm_backward(
        dtype, gp + at, gsp ? gsp + at : nullptr, sp + at, mp + begin * stat_bytes,
        vp + begin * stat_bytes, wp, dsp ? dsp + at : nullptr, dxp ? dxp + at : nullptr,
        dwp ? dwp + blk * part_bytes : nullptr, dbp ? dbp + blk * part_bytes : nullptr,
        end - begin, cols, keep, dropout_p);
  });
  return {in.dsummed, in.dx,
          has_weight ? sum_partials(partials, 0, dw_blocks, summed.scalar_type()) : at::Tensor(),
          has_bias ? sum_partials(partials, dw_blocks, db_blocks, summed.scalar_type())
                   : at::Tensor()};
}
FUSEDLM_KERNEL(add_layer_norm_backward);

}  // namespace fusedlm

#endif  // FUSEDLM_ISA
