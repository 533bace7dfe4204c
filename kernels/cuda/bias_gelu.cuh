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
// gelu_ffn.cuh applies the same activation (gelu.cuh) in the epilogue of a matrix product.
#pragma once
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "gelu.cuh"

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
