// attention and attention_varlen on the CPU: FlashAttention-2's tiling around matrix
// products, with the softmax, masking, dropout and their backward fused in
// between (the kernels of csrc/cpu/attention.cpp).
//
// Forward: one task per (sequence, set of up to kHeadGroup heads, block of kBlockQ
// queries). For each block of kBlockK keys: S = Q K^T (one product over the heads), the
// fused scale + bias + mask + online-softmax step per head, O += P V. It writes O / l and
// each row's log-sum-exp, the one statistic backward needs.
//
// Grouped-query (and multi-query) attention: k and v have kv_heads heads, and query head
// h reads key/value head h / (heads / kv_heads), in place (or packed per task like any
// operand), never repeated per query head. The heads of a set are chosen so that one
// product serves them (Heads, below): heads of one rank in consecutive groups, whose
// key/value heads are consecutive too, or, with large enough groups, heads of one group,
// whose rows stack into one product against their shared K and V.
//
// Backward: one task per (sequence, group of key/value heads), which owns their dK and
// dV and every query head that reads them, so those sums (over query blocks and over the
// query heads of a group) need no reduction across threads. Per query block and set of
// query heads it recomputes P = exp(S - lse) tile by tile and accumulates dV += P^T dO,
// dK += dS^T Q, dQ += dS K.
//
// Sliding windows: query i of a sequence sees the keys at positions i + off - left ..
// i + off + right (off = seq_k - seq_q, the bottom-right alignment of causal). Each row
// has a first key as well as a limit, both growing with i, and a query block walks only
// the key blocks between its first row's first key and its last row's limit: the work
// follows the window, never a masked [seq_q, seq_k] walk.
//
// Tasks go to ATen's threads costliest first, each thread taking the next when it is
// done (run_balanced): sequences of unequal length make tasks of unequal cost.
//
// The products are ATen's bmm, or plain loops where they are too small to pay for its
// dispatch (a short sequence's). They read float32/float64 inputs in place (any row
// stride); other dtypes and layouts are first packed into dense float32 buffers, one read
// of each input.
// Padding keys never enter a tile: each sequence's valid keys are gathered when K and
// V are packed (or, when they are consecutive, read in place), so the work follows the
// real lengths, and a row's allowed keys stay a run of the gathered ones: the window is
// defined on positions, and each of its ends maps to the gathered index of the first
// valid key at or after it (the walk starts at a block's first allowed key and stops at
// its last, which skips the causal-masked blocks and those outside the window). Only
// [kBlockQ, kBlockK] tiles are held, never a [seq_q, seq_k] matrix. Every reduction
// runs in a fixed order inside one task, and the split into tasks depends only on the
// shapes, so results do not depend on the number of threads.
//
// The fused steps of attention on the CPU, between the matrix products that the
// host role (below) runs.
//
// Algorithm: FlashAttention-2 on one core. The host walks a block of queries over
// blocks of keys; for each tile of products S = Q K^T (an AttnTile, below)
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
#include "kernel.h"

#ifdef FUSEDLM_ISA
#include <algorithm>
#include <limits>

#include "math.h"
#else
#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "attention_problem.h"
#include "ops/compiled_kernel.h"
#include "common.h"
#endif

namespace fusedlm::cpu {

// A [rows, cols] tile of scores Q K^T, dense and row-major in the accumulation type,
// for a block of queries against a block of (gathered) keys.
struct AttnTile {
  DType dtype;  // of the inputs and of the bias
  int64_t rows, cols;
  // Row r may attend to columns [start[r], limit[r]) only (its window, causal masking,
  // the end of the keys).
  const int32_t *start, *limit;
  // The scores are scale * (Q K^T) + bias.
  double scale;
  // Bias of (r, j) at bias[r * bias_row + key_pos[j] * bias_col] (strides may be 0), or null.
  const void* bias;
  int64_t bias_row, bias_col;
  // The original position (in its sequence) of the key of each column.
  const int32_t* key_pos;
  // Dropout keep mask [rows, cols] and probability, or null.
  const uint8_t* keep;
  double p;
};

}  // namespace fusedlm::cpu

// Attention (csrc/cpu/attention.cpp); a tile is described by an AttnTile
// (above). "acc" buffers are in the accumulation type of the DType.
//
// dst[r] = src[rows[r]] (rows null: r), a dense [n, cols] acc buffer from a strided matrix.
FUSEDLM_CPU_KERNEL(attn_pack, void(DType, const void* src, int64_t row_stride, int64_t col_stride,
                                   const int32_t* rows, int64_t n, int64_t cols, void* dst))

// dst[r] = src[from[r]] (from null: r) into a strided matrix; zeros where from[r] < 0.
// For each of `heads` heads, their src and dst the given head strides (elements) apart.
FUSEDLM_CPU_KERNEL(attn_unpack, void(DType, const void* src, const int32_t* from, int64_t n,
                                     int64_t cols, void* dst, int64_t row_stride,
                                     int64_t col_stride, int64_t heads, int64_t src_head_stride,
                                     int64_t dst_head_stride))

// keep[r, j] = element offset + r * row_pitch + key_pos[j] of the dropout stream; scratch
// holds key_pos[cols - 1] - key_pos[0] + 1 bytes.
FUSEDLM_CPU_KERNEL(attn_dropout_keep, void(uint64_t seed, double p, uint64_t offset,
                                           int64_t row_pitch, int64_t rows, const int32_t* key_pos,
                                           int64_t cols, uint8_t* scratch, uint8_t* keep))

// One key block of the online softmax over the tile's product s: scales, adds the bias,
// masks, updates the row max m and sum l (which `first` initialises), rescales the output
// accumulator o [rows, o_cols] (unless first), and leaves in s the weights of V:
// exp(score - m) [* keep / (1 - p)], zero where masked.
FUSEDLM_CPU_KERNEL(attn_forward_block, void(const AttnTile* tile, bool first, void* s, void* m,
                                            void* l, void* o, int64_t o_cols))

// out = o / l (zeros where l == 0), stored strided in the DType, and lse = m + log(l)
// (+inf where l == 0).
FUSEDLM_CPU_KERNEL(attn_forward_finish, void(DType, int64_t rows, int64_t o_cols, const void* m,
                                             const void* l, const void* o, void* lse, void* out,
                                             int64_t out_row_stride, int64_t out_col_stride))

// delta[r] = sum over c of o[r, c] * dout[r, c]; o strided in the DType, dout acc rows
// dout_row_stride apart.
FUSEDLM_CPU_KERNEL(attn_delta, void(DType, const void* o, int64_t row_stride, int64_t col_stride,
                                    const void* dout, int64_t dout_row_stride, int64_t rows,
                                    int64_t cols, void* delta))

// From the tile's product s and dp = dO V^T: s <- P [* keep / (1 - p)] with
// P = exp(score - lse), dp <- dS = P * (dp [* keep / (1 - p)] - delta); zero where masked.
// delta = rowsum(dO * O) is read, or with own_delta (the tile holds every allowed key of
// its rows) computed here as rowsum(P * dp [* keep / (1 - p)]) and written.
FUSEDLM_CPU_KERNEL(attn_backward_block, void(const AttnTile* tile, void* s, void* dp,
                                             const void* lse, void* delta, bool own_delta))

// dbias[r * row_stride + key_pos[j] * col_stride] += ds[r, j] over the tile, in order; a
// stride of 0 sums over that dimension (a broadcast bias).
FUSEDLM_CPU_KERNEL(attn_bias_grad, void(const AttnTile* tile, const void* ds, void* dbias,
                                        int64_t row_stride, int64_t col_stride))

