// What the CUDA kernels share on the device side: element types and 16-byte vectors,
// row reductions, the dropout stream, the block's dynamic shared memory, and the
// second stage of the parameter-gradient reductions. Their host side (checks, dispatch,
// launch configuration) is csrc/cuda/common.h.
//
// Kernels take float32, bfloat16 or float16 and compute in float32. Each is compiled
// twice per type: with N = 16 / sizeof(T) elements per load and store (rows whose
// length and base addresses allow it), and with N = 1 (any shape).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "platform.cuh"

namespace fusedlm::cuda {

// --- element types and vectors ------------------------------------------------------------

template <typename T>
constexpr int kVec = 16 / sizeof(T);

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// N elements at p (16-byte aligned when N > 1), as float.
template <int N, typename T>
__device__ __forceinline__ void load(const T* p, float (&out)[N]) {
  const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(p);
#pragma unroll
  for (int i = 0; i < N; ++i) out[i] = static_cast<float>(v.v[i]);
}

// N floats rounded to T at p, in one store.
template <int N, typename T>
__device__ __forceinline__ void store(T* p, const float (&in)[N]) {
  Vec<T, N> v;
#pragma unroll
  for (int i = 0; i < N; ++i) v.v[i] = static_cast<T>(in[i]);
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// in rounded to T and back: the value a tensor of T holds once in is stored.
template <typename T>
__device__ __forceinline__ float rounded(float in) {
  return static_cast<float>(static_cast<T>(in));
}

// --- shared memory ------------------------------------------------------------------------

// The block's dynamic shared memory (the byte count its launch passed), 16-byte aligned:
// every kernel takes its shared memory from here, none declares its own.
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
  return ptx::dynamic_shared_memory();
}

// --- row reductions -----------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sums each of v[0..K) over a group of `group` threads that owns one row: a warp, or
// `group / 32` whole warps (the block is whole groups, at most 32 warps). Every thread of
// the group receives the sums. A warp sums by shuffles alone; wider groups meet in shared
// (K * 32 floats) between two __syncthreads, which every thread of the block must reach.
// The order of the additions is fixed by the group size, so equal inputs give equal sums
// bit for bit.
template <int K>
__device__ __forceinline__ void group_sum(float (&v)[K], float* shared, int group) {
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  if (group == 32) return;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = group / 32;
  const int first = warp / warps * warps;  // the group's first warp
  __syncthreads();  // the previous call's readers are done with shared
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) shared[k * 32 + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(lane < warps ? shared[k * 32 + first + lane] : 0.0f);
}

// --- dropout ------------------------------------------------------------------------------

// Philox-4x32-10 (Salmon et al. 2011), the generator of the cpu backend's dropout
// (csrc/cpu/dropout.cpp): key = seed, counter = element / 4.
__device__ __forceinline__ uint4 philox(uint64_t seed, uint64_t counter) {
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return make_uint4(c0, c1, c2, c3);
}

// A dropout stream: element e is kept when the top 24 bits of word e % 4 of
// philox(seed, e / 4) are >= p * 2^24. That is the cpu backend's stream bit for bit, and
// it depends on the element index alone, never on how the work is split over threads.
struct Dropout {
  uint64_t seed = 0;
  uint32_t threshold = 0;  // p * 2^24
  float scale = 1.0f;      // 1 / (1 - p), the kept elements' factor
  bool active = false;

  // Whether elements e .. e + N - 1 are kept. With N a multiple of 4, e must be too: one
  // Philox call then decides four elements.
  template <int N>
  __device__ __forceinline__ void keep(uint64_t e, bool (&kept)[N]) const {
    if constexpr (N % 4 == 0) {
#pragma unroll
      for (int j = 0; j < N / 4; ++j) {
        const uint4 w = philox(seed, e / 4 + j);
        kept[4 * j] = (w.x >> 8) >= threshold;
        kept[4 * j + 1] = (w.y >> 8) >= threshold;
        kept[4 * j + 2] = (w.z >> 8) >= threshold;
        kept[4 * j + 3] = (w.w >> 8) >= threshold;
      }
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const uint4 w = philox(seed, (e + i) / 4);
        const uint32_t at = (e + i) % 4;  // selects, not an indexed array (local memory)
        const uint32_t word = at == 0 ? w.x : at == 1 ? w.y : at == 2 ? w.z : w.w;
        kept[i] = (word >> 8) >= threshold;
      }
    }
  }

  // v[i] * scale where element e + i is kept, else 0.
  template <int N>
  __device__ __forceinline__ void apply(uint64_t e, float (&v)[N]) const {
    bool kept[N];
    keep(e, kept);
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = kept[i] ? v[i] * scale : 0.0f;
  }
};

// --- the second stage of a deterministic column sum ---------------------------------------

// out[c] = sum over b of partial[b, c], in block order (one thread per column).
template <typename T>
__global__ void sum_partials_kernel(const float* __restrict__ partial, int64_t blocks,
                                    int64_t cols, T* __restrict__ out) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) s += partial[b * cols + c];
  out[c] = static_cast<T>(s);
}

}  // namespace fusedlm::cuda
