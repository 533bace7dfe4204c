// The emulator's execution model and hazard checks, on small kernels written as the
// CUDA kernels are (device.h), each correct kernel beside a broken twin that the
// emulator must catch: a missing __syncthreads, a missing cp.async wait, out-of-bounds
// stores, a wrong swizzle, a missing fence, lanes that leave a warp-wide instruction.
// This file is compiled with ThreadSanitizer's instrumentation, as the kernels are.
#include <cstring>
#include <vector>

#include "emulator/device.h"
#include "emulator/runtime.h"
#include "harness.h"

namespace {

using namespace fusedlm::cuda;
namespace emu = fusedlm::emu;

// Runs f with the emulator acting as `arch`, then ends the op's exposures.
template <typename F>
void on(const char* arch, F&& f) {
  emu::set_arch(arch);
  try {
    f();
  } catch (...) {
    emu::end_exposure();
    throw;
  }
  emu::end_exposure();
}

template <typename T>
T* exposed(std::vector<T>& v) {
  emu::expose(v.data(), v.size() * sizeof(T));
  return v.data();
}

// --- indices, barriers, shared memory --------------------------------------------------------

void write_indices(int* out) {
  const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const int thread = threadIdx.x + blockDim.x * threadIdx.y;
  out[block * blockDim.x * blockDim.y + thread] = block * 1000 + thread;
}

EMU_TEST(runtime_indices) {
  std::vector<int> out(3 * 2 * 2 * 8 * 4, -1);
  on("sm_80", [&] { emu::launch(write_indices, dim3(3, 2, 2), dim3(8, 4), 0, exposed(out)); });
  for (int i = 0; i < static_cast<int>(out.size()); ++i)
    EMU_CHECK(out[i] == i / 32 * 1000 + i % 32, "element ", i, " is ", out[i]);
}

// out = in reversed within each block, through shared memory.
void reverse(const float* in, float* out, bool sync) {
  float* tile = reinterpret_cast<float*>(ptx::dynamic_shared_memory());
  const int n = blockDim.x, i = threadIdx.x, base = blockIdx.x * n;
  tile[i] = in[base + i];
  if (sync) __syncthreads();
  out[base + i] = tile[n - 1 - i];
}

EMU_TEST(runtime_syncthreads) {
  std::vector<float> in(4 * 64), out(in.size());
  for (size_t i = 0; i < in.size(); ++i) in[i] = float(i);
  on("sm_80", [&] {
    emu::launch(reverse, dim3(4), dim3(64), 64 * sizeof(float), exposed(in), exposed(out), true);
  });
  for (int i = 0; i < 256; ++i) EMU_CHECK(out[i] == float(i / 64 * 64 + 63 - i % 64), "element ", i);
}

EMU_TEST(runtime_missing_syncthreads_is_a_race) {
  std::vector<float> in(64), out(64);
  EMU_CHECK_THROWS(on("sm_80", [&] {
                     emu::launch(reverse, dim3(1), dim3(64), 64 * sizeof(float), exposed(in),
                                 exposed(out), false);
                   }),
                   "shared-memory race");
}

void store_at(float* out, int at) { if (threadIdx.x == 0) out[at] = 1.0f; }

EMU_TEST(runtime_out_of_bounds_global_store) {
  std::vector<float> out(16);
  on("sm_80", [&] { emu::launch(store_at, dim3(1), dim3(32), 0, exposed(out), 15); });
  EMU_CHECK_THROWS(on("sm_80", [&] { emu::launch(store_at, dim3(1), dim3(32), 0, exposed(out), 16); }),
                   "out-of-bounds global write of 4 bytes");
  EMU_CHECK_THROWS(on("sm_80", [&] { emu::launch(store_at, dim3(1), dim3(32), 0, exposed(out), -1); }),
                   "out-of-bounds global write");
}

void store_shared_at(int at) {
  if (threadIdx.x == 0) reinterpret_cast<float*>(ptx::dynamic_shared_memory())[at] = 1.0f;
}

EMU_TEST(runtime_out_of_bounds_shared_store) {
  on("sm_80", [&] { emu::launch(store_shared_at, dim3(1), dim3(32), 256, 63); });
  EMU_CHECK_THROWS(on("sm_80", [&] { emu::launch(store_shared_at, dim3(1), dim3(32), 256, 64); }),
                   "out-of-bounds shared-memory write");
}

struct alignas(16) Four {
  float v[4];
};

void load_four(const float* in, float* out, int offset) {
  const Four f = *reinterpret_cast<const Four*>(in + offset);
  out[threadIdx.x] = f.v[threadIdx.x % 4];
}

EMU_TEST(runtime_misaligned_vector_load) {
  std::vector<float> in(16, 1.0f), out(32);
  on("sm_80", [&] { emu::launch(load_four, dim3(1), dim3(32), 0, exposed(in), exposed(out), 4); });
  EMU_CHECK_THROWS(on("sm_80", [&] {
                     emu::launch(load_four, dim3(1), dim3(32), 0, exposed(in), exposed(out), 1);
                   }),
                   "misaligned");
}

// Each block adds its index into out[0] (a race between blocks), or writes its own slot.
void accumulate(float* out, bool own_slot) {
  if (threadIdx.x == 0) out[own_slot ? blockIdx.x : 0] += float(blockIdx.x);
}

EMU_TEST(runtime_global_race_between_blocks) {
  std::vector<float> out(4);
  on("sm_80", [&] { emu::launch(accumulate, dim3(4), dim3(32), 0, exposed(out), true); });
  EMU_CHECK_THROWS(on("sm_80", [&] { emu::launch(accumulate, dim3(4), dim3(32), 0, exposed(out), false); }),
                   "global-memory race");
}

void too_much_shared() {}

EMU_TEST(runtime_launch_limits) {
  EMU_CHECK_THROWS(on("sm_80", [&] { emu::launch(too_much_shared, dim3(1), dim3(32), 200 * 1024); }),
                   "bytes of shared memory");
  on("sm_90a", [&] { emu::launch(too_much_shared, dim3(1), dim3(32), 200 * 1024); });
  EMU_CHECK_THROWS(on("sm_80", [&] { emu::launch(too_much_shared, dim3(1), dim3(2048), 0); }),
                   "1 to 1024 threads");
}

// --- warp-wide instructions ------------------------------------------------------------------

void warp_sums(const float* in, float* out, int leave) {
  if (int(threadIdx.x % 32) < leave) return;
  float v = in[threadIdx.x];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  out[threadIdx.x] = v;
}

EMU_TEST(runtime_shuffle) {
  std::vector<float> in(64), out(64);
  for (int i = 0; i < 64; ++i) in[i] = float(i);
  on("sm_80", [&] { emu::launch(warp_sums, dim3(1), dim3(64), 0, exposed(in), exposed(out), 0); });
  for (int i = 0; i < 64; ++i) EMU_CHECK(out[i] == (i < 32 ? 496.0f : 1520.0f), "lane ", i, ": ", out[i]);
}

EMU_TEST(runtime_lanes_leaving_a_warp_instruction_deadlock) {
  std::vector<float> in(32), out(32);
  EMU_CHECK_THROWS(on("sm_80", [&] {
                     emu::launch(warp_sums, dim3(1), dim3(32), 0, exposed(in), exposed(out), 1);
                   }),
                   "deadlock");
}

// --- cp.async ----------------------------------------------------------------------------------

// Each thread copies 16 bytes of a row into shared memory, and another thread reads them.
void copy_rows(const float* in, float* out, bool wait, bool drain) {
  float* tile = reinterpret_cast<float*>(ptx::dynamic_shared_memory());
  const int t = threadIdx.x;
  ptx::cp_async16(tile + 4 * t, in + 4 * t, true);
  ptx::cp_async_commit();
  if (wait) ptx::cp_async_wait<0>();
  __syncthreads();
  const int other = (t + 1) % blockDim.x;
  if (wait || !drain)
    for (int e = 0; e < 4; ++e) out[4 * t + e] = tile[4 * other + e];
  if (drain) ptx::cp_async_wait<0>();
}

EMU_TEST(runtime_cp_async) {
  std::vector<float> in(4 * 64), out(in.size());
  for (size_t i = 0; i < in.size(); ++i) in[i] = float(i);
  on("sm_80", [&] {
    emu::launch(copy_rows, dim3(1), dim3(64), in.size() * 4, exposed(in), exposed(out), true, true);
  });
  for (int i = 0; i < 256; ++i) EMU_CHECK(out[i] == in[(i + 4) % 256], "element ", i);
}

EMU_TEST(runtime_missing_cp_async_wait) {
  std::vector<float> in(4 * 64), out(in.size());
  EMU_CHECK_THROWS(on("sm_80", [&] {
                     emu::launch(copy_rows, dim3(1), dim3(64), in.size() * 4, exposed(in),
                                 exposed(out), false, false);
                   }),
                   "while a cp.async to it is in flight");
}

EMU_TEST(runtime_cp_async_outliving_its_thread) {
  std::vector<float> in(4 * 64), out(in.size());
  // Not read and never waited for: the copies would land in the next block's memory.
  EMU_CHECK_THROWS(on("sm_80", [&] {
                     emu::launch(copy_rows, dim3(1), dim3(64), in.size() * 4, exposed(in),
                                 exposed(out), false, /*drain=*/false);
                   }),
                   "in flight");
}

EMU_TEST(runtime_cp_async_out_of_bounds_source) {
  std::vector<float> in(4 * 63), out(4 * 64);  // one row short
  EMU_CHECK_THROWS(on("sm_80", [&] {
                     emu::launch(copy_rows, dim3(1), dim3(64), out.size() * 4, exposed(in),
                                 exposed(out), true, true);
                   }),
                   "out-of-bounds global read of 16 bytes");
}

// --- ldmatrix and mma.sync: one 16 x 8 x 16 product --------------------------------------------

// C = A B^T with A [16][16] and B [8][16] (bf16 bits) through shared memory, one warp.
void small_product(const uint16_t* a, const uint16_t* b, float* c) {
  uint16_t* ta = reinterpret_cast<uint16_t*>(ptx::dynamic_shared_memory());  // [16][24]
  uint16_t* tb = ta + 16 * 24;                                              // [16][24], rows 8.. unused
  const int lane = threadIdx.x;
  for (int i = lane; i < 16 * 16; i += 32) ta[i / 16 * 24 + i % 16] = a[i];
  for (int i = lane; i < 16 * 16; i += 32) tb[i / 16 * 24 + i % 16] = i < 8 * 16 ? b[i] : 0;
  __syncthreads();
  uint32_t fa[4], fb[4];
  ptx::ldmatrix_x4(fa, ptx::smem_address(ta + (lane % 16) * 24 + (lane / 16) * 8));
  ptx::ldmatrix_x4(fb, ptx::smem_address(tb + ((lane / 16) * 8 + lane % 8) * 24 + ((lane / 8) % 2) * 8));
  float acc[4] = {};
  ptx::mma_m16n8k16<c10::BFloat16>(acc, fa, fb[0], fb[1]);
  const int g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) c[(g + 8 * (e / 2)) * 8 + 2 * t + e % 2] = acc[e];
}

