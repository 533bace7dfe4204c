// The CUDA emulator's warp-wide and asynchronous instructions: __shfl_xor_sync; cp.async
// with its commit and wait groups; ldmatrix and mma.sync; and Hopper's wgmma with its
// fences, commit and wait groups. Their arithmetic and layouts are isa.cpp's; here they
// meet their lanes, check the shared memory they touch, and keep asynchronous work in
// flight until it is waited for:
//   - a cp.async copy lands when its thread waits for its group (cp.async.wait_group),
//     not before: a read of its destination before that is reported, and a missing wait
//     leaves stale bytes behind;
//   - a wgmma product reads shared memory and writes its accumulators when its
//     warpgroup waits for it (wgmma.wait_group): accumulators read earlier are stale,
//     and a write to the shared memory it reads meanwhile is reported. Its operands must
//     have been written before a fence.proxy.async of their writer, and the warpgroup
//     must have executed wgmma.fence since its last wait.
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "emulator/device.h"
#include "emulator/isa.h"
#include "emulator/state.h"

namespace fusedlm::emu {

struct Product {
  isa::Type type;
  int n;
  bool a_from_registers;
  uint32_t a[128][4];
  uint64_t a_descriptor, b_descriptor;
  bool b_mn_major;
  int scale_d;
  float* d[128];
  bool check_accumulators;        // the first in-flight product on these accumulators:
  std::vector<float> accumulators;  // their values at issue, unchanged until its wait
  std::vector<isa::Range> reads;
};

namespace {

Block& block() { return *grid->block; }
Thread& thread_at(const Team& team, bool warpgroup, int lane) {
  Block& b = block();
  const Team* teams = warpgroup ? b.warpgroups.data() : b.warps.data();
  const int first = static_cast<int>(&team - teams) * (warpgroup ? 128 : 32);
  return b.threads[first + lane];
}

isa::Window window() { return {block().window, block().window_bytes}; }

void require_sm90(const char* what) {
  if (!grid->sm90)
    fail(std::string(what) + " needs sm_90a, and the emulated device is " + grid->arch +
         " (set FUSEDLM_EMULATE_ARCH=sm_90a)");
}

// Runs an isa function, turning its complaint about bad operands into a hazard.
template <typename F>
void checked(const char* what, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    fail(std::string(what) + ": " + e.what());
  }
}

// --- shuffle --------------------------------------------------------------------------------

struct ShuffleIn {
  const void* value;
  int bytes, lane_mask, width;
};

void shuffle(Team& team) {
  const auto* first = static_cast<const ShuffleIn*>(team.in[0]);
  for (int lane = 0; lane < 32; ++lane) {
    const auto* in = static_cast<const ShuffleIn*>(team.in[lane]);
    if (in->bytes != first->bytes || in->width != first->width)
      fail("__shfl_xor_sync: the lanes of a warp exchange values of different types or widths");
    int source = lane ^ in->lane_mask;
    if (source / in->width != lane / in->width || source > 31) source = lane;
    std::memcpy(team.out[lane], static_cast<const ShuffleIn*>(team.in[source])->value, in->bytes);
  }
}

// --- ldmatrix and mma.sync -------------------------------------------------------------------

struct LdmatrixIn {
  uint32_t address;
  bool trans;
};

void ldmatrix(Team& team) {
  uint32_t addresses[32], out[32][4];
  const bool trans = static_cast<const LdmatrixIn*>(team.in[0])->trans;
  for (int lane = 0; lane < 32; ++lane)
    addresses[lane] = static_cast<const LdmatrixIn*>(team.in[lane])->address;
  const char* what = trans ? "ldmatrix.x4.trans" : "ldmatrix.x4";
  std::vector<isa::Range> reads;
  checked(what, [&] { reads = isa::ldmatrix_x4_reads(addresses); });
  // Row i is read from the address lane i gave: the read is that lane's.
  for (int lane = 0; lane < 32; ++lane) {
    Thread& t = thread_at(team, false, lane);
    const std::string by = std::string(what) + " (row address of " + describe(t) + ")";
    check_shared(t, reads[lane].address, reads[lane].bytes, false, by.c_str());
  }
  checked(what, [&] { isa::ldmatrix_x4(window(), addresses, trans, out); });
  for (int lane = 0; lane < 32; ++lane) std::memcpy(team.out[lane], out[lane], sizeof(out[lane]));
}

struct MmaIn {
  int type;
  const uint32_t* a;
  uint32_t b0, b1;
};

void mma(Team& team) {
  uint32_t a[32][4], b[32][2];
  float c[32][4];
  const int type = static_cast<const MmaIn*>(team.in[0])->type;
  for (int lane = 0; lane < 32; ++lane) {
    const auto* in = static_cast<const MmaIn*>(team.in[lane]);
    if (in->type != type) fail("mma.sync: lanes of one warp disagree on the operand type");
    std::memcpy(a[lane], in->a, sizeof(a[lane]));
    b[lane][0] = in->b0;
    b[lane][1] = in->b1;
    std::memcpy(c[lane], team.out[lane], sizeof(c[lane]));
  }
  grid->tensor_core_macs += 16 * 8 * 16;
  checked("mma.sync.m16n8k16", [&] {
    isa::mma_m16n8k16(type == 0 ? isa::Type::bf16 : isa::Type::f16, a, b, c);
  });
  for (int lane = 0; lane < 32; ++lane) std::memcpy(team.out[lane], c[lane], sizeof(c[lane]));
}

// --- wgmma -------------------------------------------------------------------------------------

struct WgmmaIn {
  int type, n;
  const uint32_t* a;
  uint64_t a_descriptor, b_descriptor;
  bool b_mn_major;
  int scale_d;
  float* d;
};

bool in_flight(const Team& team, const float* d) {
  for (const Product* p : team.open_products)
    if (p->d[0] == d) return true;
  for (const auto& group : team.committed_products)
    for (const Product* p : group)
      if (p->d[0] == d) return true;
  return false;
}

// Checks the shared bytes a product reads, as its warpgroup issues it.
void check_operand(Team& team, const isa::Range& r) {
  Block& b = block();
  const int group = static_cast<int>(&team - b.warpgroups.data());
  if (r.address < kSharedOrigin || uint64_t(r.address) + r.bytes > b.window_bytes)
    fail("wgmma.mma_async reads shared addresses " + hex(r.address) + " .. " +
         hex(r.address + r.bytes) + ", outside the block's shared memory (" + hex(kSharedOrigin) +
         " .. " + hex(b.window_bytes) + ")");
  for (uint32_t a = r.address; a < r.address + r.bytes; ++a) {
    Shadow& s = block().shadow[a];
    if (s.copies_in_flight)
      fail("wgmma.mma_async reads shared address " + hex(a) +
           " while a cp.async to it is in flight (no cp.async.wait_group covers it)");
    if (s.write_epoch) {
      const Thread& writer = b.threads[s.writer - 1];
      if (s.write_epoch == b.epoch && writer.linear / 128 != group)
        fail("shared-memory race at shared address " + hex(a) + ": " + describe(writer) +
             " wrote it and warpgroup " + std::to_string(group) +
             "'s wgmma.mma_async reads it with no __syncthreads between");
      if (writer.proxy_fences <= s.writer_fences)
        fail("wgmma.mma_async reads shared address " + hex(a) + ", which " + describe(writer) +
             " wrote with no fence.proxy.async after the write (wgmma reads through the async "
             "proxy and may see the old bytes)");
    }
    if (s.products_reading == 255) fail("more than 255 wgmma products in flight on one byte");
    ++s.products_reading;
  }
}

void issue(Team& team) {
  const auto* first = static_cast<const WgmmaIn*>(team.in[0]);
  auto p = std::make_unique<Product>();
  p->type = first->type == 0 ? isa::Type::bf16 : isa::Type::f16;
  p->n = first->n;
  p->a_from_registers = first->a != nullptr;
  p->a_descriptor = first->a_descriptor;
  p->b_descriptor = first->b_descriptor;
  p->b_mn_major = first->b_mn_major;
  p->scale_d = first->scale_d;
  for (int lane = 0; lane < 128; ++lane) {
    const auto* in = static_cast<const WgmmaIn*>(team.in[lane]);
    if (in->type != first->type || in->n != first->n || (in->a != nullptr) != p->a_from_registers ||
        in->a_descriptor != first->a_descriptor || in->b_descriptor != first->b_descriptor ||
        in->b_mn_major != first->b_mn_major || (in->scale_d != 0) != (first->scale_d != 0))
      fail("wgmma.mma_async: the threads of a warpgroup disagree on its shape, descriptors or scale-d");
    if (!thread_at(team, true, lane).wgmma_fenced)
      fail("wgmma.mma_async by " + describe(thread_at(team, true, lane)) +
           " with no wgmma.fence since its last wgmma.wait_group (its registers may not be ready)");
    if (in->a) std::memcpy(p->a[lane], in->a, sizeof(p->a[lane]));
    p->d[lane] = in->d;
  }
  p->check_accumulators = !in_flight(team, p->d[0]);
  if (p->check_accumulators)
    for (int lane = 0; lane < 128; ++lane)
      p->accumulators.insert(p->accumulators.end(), p->d[lane], p->d[lane] + p->n / 2);
  checked("wgmma.mma_async", [&] {
    if (!p->a_from_registers) p->reads = isa::wgmma_reads(p->a_descriptor, false, 64);
    const auto b = isa::wgmma_reads(p->b_descriptor, p->b_mn_major, p->n);
    p->reads.insert(p->reads.end(), b.begin(), b.end());
  });
  for (const isa::Range& r : p->reads) check_operand(team, r);
  grid->tensor_core_macs += uint64_t(64) * p->n * 16;
  team.open_products.push_back(p.release());
}

void complete(Team& team, Product* p) {
  if (p->check_accumulators) {
    size_t at = 0;
    for (int lane = 0; lane < 128; ++lane)
      for (int i = 0; i < p->n / 2; ++i, ++at)
        if (std::memcmp(&p->d[lane][i], &p->accumulators[at], sizeof(float)) != 0)
          fail("the accumulators of an in-flight wgmma were changed by " +
               describe(thread_at(team, true, lane)) + " before its wgmma.wait_group");
  }
  checked("wgmma.mma_async", [&] {
    isa::wgmma(p->type, p->n, p->a_from_registers ? p->a : nullptr, p->a_descriptor,
               p->b_descriptor, p->b_mn_major, p->scale_d, window(), p->d);
  });
  for (const isa::Range& r : p->reads)
    for (uint32_t a = r.address; a < r.address + r.bytes; ++a) --block().shadow[a].products_reading;
  delete p;
}

void commit_products(Team& team) {
  team.committed_products.push_back(std::move(team.open_products));
  team.open_products.clear();
}

void wait_products(Team& team) {
  const int pending = *static_cast<const int*>(team.in[0]);
  for (int lane = 0; lane < 128; ++lane)
    if (*static_cast<const int*>(team.in[lane]) != pending)
      fail("wgmma.wait_group: the threads of a warpgroup wait for different counts");
  while (static_cast<int>(team.committed_products.size()) > pending) {
    for (Product* p : team.committed_products.front()) complete(team, p);
    team.committed_products.pop_front();
  }
  for (int lane = 0; lane < 128; ++lane) thread_at(team, true, lane).wgmma_fenced = false;
}

void land(Thread& t, std::vector<Copy>& copies) {
  Block& b = block();
  for (const Copy& c : copies) {
    if (c.valid) std::memcpy(c.dst, c.src, 16);
    else std::memset(c.dst, 0, 16);
    const uint32_t address = static_cast<uint32_t>(c.dst - b.window);
    for (uint32_t a = address; a < address + 16; ++a) {
      Shadow& s = block().shadow[a];
      --s.copies_in_flight;
      s.writer = static_cast<uint16_t>(t.linear + 1);
      s.write_epoch = b.epoch;
      s.writer_fences = t.proxy_fences;
    }
  }
}

}  // namespace