#ifdef FUSEDLM_ISA

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
void unpack(const acc_t<T>* src, const int32_t* from, int64_t n, int64_t cols, T* dst,
            int64_t row_stride, int64_t col_stride, int64_t heads,
            int64_t src_head_stride, int64_t dst_head_stride) {
  using A = acc_t<T>;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t f = from ? from[r] : r;
    for (int64_t h = 0; h < heads; ++h) {
      T* d = dst + h * dst_head_stride + r * row_stride;
      const A* s = f >= 0 ? src + h * src_head_stride + f * cols : nullptr;
      if (!s) {  // a padding key
        for (int64_t c = 0; c < cols; ++c) store(d[c * col_stride], A(0));
      } else if (col_stride == 1) {
        for (int64_t c = 0; c < cols; ++c) store(d[c], s[c]);
      } else {
        for (int64_t c = 0; c < cols; ++c) store(d[c * col_stride], s[c]);
      }
    }
  }
}

// s <- scale * s + bias over the allowed columns [lo, lim) of row r; returns their max
// when kMax (one pass: the row is in L1 either way, but the loads are not repeated).
template <typename T, bool kMax>
acc_t<T> scores_row(const AttnTile& t, int64_t r, acc_t<T>* s, int64_t lo, int64_t lim) {
  using A = acc_t<T>;
  const A scale = A(t.scale);
  auto best = order_key(-kInf<A>);
  if (t.bias) {
    const T* b = static_cast<const T*>(t.bias) + r * t.bias_row;
    const int32_t* pos = t.key_pos;
    const int64_t bc = t.bias_col;
    for (int64_t j = lo; j < lim; ++j) {
      const A v = s[j] * scale + load(b[pos[j] * bc]);
      s[j] = v;
      if (kMax) {
        const auto key = order_key(v);
        best = key > best ? key : best;
      }
    }
  } else {
    for (int64_t j = lo; j < lim; ++j) {
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
    const int64_t lo = t.start[r], lim = t.limit[r];
    const A m_old = first ? -kInf<A> : m[r];
    const A m_new = std::max(m_old, scores_row<T, true>(t, r, sr, lo, lim));
    // A row with no finite score yet keeps every probability at exp(-inf) = 0.
    const A shift = m_new == -kInf<A> ? A(0) : m_new;
    // The normaliser counts every allowed key; dropout only scales what reaches V.
    const A sum = exp_sum(sr + lo, lim - lo, shift);
    const A alpha = exp_(m_old - shift);  // rescales the earlier blocks' sums
    l[r] = (first ? A(0) : l[r] * alpha) + sum;
    m[r] = m_new;
    if (t.keep) {
      const uint8_t* kr = t.keep + r * t.cols;
      for (int64_t j = lo; j < lim; ++j) sr[j] *= A(kr[j]) * keep_scale;  // keep is 0 or 1: a multiply vectorises, ?: does not
    }
    for (int64_t j = 0; j < lo; ++j) sr[j] = A(0);
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
    const int64_t lo = t.start[r], lim = t.limit[r];
    scores_row<T, false>(t, r, sr, lo, lim);
    const A lse_r = lse[r];
    for (int64_t j = lo; j < lim; ++j) sr[j] = exp_(sr[j] - lse_r);  // P
    if (kDropout)  // the gradient reaching P passes through the dropout
      for (int64_t j = lo; j < lim; ++j) dr[j] *= A(kr[j]) * keep_scale;  // keep is 0 or 1
    // delta = rowsum(dO * O) = rowsum(P * dP). From the tile when it holds all of the
    // row: exact, where the stored O has been rounded to the output's dtype.
    if (own_delta) delta[r] = exact_delta(sr + lo, dr + lo, lim - lo);
    const A delta_r = delta[r];
    for (int64_t j = lo; j < lim; ++j) dr[j] = sr[j] * (dr[j] - delta_r);  // dS
    if (kDropout)  // what multiplied V, for dV
      for (int64_t j = lo; j < lim; ++j) sr[j] *= A(kr[j]) * keep_scale;  // keep is 0 or 1: a multiply vectorises, ?: does not
    for (int64_t j = 0; j < lo; ++j) {
      sr[j] = A(0);
      dr[j] = A(0);
    }
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
                 void* dst, int64_t row_stride, int64_t col_stride, int64_t heads,
                 int64_t src_head_stride, int64_t dst_head_stride) {
  dispatch_dtype(dtype, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    unpack(static_cast<const acc_t<T>*>(src), from, n, cols, static_cast<T*>(dst), row_stride,
           col_stride, heads, src_head_stride, dst_head_stride);
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

#else  // the host role: entry points

namespace fusedlm {
namespace {

// A tile is [kBlockQ, kBlockK] scores: 128 KiB in float32, resident in L2 with the
// operands, and large enough that each product does over a million multiply-adds at
// head_dim 64.
constexpr int64_t kBlockQ = 128;
constexpr int64_t kBlockK = 256;
// Tasks take this many heads at once, so that each ATen call (a few microseconds to
// dispatch, a fifth of a product at seq 128) serves them all through bmm; half as many
// where a call would otherwise make fewer than kFewTasks tasks (one short query: 12
// heads make 3 tasks, two cores take 2 and 1). Both follow from the shapes alone, so the
// split of the work never depends on the machine.
constexpr int64_t kHeadGroup = 4;
constexpr int64_t kFewTasks = 8;

// Rows of a tensor in units of elements: row `r` of head `h` of sequence `b` starts at
// data + (b * batch + h * head + r * row) * elem; columns are `col` apart. Padded
// tensors index rows from 0 in every sequence, packed (varlen) ones from the
// sequence's first token, with batch = 0.
struct Rows {
  char* data = nullptr;
  int64_t elem = 0, batch = 0, head = 0, row = 0, col = 0;

  char* at(int64_t b, int64_t h, int64_t r) const {
    return data + (b * batch + h * head + r * row) * elem;
  }
};

Rows padded_rows(const at::Tensor& t) {  // [batch, heads, seq, dim]
  return {static_cast<char*>(t.data_ptr()), static_cast<int64_t>(t.element_size()), t.stride(0),
          t.stride(1), t.stride(2), t.stride(3)};
}

Rows packed_rows(const at::Tensor& t) {  // [tokens, heads, dim]
  return {static_cast<char*>(t.data_ptr()), static_cast<int64_t>(t.element_size()), 0,
          t.stride(1), t.stride(0), t.stride(2)};
}

// The query heads that one set of products serves, heads h(0) .. h(count - 1), and the
// key/value heads they read. Query head h reads key/value head h / g (g = heads /
// kv_heads), so the heads of one group share K and V. Either a set takes the heads of one
// rank r in consecutive groups, h(j) = (kv0 + j) * g + r, which read kv0 + j: both strides
// uniform, one bmm serves them as it serves ungrouped heads (g = 1, r = 0). Or, where the
// groups are at least as large as kv_heads or kHeadGroup (Problem::flat), a set takes
// consecutive heads of one group, all reading kv0: their rows stack into one matrix
// (`flat`, packed), and each product is one larger product against the shared K or V,
// which also sums dK and dV over the set's heads.
struct Heads {
  int64_t h0, step, count, kv0;
  bool flat;

  int64_t h(int64_t j) const { return h0 + j * step; }
  int64_t kv_count() const { return flat ? 1 : count; }
  // The products' batch of heads and rows per head: a flat set is one head of all rows.
  int64_t batch() const { return flat ? 1 : count; }
  int64_t rows(int64_t per_head) const { return flat ? count * per_head : per_head; }
};

// One call: the sequences, their layout, and the keys each may attend to.
struct Problem : AttentionProblem {
  cpu::DType dtype;
  at::ScalarType acc;
  std::vector<int64_t> q_row0, q_len, k_row0, k_len;
  // The dropout stream is laid out as [batch, heads, seq_q, seq_k] (the longest
  // sequences for varlen), each sequence in its top-left corner.
  uint64_t seed = 0;
  Rows q, k, v, bias;
  bool has_bias = false;
  // The products may read the inputs in place: their element type is the accumulation type.
  bool direct = false;
  // Query heads per set (kHeadGroup, or fewer for a call of few tasks): choose_head_group.
  int64_t head_group = kHeadGroup;

  // The layout of q, k and v (padded_rows or packed_rows of each), each sequence from
  // row 0 (padded) until the offsets say otherwise, and the dropout seed.
  Problem(const AttentionProblem& shape, const Rows& q_rows, const Rows& k_rows,
          const Rows& v_rows, at::ScalarType dtype_of_q, const at::Tensor& seed_tensor)
      : AttentionProblem(shape),
        dtype(kernel_dtype(dtype_of_q)),
        acc(acc_dtype(dtype_of_q)),
        q_row0(batch, 0),
        q_len(batch, seq_q),
        k_row0(batch, 0),
        k_len(batch, seq_k),
        seed(dropout_p > 0 ? seed_value(seed_tensor) : 0),
        q(q_rows),
        k(k_rows),
        v(v_rows),
        direct(dtype_of_q == acc) {}

  // The gathered keys of sequence b: key_pos[key_start[b] + j] is the position of its
  // j-th valid key; slot[slot_start[b] + t] is the gathered index of position t (-1
  // for padding); below[slot_start[b] + b + t] counts the valid keys before position
  // t, for t in [0, k_len[b]].
  std::vector<int32_t> key_pos, slot, below;
  std::vector<int64_t> key_start, slot_start;
  // Whether sequence b's valid keys are consecutive positions (padding only at the ends),
  // so that a product can read them in place.
  std::vector<bool> keys_consecutive;

  int64_t keys(int64_t b) const { return key_start[b + 1] - key_start[b]; }
  const int32_t* positions(int64_t b) const { return key_pos.data() + key_start[b]; }
  const int32_t* slots(int64_t b) const { return slot.data() + slot_start[b]; }

  // Query i of sequence b attends to the gathered keys [first(b, i), limit(b, i)): the
  // valid ones at positions i + off - window_left .. i + off + right, off = k_len - q_len
  // (bottom-right alignment), right = 0 when causal. The window bounds positions, not
  // gathered indices: `below` turns each bound into a gathered index, so the padding
  // inside a window takes no room in it. Both ends grow with i.
  int32_t limit(int64_t b, int64_t i) const {
    const int64_t right = causal ? 0 : window_right;
    if (right < 0) return static_cast<int32_t>(keys(b));
    return valid_before(b, i + k_len[b] - q_len[b] + right + 1);
  }
  int32_t first(int64_t b, int64_t i) const {
    if (window_left < 0) return 0;
    return valid_before(b, i + k_len[b] - q_len[b] - window_left);
  }
  // The number of valid keys of sequence b before position t (clamped into the sequence).
  int32_t valid_before(int64_t b, int64_t t) const {
    return below[slot_start[b] + b + std::clamp<int64_t>(t, 0, k_len[b])];
  }

  // The query-key pairs that the block of queries from i0 walks: from its first row's
  // first key to its last row's limit.
  int64_t block_work(int64_t b, int64_t i0) const {
    const int64_t rows = std::min(kBlockQ, q_len[b] - i0);
    return rows > 0 ? rows * (limit(b, i0 + rows - 1) - first(b, i0)) : 0;
  }

  // Query heads per key/value head.
  int64_t group_size() const { return kv_heads ? heads / kv_heads : 1; }
  // Whether a set stacks the heads of one group (Heads::flat): where that fills a set at
  // least as well as one rank of consecutive groups would. Never for ungrouped heads.
  bool flat() const {
    const int64_t g = group_size();
    return g > 1 && std::min(head_group, g) >= std::min(head_group, kv_heads);
  }
  // The key/value heads of one backward task, which owns their dK and dV and therefore
  // every query head that reads them, and how many such groups a sequence has.
  int64_t kv_group() const { return flat() ? 1 : std::min(head_group, kv_heads); }
  int64_t kv_groups() const { return kv_heads ? (kv_heads + kv_group() - 1) / kv_group() : 0; }
  // The sets of query heads (Heads) that read key/value group kvg: set(kvg, i), i < sets().
  int64_t sets() const { return flat() ? (group_size() + head_group - 1) / head_group : group_size(); }
  Heads set(int64_t kvg, int64_t i) const {
    const int64_t g = group_size();
    if (flat()) {
      const int64_t h0 = kvg * g + i * head_group;
      return {h0, 1, std::min(head_group, g - i * head_group), kvg, true};
    }
    const int64_t kv0 = kvg * kv_group();
    return {kv0 * g + i, g, std::min(kv_group(), kv_heads - kv0), kv0, false};
  }

  int64_t max_keys() const {
    int64_t n = 0;
    for (int64_t b = 0; b < batch; ++b) n = std::max(n, keys(b));
    return n;
  }

  // Fills the key tables; mask is bool [batch, k_len], True = padding, or undefined.
  void gather_keys(const at::Tensor& mask) {
    const bool* m = mask.defined() ? mask.data_ptr<bool>() : nullptr;
    key_start.assign(1, 0);
    slot_start.clear();
    for (int64_t b = 0; b < batch; ++b) {
      slot_start.push_back(static_cast<int64_t>(slot.size()));
      int32_t count = 0;
      for (int64_t t = 0; t < k_len[b]; ++t) {
        below.push_back(count);
        const bool valid = !m || !m[b * mask.stride(0) + t * mask.stride(1)];
        slot.push_back(valid ? count : -1);
        if (valid) {
          key_pos.push_back(static_cast<int32_t>(t));
          ++count;
        }
      }
      below.push_back(count);
      key_start.push_back(static_cast<int64_t>(key_pos.size()));
      keys_consecutive.push_back(count == 0 || key_pos.back() - key_pos[key_start[b]] + 1 == count);
    }
    choose_head_group();
  }

  // kHeadGroup heads per set, or half as many where the forward would make fewer than
  // kFewTasks tasks (sequences x sets x query blocks) with them.
  void choose_head_group() {
    int64_t blocks = 0;
    for (int64_t b = 0; b < batch; ++b) blocks += (q_len[b] + kBlockQ - 1) / kBlockQ;
    head_group = kHeadGroup;
    if (blocks * kv_groups() * sets() < kFewTasks) head_group = kHeadGroup / 2;
  }
};

// A task's products are sized for one core and run on its thread. MKL (torch's BLAS on
// x86) would otherwise spread each over its own threads wherever a task runs outside a
// parallel region (a single task, or a call from inside another parallel region; torch
// turns MKL's dynamic adjustment off): on small products that costs more than it gains,
// up to hundreds of milliseconds of spinning on a busy machine, and it would make the
// results depend on the number of threads. The setting is thread-local and restored
// after; the weak symbol is null (and this a no-op) without MKL. (It is MKL's C entry
// point, what mkl_service.h's mkl_set_num_threads_local expands to; the lower-case
// symbol is the Fortran one, which takes a pointer.)
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));

class OneBlasThread {
 public:
  OneBlasThread() : before_(MKL_Set_Num_Threads_Local ? MKL_Set_Num_Threads_Local(1) : 0) {}
  ~OneBlasThread() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(before_);
  }
  OneBlasThread(const OneBlasThread&) = delete;
  OneBlasThread& operator=(const OneBlasThread&) = delete;

 private:
  int before_;
};

// Runs work(t, workspace) for every task t in [0, n) on ATen's threads, each thread with
// its own workspace from make_workspace(); a thread takes the next task when it finishes
// one, the costliest first (cost(t): any measure proportional to a task's time).
// at::parallel_for alone hands each thread an equal count of consecutive tasks: with
// sequences of unequal lengths, one of two threads got 61% of a padded BERT batch's
// attention. A task writes only its own outputs, so which thread runs it changes nothing.
template <class Cost, class MakeWorkspace, class Work>
void run_balanced(int64_t n, Cost cost, MakeWorkspace make_workspace, Work work) {
  if (n == 0) return;
  std::vector<int64_t> costs(n), order(n);
  for (int64_t t = 0; t < n; ++t) costs[t] = cost(t);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return costs[a] > costs[b]; });
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    OneBlasThread one_blas_thread;
    auto ws = make_workspace();
    for (int64_t i = next++; i < n; i = next++) work(order[i], ws);
  });
}

