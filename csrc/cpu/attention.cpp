// The fused steps of attention on the CPU, between the matrix products that the
// host (csrc/attention.cpp) runs with ATen.
//
// Algorithm: FlashAttention-2 on one core. The host walks a block of queries over
// blocks of keys; for each tile of products S = Q K^T (an AttnTile, attention.h)
//   attn_dropout_keep   draws the tile's keep mask from the Philox stream (p > 0 only)
//   attn_forward_block  scales, adds the bias and masks in the pass that finds the row
//                       max, then runs the online softmax: running row max m and sum l,
//                       rescaling of the output accumulator, S <- exp(S - m) [* keep / (1 - p)]
// then the host adds S V to the accumulator, and after the last tile
// attn_forward_finish stores O / l and the log-sum-exp. Backward recomputes
// P = exp(S - lse) tile by tile and forms dS = P * (dP - delta) in attn_backward_block,
// with delta = rowsum(dO * O) from attn_delta, or from the tile itself when it holds
// whole rows; nothing of size [seq_q, seq_k] is ever stored.
//
// Memory traffic: each step streams the [block_q, block_k] tile of one head that a
// matrix product has just written, in L2 (128 x 256 floats = 128 KiB per head). What
// limits it is exp: about twenty vector instructions per score.
//
// Scores, statistics and accumulators are in the accumulation type (float64 for
// kF64, float32 otherwise); attn_pack, attn_forward_finish and attn_unpack convert
// from and to the tensors' own element type and strides. Loops are written so that
// GCC and Clang vectorise them: sums use kLanes independent partials.
#include <algorithm>
#include <limits>

#include "attention.h"
#include "math.h"

namespace fusedlm::cpu::FUSEDLM_ISA {

void dropout_mask(uint64_t seed, uint64_t offset, int64_t n, double p, uint8_t* keep);

namespace {

// Independent partial sums per reduction: one 64-byte vector of floats. The order of
// the additions is fixed by the source, not by the vector width.
constexpr int kLanes = 16;

template <typename A>
constexpr A kInf = std::numeric_limits<A>::infinity();

// Maxima go through an order-preserving map of the floats' bits to integers: integer
// max reductions vectorise, while GCC keeps a float max reduction scalar unless it may
// ignore NaN and signed zeros. (A NaN score, whatever the max, still makes its row NaN
// through exp.)
inline int32_t order_key(float x) {
  const int32_t i = static_cast<int32_t>(float_to_bits(x));
  return i ^ ((i >> 31) & 0x7fffffff);
}
inline float from_order_key(int32_t k) {
  return bits_to_float(static_cast<uint32_t>(k ^ ((k >> 31) & 0x7fffffff)));
}
inline int64_t order_key(double x) {
  int64_t i;
  std::memcpy(&i, &x, sizeof i);
  return i ^ ((i >> 63) & INT64_MAX);
}
inline double from_order_key(int64_t k) {
  const int64_t i = k ^ ((k >> 63) & INT64_MAX);
  double x;
  std::memcpy(&x, &i, sizeof x);
  return x;
}

// The sum of kLanes partials, as a tree: log2(kLanes) vector adds instead of a chain of
// kLanes dependent scalar ones.
template <typename A>
A reduce(A* part) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int u = 0; u < w; ++u) part[u] += part[u + w];
  return part[0];
}

template <typename A>
A row_sum(const A* x, int64_t n) {
  A part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) part[u] += x[j + u];
  for (int u = 0; j + u < n; ++u) part[u] += x[j + u];
  return reduce(part);
}

template <typename A>
A row_dot(const A* x, const A* y, int64_t n) {
  A part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) part[u] += x[j + u] * y[j + u];
  for (int u = 0; j + u < n; ++u) part[u] += x[j + u] * y[j + u];
  return reduce(part);
}

// rowsum(P * dP) / rowsum(P), for a tile that holds whole rows. P = exp(S - lse) sums to 1
// only up to the rounding of the float lse, whose absolute error grows with the scores
// (|lse| ~ 100 gives ~1e-5); dS = P * (dP - delta) subtracts nearly equal terms when P is
// near one-hot, so that error, times dP, would swamp dS. Dividing by P's own sum cancels it.
// A row that sees no key has no mass: delta 0.
template <typename A>
A exact_delta(const A* p, const A* dp, int64_t n) {
  const A mass = row_sum(p, n);
  return mass > A(0) ? row_dot(p, dp, n) / mass : A(0);
}