float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

EMU_TEST(runtime_ldmatrix_mma_product) {
  std::vector<uint16_t> a(16 * 16), b(8 * 16);
  for (size_t i = 0; i < a.size(); ++i) a[i] = emu::to_bf16(float(int(i * 7 % 13) - 6) / 4);
  for (size_t i = 0; i < b.size(); ++i) b[i] = emu::to_bf16(float(int(i * 5 % 11) - 5) / 2);
  std::vector<float> c(16 * 8);
  on("sm_80", [&] {
    emu::launch(small_product, dim3(1), dim3(32), 2 * 16 * 24 * 2, exposed(a), exposed(b), exposed(c));
  });
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      double want = 0;
      for (int k = 0; k < 16; ++k) want += double(bf16_value(a[m * 16 + k])) * bf16_value(b[n * 16 + k]);
      EMU_CHECK(c[m * 8 + n] == float(want), "C[", m, "][", n, "] = ", c[m * 8 + n], ", want ", want);
    }
}

// --- counting: the bytes each launch moves per tensor, and its products --------------------------

EMU_TEST(runtime_counts_traffic_and_products) {
  std::vector<float> in(4 * 64), out(in.size());
  std::vector<uint16_t> a(16 * 16), b(8 * 16);
  std::vector<float> c(16 * 8);
  emu::count_launches(true);
  on("sm_80", [&] {
    // Each thread copies 16 bytes in (cp.async) and writes 16 out: every byte once.
    emu::launch(copy_rows, dim3(1), dim3(64), in.size() * 4, exposed(in), exposed(out), true, true);
  });
  on("sm_80", [&] {
    emu::launch(small_product, dim3(1), dim3(32), 2 * 16 * 24 * 2, exposed(a), exposed(b), exposed(c));
  });
  emu::count_launches(false);
  const std::vector<emu::LaunchCount> counts = emu::counted_launches();
  EMU_CHECK(counts.size() == 2, counts.size(), " launches counted, want 2");
  if (counts.size() != 2) return;
  auto traffic = [](const emu::LaunchCount& launch, const void* storage) {
    for (const emu::TensorTraffic& t : launch.tensors)
      if (t.storage == storage) return t;
    return emu::TensorTraffic{storage, 0};
  };
  const emu::TensorTraffic copied = traffic(counts[0], in.data()), stored = traffic(counts[0], out.data());
  EMU_CHECK(copied.read == in.size() * 4 && copied.written == 0, "in: read ", copied.read, " written ",
            copied.written);
  EMU_CHECK(stored.read == 0 && stored.written == out.size() * 4, "out: read ", stored.read,
            " written ", stored.written);
  EMU_CHECK(counts[0].tensor_core_macs == 0, counts[0].tensor_core_macs, " products in a copy");
  EMU_CHECK(counts[1].tensor_core_macs == 16 * 8 * 16, counts[1].tensor_core_macs,
            " multiply-adds, want one m16n8k16");
  EMU_CHECK(traffic(counts[1], a.data()).read == a.size() * 2, "A read ", traffic(counts[1], a.data()).read);
  EMU_CHECK(counts[1].block.x == 32 && counts[1].grid.x == 1, "the launch shape");
  // Counting off, nothing more is recorded.
  on("sm_80", [&] {
    emu::launch(copy_rows, dim3(1), dim3(64), in.size() * 4, exposed(in), exposed(out), true, true);
  });
  EMU_CHECK(emu::counted_launches().size() == 2, "counted while off");
}