// A buffer of at least n elements for this thread. Up to kKeptBytes it is kept for the
// thread's next call: a fresh allocation of that size comes from mmap, and touching its
// pages again on every call costs more than the attention of a short sequence.
constexpr int64_t kKeptBytes = int64_t(8) << 20;

at::Tensor thread_buffer(int64_t n, const at::TensorOptions& options) {
  thread_local at::Tensor kept;
  const int64_t bytes = n * static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
  if (kept.defined() && kept.dtype() == options.dtype() && kept.numel() >= n) return kept;
  auto fresh = at::empty({n}, options);
  if (bytes <= kKeptBytes) kept = fresh;
  return fresh;
}

// A matrix operand of the products, per head of a group: rows `ld` elements apart,
// heads `head_ld` apart, unit column stride.
struct Operand {
  char* data;
  int64_t head_ld, ld;
};

// Matrices of a group of heads, in the accumulation type: element (h, i, j) at
// data + (h * head + i * row + j * col) elements.
struct Mats {
  void* data;
  int64_t head, row, col;

  Mats t() const { return {data, head, col, row}; }  // the transposes
};

// Products of at most this many multiply-adds (all heads together) run as plain loops: at
// the sizes of a short sequence, ATen's bmm costs more in its dispatch and the views it
// takes than in arithmetic.
constexpr int64_t kLoopProduct = 4096;