// x[j] <- exp(x[j] - shift) for j < n; returns their sum. The tail goes through one more
// full chunk padded with exp(-inf) = 0, so every exp runs in vector registers.
template <typename A>
A exp_sum(A* x, int64_t n, A shift) {
  A part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) {
      const A e = exp_(x[j + u] - shift);
      x[j + u] = e;
      part[u] += e;
    }
  if (j < n) {
    A tail[kLanes];
    for (int u = 0; u < kLanes; ++u) tail[u] = j + u < n ? x[j + u] - shift : -kInf<A>;
    for (int u = 0; u < kLanes; ++u) {
      tail[u] = exp_(tail[u]);
      part[u] += tail[u];
    }
    for (int u = 0; j + u < n; ++u) x[j + u] = tail[u];
  }
  return reduce(part);
}

template <typename T>
void pack(const T* src, int64_t row_stride, int64_t col_stride, const int32_t* rows, int64_t n,
          int64_t cols, acc_t<T>* dst) {
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src + (rows ? int64_t(rows[r]) : r) * row_stride;
    acc_t<T>* d = dst + r * cols;
    if (col_stride == 1) {
      for (int64_t c = 0; c < cols; ++c) d[c] = load(s[c]);
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c] = load(s[c * col_stride]);
    }
  }
}

// Row by row across the heads: in a [batch, seq, heads, dim] output one row of every
// head is one contiguous run, which the stores (the first touch of that memory) favour.
template <typename T>
void unpack(const acc_t<T>* src, const int32_t* from, int64_t n, int64_t cols, acc_t<T> scale,
            T* dst, int64_t row_stride, int64_t col_stride, int64_t heads,
            int64_t src_head_stride, int64_t dst_head_stride) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t f = from ? from[r] : r;
    for (int64_t h = 0; h < heads; ++h) {
      T* d = dst + h * dst_head_stride + r * row_stride;
      // A row with no source (a padding key) gets zeros: multiplying by 0 would keep NaN/inf.
      const A* s = f >= 0 ? src + h * src_head_stride + f * cols : nullptr;
      if (!s) {
        for (int64_t c = 0; c < cols; ++c) store(d[c * col_stride], A(0));
      } else if (col_stride == 1) {
        for (int64_t c = 0; c < cols; ++c) store(d[c], s[c] * scale);
      } else {
        for (int64_t c = 0; c < cols; ++c) store(d[c * col_stride], s[c] * scale);
      }
    }
  }
}

// s <- scale * s + bias over the allowed columns [0, lim) of row r; returns their max
// when kMax (one pass: the row is in L1 either way, but the loads are not repeated).
template <typename T, bool kMax>
acc_t<T> scores_row(const AttnTile& t, int64_t r, acc_t<T>* s, int64_t lim) {
  using A = acc_t<T>;
  const A scale = A(t.scale);
  auto best = order_key(-kInf<A>);
  if (t.bias) {
    const T* b = static_cast<const T*>(t.bias) + r * t.bias_row;
    const int32_t* pos = t.key_pos;
    const int64_t bc = t.bias_col;
    for (int64_t j = 0; j < lim; ++j) {
      const A v = s[j] * scale + load(b[pos[j] * bc]);
      s[j] = v;
      if (kMax) {
        const auto key = order_key(v);
        best = key > best ? key : best;
      }
    }
  } else {
    for (int64_t j = 0; j < lim; ++j) {
      const A v = s[j] * scale;
      s[j] = v;
      if (kMax) {
        const auto key = order_key(v);
        best = key > best ? key : best;
      }
    }
  }
  return from_order_key(best);
}

template <typename T>
void forward_block(const AttnTile& t, bool first, acc_t<T>* s, acc_t<T>* m, acc_t<T>* l,
                   acc_t<T>* o, int64_t o_cols) {
  using A = acc_t<T>;
  const A keep_scale = A(1) / (A(1) - A(t.p));
  for (int64_t r = 0; r < t.rows; ++r) {
    A* sr = s + r * t.cols;
    const int64_t lim = t.limit[r];
    const A m_old = first ? -kInf<A> : m[r];
    const A m_new = std::max(m_old, scores_row<T, true>(t, r, sr, lim));
    // A row with no finite score yet keeps every probability at exp(-inf) = 0.
    const A shift = m_new == -kInf<A> ? A(0) : m_new;
    // The normaliser counts every allowed key; dropout only scales what reaches V.
    const A sum = exp_sum(sr, lim, shift);
    const A alpha = exp_(m_old - shift);  // rescales the earlier blocks' sums
    l[r] = (first ? A(0) : l[r] * alpha) + sum;
    m[r] = m_new;
    if (t.keep) {
      const uint8_t* kr = t.keep + r * t.cols;
      for (int64_t j = 0; j < lim; ++j) sr[j] *= A(kr[j]) * keep_scale;  // keep is 0 or 1: a multiply vectorises, ?: does not
    }
    for (int64_t j = lim; j < t.cols; ++j) sr[j] = A(0);
    if (!first) {
      A* orow = o + r * o_cols;
      for (int64_t c = 0; c < o_cols; ++c) orow[c] *= alpha;
    }
  }
}

