// The fused steps of attention on the CPU, between the matrix products that the
// host (csrc/attention.cpp) runs with ATen.
//
// Algorithm: FlashAttention-2 on one core. The host walks a block of queries over
// blocks of keys; for each tile of scores S = (scale * Q) K^T it calls
//   attn_add_bias       S += bias, read at the keys' original positions
//   attn_dropout_keep   the tile's keep mask from the Philox stream (p > 0 only)
//   attn_forward_block  online softmax: running row max m and sum l, rescaling of the
//                       output accumulator, S <- exp(S - m) [* keep / (1 - p)]
// then O += S V, and after the last tile attn_forward_finish (O /= l, log-sum-exp).
// Backward recomputes P = exp(S - lse) tile by tile and forms dS = P * (dP - delta)
// in attn_backward_block; nothing of size [seq_q, seq_k] is ever stored.
//
// Memory traffic: each step streams one [block_q, block_k] tile that a matrix
// product has just written, so it stays in L2 (128 x 256 floats = 128 KiB). What
// limits it is exp (about twenty vector instructions per score) and, for short
// sequences, the dispatch cost of the products around it.
//
// Scores, statistics and accumulators are in the accumulation type (float64 for
// kF64, float32 otherwise); attn_pack and attn_unpack convert from and to the
// tensors' own element type and strides. Loops are written so that GCC and Clang
// vectorise them: sums and maxima use kLanes independent partials.
#include <algorithm>
#include <limits>

#include "math.h"

namespace fusedlm::cpu::FUSEDLM_ISA {

void dropout_mask(uint64_t seed, uint64_t offset, int64_t n, double p, uint8_t* keep);

namespace {

// Independent partial sums (or maxima) per reduction: one 64-byte vector of floats.
// The order of the partials is fixed, so results do not depend on the instruction set.
constexpr int kLanes = 16;

template <typename A>
constexpr A kInf = std::numeric_limits<A>::infinity();

// Maxima go through an order-preserving map of the floats' bits to integers: integer
// max reductions vectorise, while GCC keeps a float max reduction scalar unless it may
// ignore NaN and signed zeros. A NaN maps above +inf, so it propagates as it should.
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

template <typename A>
A row_max(const A* x, int64_t n) {
  auto out = order_key(-kInf<A>);
  for (int64_t j = 0; j < n; ++j) {
    const auto key = order_key(x[j]);
    out = key > out ? key : out;
  }
  return from_order_key(out);
}

template <typename A>
A row_sum(const A* x, int64_t n) {
  A part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) part[u] += x[j + u];
  A out = 0;
  for (; j < n; ++j) out += x[j];
  for (int u = 0; u < kLanes; ++u) out += part[u];
  return out;
}

template <typename A>
A row_dot(const A* x, const A* y, int64_t n) {
  A part[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int u = 0; u < kLanes; ++u) part[u] += x[j + u] * y[j + u];
  A out = 0;
  for (; j < n; ++j) out += x[j] * y[j];
  for (int u = 0; u < kLanes; ++u) out += part[u];
  return out;
}

template <typename T>
void pack(const T* src, int64_t row_stride, int64_t col_stride, const int32_t* rows, int64_t n,
          int64_t cols, acc_t<T> scale, acc_t<T>* dst) {
  for (int64_t r = 0; r < n; ++r) {
    const T* s = src + (rows ? int64_t(rows[r]) : r) * row_stride;
    acc_t<T>* d = dst + r * cols;
    if (col_stride == 1) {
      for (int64_t c = 0; c < cols; ++c) d[c] = load(s[c]) * scale;
    } else {
      for (int64_t c = 0; c < cols; ++c) d[c] = load(s[c * col_stride]) * scale;
    }
  }
}

template <typename T>
void unpack(const acc_t<T>* src, const int32_t* from, int64_t n, int64_t cols, acc_t<T> scale,
            T* dst, int64_t row_stride, int64_t col_stride) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < n; ++r) {
    T* d = dst + r * row_stride;
    const int64_t f = from ? from[r] : r;
    // A row with no source (a padding key) gets zeros: multiplying by 0 would keep NaN/inf.
    const A* s = f >= 0 ? src + f * cols : nullptr;
    if (!s) {
      for (int64_t c = 0; c < cols; ++c) store(d[c * col_stride], A(0));
    } else if (col_stride == 1) {
      for (int64_t c = 0; c < cols; ++c) store(d[c], s[c] * scale);
    } else {
      for (int64_t c = 0; c < cols; ++c) store(d[c * col_stride], s[c] * scale);
    }
  }
}

