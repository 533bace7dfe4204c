// Hopper (sm_90a) building blocks of the wgmma paths of the attention forward
// (attention.cu) and the FFN product (gelu_ffn.cu): shared tiles in the 128-byte-swizzled
// layout that wgmma reads, their matrix descriptors, and the warpgroup products with
// their fences (the instructions themselves are in ptx.cuh). Only code compiled for an
// sm_90a target (__CUDA_ARCH_FEAT_SM90_ALL) may call these.
//
// A warpgroup is 4 consecutive warps. wgmma.mma_async m64nNk16 multiplies a 64 x 16 A
// (the warpgroup's 64 rows, warp w holding rows 16w .. 16w + 15) by a 16 x N B and adds
// into 64 x N f32 accumulators. Per warp, the A fragment held in registers and the
// accumulator fragments are laid out exactly as mma.sync m16n8k16's (tensor_core.cuh):
// accumulator element d[nt][e] is C[g + 8 (e / 2)][8 nt + 2t + e % 2], so the attention
// kernels' masking, softmax and epilogue code reads them unchanged.
//
// Shared tiles, PTX ISA "Shared Memory Matrix Layout" (128-byte swizzle): a tile of
// kRows rows of 16-bit elements is kept in panels of 64 columns; panel p holds columns
// 64p .. 64p + 63 of every row, 128 bytes a row, and within each 1024-byte group of 8 rows
// (1024-byte aligned) the 16-byte chunk c of row r sits at chunk c ^ (r % 8). Read as
//   K-major (Q as A, K as B of S = Q K^T; the FFN's x, dy and w1; the product's k runs
//     along a row): 8-row groups 1024 bytes apart (the stride byte offset); a k-step of
//     16 columns starts 32 bytes further into the panel (the hardware swizzles the
//     address it forms);
//   MN-major (V as B of O = P V; w2 as B of dy w2; k runs down the rows): 8-row groups
//     1024 bytes apart (the stride byte offset), panels of 64 columns kRows * 128 bytes
//     apart (the leading byte offset); a k-step of 16 rows starts 2048 bytes further.
#pragma once
#include "tensor_core.cuh"

namespace fusedlm::cuda::wg {

using ptx::cp_async16;
using ptx::smem_address;

// Element offset of chunk `chunk` (8 elements) of row r in a swizzled tile of kRows rows.
template <int kRows>
__device__ __forceinline__ int swizzled(int r, int chunk) {
  return (chunk / 8) * kRows * 64 + r * 64 + ((chunk % 8) ^ (r % 8)) * 8;
}

// Starts copying a kRows x kCols tile into the swizzled tile: row r, column c from
// src + r * row_stride + c, zeros outside rows < rows and columns < cols (cols a multiple
// of 8, so a 16-byte chunk is wholly inside or outside). Consecutive threads take
// consecutive chunks of a row, so the reads coalesce and each warp's stores cover whole rows.
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_tile_2d(T* tile, const T* src, int64_t row_stride,
                                             int64_t rows, int64_t cols) {
  constexpr int kChunks = kCols / 8;
  for (int i = threadIdx.x; i < kRows * kChunks; i += kThreads) {
    const int r = i / kChunks, chunk = i % kChunks;
    const bool in = r < rows && chunk * 8 < cols;
    cp_async16(tile + swizzled<kRows>(r, chunk), in ? src + r * row_stride + chunk * 8 : src, in);
  }
}

// Rows [0, kRows) of head_dim D: zeros for rows >= valid.
template <int kRows, int D, int kThreads, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row_stride, int valid) {
  load_tile_2d<kRows, D, kThreads>(tile, src, row_stride, valid, D);
}

// A shared-memory matrix descriptor with the 128-byte swizzle: the start address, the
// leading and the stride byte offsets (all in 16-byte units), swizzle mode 1 in bits 62-63.
__device__ __forceinline__ uint64_t descriptor(const void* start, uint32_t leading_bytes,
                                               uint32_t stride_bytes) {
  return uint64_t((smem_address(start) >> 4) & 0x3FFF) |
         uint64_t((leading_bytes >> 4) & 0x3FFF) << 16 |
         uint64_t((stride_bytes >> 4) & 0x3FFF) << 32 | uint64_t(1) << 62;
}

// K-step kk (columns 16kk .. 16kk + 15) of rows row0 .. of a swizzled tile of kRows rows,
// read K-major. row0 is a multiple of 8, so the 8-row groups stay 1024-byte aligned.
template <int kRows, typename T>
__device__ __forceinline__ uint64_t k_major(const T* tile, int row0, int kk) {
  return descriptor(tile + (kk / 4) * kRows * 64 + row0 * 64 + (kk % 4) * 16, 16, 1024);
}

// K-step kt (rows 16kt .. 16kt + 15) of a swizzled tile of kRows rows, read MN-major.
template <int kRows, typename T>
__device__ __forceinline__ uint64_t mn_major(const T* tile, int kt) {
  return descriptor(tile + kt * 16 * 64, kRows * 128, 1024);
}

// The warpgroup products and their fences (ptx.cuh), by the names the kernels use.

// Orders this thread's register accesses before the warpgroup products that follow.
__device__ __forceinline__ void fence() { ptx::wgmma_fence(); }

__device__ __forceinline__ void commit() { ptx::wgmma_commit(); }

template <int pending>
__device__ __forceinline__ void wait() {
  ptx::wgmma_wait<pending>();
}

// Makes this thread's generic-proxy writes to shared memory (cp.async, plain stores)
// visible to wgmma, which reads through the async proxy.
__device__ __forceinline__ void fence_shared_for_async() { ptx::fence_proxy_async(); }

// Keeps the compiler from moving reads or writes of a product's registers (accumulators,
// A fragments) across the fences and waits around it.
template <int kTiles>
__device__ __forceinline__ void pin(float (&d)[kTiles][4]) {
  ptx::wgmma_pin(d);
}

template <int kTiles>
__device__ __forceinline__ void pin(uint32_t (&a)[kTiles][4]) {
  ptx::wgmma_pin(a);
}

// d (+)= A B, m64nNk16: A and B from shared memory (B read MN-major when kMnMajorB),
// or A from registers and B from shared memory read MN-major. scale_d = 0 overwrites d
// instead of adding to it.
template <typename T, bool kMnMajorB = false>
__device__ __forceinline__ void mma_ss(float (&d)[8][4], uint64_t a, uint64_t b, int scale_d) {
  ptx::wgmma_ss<T, kMnMajorB>(d, a, b, scale_d);
}

template <typename T>
__device__ __forceinline__ void mma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b,
                                       int scale_d) {
  ptx::wgmma_rs<T>(d, a, b, scale_d);
}

template <typename T>
__device__ __forceinline__ void mma_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b,
                                       int scale_d) {
  ptx::wgmma_rs<T>(d, a, b, scale_d);
}

}  // namespace fusedlm::cuda::wg
