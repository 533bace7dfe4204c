// Sums along a row that keep the accumulation type's precision at any width, for the
// per-instruction-set kernels of the row-wise ops (layer_norm.cpp, rms_norm.cpp).
//
// GCC vectorises no float reduction without -ffast-math, so a row sum keeps a fixed number
// of independent partial sums (lanes): the loop over the lanes becomes vector adds on every
// instruction set, and the order of the additions stays fixed (results never depend on the
// thread count). Rows longer than a block (kBlock elements) are summed a block at a time,
// the blocks' sums pairwise.
#pragma once
#include <algorithm>
#include <array>
#include <cstdint>

#include "math.h"

namespace fusedlm::cpu::FUSEDLM_ISA {

// 32 floats or 16 doubles: two AVX-512 registers of partial sums, which hides the
// latency of the vector add; four AVX2 or eight SSE registers.
template <typename A>
constexpr int kLanes = 128 / sizeof(A);

// Calls body(c, l) for c = 0 .. n-1 in order, with l = c % kLanes: the loop over
// a fixed number of lanes becomes vector code, partial sums indexed by l included.
template <typename A, typename Body>
inline void over_lanes(int64_t n, Body&& body) {
  constexpr int L = kLanes<A>;
  int64_t c = 0;
  for (; c + L <= n; c += L)
    for (int l = 0; l < L; ++l) body(c + l, l);
  for (int l = 0; c + l < n; ++l) body(c + l, l);
}

// Adds the lane sums pairwise into lanes[0].
template <typename A>
inline A fold(A* lanes) {
  for (int w = kLanes<A> / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// The elements of a block of a row sum: each lane adds kBlock / kLanes of them in turn.
constexpr int64_t kBlock = 4096;

// A sum of block sums added pairwise as they come, like a binary counter: when bit k
// of count is set, partial[k] holds the sum of 2^k blocks.
template <typename A>
struct PairwiseSum {
  A partial[64];
  uint64_t count = 0;

  void add(A v) {
    int k = 0;
    for (uint64_t c = count++; c & 1; c >>= 1, ++k) v += partial[k];
    partial[k] = v;
  }

  A total() const {
    A sum = 0;
    for (int k = 0; count >> k; ++k)
      if (count >> k & 1) sum += partial[k];
    return sum;
  }
};

// The N sums over c = 0 .. n-1 of terms(c), a std::array<A, N>; terms is called once for
// each c, in order, so it may also write the row. In one accumulator a sum of n terms
// errs by up to about n ulps of the sum of their magnitudes; here lanes add at most
// kBlock / kLanes terms each, and a row's blocks are added pairwise, so the error grows
// with log2(n / kBlock) instead: LayerNorm over millions of elements keeps float's
// precision. A row of at most kBlock elements is one block: lanes and fold, nothing more.
template <typename A, int N, typename Terms>
inline std::array<A, N> row_sums(int64_t n, Terms&& terms) {
  constexpr int L = kLanes<A>;
  PairwiseSum<A> sums[N];
  for (int64_t begin = 0; begin < n; begin += kBlock) {
    A lanes[N][L] = {};
    over_lanes<A>(std::min(kBlock, n - begin), [&](int64_t c, int l) {
      const std::array<A, N> t = terms(begin + c);
      for (int k = 0; k < N; ++k) lanes[k][l] += t[k];
    });
    for (int k = 0; k < N; ++k) sums[k].add(fold(lanes[k]));
  }
  std::array<A, N> totals;
  for (int k = 0; k < N; ++k) totals[k] = sums[k].total();
  return totals;
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA
