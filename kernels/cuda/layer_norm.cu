// add_layer_norm on CUDA: summed = dropout(x) + residual and out = LayerNorm(summed),
// forward and backward, on the row-wise kernels' layout (rows.cuh: a group of threads per
// row, its share of the row in registers).
//
// Forward: x and the residual are read once and out and summed written once. Rows of up
// to 512 elements take one warp, four rows to a block, and reduce by shuffles alone. Rows
// longer than the group's registers hold (16384 elements, 8192 taken one at a time) read
// their remaining vectors back from summed, which the thread has just written (L2). out
// normalises summed before rounding, as the reference does; the saved statistics are
// those of summed as stored, since the backward rebuilds xhat from it and xhat must have
// mean 0 and variance 1 exactly there (else rows of near-zero variance turn bf16/fp16
// rounding into gradients of 1/sqrt(eps) times it). Both sets come from the same three row
// reductions: the sum, the centred sum (the rounding of the first mean, corrected: rows of
// equal values then centre to exact zeros) and the centred sum of squares. Vectors read
// back from summed have only their stored values, so in rows past the register cache out
// normalises those. Traffic: 2 reads and 2 writes per element with a residual, plus the
// weight and bias per row (cache hits); it should run near the copy bandwidth.
//
// Backward: each thread keeps xhat and weight * dy of its columns in registers between
// the row's two passes, and the block's shares of dweight and dbias for them in shared
// memory (columns past the cached ones, in rows over 8192 elements, accumulate in the
// block's row of partial sums in global memory directly). Traffic: 2 or 3 reads
// (grad_out, summed, grad_summed) and 1 or 2 writes per element.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "ops/compiled_kernel.h"
#include "rows.cuh"

namespace fusedlm::cuda::kernels::layer_norm {

using namespace row_kernels;

// Dynamic shared memory of the forward: group_sum's 2 * 32 floats.
constexpr size_t kSharedBytes = 2 * 32 * sizeof(float);

// And of the backward: group_sum's, then room for the shares of dweight and dbias of the
// columns its threads keep.
constexpr size_t backward_shared_bytes(int64_t cols, int n, int group) {
  const int64_t cached = std::min<int64_t>(cols / n, int64_t(kBackwardElements / n) * group);
  return kSharedBytes + 2 * cached * n * sizeof(float);
}

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads)
    add_layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                  const T* __restrict__ weight, const T* __restrict__ bias,
                                  T* __restrict__ out, T* __restrict__ summed,
                                  float* __restrict__ mean_out, float* __restrict__ rstd_out,
                                  int64_t rows, int64_t cols, int group, float eps,
                                  Dropout dropout) {
  constexpr int kCached = forward_cached(N);
  float* shared = reinterpret_cast<float*>(dynamic_shared_memory());  // kSharedBytes
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  const int lane = threadIdx.x % group;
  // A group past the last row has no vectors, but takes part in the group reductions'
  // __syncthreads with the rest of its block.
  const bool live = row < rows;
  const int64_t base = live ? row * cols : 0;
  const int64_t vecs = live ? cols / N : 0;

  // summed at vector v: dropout(x) + residual, stored, and returned before rounding.
  auto make_summed = [&](int64_t v, float (&s)[N]) {
    const int64_t at = base + v * N;
    load<N>(x + at, s);
    if (dropout.active) dropout.apply<N>(at, s);
    if (residual) {
      float r[N];
      load<N>(residual + at, r);
#pragma unroll
      for (int i = 0; i < N; ++i) s[i] += r[i];
    }
    store<N>(summed + at, s);
  };

  // stat[0] accumulates over summed before rounding, stat[1] over summed as stored.
  float cache[kCached][N];
  float stat[2] = {0.0f, 0.0f};
#pragma unroll
  for (int k = 0; k < kCached; ++k) {
    const int64_t v = lane + int64_t(k) * group;
    if (v < vecs) {
      make_summed(v, cache[k]);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        stat[0] += cache[k][i];
        stat[1] += rounded<T>(cache[k][i]);
      }
    }
  }
  for (int64_t v = lane + int64_t(kCached) * group; v < vecs; v += group) {
    float s[N];
    make_summed(v, s);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      stat[0] += s[i];
      stat[1] += rounded<T>(s[i]);
    }
  }
  group_sum(stat, shared, group);
  const float first_mean[2] = {stat[0] / cols, stat[1] / cols};

  // Calls f(s, v) for each of this thread's vectors of summed, cached or read back.
  auto each = [&](auto&& f) {
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t v = lane + int64_t(k) * group;
      if (v < vecs) f(cache[k], v);
    }
    for (int64_t v = lane + int64_t(kCached) * group; v < vecs; v += group) {
      float s[N];
      load<N>(summed + base + v * N, s);
      f(s, v);
    }
  };

  stat[0] = stat[1] = 0.0f;
  each([&](const float(&s)[N], int64_t) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      stat[0] += s[i] - first_mean[0];
      stat[1] += rounded<T>(s[i]) - first_mean[1];
    }
  });
  group_sum(stat, shared, group);
  const float mean = first_mean[0] + stat[0] / cols;
  const float mean_stored = first_mean[1] + stat[1] / cols;

  stat[0] = stat[1] = 0.0f;
  each([&](const float(&s)[N], int64_t) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float d = s[i] - mean, d_stored = rounded<T>(s[i]) - mean_stored;
      stat[0] += d * d;
      stat[1] += d_stored * d_stored;
    }
  });
  group_sum(stat, shared, group);
  const float rstd = rsqrtf(stat[0] / cols + eps);
  const float rstd_stored = rsqrtf(stat[1] / cols + eps);

  each([&](const float(&s)[N], int64_t v) {
    float y[N], w[N], b[N];
    if (weight) load<N>(weight + v * N, w);
    if (bias) load<N>(bias + v * N, b);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      y[i] = (s[i] - mean) * rstd;
      if (weight) y[i] *= w[i];
      if (bias) y[i] += b[i];
    }
    store<N>(out + base + v * N, y);
  });
  if (live && lane == 0) {
    mean_out[row] = mean_stored;
    rstd_out[row] = rstd_stored;
  }
}

