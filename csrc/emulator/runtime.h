// The host side of the CUDA emulator: what csrc/cuda/runtime.h calls in the emulation
// build (FUSEDLM_CUDA=emulate) instead of the CUDA runtime.
//
// A launch runs the whole grid before it returns: block after block, the threads of a
// block as fibers that switch at every barrier and warp-wide instruction (device.h).
// Kernels may touch only their own stack, their block's shared memory, their launch's
// parameters and the memory the op has exposed (the tensors it passed, see expose).
// Anything else, a shared-memory race, or an asynchronous copy or product used before it
// was waited for, stops the launch with a std::runtime_error naming the kernel, the
// block, the thread and the address.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "emulator/types.h"

namespace fusedlm::emu {

// The GPU the emulator acts as: sm_90a (wgmma) or sm_80, from FUSEDLM_EMULATE_ARCH
// (default sm_80), read once per process; set_arch switches it (for the emulator's own
// tests). FUSEDLM_EMULATE_TRACE=1 prints every launch (kernel, grid, block, shared memory)
// to stderr.
const char* arch_name();
void set_arch(const char* name);  // "sm_80" or "sm_90a"; throws std::invalid_argument otherwise
int compute_capability_major();
int multiprocessors();
size_t max_shared_memory();  // per block, as cudaDevAttrMaxSharedMemoryPerBlockOptin

// [base, base + bytes) is global memory the kernels of the current op may access (a
// tensor's storage); end_exposure() ends the op, and with it every exposure.
void expose(const void* base, size_t bytes);
void end_exposure();

// What one launch did, for checking a kernel against its ideal without a GPU: for each
// tensor the op exposed, the bytes its kernels loaded from and stored to it (every access
// as issued, cp.async copies included, before any cache: a re-read counts again), and
// the multiply-adds its tensor-core instructions issued (an m16n8k16 counts 2048, an
// m64nNk16 wgmma 1024 N).
struct TensorTraffic {
  const void* storage;  // the exposed tensor's storage, as exposed
  size_t bytes;
  uint64_t read = 0, written = 0;
};
struct LaunchCount {
  std::string kernel;
  dim3 grid, block;
  size_t shared_bytes = 0;
  std::vector<TensorTraffic> tensors;
  uint64_t tensor_core_macs = 0;
};

// count_launches(true) clears the record and counts every later launch, on any thread,
// until count_launches(false); counted_launches() is the record, oldest first.
void count_launches(bool on);
std::vector<LaunchCount> counted_launches();

struct Launch {
  const void* kernel;  // for the name in reports
  dim3 grid, block;
  size_t shared_bytes;    // dynamic shared memory of each block
  void (*entry)(void*);   // runs the kernel on one thread, with
  void* call;             // its parameters: read-only to the kernel
  size_t call_bytes;
};

// Runs every block of the grid; throws std::runtime_error on a hazard or a bad launch.
void run(const Launch& launch);

// kernel<<<grid, block, shared_bytes>>>(args...), run to completion.
template <typename... P, typename... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t shared_bytes, A&&... args) {
  struct Call {
    void (*kernel)(P...);
    std::tuple<std::decay_t<P>...> params;
  };
  Call call{kernel, std::tuple<std::decay_t<P>...>(
                        static_cast<std::decay_t<P>>(std::forward<A>(args))...)};
  auto entry = [](void* c) {
    auto* self = static_cast<Call*>(c);
    std::apply(self->kernel, self->params);
  };
  run({reinterpret_cast<const void*>(kernel), grid, block, shared_bytes, entry, &call,
       sizeof(call)});
}

}  // namespace fusedlm::emu