void shuffle_xor(unsigned mask, const void* value, void* result, int bytes, int lane_mask,
                 int width) {
  const InEmulator in_emulator;
  if (mask != 0xFFFFFFFFu)
    fail("__shfl_xor_sync with mask " + hex(mask) + ": the emulator takes whole warps only");
  if (width <= 0 || width > 32 || (width & (width - 1)))
    fail("__shfl_xor_sync width must be a power of two up to 32, got " + std::to_string(width));
  const ShuffleIn in{value, bytes, lane_mask, width};
  meet(false, "__shfl_xor_sync", &in, result, shuffle);
}

void cp_async16(void* dst, const void* src, bool valid) {
  const InEmulator in_emulator;
  Thread& t = *current;
  Block& b = block();
  const uintptr_t d = uintptr_t(dst), w = uintptr_t(b.window);
  if (d < w || d + 16 > w + b.window_bytes)
    fail("cp.async to " + hex(d) + ", which is not in the block's shared memory");
  if (d % 16 || (valid && uintptr_t(src) % 16))
    fail("cp.async of 16 bytes needs 16-byte aligned addresses, got shared " + hex(d - w) +
         " and global " + hex(uintptr_t(src)));
  const uint32_t address = static_cast<uint32_t>(d - w);
  check_shared(t, address, 16, true, "cp.async");
  if (valid) check_memory(src, 16, false);
  for (uint32_t a = address; a < address + 16; ++a) ++block().shadow[a].copies_in_flight;
  t.open_copies.push_back({static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), valid});
}

