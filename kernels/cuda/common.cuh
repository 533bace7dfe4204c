// What the CUDA kernels share: element types and 16-byte vectors, block reductions,
// the dropout stream, the second stage of the parameter-gradient reductions, and the
// host-side checks and dispatch of their entry points.
//
// Kernels take float32, bfloat16 or float16 and compute in float32. Each is compiled
// twice per type: with N = 16 / sizeof(T) elements per load and store (rows whose
// length and base addresses allow it), and with N = 1 (any shape).
#pragma once
// c10's CUDA headers, not ATen/cuda/CUDAContext.h: that one needs cuBLAS and cuSPARSE
// headers, which the compile check (CUDA toolkit only, CPU PyTorch) does not have.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "checks.h"
#include "common.h"

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

// --- block reductions ---------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Sums each of v[0..K) over the block (blockDim.x a multiple of 32, at most 1024); every
// thread receives the sums. shared holds K * 32 floats. The order of the additions is
// fixed by the block size, so equal inputs give equal sums bit for bit.
template <int K>
__device__ __forceinline__ void block_sum(float (&v)[K], float* shared) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(v[k]);
  __syncthreads();  // the previous call's readers are done with shared
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < K; ++k) shared[k * 32 + warp] = v[k];
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < K; ++k) v[k] = warp_sum(lane < warps ? shared[k * 32 + lane] : 0.0f);
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

// The dropout stream (seed, p); inactive for p == 0.
inline Dropout dropout_stream(const at::Tensor& seed, double p) {
  Dropout d;
  if (p <= 0.0) return d;
  d.seed = seed_value(seed);
  d.threshold = static_cast<uint32_t>(p * 16777216.0);
  d.scale = static_cast<float>(1.0 / (1.0 - p));
  d.active = true;
  return d;
}

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

// --- host side ----------------------------------------------------------------------------

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
}

// Runs f(T{}) for the element type T of `dtype`: float, at::Half or at::BFloat16.
template <typename F>
void dispatch(at::ScalarType dtype, const char* name, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(at::Half{}); break;
    case at::kBFloat16: f(at::BFloat16{}); break;
    default:
      TORCH_CHECK_TYPE(false, "fusedlm's CUDA kernels take float32, bfloat16 or float16; ",
                       name, " is ", dtype);
  }
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether every pointer is null or 16-byte aligned.
template <typename... P>
bool all_aligned16(const P*... p) {
  return ((p == nullptr || aligned16(p)) && ...);
}

template <typename T>
T* ptr(const at::Tensor& t) {
  return t.defined() ? static_cast<T*>(t.data_ptr()) : nullptr;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

inline int multiprocessors() {
  int count = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount,
                                        c10::cuda::current_device()));
  return count;
}

// The most shared memory one block of the current device may ask for.
inline size_t max_shared_memory() {
  int bytes = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        c10::cuda::current_device()));
  return static_cast<size_t>(bytes);
}

// Whether a kernel path with a switch may run: unless the environment variable `setting`
// is "0" (which turns it off, to compare it with the path it replaces at the same shapes).
inline bool path_enabled(const char* setting) {
  const char* value = std::getenv(setting);
  return value == nullptr || std::string_view(value) != "0";
}

// Whether a kernel's Hopper variant (wgmma.cuh) runs: on an sm_90 device, in a build
// with sm_90a code, when path_enabled(setting) (else the mma.sync kernel it replaces).
inline bool hopper_path(const char* setting) {
#if defined(FUSEDLM_SM90A)
  int major = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                        c10::cuda::current_device()));
  return major == 9 && path_enabled(setting);
#else
  (void)setting;
  return false;
#endif
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

// Threads per block of the row kernels; with __launch_bounds__(kRowThreads) each thread
// may use 128 registers, room for its cached vectors without spilling.
constexpr int kRowThreads = 512;

// Threads per block for one row of `vecs` vectors, each thread holding up to `cached` of
// them: at least one warp, one vector a thread up to 128 threads, at most kRowThreads.
inline int row_threads(int64_t vecs, int cached) {
  const int64_t one_each = std::min<int64_t>(ceil_div(vecs, 32) * 32, 128);
  const int64_t spread = ceil_div(ceil_div(vecs, cached), 32) * 32;
  return static_cast<int>(
      std::max<int64_t>(32, std::min<int64_t>(kRowThreads, std::max(one_each, spread))));
}

// The column sums of partial [blocks, cols] (float32), as a new [cols] tensor of dtype:
// the second stage of a parameter gradient. Zeros when there are no blocks.
template <typename T>
at::Tensor sum_partials(const at::Tensor& partial, at::ScalarType dtype) {
  const int64_t blocks = partial.size(0), cols = partial.size(1);
  auto out = at::empty({cols}, partial.options().dtype(dtype));
  if (cols == 0) return out;
  const int threads = 256;
  sum_partials_kernel<T><<<ceil_div(cols, threads), threads, 0, current_stream()>>>(
      partial.data_ptr<float>(), blocks, cols, ptr<T>(out));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace fusedlm::cuda