template <typename A>
void loop_product(int64_t heads, int64_t m, int64_t n, int64_t k, const Mats& a, const Mats& b,
                  const Mats& c, bool accumulate, A alpha) {
  const A* pa = static_cast<const A*>(a.data);
  const A* pb = static_cast<const A*>(b.data);
  A* pc = static_cast<A*>(c.data);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) {
        A sum = 0;
        for (int64_t p = 0; p < k; ++p)
          sum += pa[h * a.head + i * a.row + p * a.col] * pb[h * b.head + p * b.row + j * b.col];
        A& out = pc[h * c.head + i * c.row + j * c.col];
        out = accumulate ? out + alpha * sum : alpha * sum;
      }
}

// c = alpha * a b, or c += alpha * a b, for each of `heads`: a [m, k], b [k, n], c [m, n].
// The products take the softmax scale, which Q K^T left out, as their alpha.
void product(const at::TensorOptions& options, int64_t heads, int64_t m, int64_t n, int64_t k,
             const Mats& a, const Mats& b, const Mats& c, bool accumulate, double alpha) {
  if (heads * m * n * k <= kLoopProduct) {
    if (options.dtype() == at::kDouble) loop_product<double>(heads, m, n, k, a, b, c, accumulate, alpha);
    else loop_product<float>(heads, m, n, k, a, b, c, accumulate, static_cast<float>(alpha));
    return;
  }
  auto view = [&](const Mats& x, int64_t rows, int64_t cols) {
    return at::from_blob(x.data, {heads, rows, cols}, {x.head, x.row, x.col}, options);
  };
  auto out = view(c, m, n);
  if (!accumulate && alpha == 1.0) at::bmm_out(out, view(a, m, k), view(b, k, n));
  else at::baddbmm_out(out, out, view(a, m, k), view(b, k, n), accumulate ? 1.0 : 0.0, alpha);
}

// One thread's buffers, in the accumulation type. Sized for `group` heads of a query
// block and of all the keys of the longest sequence (a set of Heads reads at most as many
// key/value heads as it has query heads).
struct Workspace {
  at::Tensor storage;
  at::TensorOptions options;
  int64_t acc_size;
  void *q, *k, *v, *s, *dp, *o, *dout, *dk, *dv, *m, *l, *delta;
  std::vector<int32_t> start, limit, relative_start, relative;
  std::vector<uint8_t> keep, scratch;

  Workspace(const Problem& pb, bool backward, int64_t group) : options(at::dtype(pb.acc)) {
    const int64_t n = pb.max_keys(), tile = kBlockQ * kBlockK;
    // Each buffer's size in elements, carved from one allocation in this order.
    const int64_t sizes[] = {group * kBlockQ * pb.dk, group * n * pb.dk, group * n * pb.dv,
                             group * tile, backward ? group * tile : 0,
                             group * kBlockQ * std::max(pb.dk, pb.dv),
                             backward ? group * kBlockQ * pb.dv : 0,
                             backward ? group * n * pb.dk : 0, backward ? group * n * pb.dv : 0,
                             group * kBlockQ, group * kBlockQ, group * kBlockQ};
    void** slots[] = {&q, &k, &v, &s, &dp, &o, &dout, &dk, &dv, &m, &l, &delta};
    storage = thread_buffer(std::accumulate(std::begin(sizes), std::end(sizes), int64_t(0)), options);
    acc_size = static_cast<int64_t>(storage.element_size());
    char* at = static_cast<char*>(storage.data_ptr());
    for (size_t i = 0; i < std::size(sizes); ++i) {
      *slots[i] = at;
      at += sizes[i] * acc_size;
    }
    start.resize(kBlockQ);
    limit.resize(kBlockQ);
    relative_start.resize(kBlockQ);
    relative.resize(kBlockQ);
    if (pb.dropout_p > 0) {
      keep.resize(tile);
      scratch.resize(*std::max_element(pb.k_len.begin(), pb.k_len.end()));
    }
  }