template <typename T, int N>
__global__ void __launch_bounds__(kMaxThreads) add_layer_norm_backward_kernel(
    const T* __restrict__ dy, const T* __restrict__ grad_summed, const T* __restrict__ summed,
    const float* __restrict__ mean, const float* __restrict__ rstd, const T* __restrict__ weight,
    T* __restrict__ dsummed, T* __restrict__ dx, float* __restrict__ dw_part,
    float* __restrict__ db_part, int64_t rows, int64_t cols, int64_t rows_per_block,
    Dropout dropout) {
  constexpr int kCached = kBackwardElements / N;  // vectors of the row a thread keeps
  const int64_t vecs = cols / N;
  const int group = blockDim.x;
  const int64_t cached = std::min<int64_t>(vecs, int64_t(kCached) * group);
  // group_sum's floats, then the block's shares of dweight and dbias for the cached
  // columns (backward_shared_bytes); a thread only ever touches its own columns.
  float* shared = reinterpret_cast<float*>(dynamic_shared_memory());
  float* dw_cached = dw_part ? shared + 2 * 32 : nullptr;
  float* db_cached = db_part ? shared + 2 * 32 + cached * N : nullptr;
  // This block's row of partial sums, where the shares end; columns past the cached ones
  // (very long rows) accumulate there directly.
  float* dw_row = dw_part ? dw_part + int64_t(blockIdx.x) * cols : nullptr;
  float* db_row = db_part ? db_part + int64_t(blockIdx.x) * cols : nullptr;
  auto dw_at = [&](int64_t v) { return v < cached ? dw_cached + v * N : dw_row + v * N; };
  auto db_at = [&](int64_t v) { return v < cached ? db_cached + v * N : db_row + v * N; };

  for (int64_t v = threadIdx.x; v < vecs; v += group) {
    const float zero[N] = {};
    if (dw_row) store<N>(dw_at(v), zero);
    if (db_row) store<N>(db_at(v), zero);
  }

  const int64_t first = int64_t(blockIdx.x) * rows_per_block;
  const int64_t last = std::min(rows, first + rows_per_block);
  for (int64_t row = first; row < last; ++row) {
    const int64_t base = row * cols;
    const float mu = mean[row], rs = rstd[row];

    // xhat and weight * dy at vector v; adds dy * xhat and dy to the parameter shares
    // when `shares`.
    auto grads_at = [&](int64_t v, float (&xhat)[N], float (&wdy)[N], bool shares) {
      float g[N], w[N];
      load<N>(dy + base + v * N, g);
      load<N>(summed + base + v * N, xhat);
      if (weight) load<N>(weight + v * N, w);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        xhat[i] = (xhat[i] - mu) * rs;
        wdy[i] = weight ? g[i] * w[i] : g[i];
      }
      if (!shares) return;
      if (dw_row) {
        float gx[N];
#pragma unroll
        for (int i = 0; i < N; ++i) gx[i] = g[i] * xhat[i];
        add_to<N>(dw_at(v), gx);
      }
      if (db_row) add_to<N>(db_at(v), g);
    };
    // dsummed (and dx under dropout) at vector v from xhat, weight * dy and the row's sums.
    auto write_at = [&](int64_t v, const float(&xhat)[N], const float(&wdy)[N], float c1,
                        float c2) {
      const int64_t at = base + v * N;
      float ds[N];
      if (grad_summed) load<N>(grad_summed + at, ds);
#pragma unroll
      for (int i = 0; i < N; ++i)
        ds[i] = (wdy[i] - (xhat[i] * c1 + c2)) * rs + (grad_summed ? ds[i] : 0.0f);
      if (dsummed) store<N>(dsummed + at, ds);
      if (dropout.active) {
        dropout.apply<N>(at, ds);
        store<N>(dx + at, ds);
      }
    };

    float xhat[kCached][N], wdy[kCached][N];
    float sums[2] = {0.0f, 0.0f};  // of xhat * wdy and of wdy
    auto add_sums = [&](const float(&xh)[N], const float(&wg)[N]) {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        sums[0] += xh[i] * wg[i];
        sums[1] += wg[i];
      }
    };
