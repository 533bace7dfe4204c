// Tensor-core building blocks of the attention kernels (attention.cu) and the FFN's
// matrix product (gelu_ffn.cu): cp.async tile loads, ldmatrix fragment loads, the
// m16n8k16 matrix product (the instructions themselves are in ptx.cuh), and the fragment
// layouts that tie them together. Everything here needs sm_80 or newer.
//
// Fragment layouts of mma.sync.aligned.m16n8k16 (bf16/fp16 in, fp32 accumulate), PTX
// ISA "Matrix Fragments for mma.m16n8k16". With g = lane / 4 and t = lane % 4:
//   A (16 x 16, 4 registers of 2 elements, the lower k in the low half):
//     a0 = A[g][2t, 2t+1]   a1 = A[g+8][2t, 2t+1]   a2 = A[g][2t+8, 2t+9]   a3 = A[g+8][2t+8, 2t+9]
//   B (16 x 8, 2 registers): b0 = B[2t, 2t+1][g]   b1 = B[2t+8, 2t+9][g]
//   C (16 x 8, 4 floats):    c0, c1 = C[g][2t, 2t+1]   c2, c3 = C[g+8][2t, 2t+1]
// ldmatrix.x4 loads four 8 x 8 matrices of 16-bit elements; lanes 8i .. 8i+7 give the
// addresses of the 8 rows of matrix i, and register i of lane l receives
//   plain:  row l / 4, elements 2(l % 4), 2(l % 4) + 1 of matrix i
//   .trans: rows 2(l % 4), 2(l % 4) + 1, element l / 4 of matrix i (a column pair)
// Tiles sit in shared memory row-major with a pitch of their width + 8 elements (a width
// that is a multiple of 32): the eight 16-byte rows of one ldmatrix matrix then start
// 16 bytes apart modulo 128 and fall in different banks.
#pragma once
#include <cstdint>
#include <type_traits>

#include "common.cuh"

namespace fusedlm::cuda::tc {

// The instructions (ptx.cuh), by the names the kernels use.
using ptx::cp_async16;
using ptx::cp_async_commit;
using ptx::cp_async_wait;
using ptx::ldmatrix_x4;
using ptx::ldmatrix_x4_trans;
using ptx::smem_address;

// --- global -> shared ---------------------------------------------------------------------

// cp_async_wait with a count known only at run time (the same in every thread of the
// block). A count past kMax waits for more groups than asked, which is only slower.
template <int kMax = 16, int N = 0>
__device__ __forceinline__ void cp_async_wait_runtime(int pending) {
  if constexpr (N == kMax) {
    cp_async_wait<N>();
  } else if (pending == N) {
    cp_async_wait<N>();
  } else {
    cp_async_wait_runtime<kMax, N + 1>(pending);
  }
}

// Starts copying rows [0, kRows) of a tile of head_dim D into shared memory `tile`
// (pitch D + 8): row r from src + r * row_stride, zeros for rows >= valid. The whole
// block shares the work, one 16-byte chunk per thread per step.
template <int kRows, int D, int kThreads, typename T>
__device__ __forceinline__ void load_tile(T* tile, const T* src, int64_t row_stride, int valid) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool in = r < valid;
    cp_async16(tile + r * (D + 8) + col, in ? src + r * row_stride + col : src, in);
  }
}

// Starts copying a kRows x kCols tile into shared memory `tile` (pitch kCols + 8): row r,
// column c from src + r * row_stride + c, zeros outside rows < rows and columns < cols
// (cols a multiple of 8, so a 16-byte chunk is wholly inside or outside).
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_tile_2d(T* tile, const T* src, int64_t row_stride,
                                             int64_t rows, int64_t cols) {
  constexpr int kChunks = kCols / 8;
  static_assert(kRows * kChunks % kThreads == 0, "every thread copies as many chunks");
#pragma unroll
  for (int c = threadIdx.x; c < kRows * kChunks; c += kThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const bool in = r < rows && col < cols;
    cp_async16(tile + r * (kCols + 8) + col, in ? src + r * row_stride + col : src, in);
  }
}

// --- shared -> registers ------------------------------------------------------------------

// The A fragment of rows row0 .. row0+15, columns col0 .. col0+15 of a row-major tile
// (pitch P). Lane l addresses row row0 + l % 16 at column col0 + (l / 16) * 8, so
// matrices 0..3 are (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15),
// (rows 8-15, cols 8-15): a0..a3 in the layout above.
template <int P, typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* tile, int row0, int col0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(a, smem_address(tile + (row0 + lane % 16) * P + col0 + (lane / 16) * 8));
}