// --- wgmma: D = A B^T, m64n64k16, A and B K-major in 128-byte-swizzled shared tiles ------------

enum class Mistake { none, unswizzled_store, no_proxy_fence, no_wgmma_fence, no_wait, late_wait };

uint64_t descriptor_of(uint32_t address) {
  // Start address, leading byte offset 16 (unused for a swizzled K-major operand),
  // stride byte offset 1024 (8-row groups), 128-byte swizzle.
  return uint64_t((address >> 4) & 0x3FFF) | uint64_t(16 >> 4) << 16 | uint64_t(1024 >> 4) << 32 |
         uint64_t(1) << 62;
}

void swizzled_product(const uint16_t* a, const uint16_t* b, float* out, Mistake mistake) {
  unsigned char* smem = ptx::dynamic_shared_memory();
  const uint32_t pad = (1024 - ptx::smem_address(smem) % 1024) % 1024;
  uint16_t* ta = reinterpret_cast<uint16_t*>(smem + pad);  // [64 rows][64 columns], swizzled
  uint16_t* tb = ta + 64 * 64;
  for (int i = threadIdx.x; i < 64 * 8; i += 128) {  // 16-byte chunk c of row r
    const int r = i / 8, c = i % 8;
    const int at = mistake == Mistake::unswizzled_store ? c : c ^ (r % 8);
    for (int e = 0; e < 8; ++e) {
      ta[r * 64 + at * 8 + e] = c < 2 ? a[r * 16 + c * 8 + e] : 0;
      tb[r * 64 + at * 8 + e] = c < 2 ? b[r * 16 + c * 8 + e] : 0;
    }
  }
  if (mistake != Mistake::no_proxy_fence) ptx::fence_proxy_async();
  __syncthreads();
  float d[8][4];
  for (auto& tile : d)
    for (float& v : tile) v = -1.0f;
  if (mistake != Mistake::no_wgmma_fence) ptx::wgmma_fence();
  ptx::wgmma_ss<c10::BFloat16, false>(d, descriptor_of(ptx::smem_address(ta)),
                                      descriptor_of(ptx::smem_address(tb)), 0);
  ptx::wgmma_commit();
  if (mistake != Mistake::no_wait && mistake != Mistake::late_wait) ptx::wgmma_wait<0>();
  const int t = threadIdx.x, w = t / 32, g = t % 32 / 4, q = t % 4;
  for (int nt = 0; nt < 8; ++nt)
    for (int e = 0; e < 4; ++e) out[(16 * w + g + 8 * (e / 2)) * 64 + 8 * nt + 2 * q + e % 2] = d[nt][e];
  if (mistake == Mistake::late_wait) ptx::wgmma_wait<0>();
}

struct Operands {
  std::vector<uint16_t> a, b;
  std::vector<float> want;
  Operands() : a(64 * 16), b(64 * 16), want(64 * 64) {
    for (size_t i = 0; i < a.size(); ++i) a[i] = emu::to_bf16(float(int(i * 7 % 17) - 8) / 8);
    for (size_t i = 0; i < b.size(); ++i) b[i] = emu::to_bf16(float(int(i * 3 % 19) - 9) / 4);
    for (int m = 0; m < 64; ++m)
      for (int n = 0; n < 64; ++n) {
        double s = 0;
        for (int k = 0; k < 16; ++k) s += double(bf16_value(a[m * 16 + k])) * bf16_value(b[n * 16 + k]);
        want[m * 64 + n] = float(s);
      }
  }
};

int mismatches(const std::vector<float>& got, const std::vector<float>& want) {
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) bad += got[i] != want[i];
  return bad;
}

constexpr size_t kProductShared = 2 * 64 * 64 * 2 + 1024;

// swizzled_product of x's operands into out, made with `mistake`, on `arch`.
void run_product(Operands& x, std::vector<float>& out, Mistake mistake, const char* arch = "sm_90a") {
  on(arch, [&] {
    emu::launch(swizzled_product, dim3(1), dim3(128), kProductShared, exposed(x.a), exposed(x.b),
                exposed(out), mistake);
  });
}