  void* at(void* data, int64_t offset) const { return static_cast<char*>(data) + offset * acc_size; }
  // A dense [rows, cols] matrix over an acc buffer.
  at::Tensor mat(void* data, int64_t rows, int64_t cols) const {
    return at::from_blob(data, {rows, cols}, options);
  }
  // Dense [heads, rows, cols] matrices over an acc buffer.
  Mats dense(void* data, int64_t rows, int64_t cols) const { return {data, rows * cols, cols, 1}; }
  // Rows [first, ...) of the heads of an operand.
  Mats rows_of(const Operand& x, int64_t first) const {
    return {x.data + first * x.ld * acc_size, x.head_ld, x.ld, 1};
  }
  // Zeroes rows [from, to) of `heads` heads of an operand, `cols` elements each.
  void zero(const Operand& x, int64_t heads, int64_t from, int64_t to, int64_t cols) const {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = from; r < to; ++r)
        std::memset(x.data + (h * x.head_ld + r * x.ld) * acc_size, 0, cols * acc_size);
  }

  // Rows [row, row + n) of heads h0, h0 + step, ... (`heads` of them) of sequence b of
  // `src` (or, with `gather`, its rows row + gather[j]): in place when `in_place` allows
  // and the products can read them so, else packed into `buffer`, dense.
  Operand operand(const Problem& pb, const Rows& src, int64_t b, int64_t h0, int64_t step,
                  int64_t heads, int64_t row, const int32_t* gather, bool in_place, int64_t n,
                  int64_t cols, void* buffer) const {
    if (in_place && pb.direct && (src.col == 1 || cols == 1))
      return {src.at(b, h0, row + (gather && n ? gather[0] : 0)), src.head * step, src.row};
    for (int64_t j = 0; j < heads; ++j)
      cpu::attn_pack(pb.dtype, src.at(b, h0 + j * step, row), src.row, src.col, gather, n, cols,
                              at(buffer, j * n * cols));
    return {static_cast<char*>(buffer), n * cols, cols};
  }
  // Rows [row, row + n) of the query heads of `hs` (of q, or of dO): packed when the set is
  // flat, where the heads' rows must follow one another.
  Operand queries(const Problem& pb, const Rows& src, int64_t b, const Heads& hs, int64_t row,
                  int64_t n, int64_t cols, void* buffer) const {
    return operand(pb, src, b, hs.h0, hs.step, hs.count, row, nullptr, !hs.flat, n, cols, buffer);
  }
  // The gathered keys [from, from + n) of sequence b, of key/value heads kv0 .. kv0 + heads.
  Operand keys(const Problem& pb, const Rows& src, int64_t b, int64_t kv0, int64_t heads,
               int64_t from, int64_t n, int64_t cols, void* buffer) const {
    return operand(pb, src, b, kv0, 1, heads, pb.k_row0[b], pb.positions(b) + from,
                   pb.keys_consecutive[b], n, cols, buffer);
  }

  // Fills start and limit for queries i0 .. i0 + rows of sequence b; returns the gathered
  // keys [lo, reach) that the block walks, its rows' windows together. Key blocks wholly
  // outside them, before or after, are never computed.
  std::pair<int64_t, int64_t> set_limits(const Problem& pb, int64_t b, int64_t i0, int64_t rows) {
    int32_t lo = std::numeric_limits<int32_t>::max(), reach = 0;
    for (int64_t r = 0; r < rows; ++r) {
      start[r] = pb.first(b, i0 + r);
      limit[r] = pb.limit(b, i0 + r);
      lo = std::min(lo, start[r]);
      reach = std::max(reach, limit[r]);
    }
    return {std::min(lo, reach), reach};
  }

  // The tile of queries i0 .. i0 + rows of (b, h) against gathered keys [k0, k0 + cols).
  cpu::AttnTile tile(const Problem& pb, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t k0,
                     int64_t cols) {
    for (int64_t r = 0; r < rows; ++r) {
      relative_start[r] = static_cast<int32_t>(std::clamp<int64_t>(start[r] - k0, 0, cols));
      relative[r] = static_cast<int32_t>(std::clamp<int64_t>(limit[r] - k0, 0, cols));
    }
    const int32_t* key_pos = pb.positions(b) + k0;
    const uint8_t* mask = nullptr;
    if (pb.dropout_p > 0) {
      // The stream's elements [b, h, i0 + r, key_pos[j]].
      const auto offset = static_cast<uint64_t>(((b * pb.heads + h) * pb.seq_q + i0) * pb.seq_k);
      cpu::attn_dropout_keep(pb.seed, pb.dropout_p, offset, pb.seq_k, rows, key_pos, cols,
                                      scratch.data(), keep.data());
      mask = keep.data();
    }
    return {pb.dtype, rows, cols, relative_start.data(), relative.data(), pb.scale,
            pb.has_bias ? pb.bias.at(b, h, i0) : nullptr, pb.bias.row, pb.bias.col, key_pos, mask,
            pb.dropout_p};
  }
};

void forward_query_block(const Problem& pb, Workspace& ws, int64_t b, const Heads& hs,
                         int64_t i0, const Rows& out, const Rows& lse) {
  const int64_t rows = std::min(kBlockQ, pb.q_len[b] - i0), row = pb.q_row0[b] + i0;
  const auto [lo, reach] = ws.set_limits(pb, b, i0, rows);
  const int64_t heads = hs.count, batch = hs.batch(), m = hs.rows(rows);
  const Mats q = ws.rows_of(ws.queries(pb, pb.q, b, hs, row, rows, pb.dk, ws.q), 0);
  // Only the keys the block walks are packed, and K and V come from the set's key/value
  // heads, read in place where the products can.
  const Operand k = ws.keys(pb, pb.k, b, hs.kv0, hs.kv_count(), lo, reach - lo, pb.dk, ws.k);
  const Operand v = ws.keys(pb, pb.v, b, hs.kv0, hs.kv_count(), lo, reach - lo, pb.dv, ws.v);
  const Mats o = ws.dense(ws.o, rows, pb.dv);
  for (int64_t k0 = lo; k0 < reach; k0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, reach - k0);
    const Mats s = ws.dense(ws.s, rows, cols);
    product(ws.options, batch, m, cols, pb.dk, q, ws.rows_of(k, k0 - lo).t(), s, false, 1.0);
    for (int64_t j = 0; j < heads; ++j) {
      const cpu::AttnTile tile = ws.tile(pb, b, hs.h(j), i0, rows, k0, cols);
      cpu::attn_forward_block(&tile, k0 == lo, ws.at(ws.s, j * rows * cols), ws.at(ws.m, j * rows),
                              ws.at(ws.l, j * rows), ws.at(ws.o, j * rows * pb.dv), pb.dv);
    }
    product(ws.options, batch, m, pb.dv, cols, s, ws.rows_of(v, k0 - lo), o, k0 > lo, 1.0);
  }
  if (reach == lo) {  // no key at all: every row is empty
    ws.mat(ws.m, 1, heads * rows).fill_(-std::numeric_limits<double>::infinity());
    ws.mat(ws.l, 1, heads * rows).zero_();
  }
  for (int64_t j = 0; j < heads; ++j)
    cpu::attn_forward_finish(pb.dtype, rows, pb.dv, ws.at(ws.m, j * rows), ws.at(ws.l, j * rows),
                             ws.at(ws.o, j * rows * pb.dv), lse.at(b, hs.h(j), row),
                             out.at(b, hs.h(j), row), out.row, out.col);
}

void forward(const Problem& pb, const Rows& out, const Rows& lse) {
  const int64_t longest = pb.batch ? *std::max_element(pb.q_len.begin(), pb.q_len.end()) : 0;
  const int64_t blocks = (longest + kBlockQ - 1) / kBlockQ;
  const int64_t per_group = pb.sets(), sets = pb.kv_groups() * per_group;
  // Task t: sequence b, a set of heads, queries from i0.
  auto b_of = [&](int64_t t) { return t / (sets * blocks); };
  auto i0_of = [&](int64_t t) { return t % blocks * kBlockQ; };
  run_balanced(
      pb.batch * sets * blocks, [&](int64_t t) { return pb.block_work(b_of(t), i0_of(t)); },
      [&] { return Workspace(pb, false, std::min(pb.head_group, pb.heads)); },
      [&](int64_t t, Workspace& ws) {
        const int64_t b = b_of(t), set = t / blocks % sets, i0 = i0_of(t);
        if (i0 < pb.q_len[b])
          forward_query_block(pb, ws, b, pb.set(set / per_group, set % per_group), i0, out, lse);
      });
}

struct Grads {
  Rows out, lse, grad, dq, dk, dv;
  const Rows* dbias;  // null without a bias gradient; strides 0 where it is broadcast
};

