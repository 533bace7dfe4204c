// bias_gelu on CUDA: out = gelu(x + bias) over the last dimension, and its backward
// dx = dy * gelu'(x + bias) with the bias gradient; and the same passes with dropout after
// the GELU, which gelu_ffn runs between cuBLAS's products (gelu_ffn.cu).
//
// Both kernels tile [rows, cols] into kTileRows rows by one 16-byte vector of columns per
// thread: a thread loads its bias vector once and walks down the tile's rows, so each
// element is read once and written once (the backward reads dy and x, writes dx, and under
// dropout the activation again if asked: gelu_ffn's dw2 needs it). Memory-bound: they
// should run near the copy bandwidth. The backward's thread also sums its columns of dx
// over the tile, in float32; the sums land in a [row tiles, cols] buffer summed over tiles
// by a second kernel (no atomics: the bias gradient repeats bit for bit), an extra
// 4 / (kTileRows * element size) of the traffic.
//
// gelu_ffn.cu's own product kernels apply the same activation (gelu.cuh) in their
// epilogues.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "gelu.cuh"
#include "ops/compiled_kernel.h"

namespace fusedlm::cuda::kernels::bias_gelu {

constexpr int kTileRows = 32;
constexpr int kThreads = 128;

// grid: (row tiles, column blocks); thread: one vector of columns over the tile's rows.
// out = dropout(gelu(x + bias)), the dropout stream numbering [rows, cols] row-major.
template <typename T, int N, bool kTanh>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_forward_kernel(const T* __restrict__ x, const T* __restrict__ bias,
                             T* __restrict__ out, int64_t rows, int64_t cols, Dropout dropout) {
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
    if (dropout.active) dropout.apply<N>(r * cols + col, z);
    store<N>(out + r * cols + col, z);
  }
}

// dx = dropout'(dy) * gelu'(x + bias), the dropout's mask and scale applied to dy; with
// act, also act = dropout(gelu(x + bias)) as the forward wrote it.
template <typename T, int N, bool kTanh>
__global__ void __launch_bounds__(kThreads)
    bias_gelu_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                              const T* __restrict__ bias, T* __restrict__ dx, T* __restrict__ act,
                              float* __restrict__ db_part, int64_t rows, int64_t cols,
                              Dropout dropout) {
  const int64_t col = (int64_t(blockIdx.y) * blockDim.x + threadIdx.x) * N;
  if (col >= cols) return;
  const int64_t first = int64_t(blockIdx.x) * kTileRows;
  const int64_t last = std::min(rows, first + kTileRows);
  float b[N] = {}, db[N] = {};
  if (bias) load<N>(bias + col, b);
#pragma unroll 4
  for (int64_t r = first; r < last; ++r) {
    float g[N], z[N], kept[N];
    load<N>(dy + r * cols + col, g);
    load<N>(x + r * cols + col, z);
#pragma unroll
    for (int i = 0; i < N; ++i) kept[i] = 1.0f;
    if (dropout.active) dropout.apply<N>(r * cols + col, kept);  // 0 or 1 / (1 - p)
#pragma unroll
    for (int i = 0; i < N; ++i) {
      z[i] += b[i];
      g[i] *= kept[i] * gelu_grad<kTanh>(z[i]);
      db[i] += g[i];
    }
    store<N>(dx + r * cols + col, g);
    if (act) {
#pragma unroll
      for (int i = 0; i < N; ++i) z[i] = gelu<kTanh>(z[i]) * kept[i];
      store<N>(act + r * cols + col, z);
    }
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

// run(N, kTanh), as integral constants, for the vector width the pointers allow and the GELU.
template <typename T, typename Run>
void with_kernel(bool vector, bool tanh, Run&& run) {
  constexpr int V = kVec<T>;
  if (vector && tanh) run(std::integral_constant<int, V>{}, std::true_type{});
  else if (vector) run(std::integral_constant<int, V>{}, std::false_type{});
  else if (tanh) run(std::integral_constant<int, 1>{}, std::true_type{});
  else run(std::integral_constant<int, 1>{}, std::false_type{});
}

}  // namespace

void gelu_forward_pass(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& out,
                       bool tanh, const Dropout& dropout) {
  const int64_t rows = x.size(0), cols = x.size(1);
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    if (x.numel() == 0) return;
    const T *xp = ptr<T>(x), *bp = ptr<T>(bias);
    T* op = ptr<T>(out);
    const bool vector = cols % kVec<T> == 0 && all_aligned16(xp, bp, op);
    with_kernel<T>(vector, tanh, [&](auto n, auto approx) {
      launch(bias_gelu_forward_kernel<T, decltype(n)::value, decltype(approx)::value>, tiles(rows, cols, decltype(n)::value), kThreads, 0, xp, bp,
             op, rows, cols, dropout);
    });
  });
}

at::Tensor gelu_backward_pass(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& bias,
                              const at::Tensor& dx, const at::Tensor& act, bool tanh,
                              const Dropout& dropout, bool want_dbias) {
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor dbias;
  dispatch(x.scalar_type(), "x", [&](auto tag) {
    using T = decltype(tag);
    const T *gp = ptr<T>(grad), *xp = ptr<T>(x), *bp = ptr<T>(bias);
    T *dxp = ptr<T>(dx), *ap = ptr<T>(act);
    const bool vector = cols % kVec<T> == 0 && all_aligned16(gp, xp, bp, dxp, ap);
    const Grid grid = tiles(rows, cols, vector ? kVec<T> : 1);
    auto db_part = at::empty({want_dbias ? int64_t(grid.x) : 0, cols}, x.options().dtype(at::kFloat));
    float* dbp = want_dbias ? ptr<float>(db_part) : nullptr;
    if (x.numel() > 0)
      with_kernel<T>(vector, tanh, [&](auto n, auto approx) {
        launch(bias_gelu_backward_kernel<T, decltype(n)::value, decltype(approx)::value>, grid, kThreads, 0, gp, xp, bp, dxp, ap,
               dbp, rows, cols, dropout);
      });
    if (want_dbias) dbias = sum_partials<T>(db_part, x.scalar_type());
  });
  return dbias;
}

at::Tensor bias_gelu_forward(const at::Tensor& x, const std::optional<at::Tensor>& bias,
                             const std::string& approximate) {
  const auto in = bias_gelu_inputs(x, bias, approximate, check_device_tensor);
  const DeviceGuard guard(x);
  // Outputs are allocated in their final shapes: an op's output must not be a view.
  auto out = at::empty(x.sizes(), in.x.options());
  gelu_forward_pass(in.x, in.bias, out.view(in.x.sizes()), in.tanh, Dropout{});
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
  auto dbias = gelu_backward_pass(in.grad, in.x, in.bias, dx.view(in.x.sizes()), at::Tensor(),
                                  in.tanh, Dropout{}, in.bias.defined());
  return {dx, dbias};
}
FUSEDLM_KERNEL(bias_gelu_backward);

}  // namespace fusedlm::cuda