void cp_async_commit() {
  const InEmulator in_emulator;
  Thread& t = *current;
  t.committed_copies.push_back(std::move(t.open_copies));
  t.open_copies.clear();
}

void cp_async_wait(int pending) {
  const InEmulator in_emulator;
  Thread& t = *current;
  while (static_cast<int>(t.committed_copies.size()) > pending) {
    land(t, t.committed_copies.front());
    t.committed_copies.pop_front();
  }
}

void ldmatrix_x4(uint32_t (&r)[4], uint32_t address, bool trans) {
  const InEmulator in_emulator;
  const LdmatrixIn in{address, trans};
  meet(false, trans ? "ldmatrix.x4.trans" : "ldmatrix.x4", &in, r, ldmatrix);
}

void mma_m16n8k16(int type, float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const InEmulator in_emulator;
  const MmaIn in{type, a, b0, b1};
  meet(false, "mma.sync.m16n8k16", &in, c, mma);
}

void wgmma_fence() {
  const InEmulator in_emulator;
  require_sm90("wgmma.fence");
  current->wgmma_fenced = true;
}

void fence_proxy_async() {
  const InEmulator in_emulator;
  require_sm90("fence.proxy.async");
  ++current->proxy_fences;
}

void wgmma(int type, int n, float* d, const uint32_t* a, uint64_t a_descriptor,
           uint64_t b_descriptor, bool b_mn_major, int scale_d) {
  const InEmulator in_emulator;
  require_sm90("wgmma.mma_async");
  const WgmmaIn in{type, n, a, a_descriptor, b_descriptor, b_mn_major, scale_d, d};
  meet(true, "wgmma.mma_async", &in, nullptr, issue);
}

void wgmma_commit() {
  const InEmulator in_emulator;
  require_sm90("wgmma.commit_group");
  meet(true, "wgmma.commit_group", nullptr, nullptr, commit_products);
}

void wgmma_wait(int pending) {
  const InEmulator in_emulator;
  require_sm90("wgmma.wait_group");
  meet(true, "wgmma.wait_group", &pending, nullptr, wait_products);
}

void check_drained(Thread& t) {
  const InEmulator in_emulator;
  bool copies = !t.open_copies.empty();
  for (const auto& group : t.committed_copies) copies = copies || !group.empty();
  if (copies)
    fail("exits with cp.async copies in flight: they would land in the shared memory of the "
         "next block on this multiprocessor (wait for them with cp.async.wait_group 0)");
  Block& b = block();
  if (b.warpgroups.empty()) return;
  const Team& team = b.warpgroups[t.linear / 128];
  if (!team.open_products.empty() || !team.committed_products.empty())
    fail("exits with wgmma products in flight (no wgmma.wait_group 0 after them)");
}

}  // namespace fusedlm::emu