#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t v = threadIdx.x + int64_t(k) * group;
      if (v < vecs) {
        grads_at(v, xhat[k], wdy[k], true);
        add_sums(xhat[k], wdy[k]);
      }
    }
    for (int64_t v = threadIdx.x + int64_t(kCached) * group; v < vecs; v += group) {
      float xh[N], wg[N];
      grads_at(v, xh, wg, true);
      add_sums(xh, wg);
    }
    group_sum(sums, shared, group);
    const float c1 = sums[0] / cols, c2 = sums[1] / cols;

#pragma unroll
    for (int k = 0; k < kCached; ++k) {
      const int64_t v = threadIdx.x + int64_t(k) * group;
      if (v < vecs) write_at(v, xhat[k], wdy[k], c1, c2);
    }
    for (int64_t v = threadIdx.x + int64_t(kCached) * group; v < vecs; v += group) {
      float xh[N], wg[N];
      grads_at(v, xh, wg, false);
      write_at(v, xh, wg, c1, c2);
    }
  }

  for (int64_t v = threadIdx.x; v < cached; v += group) {
    if (dw_row) copy_share<N>(dw_row + v * N, dw_cached + v * N);
    if (db_row) copy_share<N>(db_row + v * N, db_cached + v * N);
  }
}

}  // namespace fusedlm::cuda::kernels::layer_norm

// --- host side: checks, launch shapes and launches ------------------------------------

