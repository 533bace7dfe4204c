// rms_norm on CUDA: out = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps) per row,
// forward and backward, on the row-wise kernels' layout (rows.cuh: a group of threads per
// row, its share of the row in registers).
//
// Forward: x is read once and out written once; rows longer than the group's registers
// hold (16384 elements, 8192 taken one at a time) read their remaining vectors of x a
// second time, which the thread has just read (L2). The sum of squares needs no centring:
// its terms are all non-negative, so it loses nothing to cancellation. Traffic: 1 read and
// 1 write per element, plus the weight per row (cache hits) and an rstd per row.
//
// Backward: each thread keeps x and g = weight * dy of its columns in registers between the
// row's two passes (the sum of g * x, then dx = rstd * (g - x * rstd^2 * mean(g * x))), and
// the block's share of dweight for them in shared memory (columns past the cached ones, in
// rows over 8192 elements, 4096 taken one at a time, are read again in the second pass and
// accumulate in the block's row of partial sums in global memory directly). Traffic: 2
// reads (grad_out, x) and 1 write per element.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "ops/compiled_kernel.h"
#include "rows.cuh"

namespace fusedlm::cuda::kernels::rms_norm {

using namespace row_kernels;

// The vectors of N elements a backward thread keeps: fewer of single elements, whose
// addresses the loop over rows keeps besides two floats a column.
constexpr int backward_cached(int n) {
  return n == 1 ? kBackwardElements / 2 : kBackwardElements / n;
}

// Dynamic shared memory of the forward: group_sum's 32 floats (one sum).
constexpr size_t kSharedBytes = 32 * sizeof(float);

// And of the backward: group_sum's, then, with a weight, room for the shares of dweight
// of the columns its threads keep.
constexpr size_t backward_shared_bytes(int64_t cols, int n, int group, bool weight) {
  const int64_t cached = std::min<int64_t>(cols / n, int64_t(backward_cached(n)) * group);
  return kSharedBytes + (weight ? cached * n * sizeof(float) : 0);
}

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads)
    rms_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight,
                            T* __restrict__ out, float* __restrict__ rstd_out, int64_t rows,
                            int64_t cols, int group, float eps) {
  constexpr int kCached = forward_cached(N);
  float* shared = reinterpret_cast<float*>(dynamic_shared_memory());  // kSharedBytes
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  const int lane = threadIdx.x % group;
  // A group past the last row has no vectors, but takes part in the group reduction's
  // __syncthreads with the rest of its block.
  const bool live = row < rows;
  const int64_t base = live ? row * cols : 0;
  const int64_t vecs = live ? cols / N : 0;

  float cache[kCached][N];
  float squares[1] = {0.0f};
  auto add_squares = [&](const float(&v)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) squares[0] += v[i] * v[i];
  };
#pragma unroll
  for (int k = 0; k < kCached; ++k) {
    const int64_t v = lane + int64_t(k) * group;
    if (v < vecs) {
      load<N>(x + base + v * N, cache[k]);
      add_squares(cache[k]);
    }
  }
  for (int64_t v = lane + int64_t(kCached) * group; v < vecs; v += group) {
    float s[N];
    load<N>(x + base + v * N, s);
    add_squares(s);
  }
  group_sum(squares, shared, group);
  const float rstd = rsqrtf(squares[0] / cols + eps);

  // out at vector v from x's values there.
  auto write_at = [&](int64_t v, const float(&xv)[N]) {
    float y[N], w[N];
    if (weight) load<N>(weight + v * N, w);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      y[i] = xv[i] * rstd;
      if (weight) y[i] *= w[i];
    }
    store<N>(out + base + v * N, y);
  };
#pragma unroll
  for (int k = 0; k < kCached; ++k) {
    const int64_t v = lane + int64_t(k) * group;
    if (v < vecs) write_at(v, cache[k]);
  }
  for (int64_t v = lane + int64_t(kCached) * group; v < vecs; v += group) {
    float s[N];
    load<N>(x + base + v * N, s);
    write_at(v, s);
  }
  if (live && lane == 0) rstd_out[row] = rstd;
}