// B fragments of two n-tiles for a product with X^T, where X is a row-major tile
// [n][k] (the keys of S = Q K^T): B[k][n] = X[n][k]. b0 needs X[n = g][k = 2t, 2t+1],
// which is the plain ldmatrix layout of the matrix (rows n, cols k). Lane l addresses
// row n0 + (l / 16) * 8 + l % 8 at column k0 + ((l / 8) % 2) * 8, so matrices 0..3 are
// (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15):
// b[0], b[1] = b0, b1 of n-tile n0 and b[2], b[3] = b0, b1 of n-tile n0 + 8.
template <int P, typename T>
__device__ __forceinline__ void load_b_rows(uint32_t (&b)[4], const T* tile, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4(b, smem_address(tile + (n0 + (lane / 16) * 8 + lane % 8) * P + k0 +
                              ((lane / 8) % 2) * 8));
}

// B fragments of two n-tiles where B itself is a row-major tile [k][n] (V in O = P V):
// b0 needs B[k = 2t, 2t+1][n = g], a column pair, which .trans gives from a matrix
// whose addressed rows are k. Lane l addresses row k0 + l % 16 at column n0 + (l / 16) * 8,
// so matrices 0..3 are (k 0-7, n 0-7), (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15):
// b[0], b[1] = b0, b1 of n-tile n0 and b[2], b[3] = b0, b1 of n-tile n0 + 8.
template <int P, typename T>
__device__ __forceinline__ void load_b_cols(uint32_t (&b)[4], const T* tile, int k0, int n0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4_trans(b, smem_address(tile + (k0 + lane % 16) * P + n0 + (lane / 16) * 8));
}

// --- the product --------------------------------------------------------------------------

// c += A B for one 16 x 8 x 16 step. T picks bf16 or fp16 inputs.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  ptx::mma_m16n8k16<T>(c, a, b0, b1);
}

// Two floats rounded to T in one register, lo in the low half (the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The A fragment of k-step kt of a product whose left operand is the accumulator c of
// an earlier product (P in O = P V): n-tiles 2kt and 2kt+1 of c cover columns
// 16kt .. 16kt+15, and c[2kt][0..1] = C[g][2t, 2t+1] is exactly a0, c[2kt][2..3] is a1,
// c[2kt+1][0..1] is a2 and c[2kt+1][2..3] is a3 (the FlashAttention-2 register reuse).
template <typename T, int kTiles>
__device__ __forceinline__ void accumulator_as_a(uint32_t (&a)[4], const float (&c)[kTiles][4],
                                                 int kt) {
  a[0] = pack<T>(c[2 * kt][0], c[2 * kt][1]);
  a[1] = pack<T>(c[2 * kt][2], c[2 * kt][3]);
  a[2] = pack<T>(c[2 * kt + 1][0], c[2 * kt + 1][1]);
  a[3] = pack<T>(c[2 * kt + 1][2], c[2 * kt + 1][3]);
}

// The sum of v over the four lanes of a quad (the lanes that share g: one row of a C
// fragment), and its max.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Whether dropout keeps elements e and e + 1: one Philox call when both fall in the
// same group of four, two otherwise.
__device__ __forceinline__ void keep_pair(const Dropout& dropout, uint64_t e, bool (&kept)[2]) {
  if (e % 4 != 3) {
    const uint4 w = philox(dropout.seed, e / 4);
    const uint32_t at = e % 4;  // selects, not an indexed array (local memory)
    const uint32_t first = at == 0 ? w.x : at == 1 ? w.y : w.z;
    const uint32_t second = at == 0 ? w.y : at == 1 ? w.z : w.w;
    kept[0] = (first >> 8) >= dropout.threshold;
    kept[1] = (second >> 8) >= dropout.threshold;
  } else {
    dropout.keep<2>(e, kept);
  }
}

// Which elements dropout keeps of a thread's share of a C-fragment tile of kTiles
// n-tiles (kTiles <= 8): bit 2 * (8 * hh + nt) + e is element e of the pair at stream
// index row_hh + 8 * nt (row0 for the C fragment's row g, row1 for g + 8). The loop is not unrolled: the Philox rounds would otherwise be
// laid out 2 * kTiles times over, and the bits are applied by an unrolled loop later.
template <int kTiles>
__device__ __forceinline__ uint32_t kept_pairs(const Dropout& dropout, uint64_t row0,
                                               uint64_t row1) {
  static_assert(kTiles <= 8, "32 bits hold 2 rows of 8 n-tiles");
  uint32_t bits = 0;
#pragma unroll 1
  for (int i = 0; i < 2 * kTiles; ++i) {
    bool kept[2];
    keep_pair(dropout, (i < kTiles ? row0 : row1) + 8 * (i % kTiles), kept);
    bits |= (uint32_t(kept[0]) | uint32_t(kept[1]) << 1) << (2 * (i / kTiles * 8 + i % kTiles));
  }
  return bits;
}

__device__ __forceinline__ bool bit(uint32_t bits, int i) { return (bits >> i) & 1u; }

}  // namespace fusedlm::cuda::tc