namespace fusedlm::cuda {

using namespace kernels::layer_norm;

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_forward(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    double dropout_p, const at::Tensor& seed) {
  const auto in = add_layer_norm_inputs(x, residual, weight, bias, check_device_tensor);
  const DeviceGuard guard(x);
  const Dropout dropout = dropout_stream(seed, dropout_p);

  const int64_t rows = in.rows, cols = in.cols;
  // Outputs in x's shape (contiguous, so the kernels see [rows, cols]): an op's output
  // must not be a view.
  auto out = at::empty(x.sizes(), in.x.options()), summed = at::empty(x.sizes(), in.x.options());
  auto mean = at::empty({rows}, in.x.options().dtype(at::kFloat)), rstd = at::empty_like(mean);
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    if (rows == 0) return;
    const T *xp = ptr<T>(in.x), *rp = ptr<T>(in.residual), *wp = ptr<T>(in.weight);
    const T* bp = ptr<T>(in.bias);
    T *op = ptr<T>(out), *sp = ptr<T>(summed);
    constexpr int V = kVec<T>;
    auto run = [&](auto kernel, int n) {
      // Groups below kMinBlock threads share a block (four one-warp rows, or two of two
      // warps); wider groups take a block each.
      const int group = row_group(cols / n, forward_cached(n), true);
      const int threads = std::max(group, kMinBlock);
      launch(kernel, ceil_div(rows, threads / group), threads, kSharedBytes, xp, rp, wp, bp,
             op, sp, ptr<float>(mean), ptr<float>(rstd), rows, cols, group, float(eps),
             dropout);
    };
    if (cols % V == 0 && all_aligned16(xp, rp, wp, bp, op, sp))
      run(add_layer_norm_forward_kernel<T, V>, V);
    else
      run(add_layer_norm_forward_kernel<T, 1>, 1);
  });
  return {out, summed, mean, rstd};
}
FUSEDLM_KERNEL(add_layer_norm_forward);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> add_layer_norm_backward(
    const at::Tensor& grad_out, const std::optional<at::Tensor>& grad_summed,
    const at::Tensor& summed, const at::Tensor& mean, const at::Tensor& rstd,
    const std::optional<at::Tensor>& weight, bool has_bias, bool has_residual, double dropout_p,
    const at::Tensor& seed) {
  const auto in = add_layer_norm_grad_inputs(grad_out, grad_summed, summed, mean, rstd, weight,
                                             at::kFloat, dropout_p > 0, has_residual,
                                             check_device_tensor);
  const DeviceGuard guard(summed);
  const Dropout dropout = dropout_stream(seed, dropout_p);

  const int64_t rows = in.summed.size(0), cols = in.summed.size(1);
  const auto options = in.summed.options();
  at::Tensor dweight, dbias;
  dispatch(summed.scalar_type(), "summed", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T *gp = ptr<T>(in.grad_out), *gsp = ptr<T>(in.grad_summed), *sp = ptr<T>(in.summed);
    const T* wp = ptr<T>(in.weight);
    T *dsp = ptr<T>(in.dsummed), *dxp = ptr<T>(in.dx);
    const bool vector = cols % V == 0 && all_aligned16(gp, gsp, sp, wp, dsp, dxp);
    const int n = vector ? V : 1;
    const int threads = row_group(cols / n, kBackwardElements / n, false);
    const auto [rows_per_block, blocks] = row_blocks(rows, threads);
    auto partial = options.dtype(at::kFloat);
    auto dw_part = at::empty({in.weight.defined() ? blocks : 0, cols}, partial);
    auto db_part = at::empty({has_bias ? blocks : 0, cols}, partial);
    if (rows > 0) {
      float *dwp = in.weight.defined() ? ptr<float>(dw_part) : nullptr;
      float *dbp = has_bias ? ptr<float>(db_part) : nullptr;
      const size_t shared = backward_shared_bytes(cols, n, threads);
      if (vector)
        launch(add_layer_norm_backward_kernel<T, V>, blocks, threads, shared, gp, gsp, sp,
               ptr<float>(mean), ptr<float>(rstd), wp, dsp, dxp, dwp, dbp, rows, cols,
               rows_per_block, dropout);
      else
        launch(add_layer_norm_backward_kernel<T, 1>, blocks, threads, shared, gp, gsp, sp,
               ptr<float>(mean), ptr<float>(rstd), wp, dsp, dxp, dwp, dbp, rows, cols,
               rows_per_block, dropout);
    }
    if (in.weight.defined()) dweight = sum_partials<T>(dw_part, summed.scalar_type());
    if (has_bias) dbias = sum_partials<T>(db_part, summed.scalar_type());
  });
  return {in.dsummed, in.dx, dweight, dbias};
}
FUSEDLM_KERNEL(add_layer_norm_backward);

}  // namespace fusedlm::cuda