// Where the backward's first pass adds a column's share of dweight.
constexpr int kNoShares = 0, kSharedShares = 1, kGlobalShares = 2;

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads) rms_norm_backward_kernel(
    const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ rstd,
    const T* __restrict__ weight, T* __restrict__ dx, float* __restrict__ dw_part, int64_t rows,
    int64_t cols, int64_t rows_per_block) {
  constexpr int kCached = backward_cached(N);  // vectors of the row a thread keeps
  const int64_t vecs = cols / N;
  const int group = blockDim.x;
  const int64_t cached = std::min<int64_t>(vecs, int64_t(kCached) * group);
  // group_sum's floats, then the block's shares of dweight for the cached columns
  // (backward_shared_bytes); a thread only ever touches its own columns.
  float* shared = reinterpret_cast<float*>(dynamic_shared_memory());
  float* dw_cached = shared + 32;
  // This block's row of partial sums, where the shares end; columns past the cached ones
  // (very long rows) accumulate there directly. Each loop below knows which of the two its
  // columns use, so that no pointer can be either: a generic one would cost registers and
  // generic loads.
  float* dw_row = dw_part ? dw_part + int64_t(blockIdx.x) * cols : nullptr;

  // The columns a thread keeps are v = threadIdx.x + k * group < cached; those past them,
  // when cached < vecs, start at kCached * group.
  if (dw_row) {
    const float zero[N] = {};
    for (int64_t v = threadIdx.x; v < cached; v += group) store<N>(dw_cached + v * N, zero);
    for (int64_t v = threadIdx.x + int64_t(kCached) * group; v < vecs; v += group)
      store<N>(dw_row + v * N, zero);
  }

  const int64_t first = int64_t(blockIdx.x) * rows_per_block;
  const int64_t last = std::min(rows, first + rows_per_block);
  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * cols;
    const float rs = rstd[row];

    // x and g = weight * dy at vector v; adds dy * x * rstd to the dweight shares in
    // `shares` (at dw_cached, in dw_row, or none: a constant at every call).
    auto grads_at = [&](int64_t v, float (&xv)[N], float (&g)[N], int shares) {
      float w[N];
      load<N>(dy + base + v * N, g);
      load<N>(x + base + v * N, xv);
      if (shares != kNoShares && dw_row) {
        float gx[N];
#pragma unroll
        for (int i = 0; i < N; ++i) gx[i] = g[i] * xv[i] * rs;
        add_to<N>((shares == kSharedShares ? dw_cached : dw_row) + v * N, gx);
      }
      if (weight) {
        load<N>(weight + v * N, w);
#pragma unroll
        for (int i = 0; i < N; ++i) g[i] *= w[i];
      }
    };
    // dx at vector v from x, g and the row's c = rstd^2 * mean(g * x).
    auto write_at = [&](int64_t v, const float(&xv)[N], const float(&g)[N], float c) {
      float d[N];
#pragma unroll
      for (int i = 0; i < N; ++i) d[i] = rs * (g[i] - xv[i] * c);
      store<N>(dx + base + v * N, d);
    };

    float xc[kCached][N], gc[kCached][N];
    float sum[1] = {0.0f};  // of g * x
    auto add_sum = [&](const float(&xv)[N], const float(&g)[N]) {
#pragma unroll
      for (int i = 0; i < N; ++i) sum[0] += g[i] * xv[i];
    };
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t v = threadIdx.x + int64_t(k) * group;
      if (v < vecs) {
        grads_at(v, xc[k], gc[k], kSharedShares);
        add_sum(xc[k], gc[k]);
      }
    }
    for (int64_t v = threadIdx.x + int64_t(kCached) * group; v < vecs; v += group) {
      float xv[N], g[N];
      grads_at(v, xv, g, kGlobalShares);
      add_sum(xv, g);
    }
    group_sum(sum, shared, group);
    // rstd^2 alone overflows for rows of tiny values under a tiny eps; rstd * mean(g * x)
    // is of g's magnitude.
    const float c = rs * (rs * (sum[0] / cols));

