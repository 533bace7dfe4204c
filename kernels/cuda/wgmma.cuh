// Hopper (sm_90a) building blocks of the wgmma paths of the attention forward
// (attention.cu) and the FFN product (gelu_ffn.cu): shared tiles in the 128-byte-swizzled
// layout that wgmma reads, their matrix descriptors, and the warpgroup products with
// their fences. Only code compiled for an sm_90a target (__CUDA_ARCH_FEAT_SM90_ALL) may
// call these.
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

using tc::cp_async16;
using tc::smem_address;

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

// Orders this thread's register accesses before the warpgroup products that follow.
__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int pending>
__device__ __forceinline__ void wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}

// Makes this thread's generic-proxy writes to shared memory (cp.async, plain stores)
// visible to wgmma, which reads through the async proxy.
__device__ __forceinline__ void fence_shared_for_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving reads or writes of a product's registers (accumulators,
// A fragments) across the fences and waits around it: this empty asm, volatile like
// them, stays in order with them, and every later access depends on its outputs.
template <int kTiles>
__device__ __forceinline__ void pin(float (&d)[kTiles][4]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[i][e])::"memory");
}

template <int kTiles>
__device__ __forceinline__ void pin(uint32_t (&a)[kTiles][4]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+r"(a[i][e])::"memory");
}

// The products' operand lists, spelled out once: the accumulator registers of an m64n64
// (32 floats) and an m64n128 (64 floats) product, and this thread's share of them.
#define FUSEDLM_WG_R0_31 \
  "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, " \
  "%30, %31"
#define FUSEDLM_WG_R32_63 \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, " \
  "%46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, " \
  "%60, %61, %62, %63"
#define FUSEDLM_WG_TILE(d, i) "+f"(d[i][0]), "+f"(d[i][1]), "+f"(d[i][2]), "+f"(d[i][3])
#define FUSEDLM_WG_D32(d)                                                                \
  FUSEDLM_WG_TILE(d, 0), FUSEDLM_WG_TILE(d, 1), FUSEDLM_WG_TILE(d, 2), FUSEDLM_WG_TILE(d, 3), \
      FUSEDLM_WG_TILE(d, 4), FUSEDLM_WG_TILE(d, 5), FUSEDLM_WG_TILE(d, 6), FUSEDLM_WG_TILE(d, 7)
#define FUSEDLM_WG_D64(d)                                                                   \
  FUSEDLM_WG_D32(d), FUSEDLM_WG_TILE(d, 8), FUSEDLM_WG_TILE(d, 9), FUSEDLM_WG_TILE(d, 10),  \
      FUSEDLM_WG_TILE(d, 11), FUSEDLM_WG_TILE(d, 12), FUSEDLM_WG_TILE(d, 13),               \
      FUSEDLM_WG_TILE(d, 14), FUSEDLM_WG_TILE(d, 15)

// d (+)= A B with A and B from shared memory (descriptors a, b), m64n64k16: A K-major,
// B K-major (TRANS_B "0") or MN-major ("1").
#define FUSEDLM_WG_SS_N64(TYPE, TRANS_B)                                             \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n64k16.f32." TYPE "." TYPE " "        \
               "{" FUSEDLM_WG_R0_31 "}, %32, %33, p, 1, 1, 0, " TRANS_B ";\n}\n"     \
               : FUSEDLM_WG_D32(d)                                                    \
               : "l"(a), "l"(b), "r"(scale_d))

// d (+)= A B with A from registers (this warp's fragment a) and B from shared memory
// read MN-major (trans-b = 1), m64 N k16; REGS, OUTS: d's registers, A, B, P: the operand
// numbers of a, b and scale_d.
#define FUSEDLM_WG_RS(TYPE, N, REGS, OUTS, A, B, P)                                  \
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\n"                         \
               "wgmma.mma_async.sync.aligned.m64" N "k16.f32." TYPE "." TYPE " "      \
               "{" REGS "}, {" A "}, " B ", p, 1, 1, 1;\n}\n"                        \
               : OUTS                                                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d))

// d (+)= A B, m64nNk16: A and B from shared memory (B read MN-major when kMnMajorB),
// or A from registers and B from shared memory read MN-major. scale_d = 0 overwrites d
// instead of adding to it.
template <typename T, bool kMnMajorB = false>
__device__ __forceinline__ void mma_ss(float (&d)[8][4], uint64_t a, uint64_t b, int scale_d) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if constexpr (kMnMajorB) FUSEDLM_WG_SS_N64("bf16", "1");
    else FUSEDLM_WG_SS_N64("bf16", "0");
  } else {
    if constexpr (kMnMajorB) FUSEDLM_WG_SS_N64("f16", "1");
    else FUSEDLM_WG_SS_N64("f16", "0");
  }
}

template <typename T>
__device__ __forceinline__ void mma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b,
                                       int scale_d) {
  if constexpr (std::is_same_v<T, at::BFloat16>)
    FUSEDLM_WG_RS("bf16", "n64", FUSEDLM_WG_R0_31, FUSEDLM_WG_D32(d), "%32, %33, %34, %35",
                  "%36", "%37");
  else
    FUSEDLM_WG_RS("f16", "n64", FUSEDLM_WG_R0_31, FUSEDLM_WG_D32(d), "%32, %33, %34, %35",
                  "%36", "%37");
}

template <typename T>
__device__ __forceinline__ void mma_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b,
                                       int scale_d) {
  if constexpr (std::is_same_v<T, at::BFloat16>)
    FUSEDLM_WG_RS("bf16", "n128", FUSEDLM_WG_R0_31 ", " FUSEDLM_WG_R32_63, FUSEDLM_WG_D64(d),
                  "%64, %65, %66, %67", "%68", "%69");
  else
    FUSEDLM_WG_RS("f16", "n128", FUSEDLM_WG_R0_31 ", " FUSEDLM_WG_R32_63, FUSEDLM_WG_D64(d),
                  "%64, %65, %66, %67", "%68", "%69");
}

#undef FUSEDLM_WG_RS
#undef FUSEDLM_WG_SS_N64
#undef FUSEDLM_WG_D64
#undef FUSEDLM_WG_D32
#undef FUSEDLM_WG_TILE
#undef FUSEDLM_WG_R32_63
#undef FUSEDLM_WG_R0_31

}  // namespace fusedlm::cuda::wg
