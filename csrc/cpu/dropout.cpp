// Dropout keep masks from a counter-based generator (Philox-4x32-10, Salmon et al. 2011).
//
// Element e of a dropout stream is decided by word e % 4 of philox(key = seed,
// counter = e / 4), so any element can be regenerated from (seed, offset) alone:
// a backward pass or a test rebuilds exactly the mask the forward used.
//
// dropout_mask, the entry point, materialises the stream as a keep mask for tests and for
// the reference backend, which replay it.
#include "kernel.h"  // declares the dropout_mask kernel, which other ops' kernels use

#ifdef FUSEDLM_ISA
#include <algorithm>

#include "math.h"
#else
#include "bind.h"
#include "common.h"
#endif

#ifdef FUSEDLM_ISA

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

// Counters drawn together: the rounds run across them, so that the loop over counters
// vectorises (128 elements a block).
constexpr int kCounters = 32;

// words[4 * j + w] = word w of philox(key = seed, counter = first + j), j < kCounters.
// The state words are 32-bit values held in 64-bit lanes, where the round's 32 x 32 -> 64
// bit products are plain vector multiplies. The inner loop is kept rolled: unrolled
// into straight-line code, GCC vectorises neither it nor the rounds.
void philox_block(uint64_t seed, uint64_t first, uint32_t* words) {
  constexpr uint64_t kLow = 0xFFFFFFFFu;
  uint64_t c0[kCounters], c1[kCounters], c2[kCounters], c3[kCounters];
  for (int j = 0; j < kCounters; ++j) {
    const uint64_t counter = first + uint64_t(j);
    c0[j] = counter & kLow;
    c1[j] = counter >> 32;
    c2[j] = 0;
    c3[j] = 0;
  }
  uint64_t k0 = seed & kLow, k1 = seed >> 32;
  for (int round = 0; round < 10; ++round) {
#pragma GCC unroll 1
    for (int j = 0; j < kCounters; ++j) {
      const uint64_t p0 = 0xD2511F53u * c0[j], p1 = 0xCD9E8D57u * c2[j];
      const uint64_t n0 = (p1 >> 32) ^ c1[j] ^ k0, n2 = (p0 >> 32) ^ c3[j] ^ k1;
      c0[j] = n0;
      c1[j] = p1 & kLow;
      c2[j] = n2;
      c3[j] = p0 & kLow;
    }
    k0 = (k0 + 0x9E3779B9u) & kLow;
    k1 = (k1 + 0xBB67AE85u) & kLow;
  }
  for (int j = 0; j < kCounters; ++j) {
    words[4 * j] = uint32_t(c0[j]);
    words[4 * j + 1] = uint32_t(c1[j]);
    words[4 * j + 2] = uint32_t(c2[j]);
    words[4 * j + 3] = uint32_t(c3[j]);
  }
}

}  // namespace

void dropout_mask(uint64_t seed, uint64_t offset, int64_t n, double p, uint8_t* keep) {
  // A word w keeps its element when its top 24 bits, as a uniform in [0, 1), are >= p.
  const uint32_t threshold = uint32_t(p * 16777216.0);
  uint32_t words[4 * kCounters];
  for (int64_t i = 0; i < n;) {
    const uint64_t e = offset + uint64_t(i);
    philox_block(seed, e / 4, words);
    // The block starts at element 4 * (e / 4): skip the words before e.
    const int64_t skip = int64_t(e % 4), take = std::min<int64_t>(4 * kCounters - skip, n - i);
    for (int64_t t = 0; t < take; ++t) keep[i + t] = (words[skip + t] >> 8) >= threshold;
    i += take;
  }
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA

#else  // the host role: entry points

namespace fusedlm {

// The keep mask (bool, `shape`) of the dropout stream (seed, offset).
at::Tensor dropout_mask(const at::Tensor& seed, int64_t offset, at::IntArrayRef shape, double p) {
  auto keep = at::empty(shape, at::dtype(at::kBool));
  cpu::dropout_mask(seed_value(seed), static_cast<uint64_t>(offset), keep.numel(), p,
                    reinterpret_cast<uint8_t*>(keep.data_ptr()));
  return keep;
}
FUSEDLM_BIND(dropout_mask, pybind11::arg("seed"), pybind11::arg("offset"), pybind11::arg("shape"),
             pybind11::arg("p"));

}  // namespace fusedlm

#endif  // FUSEDLM_ISA