// The gradients of key/value group kvg of sequence b: its dK and dV, summed over every
// query head that reads them, and those query heads' dQ.
void backward_heads(const Problem& pb, Workspace& ws, int64_t b, int64_t kvg, const Grads& g) {
  const int64_t n = pb.keys(b);
  const Heads first_set = pb.set(kvg, 0);
  const int64_t kv0 = first_set.kv0, kv_heads = first_set.kv_count();
  const Operand k = ws.keys(pb, pb.k, b, kv0, kv_heads, 0, n, pb.dk, ws.k);
  const Operand v = ws.keys(pb, pb.v, b, kv0, kv_heads, 0, n, pb.dv, ws.v);
  // The products write the gradients in place when they are in the accumulation type,
  // with unit column strides, and the valid keys are consecutive (the padding keys, at
  // the ends, are zeroed there after); otherwise into the workspace, unpacked after. A
  // flat set's dQ is stacked like its rows, so it goes through the workspace.
  const bool in_place = pb.direct && g.dq.col == 1 && g.dk.col == 1 && g.dv.col == 1 &&
                        pb.keys_consecutive[b];
  const bool dq_in_place = in_place && !first_set.flat;
  const int64_t key_row = pb.k_row0[b], first_key = n ? pb.positions(b)[0] : 0;
  auto in_grad = [&](const Rows& grad, int64_t h0, int64_t step, int64_t row) {
    return Operand{grad.at(b, h0, row), grad.head * step, grad.row};
  };
  // dK and dV accumulate over query blocks and over the sets of query heads; a key
  // block's first product overwrites them (no zero-fill), so [from, filled) tracks which
  // of their rows hold a value. The blocks' key ranges move right with the queries and
  // leave no gap between them (each row's window starts at or before the previous row's
  // end), so one range covers what they wrote.
  const Operand dk_acc = in_place ? in_grad(g.dk, kv0, 1, key_row + first_key)
                                  : Operand{static_cast<char*>(ws.dk), n * pb.dk, pb.dk};
  const Operand dv_acc = in_place ? in_grad(g.dv, kv0, 1, key_row + first_key)
                                  : Operand{static_cast<char*>(ws.dv), n * pb.dv, pb.dv};
  int64_t from = -1, filled = 0;
  auto zero_rows = [&](const Operand& dk, const Operand& dv, int64_t first_row, int64_t end_row) {
    ws.zero(dk, kv_heads, first_row, end_row, pb.dk);
    ws.zero(dv, kv_heads, first_row, end_row, pb.dv);
  };
  for (int64_t i0 = 0; i0 < pb.q_len[b]; i0 += kBlockQ) {
    const int64_t rows = std::min(kBlockQ, pb.q_len[b] - i0), row = pb.q_row0[b] + i0;
    const auto [lo, reach] = ws.set_limits(pb, b, i0, rows);
    if (reach > lo && from < 0) from = filled = lo;
    // With one key block the tile holds whole rows, and the kernel derives delta from it
    // (exactly, and without reading O); otherwise delta comes from O before the walk.
    const bool own_delta = reach - lo <= kBlockK;
    // The sets in a fixed order, each over the same key blocks (the window is the same
    // for every head): the sums into dK and dV run in one order.
    for (int64_t set = 0; set < pb.sets(); ++set) {
      const Heads hs = pb.set(kvg, set);
      const int64_t heads = hs.count, batch = hs.batch(), m = hs.rows(rows);
      const Mats q = ws.rows_of(ws.queries(pb, pb.q, b, hs, row, rows, pb.dk, ws.q), 0);
      const Operand dout_rows = ws.queries(pb, g.grad, b, hs, row, rows, pb.dv, ws.dout);
      const Mats dout = ws.rows_of(dout_rows, 0);
      if (!own_delta)
        for (int64_t j = 0; j < heads; ++j)
          cpu::attn_delta(pb.dtype, g.out.at(b, hs.h(j), row), g.out.row, g.out.col,
                          dout_rows.data + j * dout_rows.head_ld * ws.acc_size, dout_rows.ld,
                          rows, pb.dv, ws.at(ws.delta, j * rows));
      const Operand dq_rows = dq_in_place ? in_grad(g.dq, hs.h0, hs.step, row)
                                          : Operand{static_cast<char*>(ws.o), rows * pb.dk, pb.dk};
      const Mats dq = ws.rows_of(dq_rows, 0);
      for (int64_t k0 = lo; k0 < reach; k0 += kBlockK) {
        const int64_t cols = std::min(kBlockK, reach - k0);
        const Mats kb = ws.rows_of(k, k0);
        const Mats s = ws.dense(ws.s, rows, cols), dp = ws.dense(ws.dp, rows, cols);
        product(ws.options, batch, m, cols, pb.dk, q, kb.t(), s, false, 1.0);
        product(ws.options, batch, m, cols, pb.dv, dout, ws.rows_of(v, k0).t(), dp, false, 1.0);
        for (int64_t j = 0; j < heads; ++j) {
          const cpu::AttnTile tile = ws.tile(pb, b, hs.h(j), i0, rows, k0, cols);
          cpu::attn_backward_block(&tile, ws.at(ws.s, j * rows * cols),
                                   ws.at(ws.dp, j * rows * cols), g.lse.at(b, hs.h(j), row),
                                   ws.at(ws.delta, j * rows), own_delta);
          if (g.dbias)
            cpu::attn_bias_grad(&tile, ws.at(ws.dp, j * rows * cols),
                                g.dbias->at(b, hs.h(j), i0), g.dbias->row, g.dbias->col);
        }
        // s now holds the weights that multiplied V, dp holds dS. A flat set's products
        // contract over all its heads' rows: their sum into the shared dK and dV.
        const bool fresh = k0 >= filled;
        if (!fresh) zero_rows(dk_acc, dv_acc, filled, k0 + cols);
        product(ws.options, batch, cols, pb.dv, m, s.t(), dout, ws.rows_of(dv_acc, k0), !fresh,
                1.0);
        product(ws.options, batch, cols, pb.dk, m, dp.t(), q, ws.rows_of(dk_acc, k0), !fresh,
                pb.scale);
        product(ws.options, batch, m, pb.dk, cols, dp, kb, dq, k0 > lo, pb.scale);
      }
      if (reach > lo) filled = std::max(filled, reach);
      if (reach == lo) ws.zero(dq_rows, heads, 0, rows, pb.dk);
      if (!dq_in_place)
        cpu::attn_unpack(pb.dtype, ws.o, nullptr, rows, pb.dk, g.dq.at(b, hs.h0, row), g.dq.row,
                         g.dq.col, heads, rows * pb.dk, g.dq.head * hs.step);
    }
  }
  if (from < 0) from = filled = 0;
  zero_rows(dk_acc, dv_acc, 0, from);  // keys no query attends to
  zero_rows(dk_acc, dv_acc, filled, n);
  // Padding keys get zero gradients.
  if (in_place) {
    const Operand dk_all = in_grad(g.dk, kv0, 1, key_row), dv_all = in_grad(g.dv, kv0, 1, key_row);
    zero_rows(dk_all, dv_all, 0, first_key);
    zero_rows(dk_all, dv_all, first_key + n, pb.k_len[b]);
    return;
  }
  cpu::attn_unpack(pb.dtype, ws.dk, pb.slots(b), pb.k_len[b], pb.dk, g.dk.at(b, kv0, key_row),
                   g.dk.row, g.dk.col, kv_heads, n * pb.dk, g.dk.head);
  cpu::attn_unpack(pb.dtype, ws.dv, pb.slots(b), pb.k_len[b], pb.dv, g.dv.at(b, kv0, key_row),
                   g.dv.row, g.dv.col, kv_heads, n * pb.dv, g.dv.head);
}

