// What the row-wise kernels share (layer_norm.cu, rms_norm.cu): a group of threads owns a
// row and keeps its share of it in registers, at no more than 64 registers a thread
// (__launch_bounds__(kMaxThreads)), half an SM's threads resident.
//
// Forward: a group of 32 to 1024 threads per row (a power of two below kMinBlock, so that
// groups fill a block), each caching up to kForwardElements floats. Backward: one group per
// block, walking a contiguous range of rows, with the block's shares of the parameter
// gradients for the columns its threads keep in shared memory, copied at the end to the
// block's row of a [blocks, hidden] float32 buffer that sum_partials adds up in block
// order. The block count depends only on the shape and the device: no atomics, and the
// parameter gradients repeat bit for bit.
#pragma once
#include <algorithm>
#include <cstdint>

#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"

namespace fusedlm::cuda::row_kernels {

constexpr int kForwardElements = 16;  // values of a row a forward thread keeps
constexpr int kBackwardElements = 8;  // columns a backward thread keeps (2 floats each)
constexpr int kMaxThreads = 1024;     // a block's, so that a thread has 64 registers
constexpr int kMinBlock = 128;        // threads of the forward's block: whole rows' groups

// The vectors of N elements a forward thread keeps: fewer of single elements, which need
// an address each.
constexpr int forward_cached(int n) {
  return n == 1 ? kForwardElements / 2 : kForwardElements / n;
}

// sums[0 .. N) += add: a vector of a block's row of partial sums.
template <int N>
__device__ __forceinline__ void add_to(float* sums, const float (&add)[N]) {
  float acc[N];
  load<N>(sums, acc);
#pragma unroll
  for (int i = 0; i < N; ++i) acc[i] += add[i];
  store<N>(sums, acc);
}

// dst[0 .. N) = src[0 .. N): a vector of the block's shares, to its row of partial sums.
template <int N>
__device__ __forceinline__ void copy_share(float* dst, const float* src) {
  float share[N];
  load<N>(src, share);
  store<N>(dst, share);
}

// The threads that own a row of `vecs` vectors when each keeps `cached` of them: whole
// warps, as few as hold the row (all 1024 for longer rows), a power of two if `pow2`.
inline int row_group(int64_t vecs, int cached, bool pow2) {
  const int64_t warps = std::min<int64_t>(kMaxThreads / 32, ceil_div(ceil_div(vecs, cached), 32));
  int group = 32;
  if (pow2)
    while (group < warps * 32) group *= 2;
  else
    group = static_cast<int>(std::max<int64_t>(1, warps) * 32);
  return group;
}

// A backward's rows per block and blocks of `threads`: enough blocks to fill the device
// (2048 threads an SM), but at least 8 rows each, so the partial sums stay small next to
// the rows themselves. Fixed per shape and device.
struct RowBlocks {
  int64_t rows_per_block, blocks;
};
inline RowBlocks row_blocks(int64_t rows, int threads) {
  const int64_t resident = int64_t(multiprocessors()) * (2048 / threads);
  const int64_t rows_per_block = std::max<int64_t>(8, ceil_div(rows, resident));
  return {rows_per_block, ceil_div(rows, rows_per_block)};
}

}  // namespace fusedlm::cuda::row_kernels