#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t v = threadIdx.x + int64_t(k) * group;
      if (v < vecs) write_at(v, xc[k], gc[k], c);
    }
    for (int64_t v = threadIdx.x + int64_t(kCached) * group; v < vecs; v += group) {
      float xv[N], g[N];
      grads_at(v, xv, g, kNoShares);
      write_at(v, xv, g, c);
    }
  }

  if (dw_row) {
    for (int64_t v = threadIdx.x; v < cached; v += group)
      copy_share<N>(dw_row + v * N, dw_cached + v * N);
  }
}

}  // namespace fusedlm::cuda::kernels::rms_norm

// --- host side: checks, launch shapes and launches ------------------------------------

namespace fusedlm::cuda {

using namespace kernels::rms_norm;

// (out, rstd): out = rms_norm(x) * weight over the last dimension, in x's shape; rstd [rows]
// in float32, saved for the backward.
std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x,
                                                    const std::optional<at::Tensor>& weight,
                                                    double eps) {
  const auto in = row_inputs(x, weight, check_device_tensor);
  const DeviceGuard guard(x);

  const at::Tensor &xs = in.x, &w = in.weight;
  const int64_t rows = in.rows, cols = in.cols;
  // out in x's shape (contiguous, so the kernel sees [rows, cols]): an op's output must
  // not be a view.
  auto out = at::empty(x.sizes(), xs.options());
  auto rstd = at::empty({rows}, xs.options().dtype(at::kFloat));
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    if (rows == 0) return;
    const T *xp = ptr<T>(xs), *wp = ptr<T>(w);
    T* op = ptr<T>(out);
    constexpr int V = kVec<T>;
    auto run = [&](auto kernel, int n) {
      // Groups below kMinBlock threads share a block (four one-warp rows, or two of two
      // warps); wider groups take a block each.
      const int group = row_group(cols / n, forward_cached(n), true);
      const int threads = std::max(group, kMinBlock);
      launch(kernel, ceil_div(rows, threads / group), threads, kSharedBytes, xp, wp, op,
             ptr<float>(rstd), rows, cols, group, float(eps));
    };
    if (cols % V == 0 && all_aligned16(xp, wp, op))
      run(rms_norm_forward_kernel<T, V>, V);
    else
      run(rms_norm_forward_kernel<T, 1>, 1);
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
  const auto in = row_grad_inputs(grad_out, x, weight, check_device_tensor);
  check_statistics(rstd, "rstd", in.rows, at::kFloat, x, "x", check_device_tensor);
  const at::Tensor &xs = in.x, &dys = in.grad_out, &w = in.weight;
  const int64_t rows = in.rows, cols = in.cols;
  const DeviceGuard guard(x);

  auto dx = at::empty(x.sizes(), xs.options());
  at::Tensor dweight;
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T *gp = ptr<T>(dys), *xp = ptr<T>(xs), *wp = ptr<T>(w);
    T* dxp = ptr<T>(dx);
    const bool vector = cols % V == 0 && all_aligned16(gp, xp, wp, dxp);
    const int n = vector ? V : 1;
    const int threads = row_group(cols / n, backward_cached(n), false);
    const auto [rows_per_block, blocks] = row_blocks(rows, threads);
    auto dw_part = at::empty({w.defined() ? blocks : 0, cols}, xs.options().dtype(at::kFloat));
    if (rows > 0) {
      float* dwp = w.defined() ? ptr<float>(dw_part) : nullptr;
      const size_t shared = backward_shared_bytes(cols, n, threads, w.defined());
      if (vector)
        launch(rms_norm_backward_kernel<T, V>, blocks, threads, shared, gp, xp,
               ptr<float>(rstd), wp, dxp, dwp, rows, cols, rows_per_block);
      else
        launch(rms_norm_backward_kernel<T, 1>, blocks, threads, shared, gp, xp,
               ptr<float>(rstd), wp, dxp, dwp, rows, cols, rows_per_block);
    }
    if (w.defined()) dweight = sum_partials<T>(dw_part, x.scalar_type());
  });
  return {dx, dweight};
}
FUSEDLM_KERNEL(rms_norm_backward);

}  // namespace fusedlm::cuda
