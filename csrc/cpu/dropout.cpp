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
#include "math.h"
#else
#include "bind.h"
#include "common.h"
#endif

#ifdef FUSEDLM_ISA

namespace fusedlm::cpu::FUSEDLM_ISA {
namespace {

inline void philox(uint64_t seed, uint64_t counter, uint32_t out[4]) {
  uint32_t c0 = uint32_t(counter), c1 = uint32_t(counter >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = uint32_t(seed), k1 = uint32_t(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = uint64_t(0xD2511F53u) * c0, p1 = uint64_t(0xCD9E8D57u) * c2;
    uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n2 = uint32_t(p0 >> 32) ^ c3 ^ k1;
    c0 = n0; c1 = uint32_t(p1); c2 = n2; c3 = uint32_t(p0);
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  out[0] = c0; out[1] = c1; out[2] = c2; out[3] = c3;
}

}  // namespace

void dropout_mask(uint64_t seed, uint64_t offset, int64_t n, double p, uint8_t* keep) {
  // A word w keeps its element when its top 24 bits, as a uniform in [0, 1), are >= p.
  const uint32_t threshold = uint32_t(p * 16777216.0);
  uint32_t words[4];
  for (int64_t i = 0; i < n;) {
    uint64_t e = offset + uint64_t(i);
    philox(seed, e / 4, words);
    for (uint64_t w = e % 4; w < 4 && i < n; ++w, ++i) keep[i] = (words[w] >> 8) >= threshold;
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
