// How the CPU backend's files are built, and how a CPU kernel is declared.
//
// csrc/cpu/<op>.cpp is an op's whole CPU backend, compiled in two roles (sources.txt):
// - once per instruction set (group "isa", FUSEDLM_ISA = baseline, avx2 or avx512), with
//   no torch header: its kernels, plain functions on raw pointers, in namespace
//   fusedlm::cpu::<isa>;
// - once with torch (group "host", FUSEDLM_ISA undefined): its entry points, which check
//   and allocate tensors, split the work over ATen's thread pool and call the kernels.
// The part of the file both roles read (its includes and kernel declarations) holds types
// and declarations only. Each kernel is single-threaded over the range it is given, so
// threading stays in ATen's pool.
//
// FUSEDLM_CPU_KERNEL(name, signature) declares a kernel once, for both roles: there is one
// function type `cpu::<name>_fn`, one definition per instruction set (cpu::<isa>::<name>,
// written in the kernel role), and, in the host role, `cpu::<name>(...)`, which calls the
// instruction set picked for this processor (active_isa, csrc/cpu_dispatch.cpp).
#pragma once
#include <cstdint>
#include <utility>

namespace fusedlm::cpu {

// Element types of the tensors a kernel reads and writes. Arithmetic is always
// float32 (float64 for kF64, which exists for gradcheck).
enum class DType : int { kF32, kF64, kBF16, kF16 };

enum class Gelu : int { kErf, kTanh };

// The instruction sets the kernels are built for, in the order of kIsaNames.
enum class Isa : int { kBaseline, kAvx2, kAvx512 };
inline constexpr const char* kIsaNames[] = {"baseline", "avx2", "avx512"};

#ifndef FUSEDLM_ISA
// The instruction set whose kernels run (the best this processor has, unless lowered).
Isa active_isa();
#endif

}  // namespace fusedlm::cpu

#ifdef FUSEDLM_ISA
#define FUSEDLM_CPU_KERNEL(name, ...)   \
  namespace fusedlm::cpu {              \
  using name##_fn = __VA_ARGS__;        \
  namespace FUSEDLM_ISA {               \
  name##_fn name;                       \
  }                                     \
  }
#else
// Only x86-64 builds the avx2 and avx512 kernels; elsewhere every slot holds the baseline's.
#if defined(__x86_64__) || defined(_M_X64)
#define FUSEDLM_CPU_KERNEL_OF(isa, name) &isa::name
#else
#define FUSEDLM_CPU_KERNEL_OF(isa, name) &baseline::name
#endif
#define FUSEDLM_CPU_KERNEL(name, ...)                                                      \
  namespace fusedlm::cpu {                                                                  \
  using name##_fn = __VA_ARGS__;                                                            \
  namespace baseline { name##_fn name; }                                                    \
  namespace avx2 { name##_fn name; }                                                        \
  namespace avx512 { name##_fn name; }                                                      \
  inline name##_fn* const name##_by_isa[] = {FUSEDLM_CPU_KERNEL_OF(baseline, name),        \
                                             FUSEDLM_CPU_KERNEL_OF(avx2, name),            \
                                             FUSEDLM_CPU_KERNEL_OF(avx512, name)};         \
  template <class... Args>                                                                  \
  void name(Args&&... args) {                                                               \
    name##_by_isa[static_cast<int>(active_isa())](std::forward<Args>(args)...);            \
  }                                                                                         \
  }
#endif

// Philox-4x32-10 keep mask: keep[i] = 1 for element (offset + i) with probability 1 - p.
// The same stream every dropout in fusedlm's CPU backend uses (csrc/cpu/dropout.cpp).
FUSEDLM_CPU_KERNEL(dropout_mask, void(uint64_t seed, uint64_t offset, int64_t n, double p,
                                      uint8_t* keep))
