// The emulator's state while a grid runs, shared by runtime.cpp (fibers, barriers,
// memory checks) and instructions.cpp (warp-wide and asynchronous instructions).
// Internal: kernels see device.h, host code runtime.h.
#pragma once
#include <ucontext.h>

#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <vector>

#include "emulator/runtime.h"

namespace fusedlm::emu {

// Shared address of a block's dynamic shared memory: 16-byte aligned as CUDA promises,
// deliberately not 128-byte aligned, so that a kernel which needs more aligns it itself.
constexpr uint32_t kSharedOrigin = 0x410;

// What the emulator knows of one byte of shared memory.
struct Shadow {
  uint32_t write_epoch = 0, read_epoch = 0;  // barrier intervals of the last write and reads
  uint32_t writer_fences = 0;  // the writer's fence.proxy.async count when it wrote
  uint16_t writer = 0, reader = 0;  // thread + 1; reader kManyReaders: more than one
  uint8_t copies_in_flight = 0;     // cp.async copies to it not yet waited for
  uint8_t products_reading = 0;     // wgmma products reading it not yet waited for
};
constexpr uint16_t kManyReaders = 0xFFFF;

struct Copy {  // one cp.async: 16 bytes from src (zeros when !valid) to dst
  uint8_t* dst;
  const uint8_t* src;
  bool valid;
};

struct Thread {
  ucontext_t context;
  char* stack = nullptr;
  uintptr_t stack_lo = 0, stack_hi = 0;
  dim3 index;
  int linear = 0;
  enum { kReady, kBlocked, kDone } state = kReady;
  bool at_barrier = false;
  const char* waiting_at = nullptr;  // the instruction it is blocked in
  std::vector<Copy> open_copies;                  // cp.async since the last commit
  std::deque<std::vector<Copy>> committed_copies;  // oldest first
  uint32_t proxy_fences = 0;  // fence.proxy.async executed
  bool wgmma_fenced = false;  // wgmma.fence since the last wgmma.wait_group
  bool in_emulator = false;   // running the emulator's own code: its accesses go unchecked
};

struct Product;  // one wgmma (instructions.cpp)

// The lanes of a warp, or the warps of a warpgroup, meeting at one instruction.
struct Team {
  int arrived = 0;
  const char* what = nullptr;
  const void* in[128] = {};
  void* out[128] = {};
  // Warpgroups: wgmma products issued and not yet committed, and committed groups.
  std::vector<Product*> open_products;
  std::deque<std::vector<Product*>> committed_products;
};

struct Block {
  dim3 index;
  std::vector<Thread> threads;
  std::vector<uint8_t> memory;  // redzone, the shared window, redzone
  uint8_t* window = nullptr;    // shared address a is window[a]
  uint32_t window_bytes = 0;    // kSharedOrigin + the dynamic shared memory
  std::vector<Shadow> shadow;   // per byte of the window
  uint32_t epoch = 1;           // barrier intervals so far
  int live = 0, at_barrier = 0;
  std::vector<Team> warps, warpgroups;
  std::deque<Thread*> ready;
};

// The last write of a byte of global memory in this launch.
struct GlobalWrite {
  uint32_t block;  // linear block index
  uint32_t epoch;  // its barrier interval
  uint16_t thread;
};

struct Grid {
  const Launch* launch = nullptr;
  const char* arch = nullptr;  // the GPU acted as, read once per launch
  bool sm90 = false;           // whether it has wgmma
  Block* block = nullptr;
  uint32_t block_number = 0;  // linear index of the running block
  // Blocks are unordered: a global byte one thread writes, no other block may read or
  // write in the same launch, nor another thread of its block in the same interval.
  std::unordered_map<uintptr_t, GlobalWrite> global_writes;
  uint64_t tensor_core_macs = 0;  // issued so far (for LaunchCount)
  ucontext_t scheduler;
  bool failed = false;
  std::string failure;
};

extern thread_local Grid* grid;       // while a grid runs on this OS thread
extern thread_local Thread* current;  // the running kernel thread, else null

// Marks the current kernel thread as running the emulator's code for the guard's scope.
// The emulator is compiled without instrumentation, but the library templates it calls
// (std::string, std::vector) may be the instrumented copies the kernels instantiated.
class InEmulator {
 public:
  InEmulator() : thread_(current), saved_(thread_ && thread_->in_emulator) {
    if (thread_) thread_->in_emulator = true;
  }
  ~InEmulator() {
    if (thread_) thread_->in_emulator = saved_;
  }
  InEmulator(const InEmulator&) = delete;
  InEmulator& operator=(const InEmulator&) = delete;

 private:
  Thread* thread_;
  bool saved_;
};

// Stops the grid: the launch throws `what`, with the current thread and block.
[[noreturn]] void fail(const std::string& what);
std::string describe(const Thread& t);  // "thread (x, y, z) of block (x, y, z)"

// Blocks the current thread until the rest of its team (32 lanes of its warp, or 128
// threads of its warpgroup) arrives at `what`; the last one to arrive runs compute(team)
// on everyone's in/out, then all go on.
void meet(bool warpgroup, const char* what, const void* in, void* out, void (*compute)(Team&));

// Checks an access by `t` to shared bytes [address, address + bytes) of the block, and
// records it for the race checks. `by` names the access in reports.
void check_shared(Thread& t, uint32_t address, uint32_t bytes, bool write, const char* by);

std::string hex(uint64_t v);  // "0x1f"

// Checks an access by the current kernel thread to [p, p + bytes) of any memory: its
// stack, its block's shared memory, its launch's parameters or an exposed tensor.
void check_memory(const void* p, size_t bytes, bool write);

// At thread exit: no copy or product of it may still be in flight.
void check_drained(Thread& t);

}  // namespace fusedlm::emu