template <typename T>
void forward_finish(int64_t rows, int64_t o_cols, const acc_t<T>* m, const acc_t<T>* l,
                    const acc_t<T>* o, acc_t<T>* lse, T* out, int64_t row_stride,
                    int64_t col_stride) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < rows; ++r) {
    const A* orow = o + r * o_cols;
    T* dst = out + r * row_stride;
    // A row that attends to nothing outputs zeros (whatever its accumulator holds); its
    // lse = +inf makes backward's exp(s - lse) zero.
    const bool empty = !(l[r] > A(0));
    const A inv = empty ? A(0) : A(1) / l[r];
    if (col_stride == 1) {
      for (int64_t c = 0; c < o_cols; ++c) store(dst[c], empty ? A(0) : orow[c] * inv);
    } else {
      for (int64_t c = 0; c < o_cols; ++c) store(dst[c * col_stride], empty ? A(0) : orow[c] * inv);
    }
    lse[r] = empty ? kInf<A> : m[r] + std::log(l[r]);
  }
}

template <typename T>
void delta_rows(const T* o, int64_t row_stride, int64_t col_stride, const acc_t<T>* dout,
                int64_t dout_row_stride, int64_t rows, int64_t cols, acc_t<T>* delta) {
  using A = acc_t<T>;
  constexpr int64_t kChunk = 256;
  A orow[kChunk];  // a widened piece of a row of O
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = o + r * row_stride;
    const A* g = dout + r * dout_row_stride;
    A sum = 0;
    for (int64_t c0 = 0; c0 < cols; c0 += kChunk) {
      const int64_t n = std::min(kChunk, cols - c0);
      for (int64_t c = 0; c < n; ++c) orow[c] = load(src[(c0 + c) * col_stride]);
      sum += row_dot(orow, g + c0, n);
    }
    delta[r] = sum;
  }
}

template <typename T, bool kDropout>
void backward_rows(const AttnTile& t, acc_t<T>* s, acc_t<T>* dp, const acc_t<T>* lse,
                   acc_t<T>* delta, bool own_delta) {
  using A = acc_t<T>;
  const A keep_scale = A(1) / (A(1) - A(t.p));
  for (int64_t r = 0; r < t.rows; ++r) {
    A* sr = s + r * t.cols;
    A* dr = dp + r * t.cols;
    const uint8_t* kr = kDropout ? t.keep + r * t.cols : nullptr;
    const int64_t lim = t.limit[r];
    scores_row<T, false>(t, r, sr, lim);
    const A lse_r = lse[r];
    for (int64_t j = 0; j < lim; ++j) sr[j] = exp_(sr[j] - lse_r);  // P
    if (kDropout)  // the gradient reaching P passes through the dropout
      for (int64_t j = 0; j < lim; ++j) dr[j] *= A(kr[j]) * keep_scale;  // keep is 0 or 1
    // delta = rowsum(dO * O) = rowsum(P * dP). From the tile when it holds all of the
    // row: exact, where the stored O has been rounded to the output's dtype.
    if (own_delta) delta[r] = exact_delta(sr, dr, lim);
    const A delta_r = delta[r];
    for (int64_t j = 0; j < lim; ++j) dr[j] = sr[j] * (dr[j] - delta_r);  // dS
    if (kDropout)  // what multiplied V, for dV
      for (int64_t j = 0; j < lim; ++j) sr[j] *= A(kr[j]) * keep_scale;  // keep is 0 or 1: a multiply vectorises, ?: does not
    for (int64_t j = lim; j < t.cols; ++j) {
      sr[j] = A(0);
      dr[j] = A(0);
    }
  }
}

