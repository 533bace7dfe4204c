// bias_gelu on CUDA: out = gelu(x + bias) over the last dimension, and its backward
// dx = dy * gelu'(x + bias) with the bias gradient.
//
// Both kernels tile [rows, cols] into kTileRows rows by one 16-byte vector of columns per
// thread: a thread loads its bias vector once and walks down the tile's rows, so each
// element is read once and written once (the backward reads dy and x, writes dx).
// Memory-bound: they should run near the copy bandwidth. The backward's thread also sums
// its columns of dx over the tile, in float32; the sums land in a [row tiles, cols]
// buffer summed over tiles by a second kernel (no atomics: the bias gradient repeats bit
// for bit), an extra 4 / (kTileRows * element size) of the traffic.
//
// gelu_ffn.cu applies the same activation (gelu.cuh) in the epilogue of a matrix product.
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "gelu.cuh"
#include "ops/compiled_kernel.h"

namespace fusedlm::cuda::kernels::bias_gelu {

constexpr int kTileRows = 32;
constexpr int kThreads = 128;

// grid: (row tiles, column blocks); thread: one vector of columns over the tile's rows.
template <typename T, int N, bool kTanh>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                             T* __restrict__ out, int64_t rows, int64_t cols) {
  const int64_t col = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * N;
  if (col >= cols) return;
  const int64_t first = int64_t(blockIdx.x) * kTileRows;
  const int64_t last = std::min(rows, first + kTileRows);
  float b[N] = {};
  if (bias) load<N>(bias + col, b);
#pragma unroll 4
  for (int64_t r = first; r < last; ++r) {
    float z[N];
    load<N>(x + r * cols + col, z);
#pragma unroll
    for (int i = 0; i < N; ++i) z[i] = gelu<kTanh>(z[i] + b[i]);
    store<N>(out + r * cols + col, z);
  }
}

template <typename T, int N, bool kTanh>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                              const T* __restrict__ bias, T* __restrict__ dx,
                              float* __restrict__ db_part, int64_t rows, int64_t cols) {
  const int64_t col = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * N;
  if (col >= cols) return;
  const int64_t first = int64_t(blockIdx.x) * kTileRows;
  const int64_t last = std::min(rows, first + kTileRows);
  float b[N] = {}, db[N] = {};
  if (bias) load<N>(bias + col, b);
#pragma unroll 4
  for (int64_t r = first; r < last; ++r) {
    float g[N], z[N];
    load<N>(dy + r * cols + col, g);
    load<N>(x + r * cols + col, z);
#pragma unroll
    for (int i = 0; i < N; ++i) {
      g[i] *= gelu_grad<kTanh>(z[i] + b[i]);
      db[i] += g[i];
    }
    store<N>(dx + r * cols + col, g);
  }
  if (db_part) store<N>(db_part + int64_t(blockIdx.x) * cols + col, db);
}

}  // namespace fusedlm::cuda::kernels::bias_gelu

// --- host side: checks, launch shapes and launches ------------------------------------

namespace fusedlm::cuda {
namespace {

using namespace kernels::bias_gelu;

// The launch of both kernels: (row tiles, column blocks) of kThreads vectors each.
Grid tiles(int64_t rows, int64_t cols, int n) {
  return Grid(ceil_div(rows, kTileRows), ceil_div(ceil_div(cols, n), kThreads));
}

}  // namespace

at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate) {
  const auto in = bias_gelu_inputs(x, bias, approximate, check_device_tensor);
  const DeviceGuard guard(x);
  // Outputs are allocated in their final shapes: an op's output must not be a view.
  auto out = at::empty(x.sizes(), in.x.options());
  const int64_t rows = in.x.size(0), cols = in.x.size(1);
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    if (in.x.numel() == 0) return;
    constexpr int V = kVec<T>;
    const T *xp = ptr<T>(in.x), *bp = ptr<T>(in.bias);
    T* op = ptr<T>(out);
    const bool vector = cols % V == 0 && all_aligned16(xp, bp, op);
    const Grid grid = tiles(rows, cols, vector ? V : 1);
    if (vector && in.tanh)
      launch(bias_gelu_forward_kernel<T, V, true>, grid, kThreads, 0, xp, bp, op, rows, cols);
    else if (vector)
      launch(bias_gelu_forward_kernel<T, V, false>, grid, kThreads, 0, xp, bp, op, rows, cols);
    else if (in.tanh)
      launch(bias_gelu_forward_kernel<T, 1, true>, grid, kThreads, 0, xp, bp, op, rows, cols);
    else
      launch(bias_gelu_forward_kernel<T, 1, false>, grid, kThreads, 0, xp, bp, op, rows, cols);
  });
  return out;
}
FUSEDLM_KERNEL(bias_gelu_forward);

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate) {
  const auto in = bias_gelu_grad_inputs(grad, x, bias, approximate, check_device_tensor);
  const DeviceGuard guard(x);
  auto dx = at::empty(x.sizes(), in.x.options());
  const int64_t rows = in.x.size(0), cols = in.x.size(1);
  at::Tensor dbias;
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T *gp = ptr<T>(in.grad), *xp = ptr<T>(in.x), *bp = ptr<T>(in.bias);
    T* dxp = ptr<T>(dx);
    const bool vector = cols % V == 0 && all_aligned16(gp, xp, bp, dxp);
    const Grid grid = tiles(rows, cols, vector ? V : 1);
    auto db_part = at::empty({in.bias.defined() ? int64_t(grid.x) : 0, cols},
                             in.x.options().dtype(at::kFloat));
    float* dbp = in.bias.defined() ? ptr<float>(db_part) : nullptr;
    if (in.x.numel() > 0) {
      if (vector && in.tanh)
        launch(bias_gelu_backward_kernel<T, V, true>, grid, kThreads, 0, gp, xp, bp, dxp, dbp,
               rows, cols);
      else if (vector)
        launch(bias_gelu_backward_kernel<T, V, false>, grid, kThreads, 0, gp, xp, bp, dxp, dbp,
               rows, cols);
      else if (in.tanh)
        launch(bias_gelu_backward_kernel<T, 1, true>, grid, kThreads, 0, gp, xp, bp, dxp, dbp,
               rows, cols);
      else
        launch(bias_gelu_backward_kernel<T, 1, false>, grid, kThreads, 0, gp, xp, bp, dxp, dbp,
               rows, cols);
    }
    if (in.bias.defined()) dbias = sum_partials<T>(db_part, x.scalar_type());
  });
  return {dx, dbias};
}
FUSEDLM_KERNEL(bias_gelu_backward);

}  // namespace fusedlm::cuda