template <typename T>
void add_bias(acc_t<T>* s, int64_t rows, int64_t cols, const T* bias, int64_t row_stride,
              int64_t col_stride, const int32_t* key_pos) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* b = bias + r * row_stride;
    acc_t<T>* sr = s + r * cols;
    for (int64_t j = 0; j < cols; ++j) sr[j] += load(b[int64_t(key_pos[j]) * col_stride]);
  }
}

template <typename A>
void forward_block(int64_t rows, int64_t cols, const int32_t* limit, const uint8_t* keep,
                   double p, A* s, A* m, A* l, A* o, int64_t o_cols) {
  const A keep_scale = A(1) / (A(1) - A(p));
  for (int64_t r = 0; r < rows; ++r) {
    A* sr = s + r * cols;
    const int64_t lim = limit[r];
    const A m_new = std::max(m[r], row_max(sr, lim));
    // A row with no finite score yet keeps every probability at exp(-inf) = 0.
    const A shift = m_new == -kInf<A> ? A(0) : m_new;
    const A alpha = exp_(m[r] - shift);  // 0 on the first block, where m = -inf
    for (int64_t j = 0; j < lim; ++j) sr[j] = exp_(sr[j] - shift);
    // The normaliser counts every allowed key; dropout only scales what reaches V.
    l[r] = l[r] * alpha + row_sum(sr, lim);
    m[r] = m_new;
    if (keep) {
      const uint8_t* kr = keep + r * cols;
      for (int64_t j = 0; j < lim; ++j) sr[j] = kr[j] ? sr[j] * keep_scale : A(0);
    }
    for (int64_t j = lim; j < cols; ++j) sr[j] = A(0);
    A* orow = o + r * o_cols;
    for (int64_t c = 0; c < o_cols; ++c) orow[c] *= alpha;
  }
}

template <typename A>
void forward_finish(int64_t rows, int64_t o_cols, const A* m, const A* l, A* o, A* lse) {
  for (int64_t r = 0; r < rows; ++r) {
    A* orow = o + r * o_cols;
    // A row that attends to nothing outputs zeros; lse = +inf makes backward's
    // exp(s - lse) zero for it.
    const bool empty = !(l[r] > A(0));
    const A inv = empty ? A(0) : A(1) / l[r];
    for (int64_t c = 0; c < o_cols; ++c) orow[c] = empty ? A(0) : orow[c] * inv;
    lse[r] = empty ? kInf<A> : m[r] + std::log(l[r]);
  }
}

template <typename T>
void delta_rows(const T* o, int64_t row_stride, int64_t col_stride, const acc_t<T>* dout,
                int64_t rows, int64_t cols, acc_t<T>* delta) {
  using A = acc_t<T>;
  A orow[512];  // widened row of O, in chunks
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = o + r * row_stride;
    const A* g = dout + r * cols;
    A sum = 0;
    for (int64_t c0 = 0; c0 < cols; c0 += 512) {
      const int64_t n = std::min<int64_t>(512, cols - c0);
      for (int64_t c = 0; c < n; ++c) orow[c] = load(src[(c0 + c) * col_stride]);
      sum += row_dot(orow, g + c0, n);
    }
    delta[r] = sum;
  }
}

template <typename A, bool kDropout>
void backward_rows(int64_t rows, int64_t cols, const int32_t* limit, const uint8_t* keep,
                   double p, const A* lse, const A* delta, A* s, A* dp) {
  const A keep_scale = A(1) / (A(1) - A(p));
  for (int64_t r = 0; r < rows; ++r) {
    A* sr = s + r * cols;
    A* dr = dp + r * cols;
    const int64_t lim = limit[r];
    const A lse_r = lse[r], delta_r = delta[r];
    if (kDropout) {
      const uint8_t* kr = keep + r * cols;
      for (int64_t j = 0; j < lim; ++j) {
        const A prob = exp_(sr[j] - lse_r);
        const A z = kr[j] ? keep_scale : A(0);
        sr[j] = prob * z;                   // what multiplied V: gives dV
        dr[j] = prob * (dr[j] * z - delta_r);  // dS, through the dropout
      }
    } else {
      for (int64_t j = 0; j < lim; ++j) {
        const A prob = exp_(sr[j] - lse_r);
        sr[j] = prob;
        dr[j] = prob * (dr[j] - delta_r);
      }
    }
    for (int64_t j = lim; j < cols; ++j) {
      sr[j] = A(0);
      dr[j] = A(0);
    }
  }
}