void backward(const Problem& pb, const Grads& g) {
  // A task owns the (sequence, key/value group) pairs whose bias gradients add into one
  // slice of dbias: all sequences when the bias is shared across the batch, all groups
  // when shared across heads. It visits them in order.
  const bool all_b = g.dbias && g.dbias->batch == 0, all_h = g.dbias && g.dbias->head == 0;
  const int64_t groups = pb.kv_groups();
  const int64_t tb = all_b ? 1 : pb.batch, tg = all_h ? 1 : groups;
  auto sequences = [&](int64_t t) {  // [first, last) of task t
    const int64_t bo = t / tg;
    return std::pair<int64_t, int64_t>(all_b ? 0 : bo, all_b ? pb.batch : bo + 1);
  };
  auto cost = [&](int64_t t) {
    int64_t work = 0;
    for (auto [b, last] = sequences(t); b < last; ++b)
      for (int64_t i0 = 0; i0 < pb.q_len[b]; i0 += kBlockQ) work += pb.block_work(b, i0);
    return work;
  };
  run_balanced(tb * tg, cost, [&] { return Workspace(pb, true, std::min(pb.head_group, pb.heads)); },
               [&](int64_t t, Workspace& ws) {
                 const int64_t go = t % tg;
                 for (auto [b, last] = sequences(t); b < last; ++b)
                   for (int64_t gi = all_h ? 0 : go; gi < (all_h ? groups : go + 1); ++gi)
                     backward_heads(pb, ws, b, gi, g);
               });
}

Problem padded_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& key_padding_mask,
                       const std::optional<at::Tensor>& attn_bias, bool causal,
                       int64_t window_left, int64_t window_right, double dropout_p, double scale,
                       const at::Tensor& seed) {
  Problem pb(padded_attention(q, k, v, key_padding_mask, causal, window_left, window_right, dropout_p, scale, check_cpu),
             padded_rows(q), padded_rows(k), padded_rows(v), q.scalar_type(), seed);
  pb.gather_keys(present(key_padding_mask) ? *key_padding_mask : at::Tensor());
  if (present(attn_bias)) {
    check_cpu(*attn_bias, "attn_bias");
    TORCH_CHECK_TYPE(attn_bias->scalar_type() == q.scalar_type(), "attn_bias must have q's dtype");
    // Broadcast dimensions become stride 0: the bias is read in place, never expanded.
    pb.bias = padded_rows(attn_bias->expand({pb.batch, pb.heads, pb.seq_q, pb.seq_k}));
    pb.has_bias = true;
  }
  return pb;
}

// The first row and length of each sequence from offsets cu (int32 [batch + 1]), checked
// against the tensor's `total` rows and the longest length the call gave. (The messages are
// fusedlm.ops.attention_varlen's: the cpu backend checks the offsets here alone.)
void read_offsets(const at::Tensor& cu, const char* name, int64_t total, int64_t max_len,
                  const char* max_name, std::vector<int64_t>& row0, std::vector<int64_t>& len) {
  const int32_t* c = cu.data_ptr<int32_t>();
  const int64_t st = cu.stride(0), n = cu.size(0) - 1;
  TORCH_CHECK_VALUE(c[0] == 0, name, " must start at 0, got ", c[0]);
  int64_t longest = 0;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t len_b = int64_t(c[(b + 1) * st]) - c[b * st];
    TORCH_CHECK_VALUE(len_b >= 0, name, " must be non-decreasing");
    longest = std::max(longest, len_b);
  }
  TORCH_CHECK_VALUE(c[n * st] == total, name, " must end at the number of tokens, ", total,
                    ", got ", c[n * st]);
  TORCH_CHECK_VALUE(longest <= max_len, name, " has a sequence of ", longest,
                    " tokens, more than ", max_name, " = ", max_len);
  for (int64_t b = 0; b < n; ++b) {
    const int64_t len_b = int64_t(c[(b + 1) * st]) - c[b * st];
    row0[b] = c[b * st];
    len[b] = len_b;
  }
}

Problem varlen_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                       int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                       int64_t window_left, int64_t window_right, double dropout_p, double scale,
                       const at::Tensor& seed) {
  Problem pb(varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, window_left, window_right, dropout_p, scale, check_cpu),
             packed_rows(q), packed_rows(k), packed_rows(v), q.scalar_type(), seed);
  read_offsets(cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q", pb.q_row0,
               pb.q_len);
  read_offsets(cu_seqlens_k, "cu_seqlens_k", k.size(0), max_seqlen_k, "max_seqlen_k", pb.k_row0,
               pb.k_len);
  pb.gather_keys(at::Tensor());
  return pb;
}

Rows lse_rows(const at::Tensor& lse, bool varlen) {
  // Padded: [batch, heads, seq_q]. Varlen: [heads, total_q], rows indexed by token.
  return {static_cast<char*>(lse.data_ptr()), static_cast<int64_t>(lse.element_size()),
          varlen ? 0 : lse.stride(0), lse.stride(varlen ? 0 : 1), 1, 0};
}

// attention_with_kvcache: appends k_new/v_new to the caches at each sequence's length,
// then poses the decoding step as a padded, causal Problem over the caches read in place
// ([batch, max_cache_len, kv_heads, dim] seen as [batch, kv_heads, seq, dim]): sequence b's keys
// are positions [leftpad_b, total_b), total_b = cache_seqlens[b] + seqlen_new, and the
// causal limit aligns its queries to total_b (the bottom right of its own keys).
Problem kvcache_problem(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& cache_seqlens, const std::optional<at::Tensor>& k_new,
                        const std::optional<at::Tensor>& v_new,
                        const std::optional<at::Tensor>& cache_leftpad, double scale) {
  TORCH_CHECK_VALUE(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4,
                    "q and the caches must have 4 dimensions");
  const auto qt = q.transpose(1, 2), kt = k_cache.transpose(1, 2), vt = v_cache.transpose(1, 2);
  Problem pb(padded_attention(qt, kt, vt, std::nullopt, true, -1, -1, 0.0, scale, check_cpu),
             padded_rows(qt), padded_rows(kt), padded_rows(vt), q.scalar_type(), at::Tensor());
  const int64_t batch = pb.batch, max_len = pb.seq_k;
  auto lengths = [&](const at::Tensor& t, const char* name) {
    check_cpu(t, name);
    TORCH_CHECK_VALUE(t.scalar_type() == at::kInt && t.dim() == 1 && t.size(0) == batch, name,
                      " must be int32 [batch]");
    std::vector<int64_t> values(batch);
    for (int64_t b = 0; b < batch; ++b) values[b] = t.data_ptr<int32_t>()[b * t.stride(0)];
    return values;
  };
  const std::vector<int64_t> cached = lengths(cache_seqlens, "cache_seqlens");
  const bool append = present(k_new);
  TORCH_CHECK_VALUE(append == present(v_new), "k_new and v_new must be given together");
  const int64_t seq_new = append ? k_new->size(1) : 0;
  if (append)
    for (auto [t, cache, name] : {std::tuple{&*k_new, &k_cache, "k_new"},
                                  std::tuple{&*v_new, &v_cache, "v_new"}}) {
      check_cpu(*t, name);
      TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), name, " must have q's dtype");
      TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == batch && t->size(1) == seq_new &&
                            t->size(2) == pb.kv_heads && t->size(3) == cache->size(3),
                        name, " must be [batch, seqlen_new, kv_heads, head_dim] like its cache");
    }
  for (int64_t b = 0; b < batch; ++b) {
    // (the messages are fusedlm.ops.attention_with_kvcache's: the cpu backend checks the
    // lengths here alone)
    TORCH_CHECK_VALUE(cached[b] >= 0 && cached[b] + seq_new <= max_len, "cache_seqlens[", b,
                      "] + seqlen_new = ", cached[b], " + ", seq_new, " must lie in [0, max_cache_len = ",
                      max_len, "]");
    pb.k_len[b] = cached[b] + seq_new;
  }
  at::Tensor mask;
  if (present(cache_leftpad)) {
    const std::vector<int64_t> pad = lengths(*cache_leftpad, "cache_leftpad");
    for (int64_t b = 0; b < batch; ++b)
      TORCH_CHECK_VALUE(pad[b] >= 0 && pad[b] <= pb.k_len[b], "cache_leftpad[", b, "] = ",
                        pad[b], " must lie in [0, cache_seqlens[", b, "] + seqlen_new = ",
                        pb.k_len[b], "]");
    mask = at::arange(max_len, cache_leftpad->options().dtype(at::kLong)).unsqueeze(0) <
           cache_leftpad->unsqueeze(1);
  }
  // Only now that every check has passed do the caches change.
  if (append)
    for (int64_t b = 0; b < batch; ++b) {
      k_cache[b].narrow(0, cached[b], seq_new).copy_((*k_new)[b]);
      v_cache[b].narrow(0, cached[b], seq_new).copy_((*v_new)[b]);
    }
  pb.gather_keys(mask);
  return pb;
}

}  // namespace

