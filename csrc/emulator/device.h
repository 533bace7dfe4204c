// What a CUDA kernel sees in the emulation build (kernels/cuda/platform.cuh includes this
// instead of CUDA's headers and ptx.cuh): the function qualifiers, the thread and block
// indices, __syncthreads, the warp shuffle, the math intrinsics the kernels use, the
// bf16/fp16 pair types, and fusedlm::cuda::ptx, the inline-PTX helpers of ptx.cuh with the
// same names and signatures, emulated (runtime.cpp, ptx.cpp).
//
// The kernels are compiled as C++ with ThreadSanitizer's instrumentation, whose hooks
// (every load and store) the emulator implements itself to check each access.
#pragma once
#include <math.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "emulator/types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
// The sm_90a code paths are compiled; they run when the emulator acts as sm_90a.
#define __CUDA_ARCH_FEAT_SM90_ALL 1

namespace c10 {
struct BFloat16;
struct Half;
}  // namespace c10

namespace fusedlm::emu {

dim3 thread_index();
dim3 block_index();
dim3 block_dim();
dim3 grid_dim();
void syncthreads();
[[noreturn]] void trap();
// __shfl_xor_sync on a value of `bytes` bytes: result = value of lane (lane ^ lane_mask).
void shuffle_xor(unsigned mask, const void* value, void* result, int bytes, int lane_mask,
                 int width);
unsigned char* dynamic_shared_memory();
uint32_t shared_address(const void* p);
uint16_t to_bf16(float v);  // round to nearest even
uint16_t to_f16(float v);

// The tensor-core instructions. type: 0 = bf16, 1 = f16.
void cp_async16(void* dst, const void* src, bool valid);
void cp_async_commit();
void cp_async_wait(int pending);
void ldmatrix_x4(uint32_t (&r)[4], uint32_t address, bool trans);
void mma_m16n8k16(int type, float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
void wgmma_fence();
void wgmma_commit();
void wgmma_wait(int pending);
void fence_proxy_async();
// d (+)= A B, m64nNk16: A from registers (a, this thread's fragment) or shared memory
// (a == nullptr: a_descriptor), B from shared memory.
void wgmma(int type, int n, float* d, const uint32_t* a, uint64_t a_descriptor,
           uint64_t b_descriptor, bool b_mn_major, int scale_d);

template <typename T>
constexpr int type_code() {
  static_assert(std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>,
                "tensor-core operands are bf16 or fp16");
  return std::is_same_v<T, c10::BFloat16> ? 0 : 1;
}

}  // namespace fusedlm::emu

#define threadIdx (::fusedlm::emu::thread_index())
#define blockIdx (::fusedlm::emu::block_index())
#define blockDim (::fusedlm::emu::block_dim())
#define gridDim (::fusedlm::emu::grid_dim())

inline void __syncthreads() { ::fusedlm::emu::syncthreads(); }
[[noreturn]] inline void __trap() { ::fusedlm::emu::trap(); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "a 32- or 64-bit value");
  T result;
  ::fusedlm::emu::shuffle_xor(mask, &value, &result, sizeof(T), lane_mask, width);
  return result;
}

inline unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((uint64_t(a) * b) >> 32);
}
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline size_t __cvta_generic_to_shared(const void* p) { return ::fusedlm::emu::shared_address(p); }

// CUDA's integer min and max.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }

// Two 16-bit values in one register, x in the low half.
struct __nv_bfloat162 {
  uint16_t x, y;
};
struct __half2 {
  uint16_t x, y;
};
inline __nv_bfloat162 __floats2bfloat162_rn(float lo, float hi) {
  return {::fusedlm::emu::to_bf16(lo), ::fusedlm::emu::to_bf16(hi)};
}
inline __half2 __floats2half2_rn(float lo, float hi) {
  return {::fusedlm::emu::to_f16(lo), ::fusedlm::emu::to_f16(hi)};
}

// ptx.cuh's helpers, emulated.
namespace fusedlm::cuda::ptx {

inline unsigned char* dynamic_shared_memory() { return emu::dynamic_shared_memory(); }
inline uint32_t smem_address(const void* p) { return emu::shared_address(p); }

inline void cp_async16(void* dst, const void* src, bool valid) { emu::cp_async16(dst, src, valid); }
inline void cp_async_commit() { emu::cp_async_commit(); }
template <int pending>
inline void cp_async_wait() {
  emu::cp_async_wait(pending);
}

inline void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) { emu::ldmatrix_x4(r, address, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  emu::ldmatrix_x4(r, address, true);
}

template <typename T>
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  emu::mma_m16n8k16(emu::type_code<T>(), c, a, b0, b1);
}

inline void wgmma_fence() { emu::wgmma_fence(); }
inline void wgmma_commit() { emu::wgmma_commit(); }
template <int pending>
inline void wgmma_wait() {
  emu::wgmma_wait(pending);
}
inline void fence_proxy_async() { emu::fence_proxy_async(); }

// Register pinning orders compiler accesses around the asynchronous products; the
// emulated products are calls, which the compiler orders already.
template <int kTiles>
inline void wgmma_pin(float (&)[kTiles][4]) {}
template <int kTiles>
inline void wgmma_pin(uint32_t (&)[kTiles][4]) {}

template <typename T, bool kMnMajorB>
inline void wgmma_ss(float (&d)[8][4], uint64_t a, uint64_t b, int scale_d) {
  emu::wgmma(emu::type_code<T>(), 64, &d[0][0], nullptr, a, b, kMnMajorB, scale_d);
}
template <typename T>
inline void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  emu::wgmma(emu::type_code<T>(), 64, &d[0][0], a, 0, b, true, scale_d);
}
template <typename T>
inline void wgmma_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b, int scale_d) {
  emu::wgmma(emu::type_code<T>(), 128, &d[0][0], a, 0, b, true, scale_d);
}

}  // namespace fusedlm::cuda::ptx