EMU_TEST(runtime_wgmma_product) {
  Operands x;
  std::vector<float> out(64 * 64);
  run_product(x, out, Mistake::none);
  EMU_CHECK(mismatches(out, x.want) == 0, mismatches(out, x.want), " of 4096 elements differ");
}

EMU_TEST(runtime_wgmma_wrong_swizzle_gives_a_wrong_answer) {
  Operands x;
  std::vector<float> out(64 * 64);
  run_product(x, out, Mistake::unswizzled_store);
  EMU_CHECK(mismatches(out, x.want) > 1000, "only ", mismatches(out, x.want), " elements differ");
}

EMU_TEST(runtime_wgmma_result_lands_at_its_wait) {
  Operands x;
  std::vector<float> out(64 * 64);
  run_product(x, out, Mistake::late_wait);
  int stale = 0;
  for (float v : out) stale += v == -1.0f;
  EMU_CHECK(stale == 64 * 64, "accumulators read before the wait held ", 64 * 64 - stale, " results");
}

EMU_TEST(runtime_wgmma_hazards) {
  Operands x;
  std::vector<float> out(64 * 64);
  auto run = [&](Mistake m, const char* arch) { run_product(x, out, m, arch); };
  EMU_CHECK_THROWS(run(Mistake::no_proxy_fence, "sm_90a"), "no fence.proxy.async");
  EMU_CHECK_THROWS(run(Mistake::no_wgmma_fence, "sm_90a"), "no wgmma.fence");
  EMU_CHECK_THROWS(run(Mistake::no_wait, "sm_90a"), "wgmma products in flight");
  EMU_CHECK_THROWS(run(Mistake::none, "sm_80"), "needs sm_90a");
}

}  // namespace