// Attention over q [batch, heads, seq, head_dim] and k/v [batch, kv_heads, seq_k, head_dim]
// (any strides), within window_left/window_right (-1: unbounded). key_padding_mask is
// bool [batch, seq_k], True = padding; attn_bias is broadcastable to [batch, heads, seq_q,
// seq_k]. Returns (out, lse): lse [batch, heads, seq_q] is the rows' log-sum-exp in the
// accumulation type (+inf for rows that attend to nothing), kept for backward.
// CUDA: bfloat16 and float16, head_dim 64 or 128 for q, k and v alike, no attn_bias (the
// Python limits route other calls elsewhere); lse is float32.
std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_bias,
    bool causal, int64_t window_left, int64_t window_right, double dropout_p, double scale,
    const at::Tensor& seed) {
  const Problem pb =
      padded_problem(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                     dropout_p, scale, seed);
  auto out = empty_like_layout(q, {pb.batch, pb.heads, q.size(2), pb.dv}, q.scalar_type());
  auto lse = at::empty({pb.batch, pb.heads, q.size(2)}, q.options().dtype(pb.acc));
  forward(pb, padded_rows(out), lse_rows(lse, false));
  return {out, lse};
}
FUSEDLM_KERNEL(attention_forward);

// (dq, dk, dv, dbias); dbias, in attn_bias's shape, is undefined unless bias_grad. The CUDA
// backward is deterministic: every gradient element is written by one block, without atomics.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_bias, bool causal, int64_t window_left,
    int64_t window_right, double dropout_p, double scale, const at::Tensor& seed, bool bias_grad) {
  const Problem pb =
      padded_problem(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                     dropout_p, scale, seed);
  check_saved(pb, q, grad, out, lse, pb.acc, check_cpu);
  auto dq = empty_like_layout(q, q.sizes(), q.scalar_type());
  auto dk = empty_like_layout(k, k.sizes(), k.scalar_type());
  auto dv = empty_like_layout(v, v.sizes(), v.scalar_type());
  Grads g{padded_rows(out), lse_rows(lse, false), padded_rows(grad), padded_rows(dq),
          padded_rows(dk), padded_rows(dv), nullptr};
  at::Tensor dbias_acc;
  Rows dbias;
  if (bias_grad) {
    TORCH_CHECK_VALUE(pb.has_bias, "bias_grad needs attn_bias");
    // The gradient is summed over the dimensions the bias is broadcast along: accumulate
    // it in its own (4-d aligned) shape, with stride 0 along the broadcast ones.
    std::vector<int64_t> aligned(4 - attn_bias->dim(), 1);
    for (int64_t s : attn_bias->sizes()) aligned.push_back(s);
    dbias_acc = at::zeros(attn_bias->sizes(), q.options().dtype(pb.acc));
    dbias = padded_rows(dbias_acc.view(aligned));
    int64_t* strides[] = {&dbias.batch, &dbias.head, &dbias.row, &dbias.col};
    for (int d = 0; d < 4; ++d)
      if (aligned[d] == 1) *strides[d] = 0;
    g.dbias = &dbias;
  }
  backward(pb, g);
  at::Tensor db = bias_grad ? dbias_acc.to(attn_bias->scalar_type()) : at::Tensor();
  return {dq, dk, dv, db};
}
FUSEDLM_KERNEL(attention_backward);

// Attention over packed sequences, q [total_q, heads, head_dim], k/v [total_k, kv_heads, head_dim];
// sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1]. Returns (out, lse [heads, total_q]).
std::tuple<at::Tensor, at::Tensor> attention_varlen_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    int64_t window_left, int64_t window_right, double dropout_p, double scale,
    const at::Tensor& seed) {
  const Problem pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, window_left, window_right, dropout_p,
                                    scale, seed);
  auto out = empty_like_layout(q, {q.size(0), pb.heads, pb.dv}, q.scalar_type());
  auto lse = at::empty({pb.heads, q.size(0)}, q.options().dtype(pb.acc));
  forward(pb, packed_rows(out), lse_rows(lse, true));
  return {out, lse};
}
FUSEDLM_KERNEL(attention_varlen_forward);

// (dq, dk, dv).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    int64_t window_left, int64_t window_right, double dropout_p, double scale,
    const at::Tensor& seed) {
  const Problem pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, window_left, window_right, dropout_p,
                                    scale, seed);
  check_saved(pb, q, grad, out, lse, pb.acc, check_cpu);
  auto dq = empty_like_layout(q, q.sizes(), q.scalar_type());
  auto dk = empty_like_layout(k, k.sizes(), k.scalar_type());
  auto dv = empty_like_layout(v, v.sizes(), v.scalar_type());
  backward(pb, Grads{packed_rows(out), lse_rows(lse, true), packed_rows(grad), packed_rows(dq),
                     packed_rows(dk), packed_rows(dv), nullptr});
  return {dq, dk, dv};
}
FUSEDLM_KERNEL(attention_varlen_backward);

// Decoding attention over a KV cache: q [batch, seqlen_q, heads, head_dim], caches
// [batch, max_cache_len, kv_heads, head_dim]. k_new/v_new [batch, seqlen_new, ...] are first
// written into the caches at positions cache_seqlens[b] (int32 [batch]) onwards; query i
// then attends causally (bottom right) to keys [cache_leftpad[b], cache_seqlens[b] +
// seqlen_new). Returns out [batch, seqlen_q, heads, v's head_dim].
at::Tensor attention_with_kvcache_forward(const at::Tensor& q, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& cache_seqlens,
                                     const std::optional<at::Tensor>& k_new,
                                     const std::optional<at::Tensor>& v_new,
                                     const std::optional<at::Tensor>& cache_leftpad, double scale) {
  const Problem pb =
      kvcache_problem(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, scale);
  auto out = at::empty({pb.batch, q.size(1), pb.heads, pb.dv}, q.options());
  auto lse = at::empty({pb.batch, pb.heads, q.size(1)}, q.options().dtype(pb.acc));
  forward(pb, padded_rows(out.transpose(1, 2)), lse_rows(lse, false));
  return out;
}
FUSEDLM_KERNEL(attention_with_kvcache_forward);

}  // namespace fusedlm

#endif  // FUSEDLM_ISA