template <typename A>
void bias_grad(const A* ds, int64_t rows, int64_t cols, const int32_t* key_pos, A* dbias,
               int64_t row_stride, int64_t col_stride) {
  // row_stride or col_stride is 0 where the bias is broadcast: those terms sum into
  // one element, in row-then-column order.
  for (int64_t r = 0; r < rows; ++r) {
    const A* dr = ds + r * cols;
    A* out = dbias + r * row_stride;
    if (col_stride == 0) {
      out[0] += row_sum(dr, cols);
    } else {
      for (int64_t j = 0; j < cols; ++j) out[int64_t(key_pos[j]) * col_stride] += dr[j];
    }
  }
}

// Calls f with a typed null pointer for the accumulation type of `dtype`.
template <typename F>
inline void dispatch_acc(DType dtype, F&& f) {
  if (dtype == DType::kF64) f(static_cast<double*>(nullptr));
  else f(static_cast<float*>(nullptr));
}

}  // namespace

void attn_pack(DType dtype, const void* src, int64_t row_stride, int64_t col_stride,
               const int32_t* rows, int64_t n, int64_t cols, double scale, void* dst) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    pack(static_cast<const T*>(src), row_stride, col_stride, rows, n, cols, acc_t<T>(scale),
         static_cast<acc_t<T>*>(dst));
  });
}

void attn_unpack(DType dtype, const void* src, const int32_t* from, int64_t n, int64_t cols,
                 double scale, void* dst, int64_t row_stride, int64_t col_stride) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    unpack(static_cast<const acc_t<T>*>(src), from, n, cols, acc_t<T>(scale), static_cast<T*>(dst),
           row_stride, col_stride);
  });
}

void attn_add_bias(DType dtype, void* s, int64_t rows, int64_t cols, const void* bias,
                   int64_t row_stride, int64_t col_stride, const int32_t* key_pos) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    add_bias(static_cast<acc_t<T>*>(s), rows, cols, static_cast<const T*>(bias), row_stride,
             col_stride, key_pos);
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

void attn_forward_block(DType dtype, int64_t rows, int64_t cols, const int32_t* limit,
                        const uint8_t* keep, double p, void* s, void* m, void* l, void* o,
                        int64_t o_cols) {
  dispatch_acc(dtype, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    forward_block(rows, cols, limit, keep, p, static_cast<A*>(s), static_cast<A*>(m),
                  static_cast<A*>(l), static_cast<A*>(o), o_cols);
  });
}

void attn_forward_finish(DType dtype, int64_t rows, int64_t o_cols, const void* m, const void* l,
                         void* o, void* lse) {
  dispatch_acc(dtype, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    forward_finish(rows, o_cols, static_cast<const A*>(m), static_cast<const A*>(l),
                   static_cast<A*>(o), static_cast<A*>(lse));
  });
}

void attn_delta(DType dtype, const void* o, int64_t row_stride, int64_t col_stride,
                const void* dout, int64_t rows, int64_t cols, void* delta) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    delta_rows(static_cast<const T*>(o), row_stride, col_stride,
               static_cast<const acc_t<T>*>(dout), rows, cols, static_cast<acc_t<T>*>(delta));
  });
}

void attn_backward_block(DType dtype, int64_t rows, int64_t cols, const int32_t* limit,
                         const uint8_t* keep, double p, const void* lse, const void* delta,
                         void* s, void* dp) {
  dispatch_acc(dtype, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    auto run = keep ? backward_rows<A, true> : backward_rows<A, false>;
    run(rows, cols, limit, keep, p, static_cast<const A*>(lse), static_cast<const A*>(delta),
        static_cast<A*>(s), static_cast<A*>(dp));
  });
}

void attn_bias_grad(DType dtype, const void* ds, int64_t rows, int64_t cols,
                    const int32_t* key_pos, void* dbias, int64_t row_stride, int64_t col_stride) {
  dispatch_acc(dtype, [&](auto* tag) {
    using A = std::remove_pointer_t<decltype(tag)>;
    bias_grad(static_cast<const A*>(ds), rows, cols, key_pos, static_cast<A*>(dbias), row_stride,
              col_stride);
  });
}

}  // namespace fusedlm::cpu::FUSEDLM_ISA
