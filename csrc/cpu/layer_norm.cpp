// add + LayerNorm (dropout on the added branch), forward and backward, one pass
// over memory each.
//
// Forward, per row: summed = x [* keep / (1 - p)] + residual is formed in a row
// buffer in the accumulation type while summed is written out; the mean and
// variance then come from that buffer (corrected two-pass algorithm), and the
// normalised row is written from it. Memory sees one read of x and residual and
// one write of out and summed (2 bytes per element each in bf16/fp16), plus a
// mean and rstd per row. The statistics passes run over L1-resident buffers
// (in bf16/fp16 twice: see forward_rows), so at BERT/GPT widths the forward is
// bound by memory bandwidth.
//
// Backward, per row: xhat = (summed - mean) * rstd and g = dy * weight are
// formed in row buffers while the column sums of dy * xhat and dy (the first
// stage of the weight and bias gradients) accumulate; then
//   dsummed = rstd * (g - mean(g) - xhat * mean(g * xhat)) + grad_summed,
// and dx = dsummed * keep / (1 - p). Memory sees one read of dy, summed and
// grad_summed and one write of dsummed (and dx under dropout).
//
// GCC vectorises no float reduction without -ffast-math, so row sums keep a
// fixed number of independent partial sums (lanes): the loop over the lanes
// becomes vector adds on every instruction set, in an order that does not depend
// on the instruction set or the thread count.
#include <algorithm>
#include <memory>

#include "math.h"

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

// 32 floats or 16 doubles: two AVX-512 registers of partial sums, which hides the
// latency of the vector add; four AVX2 or eight SSE registers.
template <typename A>
constexpr int kLanes = 128 / sizeof(A);

// Calls body(c, l) for c = 0 .. n-1 in order, with l = c % kLanes: the loop over
// a fixed number of lanes becomes vector code, partial sums indexed by l included.
template <typename A, typename Body>
inline void over_lanes(int64_t n, Body&& body) {
  constexpr int L = kLanes<A>;
  int64_t c = 0;
  for (; c + L <= n; c += L)
    for (int l = 0; l < L; ++l) body(c + l, l);
  for (int l = 0; c + l < n; ++l) body(c + l, l);
}

// Adds the lane sums pairwise into lanes[0].
template <typename A>
inline A fold(A* lanes) {
  for (int w = kLanes<A> / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// The mean and 1 / sqrt(variance + eps) of v[0..n), given sum(v): a second pass
// sums (v - m) and (v - m)^2, and the first pass's rounding error in the mean,
// sum(v - m), is removed from both the mean and the sum of squares (Chan, Golub
// and LeVeque's corrected two-pass algorithm).
template <typename A>
inline void row_stats(const A* __restrict__ v, int64_t n, A sum, A eps, A& mean, A& rstd) {
  constexpr int L = kLanes<A>;
  const A inv_n = A(1) / A(n), m = sum * inv_n;
  A s1[L] = {}, s2[L] = {};
  over_lanes<A>(n, [&](int64_t c, int l) {
    A d = v[c] - m;
    s1[l] += d;
    s2[l] += d * d;
  });
  const A d1 = fold(s1), d2 = fold(s2);
  const A var = std::max((d2 - d1 * d1 * inv_n) * inv_n, A(0));
  mean = m + d1 * inv_n;
  rstd = A(1) / std::sqrt(var + eps);
}

// The inner loops have no branches (residual, dropout and grad_summed are
// template parameters; weight and bias are always arrays) so that they vectorise.
//
// out is normalised from summed before rounding, as the reference does. The
// saved mean and rstd, though, are those of summed as stored: the backward
// rebuilds xhat from the stored summed, and xhat must then have mean 0 and
// variance 1 exactly, or rows of near-zero variance (constant rows, hidden
// size 1) turn bf16/fp16 rounding into gradients of 1 / sqrt(eps) times it.
// In float32 and float64 the two are the same and computed once.
template <typename T, bool residual, bool dropout>
void forward_rows(const T* __restrict__ x, const T* __restrict__ res,
                  const acc_t<T>* __restrict__ weight, const acc_t<T>* __restrict__ bias,
                  T* __restrict__ out, T* __restrict__ summed, acc_t<T>* __restrict__ mean,
                  acc_t<T>* __restrict__ rstd, int64_t rows, int64_t cols, acc_t<T> eps,
                  const uint8_t* __restrict__ keep, acc_t<T> scale, acc_t<T>* __restrict__ buf,
                  acc_t<T>* __restrict__ stored) {
  using A = acc_t<T>;
  constexpr int L = kLanes<A>;
  constexpr bool rounds = !std::is_same_v<T, A>;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    const T* rr = res + (residual ? r * cols : 0);
    const uint8_t* kr = keep + (dropout ? r * cols : 0);
    T* sr = summed + r * cols;
    T* outr = out + r * cols;
    A sum[L] = {}, sum_stored[L] = {};
    over_lanes<A>(cols, [&](int64_t c, int l) {
      A s = load(xr[c]);
      if (dropout) s *= A(kr[c]) * scale;  // keep is 0 or 1: a multiply, not a branch
      if (residual) s += load(rr[c]);
      buf[c] = s;
      sum[l] += s;
      T t;
      store(t, s);
      sr[c] = t;
      if (rounds) {
        stored[c] = load(t);
        sum_stored[l] += stored[c];
      }
    });
    A m, rs;
    row_stats(buf, cols, fold(sum), eps, m, rs);
    for (int64_t c = 0; c < cols; ++c) store(outr[c], (buf[c] - m) * rs * weight[c] + bias[c]);
    if (rounds) row_stats(stored, cols, fold(sum_stored), eps, m, rs);
    mean[r] = m;
    rstd[r] = rs;
  }
}

template <typename T, bool grad_summed, bool dropout>
void backward_rows(const T* __restrict__ dy, const T* __restrict__ gs,
                   const T* __restrict__ summed, const acc_t<T>* __restrict__ mean,
                   const acc_t<T>* __restrict__ rstd, const acc_t<T>* __restrict__ weight,
                   T* __restrict__ ds, T* __restrict__ dx, acc_t<T>* __restrict__ dweight,
                   acc_t<T>* __restrict__ dbias, int64_t rows, int64_t cols,
                   const uint8_t* __restrict__ keep, acc_t<T> scale, acc_t<T>* __restrict__ xhat,
                   acc_t<T>* __restrict__ g) {
  using A = acc_t<T>;
  constexpr int L = kLanes<A>;
  const A inv_n = A(1) / A(cols);
  for (int64_t c = 0; c < cols; ++c) dweight[c] = dbias[c] = A(0);
  for (int64_t r = 0; r < rows; ++r) {
    const T* dyr = dy + r * cols;
    const T* gsr = gs + (grad_summed ? r * cols : 0);
    const T* sr = summed + r * cols;
    const A m = mean[r], rs = rstd[r];
    A sg[L] = {}, sgx[L] = {};
    over_lanes<A>(cols, [&](int64_t c, int l) {
      A d = load(dyr[c]), xh = (load(sr[c]) - m) * rs, gc = d * weight[c];
      xhat[c] = xh;
      g[c] = gc;
      sg[l] += gc;
      sgx[l] += gc * xh;
      dweight[c] += d * xh;
      dbias[c] += d;
    });
    const A a = fold(sg) * inv_n, b = fold(sgx) * inv_n;
    if (!dropout) {
      T* dsr = ds + r * cols;
      for (int64_t c = 0; c < cols; ++c) {
        A v = rs * (g[c] - a - xhat[c] * b);
        if (grad_summed) v += load(gsr[c]);
        store(dsr[c], v);
      }
      continue;
    }
    // Under dropout dsummed is needed only for a residual (ds may be null), and
    // dx is dsummed through the mask.
    const uint8_t* kr = keep + r * cols;
    T* dxr = dx + r * cols;
    for (int64_t c = 0; c < cols; ++c) {
      A v = rs * (g[c] - a - xhat[c] * b);
      if (grad_summed) v += load(gsr[c]);
      g[c] = v;
      store(dxr[c], v * (A(kr[c]) * scale));
    }
    if (ds) {
      T* dsr = ds + r * cols;
      for (int64_t c = 0; c < cols; ++c) store(dsr[c], g[c]);
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
    // Scratch: the widened weight and bias, and two row buffers.
    std::unique_ptr<A[]> scratch(new A[4 * cols]);
    A *w = scratch.get(), *b = w + cols, *buf = b + cols, *stored = buf + cols;
    widen(static_cast<const T*>(weight), cols, A(1), w);
    widen(static_cast<const T*>(bias), cols, A(0), b);
    const bool dropout = keep != nullptr;
    auto run = residual ? forward_for<T, true>(dropout) : forward_for<T, false>(dropout);
    run(static_cast<const T*>(x), static_cast<const T*>(residual), w, b, static_cast<T*>(out),
        static_cast<T*>(summed), static_cast<A*>(mean), static_cast<A*>(rstd), rows, cols, A(eps),
        keep, A(1) / (A(1) - A(p)), buf, stored);
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
    // Scratch: the widened weight, two row buffers, and the column sums of the
    // gradients that were not asked for (computed anyway: one loop shape).
    std::unique_ptr<A[]> scratch(new A[5 * cols]);
    A *w = scratch.get(), *xhat = w + cols, *g = xhat + cols, *spare = g + cols;
    widen(static_cast<const T*>(weight), cols, A(1), w);
    A* dw = dweight_partial ? static_cast<A*>(dweight_partial) : spare;
    A* db = dbias_partial ? static_cast<A*>(dbias_partial) : spare + cols;
    const bool dropout = keep != nullptr;
    auto run = grad_summed ? backward_for<T, true>(dropout) : backward_for<T, false>(dropout);
    run(static_cast<const T*>(grad_out), static_cast<const T*>(grad_summed),
        static_cast<const T*>(summed), static_cast<const A*>(mean), static_cast<const A*>(rstd), w,
        static_cast<T*>(dsummed), static_cast<T*>(dx), dw, db, rows, cols, keep,
        A(1) / (A(1) - A(p)), xhat, g);
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA
