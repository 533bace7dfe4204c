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
#include "common.cuh"
#include "cuda/ops.h"
#include "gelu.cuh"

namespace fusedlm::cuda {
namespace {

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

// The bias as a contiguous [cols] tensor checked against x, or an undefined tensor.
at::Tensor bias_of(const std::optional<at::Tensor>& bias, const at::Tensor& x) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  check_cuda(*bias, "bias");
  check_same_device(*bias, x, "bias", "x");
  TORCH_CHECK_VALUE(bias->dim() == 1 && bias->size(0) == x.size(-1), "bias must have shape [",
                    x.size(-1), "], got ", bias->sizes());
  TORCH_CHECK_TYPE(bias->scalar_type() == x.scalar_type(), "bias must have the dtype of x (",
                   x.scalar_type(), "), got ", bias->scalar_type());
  return bias->contiguous();
}

// The launch of both kernels: (row tiles, column blocks) of kThreads vectors each.
dim3 tiles(int64_t rows, int64_t cols, int n) {
  return dim3(static_cast<unsigned>(ceil_div(rows, kTileRows)),
              static_cast<unsigned>(ceil_div(ceil_div(cols, n), kThreads)));
}

at::Tensor as_rows(const at::Tensor& t) { return t.contiguous().view({-1, t.size(-1)}); }

}  // namespace

at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate) {
  check_cuda(x, "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension");
  const bool approx_tanh = tanh_kind(approximate);
  const auto b = bias_of(bias, x);
  const c10::cuda::CUDAGuard guard(x.device());
  auto x2 = as_rows(x);
  auto out = at::empty_like(x2);
  const int64_t rows = x2.size(0), cols = x2.size(1);
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    if (x2.numel() == 0) return;
    constexpr int V = kVec<T>;
    const T *xp = ptr<T>(x2), *bp = ptr<T>(b);
    T* op = ptr<T>(out);
    const auto stream = current_stream();
    const bool vector = cols % V == 0 && all_aligned16(xp, bp, op);
    const dim3 grid = tiles(rows, cols, vector ? V : 1);
    if (vector && approx_tanh)
      bias_gelu_forward_kernel<T, V, true><<<grid, kThreads, 0, stream>>>(xp, bp, op, rows, cols);
    else if (vector)
      bias_gelu_forward_kernel<T, V, false><<<grid, kThreads, 0, stream>>>(xp, bp, op, rows, cols);
    else if (approx_tanh)
      bias_gelu_forward_kernel<T, 1, true><<<grid, kThreads, 0, stream>>>(xp, bp, op, rows, cols);
    else
      bias_gelu_forward_kernel<T, 1, false><<<grid, kThreads, 0, stream>>>(xp, bp, op, rows, cols);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out.view(x.sizes());
}

std::tuple<at::Tensor, at::Tensor> bias_gelu_backward(const at::Tensor& grad,
                                                      const at::Tensor& x,
                                                      const std::optional<at::Tensor>& bias,
                                                      const std::string& approximate) {
  check_cuda(x, "x");
  check_cuda(grad, "grad");
  check_same_device(grad, x, "grad", "x");
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must have at least one dimension");
  TORCH_CHECK_VALUE(grad.sizes() == x.sizes(), "grad must have the shape of x ", x.sizes(),
                    ", got ", grad.sizes());
  TORCH_CHECK_TYPE(grad.scalar_type() == x.scalar_type(), "grad must have the dtype of x (",
                   x.scalar_type(), "), got ", grad.scalar_type());
  const bool approx_tanh = tanh_kind(approximate);
  const auto b = bias_of(bias, x);
  const c10::cuda::CUDAGuard guard(x.device());
  auto x2 = as_rows(x), g2 = as_rows(grad);
  auto dx = at::empty_like(x2);
  const int64_t rows = x2.size(0), cols = x2.size(1);
  at::Tensor dbias;
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    constexpr int V = kVec<T>;
    const T *gp = ptr<T>(g2), *xp = ptr<T>(x2), *bp = ptr<T>(b);
    T* dxp = ptr<T>(dx);
    const bool vector = cols % V == 0 && all_aligned16(gp, xp, bp, dxp);
    const dim3 grid = tiles(rows, cols, vector ? V : 1);
    auto db_part = at::empty({b.defined() ? int64_t(grid.x) : 0, cols},
                             x2.options().dtype(at::kFloat));
    float* dbp = b.defined() ? ptr<float>(db_part) : nullptr;
    if (x2.numel() > 0) {
      const auto stream = current_stream();
      if (vector && approx_tanh)
        bias_gelu_backward_kernel<T, V, true><<<grid, kThreads, 0, stream>>>(gp, xp, bp, dxp, dbp, rows, cols);
      else if (vector)
        bias_gelu_backward_kernel<T, V, false><<<grid, kThreads, 0, stream>>>(gp, xp, bp, dxp, dbp, rows, cols);
      else if (approx_tanh)
        bias_gelu_backward_kernel<T, 1, true><<<grid, kThreads, 0, stream>>>(gp, xp, bp, dxp, dbp, rows, cols);
      else
        bias_gelu_backward_kernel<T, 1, false><<<grid, kThreads, 0, stream>>>(gp, xp, bp, dxp, dbp, rows, cols);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (b.defined()) dbias = sum_partials<T>(db_part, x.scalar_type());
  });
  return {dx.view(x.sizes()), dbias};
}

}  // namespace fusedlm::cuda
