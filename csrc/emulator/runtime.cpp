// The CUDA emulator's execution model: the grid's blocks one after another, each block's
// threads as fibers (ucontext) on the launching OS thread, switching only when a thread
// blocks at __syncthreads or at a warp-wide instruction; the thread and block indices;
// per-block shared memory with a shadow byte record for the race checks; and the
// compiler's ThreadSanitizer hooks, through which every load and store of a kernel is
// checked against what that kernel may touch.
#include <dlfcn.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string_view>

#include "emulator/device.h"
#include "emulator/state.h"

namespace fusedlm::emu {

thread_local Grid* grid = nullptr;
thread_local Thread* current = nullptr;

namespace {

constexpr size_t kStackBytes = 256 << 10;
constexpr uint32_t kRedzone = 4096;  // bytes each side of the window: shared overruns land here

struct Arch {
  const char* name;
  int major, multiprocessors;
  size_t shared_memory;
};

constexpr Arch kArches[] = {{"sm_80", 8, 108, 166912}, {"sm_90a", 9, 132, 232448}};

const Arch& arch_named(std::string_view name) {
  for (const Arch& arch : kArches)
    if (name == arch.name) return arch;
  throw std::invalid_argument("the emulated arch must be sm_80 or sm_90a, got '" +
                              std::string(name) + "'");
}

// The GPU acted as: FUSEDLM_EMULATE_ARCH's, read when first asked for, until set_arch.
std::atomic<const Arch*>& arch_setting() {
  static std::atomic<const Arch*> arch{[] {
    const char* value = std::getenv("FUSEDLM_EMULATE_ARCH");
    return &arch_named(value ? value : "sm_80");
  }()};
  return arch;
}

const Arch& emulated_arch() { return *arch_setting().load(); }

// The global memory the current op exposed, per OS thread (each op runs on one), with
// the bytes the running launch has moved to and from it.
struct Exposure {
  uintptr_t lo, hi;
  uint64_t read = 0, written = 0;
};
thread_local std::vector<Exposure> exposures;

// One grid runs at a time (the kernels' static state is the block's); the lock also
// guards the record of count_launches, which every OS thread shares.
std::mutex launches;
bool counting = false;
std::vector<LaunchCount> counts;

// The launch's count: its traffic per exposed storage (an op may expose one twice).
LaunchCount launch_count(const Launch& launch, const Grid& g, const std::string& name) {
  LaunchCount c{name, launch.grid, launch.block, launch.shared_bytes, {}, g.tensor_core_macs};
  for (const Exposure& e : exposures) {
    const void* storage = reinterpret_cast<const void*>(e.lo);
    auto same = std::find_if(c.tensors.begin(), c.tensors.end(),
                             [&](const TensorTraffic& t) { return t.storage == storage; });
    if (same == c.tensors.end())
      c.tensors.push_back({storage, size_t(e.hi - e.lo), e.read, e.written});
    else {
      same->read += e.read;
      same->written += e.written;
    }
  }
  return c;
}

std::string dims(dim3 d) {
  std::ostringstream s;
  s << "(" << d.x << ", " << d.y << ", " << d.z << ")";
  return s.str();
}

// The kernel's name, from the symbol table of the library that holds it.
std::string kernel_name(const void* kernel) {
  Dl_info info{};
  if (!dladdr(kernel, &info) || !info.dli_fname) return "a kernel at " + hex(uintptr_t(kernel));
  const uintptr_t offset = uintptr_t(kernel) - uintptr_t(info.dli_fbase);
  const std::string command =
      "addr2line -f -C -e '" + std::string(info.dli_fname) + "' " + hex(offset) + " 2>/dev/null";
  std::string name;
  if (FILE* pipe = popen(command.c_str(), "r")) {
    char line[4096];
    if (fgets(line, sizeof(line), pipe)) name = line;
    pclose(pipe);
  }
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r')) name.pop_back();
  if (name.empty() || name == "??") return "the kernel at " + std::string(info.dli_fname) + "+" + hex(offset);
  return name;
}

struct StackDeleter {
  void operator()(char* p) const { munmap(p, kStackBytes); }
};

// Fiber stacks, reused from block to block and launch to launch (per OS thread).
thread_local std::vector<std::unique_ptr<char, StackDeleter>> stacks;

char* stack_for(size_t i) {
  while (stacks.size() <= i) {
    void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("the CUDA emulator could not map a thread stack");
    mprotect(p, 4096, PROT_NONE);  // a guard page: an overflow faults instead of corrupting
    stacks.emplace_back(static_cast<char*>(p));
  }
  return stacks[i].get();
}

void yield_to_scheduler(Thread& t) {
  current = nullptr;
  swapcontext(&t.context, &grid->scheduler);
}

void block_current(const char* what) {
  Thread& t = *current;
  t.state = Thread::kBlocked;
  t.waiting_at = what;
  yield_to_scheduler(t);
}

void wake(Block& b, Thread& t) {
  t.state = Thread::kReady;
  t.waiting_at = nullptr;
  b.ready.push_back(&t);
}

void release_barrier(Block& b) {
  ++b.epoch;
  b.at_barrier = 0;
  for (Thread& t : b.threads)
    if (t.at_barrier) {
      t.at_barrier = false;
      if (&t != current) wake(b, t);
    }
}

void thread_main() {
  Thread& t = *current;
  grid->launch->entry(grid->launch->call);
  check_drained(t);
  Block& b = *grid->block;
  t.state = Thread::kDone;
  --b.live;
  // An exited thread no longer holds a barrier back.
  if (b.at_barrier > 0 && b.at_barrier == b.live) release_barrier(b);
  yield_to_scheduler(t);
}

std::string deadlock(const Block& b) {
  std::ostringstream s;
  s << "deadlock: no thread of block " << dims(b.index) << " can go on;";
  int shown = 0;
  for (const Thread& t : b.threads) {
    if (t.state == Thread::kDone) continue;
    if (shown++ == 4) {
      s << " ...";
      break;
    }
    s << " thread " << dims(t.index) << " waits in "
      << (t.at_barrier ? "__syncthreads" : t.waiting_at ? t.waiting_at : "?") << ";";
  }
  int exited = 0;
  for (const Thread& t : b.threads) exited += t.state == Thread::kDone;
  s << " " << exited << " of its " << b.threads.size()
    << " threads have exited (a warp-wide instruction needs every lane of the warp)";
  return s.str();
}

void run_block(Grid& g, Block& b, const Launch& launch) {
  const int n = static_cast<int>(launch.block.x * launch.block.y * launch.block.z);
  b.threads.assign(n, Thread{});
  b.ready.clear();
  b.epoch = 1;
  b.at_barrier = 0;
  b.live = n;
  b.warps.assign((n + 31) / 32, Team{});
  b.warpgroups.assign((n + 127) / 128, Team{});
  // Shared memory starts as NaN bytes (0xFF): a read of what no thread wrote poisons
  // the result instead of passing for zeros.
  std::fill(b.window + kSharedOrigin, b.window + b.window_bytes, uint8_t(0xFF));
  std::fill(b.shadow.begin(), b.shadow.end(), Shadow{});
  for (int i = 0; i < n; ++i) {
    Thread& t = b.threads[i];
    t.linear = i;
    t.index = dim3(i % launch.block.x, i / launch.block.x % launch.block.y,
                   i / (launch.block.x * launch.block.y));
    t.stack = stack_for(i);
    t.stack_lo = uintptr_t(t.stack);
    t.stack_hi = t.stack_lo + kStackBytes;
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = t.stack + 4096;
    t.context.uc_stack.ss_size = kStackBytes - 4096;
    t.context.uc_link = nullptr;
    makecontext(&t.context, thread_main, 0);
    b.ready.push_back(&t);
  }
  while (!b.ready.empty() && !g.failed) {
    Thread* t = b.ready.front();
    b.ready.pop_front();
    current = t;
    swapcontext(&g.scheduler, &t->context);
    current = nullptr;
  }
  if (!g.failed && b.live > 0) {
    g.failed = true;
    g.failure = deadlock(b);
  }
}

}  // namespace

// --- what kernels call ----------------------------------------------------------------------

dim3 thread_index() { return current->index; }
dim3 block_index() { return grid->block->index; }
dim3 block_dim() { return grid->launch->block; }
dim3 grid_dim() { return grid->launch->grid; }

void syncthreads() {
  const InEmulator in_emulator;
  Thread& t = *current;
  Block& b = *grid->block;
  t.at_barrier = true;
  if (++b.at_barrier == b.live) {
    t.at_barrier = false;
    release_barrier(b);
    return;
  }
  block_current("__syncthreads");
}

void trap() { fail("__trap() (the kernel was launched where it must not run)"); }

unsigned char* dynamic_shared_memory() { return grid->block->window + kSharedOrigin; }

uint32_t shared_address(const void* p) {
  const InEmulator in_emulator;
  const Block& b = *grid->block;
  const uintptr_t a = uintptr_t(p), lo = uintptr_t(b.window);
  if (a < lo || a >= lo + b.window_bytes + kRedzone)
    fail("__cvta_generic_to_shared of " + hex(a) + ", which is not in the block's shared memory");
  return static_cast<uint32_t>(a - lo);
}

uint16_t to_bf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

uint16_t to_f16(float v) {
  const _Float16 h = static_cast<_Float16>(v);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

// --- the host side ----------------------------------------------------------------------------

const char* arch_name() { return emulated_arch().name; }
void set_arch(const char* name) { arch_setting() = &arch_named(name); }
int compute_capability_major() { return emulated_arch().major; }
int multiprocessors() { return emulated_arch().multiprocessors; }
size_t max_shared_memory() { return emulated_arch().shared_memory; }

void expose(const void* base, size_t bytes) {
  if (base && bytes) exposures.push_back({uintptr_t(base), uintptr_t(base) + bytes});
}

void end_exposure() { exposures.clear(); }

void count_launches(bool on) {
  const std::lock_guard<std::mutex> lock(launches);
  if (on) counts.clear();
  counting = on;
}

std::vector<LaunchCount> counted_launches() {
  const std::lock_guard<std::mutex> lock(launches);
  return counts;
}

void run(const Launch& launch) {
  const std::lock_guard<std::mutex> lock(launches);
  const Arch& arch = emulated_arch();
  const dim3 g = launch.grid, bd = launch.block;
  const uint64_t threads = uint64_t(bd.x) * bd.y * bd.z;
  auto refuse = [&](const std::string& why) {
    throw std::runtime_error("CUDA emulator (" + std::string(arch.name) + "): launch of " +
                             kernel_name(launch.kernel) + " with grid " + dims(g) + ", block " +
                             dims(bd) + ": " + why);
  };
  if (threads == 0 || threads > 1024) refuse("a block has 1 to 1024 threads");
  if (g.y > 65535 || g.z > 65535 || g.x > 0x7FFFFFFFu) refuse("the grid exceeds CUDA's limits");
  if (launch.shared_bytes > arch.shared_memory)
    refuse("asks for " + std::to_string(launch.shared_bytes) + " bytes of shared memory, more than the " +
           std::to_string(arch.shared_memory) + " a block may have");
  if (uint64_t(g.x) * g.y * g.z == 0) return;
  static const bool trace = std::getenv("FUSEDLM_EMULATE_TRACE") != nullptr;  // read once
  if (trace)  // which kernels run, for coverage
    std::fprintf(stderr, "CUDA emulator (%s): %s grid %s block %s shared %zu\n", arch.name,
                 kernel_name(launch.kernel).c_str(), dims(g).c_str(), dims(bd).c_str(),
                 launch.shared_bytes);

  for (Exposure& e : exposures) e.read = e.written = 0;
  Block block;
  block.window_bytes = kSharedOrigin + static_cast<uint32_t>((launch.shared_bytes + 15) / 16 * 16);
  // The window 1024-byte aligned, so that host and shared addresses agree modulo 1024
  // (the swizzle period): a kernel's alignment of its shared tiles is then tested.
  block.memory.assign(2 * kRedzone + block.window_bytes + 1024, 0);
  const uintptr_t start = uintptr_t(block.memory.data()) + kRedzone;
  block.window = reinterpret_cast<uint8_t*>((start + 1023) / 1024 * 1024);
  block.shadow.assign(block.window_bytes, Shadow{});

  Grid state;
  state.launch = &launch;
  state.arch = arch.name;
  state.sm90 = arch.major == 9;
  state.block = &block;
  struct Running {  // the grid is this OS thread's until the launch returns or throws
    explicit Running(Grid* g) { grid = g; }
    ~Running() {
      grid = nullptr;
      current = nullptr;
    }
  } running(&state);
  for (unsigned z = 0; z < g.z && !state.failed; ++z)
    for (unsigned y = 0; y < g.y && !state.failed; ++y)
      for (unsigned x = 0; x < g.x && !state.failed; ++x) {
        block.index = dim3(x, y, z);
        state.block_number = x + g.x * (y + g.y * z);
        run_block(state, block, launch);
      }
  if (state.failed)
    throw std::runtime_error("CUDA emulator (" + std::string(arch.name) + "): " +
                             kernel_name(launch.kernel) + " with grid " + dims(g) + ", block " +
                             dims(bd) + ": " + state.failure);
  if (counting) counts.push_back(launch_count(launch, state, kernel_name(launch.kernel)));
}

// --- hazards ------------------------------------------------------------------------------------

std::string describe(const Thread& t) {
  return "thread " + dims(t.index) + " of block " + dims(grid->block->index);
}

void fail(const std::string& what) {
  const InEmulator in_emulator;
  Grid& g = *grid;
  if (!g.failed) {
    g.failed = true;
    g.failure = current ? describe(*current) + ": " + what : what;
  }
  if (current) {
    Thread& t = *current;
    t.state = Thread::kBlocked;  // never resumed: the scheduler stops
    yield_to_scheduler(t);
  }
  throw std::runtime_error(g.failure);  // only outside a kernel thread
}

std::string hex(uint64_t v) {
  std::ostringstream s;
  s << "0x" << std::hex << v;
  return s.str();
}

void check_shared(Thread& t, uint32_t address, uint32_t bytes, bool write, const char* by) {
  Block& b = *grid->block;
  const char* kind = write ? "write" : "read";
  if (address < kSharedOrigin || uint64_t(address) + bytes > b.window_bytes)
    fail(std::string("out-of-bounds shared-memory ") + kind + " of " + std::to_string(bytes) +
         " bytes at shared address " + hex(address) + " by " + by + ": the block's shared memory is " +
         hex(kSharedOrigin) + " .. " + hex(b.window_bytes));
  const uint16_t me = static_cast<uint16_t>(t.linear + 1);
  for (uint32_t a = address; a < address + bytes; ++a) {
    Shadow& s = b.shadow[a];
    auto other = [&](uint16_t who) {
      return describe(b.threads[who - 1]);
    };
    if (s.copies_in_flight)
      fail(std::string(by) + " " + kind + "s shared address " + hex(a) +
           " while a cp.async to it is in flight (no cp.async.wait_group covers it)");
    if (write && s.products_reading)
      fail(std::string(by) + " writes shared address " + hex(a) +
           " while a wgmma that reads it is in flight (no wgmma.wait_group covers it)");
    if (s.write_epoch == b.epoch && s.writer != me)
      fail(std::string("shared-memory race at shared address ") + hex(a) + ": " + other(s.writer) +
           " wrote it and " + by + " " + kind + "s it with no __syncthreads between");
    if (write) {
      if (s.read_epoch == b.epoch && s.reader != me)
        fail(std::string("shared-memory race at shared address ") + hex(a) + ": " +
             (s.reader == kManyReaders ? std::string("other threads") : other(s.reader)) +
             " read it and " + by + " writes it with no __syncthreads between");
      s.writer = me;
      s.write_epoch = b.epoch;
      s.writer_fences = t.proxy_fences;
    } else if (s.read_epoch != b.epoch) {
      s.reader = me;
      s.read_epoch = b.epoch;
    } else if (s.reader != me) {
      s.reader = kManyReaders;
    }
  }
}

void meet(bool warpgroup, const char* what, const void* in, void* out, void (*compute)(Team&)) {
  Thread& t = *current;
  Block& b = *grid->block;
  const int size = warpgroup ? 128 : 32;
  if (b.threads.size() % size)
    fail(std::string(what) + " in a block of " + std::to_string(b.threads.size()) +
         " threads: it needs whole " + (warpgroup ? "warpgroups" : "warps"));
  Team& team = (warpgroup ? b.warpgroups : b.warps)[t.linear / size];
  if (team.arrived == 0) {
    team.what = what;
  } else if (std::strcmp(team.what, what) != 0) {
    fail(std::string("lanes of one ") + (warpgroup ? "warpgroup" : "warp") +
         " reached different warp-wide instructions: " + team.what + " and " + what);
  }
  const int lane = t.linear % size;
  team.in[lane] = in;
  team.out[lane] = out;
  if (++team.arrived < size) {
    block_current(what);
    return;
  }
  team.arrived = 0;
  compute(team);
  const int first = t.linear / size * size;
  for (int i = first; i < first + size; ++i)
    if (i != t.linear) wake(b, b.threads[i]);
}

// --- ThreadSanitizer's hooks: every load and store of the instrumented kernels ----------------

namespace {

void check_global_race(const Thread& t, uintptr_t address, size_t bytes, bool write) {
  Grid& g = *grid;
  if (!write && g.global_writes.empty()) return;
  const GlobalWrite me{g.block_number, grid->block->epoch, static_cast<uint16_t>(t.linear + 1)};
  for (uintptr_t a = address; a < address + bytes; ++a) {
    auto [at, first] = g.global_writes.try_emplace(a, me);
    if (first) {
      if (!write) g.global_writes.erase(at);
      continue;
    }
    const GlobalWrite& w = at->second;
    const bool same_thread = w.block == me.block && w.thread == me.thread;
    if (!same_thread && (w.block != me.block || w.epoch == me.epoch)) {
      const Launch& launch = *g.launch;
      const dim3 gd = launch.grid, bd = launch.block;
      const dim3 block(w.block % gd.x, w.block / gd.x % gd.y, w.block / (gd.x * gd.y));
      const dim3 thread((w.thread - 1) % bd.x, (w.thread - 1) / bd.x % bd.y,
                        (w.thread - 1) / (bd.x * bd.y));
      fail(std::string("global-memory race at ") + hex(a) + ": thread " + dims(thread) +
           " of block " + dims(block) + " wrote it and this thread " + (write ? "writes" : "reads") +
           " it in the same launch" +
           (w.block != me.block ? " (blocks run in no particular order)" : " with no __syncthreads between"));
    }
    if (write) at->second = me;
  }
}

}  // namespace

void check_memory(const void* p, size_t bytes, bool write) {
  Thread* t = current;
  if (!t || bytes == 0) return;  // host code
  const InEmulator in_emulator;
  const uintptr_t a = uintptr_t(p);
  if (a >= t->stack_lo && a + bytes <= t->stack_hi) return;  // registers and locals
  Block& b = *grid->block;
  const uintptr_t window = uintptr_t(b.window);
  if (a + bytes > window - kRedzone && a < window + b.window_bytes + kRedzone) {
    if (a < window) fail("out-of-bounds shared-memory access " + std::to_string(window - a) +
                         " bytes before the block's shared memory");
    check_shared(*t, static_cast<uint32_t>(a - window), static_cast<uint32_t>(bytes), write,
                 "this thread");
    return;
  }
  const Launch& launch = *grid->launch;
  const uintptr_t call = uintptr_t(launch.call);
  if (a >= call && a + bytes <= call + launch.call_bytes) {
    if (write) fail("writes the kernel's parameters at " + hex(a));
    return;
  }
  for (Exposure& e : exposures)
    if (a >= e.lo && a + bytes <= e.hi) {
      check_global_race(*t, a, bytes, write);
      (write ? e.written : e.read) += bytes;
      return;
    }
  // Out of bounds: say which tensor it missed, and by how much.
  std::string nearest;
  uintptr_t best = UINTPTR_MAX;
  for (const Exposure& e : exposures) {
    const uintptr_t gap = a >= e.hi ? a - e.hi : a + bytes <= e.lo ? e.lo - a : 0;
    if (gap < best) {
      best = gap;
      nearest = a >= e.hi ? std::to_string(a - e.hi) + " bytes past the end of the " +
                                std::to_string(e.hi - e.lo) + "-byte tensor at " + hex(e.lo)
                          : a < e.lo ? std::to_string(e.lo - a) + " bytes before the tensor at " + hex(e.lo)
                                     : "straddling the end of the " + std::to_string(e.hi - e.lo) +
                                           "-byte tensor at " + hex(e.lo);
    }
  }
  fail(std::string("out-of-bounds global ") + (write ? "write" : "read") + " of " +
       std::to_string(bytes) + " bytes at " + hex(a) +
       (nearest.empty() ? ": the op exposed no tensor" : ": " + nearest));
}

}  // namespace fusedlm::emu

namespace {
// A kernel's own access; the emulator's are its own business.
void check_access(const void* p, size_t bytes, bool write) {
  const fusedlm::emu::Thread* t = fusedlm::emu::current;
  if (t && !t->in_emulator) fusedlm::emu::check_memory(p, bytes, write);
}

// An access the compiler takes as naturally aligned, as the GPU requires (it faults on a
// misaligned one: "misaligned address").
void check_aligned_access(const void* p, size_t bytes, bool write) {
  const fusedlm::emu::Thread* t = fusedlm::emu::current;
  if (!t || t->in_emulator) return;
  if (uintptr_t(p) % bytes) {
    const fusedlm::emu::InEmulator in_emulator;
    fusedlm::emu::fail("misaligned " + std::to_string(bytes) + "-byte " + (write ? "write" : "read") +
                       " at " + fusedlm::emu::hex(uintptr_t(p)) +
                       " (the GPU faults: misaligned address)");
  }
  fusedlm::emu::check_memory(p, bytes, write);
}
}  // namespace

extern "C" {
// Module constructors of instrumented code call this; there is no runtime to start.
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
void __tsan_read_range(void* p, unsigned long n) { check_access(p, n, false); }
void __tsan_write_range(void* p, unsigned long n) { check_access(p, n, true); }

#define FUSEDLM_ACCESS(N)                                                                     \
  void __tsan_read##N(void* p) { check_aligned_access(p, N, false); }                         \
  void __tsan_write##N(void* p) { check_aligned_access(p, N, true); }                         \
  void __tsan_unaligned_read##N(void* p) { check_access(p, N, false); }                       \
  void __tsan_unaligned_write##N(void* p) { check_access(p, N, true); }                       \
  void __tsan_volatile_read##N(void* p) { check_access(p, N, false); }                        \
  void __tsan_volatile_write##N(void* p) { check_access(p, N, true); }                        \
  void __tsan_unaligned_volatile_read##N(void* p) { check_access(p, N, false); }              \
  void __tsan_unaligned_volatile_write##N(void* p) { check_access(p, N, true); }
FUSEDLM_ACCESS(1)
FUSEDLM_ACCESS(2)
FUSEDLM_ACCESS(4)
FUSEDLM_ACCESS(8)
FUSEDLM_ACCESS(16)
#undef FUSEDLM_ACCESS

// Atomics of instrumented host code (reference counts in torch's headers): performed,
// sequentially consistent whatever order was asked for.
#define FUSEDLM_ATOMICS(N, T)                                                                 \
  T __tsan_atomic##N##_load(const volatile T* a, int) { return __atomic_load_n(a, __ATOMIC_SEQ_CST); } \
  void __tsan_atomic##N##_store(volatile T* a, T v, int) { __atomic_store_n(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                    \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                       \
  }                                                                                           \
  T __tsan_atomic##N##_fetch_add(volatile T* a, T v, int) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_sub(volatile T* a, T v, int) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_and(volatile T* a, T v, int) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_or(volatile T* a, T v, int) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }   \
  T __tsan_atomic##N##_fetch_xor(volatile T* a, T v, int) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); } \
  T __tsan_atomic##N##_fetch_nand(volatile T* a, T v, int) { return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST); } \
  int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* expected, T v, int, int) { \
    return __atomic_compare_exchange_n(a, expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                           \
  int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* expected, T v, int, int) {   \
    return __atomic_compare_exchange_n(a, expected, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                           \
  T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T expected, T v, int, int) {       \
    __atomic_compare_exchange_n(a, &expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);  \
    return expected;                                                                          \
  }
FUSEDLM_ATOMICS(8, char)
FUSEDLM_ATOMICS(16, short)
FUSEDLM_ATOMICS(32, int)
FUSEDLM_ATOMICS(64, long)
#undef FUSEDLM_ATOMICS

void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) { __atomic_signal_fence(__ATOMIC_SEQ_CST); }
}