template <typename A>
void bias_grad(const AttnTile& t, const A* ds, A* dbias, int64_t row_stride, int64_t col_stride) {
  // row_stride or col_stride is 0 where the bias is broadcast: those terms sum into
  // one element, in row-then-column order.
  for (int64_t r = 0; r < t.rows; ++r) {
    const A* dr = ds + r * t.cols;
    A* out = dbias + r * row_stride;
    if (col_stride == 0) {
      out[0] += row_sum(dr, t.cols);
    } else {
      for (int64_t j = 0; j < t.cols; ++j) out[int64_t(t.key_pos[j]) * col_stride] += dr[j];
    }
  }
}

}  // namespace

void attn_pack(DType dtype, const void* src, int64_t row_stride, int64_t col_stride,
               const int32_t* rows, int64_t n, int64_t cols, void* dst) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    pack(static_cast<const T*>(src), row_stride, col_stride, rows, n, cols,
         static_cast<acc_t<T>*>(dst));
  });
}

void attn_unpack(DType dtype, const void* src, const int32_t* from, int64_t n, int64_t cols,
                 double scale, void* dst, int64_t row_stride, int64_t col_stride, int64_t heads,
                 int64_t src_head_stride, int64_t dst_head_stride) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    unpack(static_cast<const acc_t<T>*>(src), from, n, cols, acc_t<T>(scale), static_cast<T*>(dst),
           row_stride, col_stride, heads, src_head_stride, dst_head_stride);
  });
}

void attn_dropout_keep(uint64_t seed, double p, uint64_t offset, int64_t row_pitch, int64_t rows,
                       const int32_t* key_pos, int64_t cols, uint8_t* scratch, uint8_t* keep) {
  if (cols == 0) return;
  // Row r's stream starts at offset + r * row_pitch; the tile's columns are the keys at
  // key_pos, a subset of the span [key_pos[0], key_pos[cols - 1]] when padding was skipped.
  const int64_t first = key_pos[0], span = key_pos[cols - 1] - first + 1;
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* out = keep + r * cols;
    const uint64_t at = offset + uint64_t(r * row_pitch + first);
    if (span == cols) {
      dropout_mask(seed, at, cols, p, out);
    } else {
      dropout_mask(seed, at, span, p, scratch);
      for (int64_t j = 0; j < cols; ++j) out[j] = scratch[key_pos[j] - first];
    }
  }
}

void attn_forward_block(const AttnTile* tile, bool first, void* s, void* m, void* l, void* o,
                        int64_t o_cols) {
  dispatch_dtype(tile->dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = acc_t<T>;
    forward_block<T>(*tile, first, static_cast<A*>(s), static_cast<A*>(m), static_cast<A*>(l),
                     static_cast<A*>(o), o_cols);
  });
}

void attn_forward_finish(DType dtype, int64_t rows, int64_t o_cols, const void* m, const void* l,
                         const void* o, void* lse, void* out, int64_t out_row_stride,
                         int64_t out_col_stride) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = acc_t<T>;
    forward_finish<T>(rows, o_cols, static_cast<const A*>(m), static_cast<const A*>(l),
                      static_cast<const A*>(o), static_cast<A*>(lse), static_cast<T*>(out),
                      out_row_stride, out_col_stride);
  });
}

void attn_delta(DType dtype, const void* o, int64_t row_stride, int64_t col_stride,
                const void* dout, int64_t dout_row_stride, int64_t rows, int64_t cols,
                void* delta) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    delta_rows(static_cast<const T*>(o), row_stride, col_stride,
               static_cast<const acc_t<T>*>(dout), dout_row_stride, rows, cols,
               static_cast<acc_t<T>*>(delta));
  });
}

void attn_backward_block(const AttnTile* tile, void* s, void* dp, const void* lse, void* delta,
                         bool own_delta) {
  dispatch_dtype(tile->dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    using A = acc_t<T>;
    auto run = tile->keep ? backward_rows<T, true> : backward_rows<T, false>;
    run(*tile, static_cast<A*>(s), static_cast<A*>(dp), static_cast<const A*>(lse),
        static_cast<A*>(delta), own_delta);
  });
}

void attn_bias_grad(const AttnTile* tile, const void* ds, void* dbias, int64_t row_stride,
                    int64_t col_stride) {
  dispatch_dtype(tile->dtype, [&](auto* tag) {
    using A = acc_t<std::remove_pointer_t<decltype(tag)>>;
    bias_grad(*tile, static_cast<const A*>(ds), static_cast<A*>(dbias), row_stride, col_stride);
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA
