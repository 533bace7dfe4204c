// Every instruction the kernels spell in inline PTX, and the block's dynamic shared
// memory, behind one set of functions: the asynchronous copies (cp.async), the fragment
// loads (ldmatrix), the m16n8k16 matrix product (mma.sync), and Hopper's warpgroup
// products (wgmma) with their fences. tensor_core.cuh and wgmma.cuh build the tile
// loads, fragment layouts and descriptors on top of these.
//
// Only the nvcc build includes this header (platform.cuh); the emulation build gets
// functions of the same names and signatures from emulator/device.h. The wgmma_*
// functions need an sm_90a target (__CUDA_ARCH_FEAT_SM90_ALL), the rest sm_80 or newer.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace fusedlm::cuda::ptx {

// The block's dynamic shared memory (as many bytes as the launch asked for), 16-byte
// aligned.
__device__ __forceinline__ unsigned char* dynamic_shared_memory() {
  extern __shared__ __align__(16) unsigned char dynamic_smem[];
  return dynamic_smem;
}

__device__ __forceinline__ uint32_t smem_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// --- global -> shared ---------------------------------------------------------------------

// 16 bytes from global src to shared dst without passing through registers; when !valid
// the bytes are zeros and src is not read (it must still be a valid address).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_address(dst)),
               "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(pending));
}

// --- shared -> registers ------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// --- the mma.sync product -----------------------------------------------------------------

// c += A B for one 16 x 8 x 16 step. T picks bf16 or fp16 inputs.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// --- the warpgroup products (sm_90a) ------------------------------------------------------

// Orders this thread's register accesses before the warpgroup products that follow.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}

__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

template <int pending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}

// Makes this thread's generic-proxy writes to shared memory (cp.async, plain stores)
// visible to wgmma, which reads through the async proxy.
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Keeps the compiler from moving reads or writes of a product's registers (accumulators,
// A fragments) across the fences and waits around it: this empty asm, volatile like
// them, stays in order with them, and every later access depends on its outputs.
__device__ __forceinline__ void pin_register(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void pin_register(uint32_t& x) { asm volatile("" : "+r"(x)::"memory"); }

// Every register of a product's accumulators (float) or A fragments (uint32_t).
template <int kTiles, typename R>
__device__ __forceinline__ void wgmma_pin(R (&regs)[kTiles][4]) {
#pragma unroll
  for (int i = 0; i < kTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) pin_register(regs[i][e]);
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
template <typename T, bool kMnMajorB>
__device__ __forceinline__ void wgmma_ss(float (&d)[8][4], uint64_t a, uint64_t b, int scale_d) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if constexpr (kMnMajorB) FUSEDLM_WG_SS_N64("bf16", "1");
    else FUSEDLM_WG_SS_N64("bf16", "0");
  } else {
    if constexpr (kMnMajorB) FUSEDLM_WG_SS_N64("f16", "1");
    else FUSEDLM_WG_SS_N64("f16", "0");
  }
}

template <typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b,
                                         int scale_d) {
  if constexpr (std::is_same_v<T, at::BFloat16>)
    FUSEDLM_WG_RS("bf16", "n64", FUSEDLM_WG_R0_31, FUSEDLM_WG_D32(d), "%32, %33, %34, %35",
                  "%36", "%37");
  else
    FUSEDLM_WG_RS("f16", "n64", FUSEDLM_WG_R0_31, FUSEDLM_WG_D32(d), "%32, %33, %34, %35",
                  "%36", "%37");
}

template <typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b,
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

}  // namespace fusedlm::cuda::ptx
