// attention and attention_varlen on CUDA: FlashAttention-2 (Dao 2023) on the tensor
// cores with mma.sync m16n8k16, bf16/fp16 in and fp32 accumulation, for head dims 64
// and 128 (tensor_core.cuh has the fragment layouts every index below is derived from).
//
// Forward: a block of 4 warps (8 on the resident path below) owns 64 (128) query rows
// of one (sequence, head); each warp owns 16 rows and keeps their Q fragments, output
// accumulator, running max and sum in registers. Key tiles of 64 rows of K and V come
// through shared memory (cp.async); the online softmax works in base 2 with
// scale * log2(e) folded into the scores. It writes O and the natural log-sum-exp of
// each row (+inf for a row that sees no key, whose output is 0).
//
// Backward, no atomics, so the gradients repeat bit for bit. Up to kFusedMaxKeys = 512
// keys a sequence (BERT lengths), one kernel: a block owns a (sequence, head) and takes
// its keys 128 at a time, each of its 8 warps 16 keys, walking the query tiles with the 5
// products of FlashAttention-2 a tile: S^T and dP^T recomputed, dV += P^T dO, dK += dS^T Q,
// and dQ = dS K over the 128 keys at once, the warps sharing dS^T through shared memory.
// Where the 128 keys are all of them, each dQ row is complete in the block, so it is
// stored once, and the delta D_i = rowsum(P * dP) / rowsum(P) comes from P and dP
// themselves, summed over the warps in a fixed order; past them, the block first takes
// its queries' deltas from O, and each dQ element's owner adds the chunks' shares in
// float32, in chunk order. Longer key sequences take three kernels, which recompute S and
// dP twice (7 products a tile), since no block holds every key of a query:
//   delta: D_i = rowsum(dO_i * O_i), the rowsum(P * dP) of dS = P * (dP - D) (a sequence
//     whose keys fit one tile has the dQ kernel take it from P and dP themselves);
//   dK/dV: a block owns 64 keys (128 resident), each warp 16 of them, and walks the
//     query tiles that see them, recomputing P^T = exp(K Q^T * scale - lse) in registers;
//   dQ: a block owns 64 queries (128 resident) and walks their key tiles, recomputing P
//     the same way.
//
// Two paths walk the tiles. Streamed (FlashAttention-2, any length): the walked tiles
// pass through one shared buffer, each copied, waited for and used in turn (the forward
// starts S = Q K^T before V has landed). Resident (BERT lengths, a walked sequence of at
// most kResidentMax rows whose tiles fit in shared memory): a block of 8 warps owns 128
// rows and copies every walked tile of its sequence into shared memory up front, each
// tile its own cp.async group, then waits for one tile at a time. A head's K and V are
// then read once per 128 queries (once per head at length 128) instead of once per 64,
// and no step waits for a buffer to be free again: at these lengths the streamed path
// has too few steps a block to hide its copies behind.
// On sm_90 (a build with sm_90a code) the streamed forward runs on Hopper's warpgroup
// products instead (attention_forward_sm90_kernel, wgmma.cuh): Q and K are read by the
// tensor cores straight from swizzled shared memory, P from registers. The one-kernel
// backward walks its query tiles on either path (resident ones once for all its chunks
// of keys). Limits: the recomputation (5 products in the backward, 7 past 512 keys,
// against 2 in the forward), one block a (sequence, head) in the one-kernel backward,
// whose grid is small for a small batch, the backward's mma.sync on Hopper too, no TMA or
// warp specialisation in the wgmma forward (its copies are cp.async, double-buffered),
// and dropout, which costs one Philox call per one or two probabilities.
//
// Padded and packed (varlen) batches run the same kernels: a sequence is a row offset
// and a length per tensor, from cu_seqlens or from the padded shape. Causal masks and
// sliding windows align to the bottom right: query i sees key j when
// i + off - left <= j <= i + off + right, off = len_k - len_q, causal being right = 0
// (Window). Each query's keys are then one band that moves right with it, so every walk
// skips the tiles wholly outside it (key tiles past the diagonal or before a query
// block's left bound; for dK/dV and the one-kernel backward, the query tiles that see
// none of a block's keys), and only tiles that cross a bound, the key padding or the
// sequence's end are masked element by element.
//
// Grouped-query and multi-query attention (kv_heads dividing heads): the blocks stay one
// per query head, and query head h reads K and V of key/value head h / group in place.
// The backward's dK and dV of a key/value head sum over its group of query heads, which
// different blocks own: with groups each block writes its query head's share in float32
// (dk_heads, dv_heads, the query heads' size) and attention_group_sum_kernel then adds
// each group's shares in head order and rounds once, as FlashAttention-2 does, so the
// gradients still take no atomics and repeat bit for bit. Without groups the kernels
// write dK and dV directly.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "attention_problem.h"
#include "common.cuh"
#include "cuda/common.h"
#include "cuda/runtime.h"
#include "ops/compiled_kernel.h"
#include "tensor_core.cuh"
#include "wgmma.cuh"

namespace fusedlm::cuda::kernels::attention {

using namespace tc;

constexpr int kBlockN = 64;  // key rows of a key tile (forward and dQ)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr int kAnyTile = std::numeric_limits<int>::max();  // no limit on a walk's tiles

// A block's shape on each path. Each warp owns 16 of the block's own rows: queries in
// the forward and dQ kernels, keys in the dK/dV kernel and the one-kernel backward (whose
// block is always the resident shape).
template <bool kResident>
struct Shape {
  static constexpr int warps = kResident ? 8 : 4;
  static constexpr int threads = 32 * warps;
  static constexpr int rows = 16 * warps;
};

// The longest sequence the resident path walks: at head dim 64 its K and V tiles then
// take 144 KiB of shared memory (the 16-byte row padding included).
constexpr int kResidentMax = 512;

// Threads of the delta kernel.
constexpr int kDeltaThreads = 128;

// Query rows per step of the dK/dV kernel and the one-kernel backward: at head dim 128
// the dK and dV accumulators take 128 registers a thread, so the score tiles shrink to
// stay clear of spills.
template <int D>
constexpr int kBackwardM = D == 128 ? 32 : 64;

// Element (b, h, r) of a tensor at p + b * batch + h * head + r * row; r counts rows
// from the start of the packed tensor (varlen, batch stride 0) or of the sequence.
template <typename T>
struct Rows {
  T* p = nullptr;
  int64_t batch = 0, head = 0, row = 0;
  __device__ __forceinline__ T* at(int b, int h, int64_t r) const {
    return p + b * batch + h * head + r * row;
  }
};

// The keys a query sees besides the key padding: query i of a sequence sees key j when
// i + shift - left <= j <= i + shift + right, shift = len_k - len_q (the bottom-right
// alignment), a bound of -1 being none. Causal attention is right = 0, the tighter of its
// bound and any window's right one (>= 0). Each query sees a band of consecutive keys, and
// the band moves right as the query does: the keys a run of queries sees, and the queries
// that see a run of keys, are runs too, which is what lets the kernels skip whole tiles.
struct Window {
  int left = -1, right = -1;

  __device__ __forceinline__ bool sees(int i, int j, int shift) const {
    return (right < 0 || j <= i + shift + right) && (left < 0 || j >= i + shift - left);
  }
};

template <typename T>
struct Params {
  Rows<const T> q, k, v, dout;  // rows of head_dim elements, 16-byte aligned
  Rows<T> out, dq, dk, dv;
  Rows<float> lse, delta;        // one float per query row
  Rows<float> dq_partial;        // head_dim floats per query row: dQ summed so far
  // Grouped heads: each query head's dK and dV in float32, [batch, heads, seq_k, d] (or
  // [total_k, heads, d]), which attention_group_sum_kernel adds up per key/value head.
  Rows<float> dk_heads, dv_heads;
  const bool* key_padding = nullptr;  // [batch, seq_k], True = padding; null: none
  const int* cu_q = nullptr;          // [batch + 1] (varlen); null: padded
  const int* cu_k = nullptr;
  int total_q = 0, total_k = 0;       // varlen: the rows of q, and of k and v
  int heads = 0;
  int group = 1;             // query heads a key/value head: head h reads K and V of h / group
  int seq_q = 0, seq_k = 0;  // the padded lengths, or max_seqlen (varlen): the dropout pitch
  bool causal = false;       // (the launch order of query blocks; the mask is in window)
  Window window;
  float scale = 1.0f;
  Dropout dropout;
};

// Sequence b: the row of its first query and key, and its lengths.
struct Seq {
  int64_t q0, k0;
  int len_q, len_k;
};

// cu_seqlens' values are not checked on the device (fusedlm.backends.check_index_data), so a
// span is clamped into its tensor's rows and to max_seqlen (the key tiles' shared memory
// and the grid are sized by it): bad offsets give wrong rows, never an access outside.
__device__ __forceinline__ void span(const int* cu, int b, int total, int longest, int64_t& start,
                                     int& len) {
  const int first = min(max(cu[b], 0), total);
  len = min(min(max(cu[b + 1], first), total) - first, longest);
  start = first;
}

template <typename T>
__device__ __forceinline__ Seq sequence(const Params<T>& p, int b) {
  if (!p.cu_q) return {0, 0, p.seq_q, p.seq_k};
  Seq s;
  span(p.cu_q, b, p.total_q, p.seq_q, s.q0, s.len_q);
  span(p.cu_k, b, p.total_k, p.seq_k, s.k0, s.len_k);
  return s;
}

// The dropout stream's index of element (b, h, i, 0) of [batch, heads, seq_q, seq_k].
template <typename T>
__device__ __forceinline__ uint64_t stream_row(const Params<T>& p, int b, int h, int i) {
  return ((uint64_t(b) * p.heads + h) * p.seq_q + i) * p.seq_k;
}

// Starts copying kRows rows of one head of x and of y (K and V, or Q and dO) into
// x_tile and y_tile: rows first .. of the packed or padded tensors, zeros from `valid` on.
template <int kRows, int D, int kThreads, typename T>
__device__ __forceinline__ void load_pair(T* x_tile, T* y_tile, const Rows<const T>& x,
                                          const Rows<const T>& y, int b, int h, int64_t first,
                                          int valid) {
  load_tile<kRows, D, kThreads>(x_tile, x.at(b, h, first), x.row, valid);
  load_tile<kRows, D, kThreads>(y_tile, y.at(b, h, first), y.row, valid);
}

// key_ok[j] = whether key n0 + j exists and is not padding, for j < count.
template <int kThreads, typename T>
__device__ __forceinline__ void stage_keys(bool* key_ok, const Params<T>& p, int b, const Seq& s,
                                           int n0, int count) {
  for (int j = threadIdx.x; j < count; j += kThreads) {
    const int key = n0 + j;
    key_ok[j] = key < s.len_k && !(p.key_padding && p.key_padding[int64_t(b) * p.seq_k + key]);
  }
}

// Whether key j (of a tile starting at n0) is visible to query i.
__device__ __forceinline__ bool visible(const bool* key_ok, int n0, int i, int j,
                                        const Window& w, int shift) {
  return key_ok[j - n0] && w.sees(i, j, shift);
}

// Whether a tile of queries m0 .. m0 + queries - 1 and keys n0 .. n0 + keys - 1 needs the
// mask element by element: key padding, the sequence's last keys, or a bound of the
// window that cuts it (a key past the first query's right bound, or before the last
// query's left bound).
template <typename T>
__device__ __forceinline__ bool tile_needs_mask(const Params<T>& p, const Seq& s, int n0,
                                                int keys, int m0, int queries) {
  const int shift = s.len_k - s.len_q;
  const Window& w = p.window;
  return p.key_padding || n0 + keys > s.len_k ||
         (w.right >= 0 && n0 + keys - 1 > m0 + shift + w.right) ||
         (w.left >= 0 && n0 < m0 + queries - 1 + shift - w.left);
}

// The keys first_key .. key_end - 1 that some query of m0 .. m1 - 1 sees (m0 < m1; none
// when first_key >= key_end): the first query's left bound and the last one's right.
__device__ __forceinline__ int first_key(const Window& w, const Seq& s, int m0) {
  return w.left < 0 ? 0 : min(max(m0 + s.len_k - s.len_q - w.left, 0), s.len_k);
}
__device__ __forceinline__ int key_end(const Window& w, const Seq& s, int m1) {
  return w.right < 0 ? s.len_k : min(max(m1 + s.len_k - s.len_q + w.right, 0), s.len_k);
}

// The queries first_query .. query_end - 1 that see some key of n0 .. n1 - 1 (n0 < n1;
// none when first_query >= query_end).
__device__ __forceinline__ int first_query(const Window& w, const Seq& s, int n0) {
  return w.right < 0 ? 0 : min(max(n0 - (s.len_k - s.len_q) - w.right, 0), s.len_q);
}
__device__ __forceinline__ int query_end(const Window& w, const Seq& s, int n1) {
  return w.left < 0 ? s.len_q : min(max(n1 - (s.len_k - s.len_q) + w.left, 0), s.len_q);
}

// The tiles first .. last - 1 of kRows rows that hold rows r0 .. r1 - 1 (none when
// r0 >= r1), among the first `held`.
struct TileSpan {
  int first, last;
};
__device__ __forceinline__ TileSpan tile_span(int r0, int r1, int rows, int held) {
  const int first = r0 / rows;
  return {first, r0 < r1 ? max(first, min((r1 + rows - 1) / rows, held)) : first};
}

// This thread's rows of its warp's C fragments, g and g + 8 of the warp's 16 (half 0 and
// 1), in a block whose rows start at r0: warp w owns rows r0 + 16w .. r0 + 16w + 15.
__device__ __forceinline__ int fragment_row(int r0, int half) {
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4;
  return r0 + warp * 16 + g + 8 * half;
}

// The first of this thread's warp's 16 rows, in a block whose rows start at r0.
__device__ __forceinline__ int warp_rows(int r0) { return r0 + threadIdx.x / 32 * 16; }

// A query block's index: under causal masking the last blocks carry the most keys, so
// they are launched first.
__device__ __forceinline__ int query_block(bool causal) {
  return causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
}

// Tiles of `rows` rows a resident block holds: enough for the longest sequence (the
// padded length, or max_seqlen). Streamed blocks hold one.
__host__ __device__ __forceinline__ int held_tiles(bool resident, int64_t len, int rows) {
  return resident ? static_cast<int>((len + rows - 1) / rows) : 1;
}

template <int D>
constexpr int kPitch = D + 8;  // shared tile pitch in elements (tensor_core.cuh)

// Shared memory of a block; seq_k (seq_q for dK/dV) sizes the resident path's tiles.
template <int D, bool kResident>
size_t forward_smem(int64_t seq_k) {
  const int64_t keys = int64_t(held_tiles(kResident, seq_k, kBlockN)) * kBlockN;
  return size_t(Shape<kResident>::rows + 2 * keys) * kPitch<D> * 2 + keys;
}

template <int D, bool kResident>
size_t dq_smem(int64_t seq_k) {
  const int64_t keys = int64_t(held_tiles(kResident, seq_k, kBlockN)) * kBlockN;
  return size_t(2 * Shape<kResident>::rows + 2 * keys) * kPitch<D> * 2 + keys;
}

template <int D, bool kResident>
size_t dkdv_smem(int64_t seq_q) {
  const int64_t queries = int64_t(held_tiles(kResident, seq_q, kBackwardM<D>)) * kBackwardM<D>;
  return size_t(2 * Shape<kResident>::rows + 2 * queries) * kPitch<D> * 2 +
         2 * queries * sizeof(float) + Shape<kResident>::rows;
}

// The resident path's copies of the walked tiles first .. last - 1 of a sequence whose
// rows start at row0 and number len in x and y (K and V, or Q and dO), into x_tiles and
// y_tiles (kRows rows a tile, pitch D + 8): all started at once, one cp.async group a
// tile so that each is waited for alone.
template <int kRows, int D, int kThreads, typename T>
__device__ __forceinline__ void prefetch_tiles(T* x_tiles, T* y_tiles, const Rows<const T>& x,
                                               const Rows<const T>& y, int b, int h,
                                               int64_t row0, int len, int first, int last) {
  for (int tile = first; tile < last; ++tile) {
    const int r0 = tile * kRows, at = tile * kRows * kPitch<D>;
    load_pair<kRows, D, kThreads>(x_tiles + at, y_tiles + at, x, y, b, h, row0 + r0, len - r0);
    cp_async_commit();
  }
}

// The resident path's copies of a sequence's walked key tiles (K and V of key/value head
// hk), and the flags of their keys.
template <int D, int kThreads, typename T>
__device__ __forceinline__ void prefetch_keys(T* k_tiles, T* v_tiles, bool* key_ok,
                                              const Params<T>& p, int b, int hk, const Seq& s,
                                              TileSpan walk) {
  prefetch_tiles<kBlockN, D, kThreads>(k_tiles, v_tiles, p.k, p.v, b, hk, s.k0, s.len_k,
                                       walk.first, walk.last);
  stage_keys<kThreads>(key_ok + walk.first * kBlockN, p, b, s, walk.first * kBlockN,
                       (walk.last - walk.first) * kBlockN);
}

// The key tiles a forward or dQ block walks, in its shared memory from `at`: K and V
// ([held][kBlockN][D + 8] each), then the flags of their keys ([held * kBlockN]). A
// resident block holds every tile of its walk, a streamed block the current one.
template <typename T, int D, bool kResident>
struct KeyTiles {
  static constexpr int kTile = kBlockN * kPitch<D>;  // elements of a K or V tile
  int held;
  T* k;
  T* v;
  bool* ok;

  __device__ __forceinline__ KeyTiles(T* at, int64_t seq_k)
      : held(held_tiles(kResident, seq_k, kBlockN)),
        k(at),
        v(at + held * kTile),
        ok(reinterpret_cast<bool*>(at + 2 * held * kTile)) {}

  // Walked tile `tile`: its K, its V and its keys' flags.
  __device__ __forceinline__ const T* k_at(int tile) const {
    return k + (kResident ? tile * kTile : 0);
  }
  __device__ __forceinline__ const T* v_at(int tile) const {
    return v + (kResident ? tile * kTile : 0);
  }
  __device__ __forceinline__ const bool* ok_at(int tile) const {
    return ok + (kResident ? tile * kBlockN : 0);
  }

  // The tiles a block of kRows queries from m0 walks: those with keys its queries may
  // see, past the diagonal and outside the window skipped whole. A resident block never
  // walks past the tiles it holds, even for a sequence longer than the max_seqlen_k it
  // was promised.
  template <int kRows, typename P>
  __device__ __forceinline__ TileSpan walked(const P& p, const Seq& s, int m0) const {
    const int m1 = min(m0 + kRows, s.len_q);
    return tile_span(first_key(p.window, s, m0), key_end(p.window, s, m1), kBlockN,
                     kResident ? held : kAnyTile);
  }
};

// acc += A B for a warp's 16 rows, over the kN rows of a shared tile: A is the C
// fragments c (16 x kN, reused as A fragments), B the tile's rows 0 .. kN - 1 (pitch
// D + 8) and all its D columns. k-step kt covers tile rows 16kt .. 16kt + 15.
template <typename T, int D, int kN>
__device__ __forceinline__ void add_product(float (&acc)[D / 8][4], const float (&c)[kN / 8][4],
                                            const T* tile) {
#pragma unroll
  for (int kt = 0; kt < kN / 16; ++kt) {
    uint32_t a[4];
    accumulator_as_a<T>(a, c, kt);
#pragma unroll
    for (int dt = 0; dt < D / 16; ++dt) {
      uint32_t bf[4];
      load_b_cols<kPitch<D>>(bf, tile, kt * 16, dt * 16);
      mma<T>(acc[2 * dt], a, bf[0], bf[1]);
      mma<T>(acc[2 * dt + 1], a, bf[2], bf[3]);
    }
  }
}

// --- the forward's steps, shared by its kernels -------------------------------------------

// One key tile of the online softmax, for this thread's share of a warp's 16 query rows
// (its fragment rows) against keys n0 .. n0 + kBlockN - 1 of a block whose first query is
// m0: sc goes from the raw scores Q K^T to the probabilities P (masked, in base 2, with
// dropout applied), and the running max, sum and output accumulator are rescaled.
template <typename T, int D>
__device__ __forceinline__ void online_softmax(float (&sc)[kBlockN / 8][4],
                                               float (&acc)[D / 8][4], float (&row_max)[2],
                                               float (&row_sum)[2], const Params<T>& p,
                                               const bool* tile_ok, int b, int h, const Seq& s,
                                               int m0, int n0) {
  const int t = threadIdx.x % 4, shift = s.len_k - s.len_q;
  const int rows[2] = {fragment_row(m0, 0), fragment_row(m0, 1)};
  const float c = p.scale * kLog2e;
  // The warp's own 16 rows decide: a window's band can cross one warp's rows and not
  // another's.
  const bool masked = tile_needs_mask(p, s, n0, kBlockN, warp_rows(m0), 16);
#pragma unroll
  for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int j = n0 + nt * 8 + 2 * t + e % 2;
      sc[nt][e] = masked && !visible(tile_ok, n0, rows[e / 2], j, p.window, shift)
                      ? -kInf
                      : sc[nt][e] * c;
    }
  }
  // The online softmax, per row: the quad of lanes sharing g holds the whole row.
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    float tile_max = -kInf;
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt)
      tile_max = fmaxf(tile_max, fmaxf(sc[nt][2 * hh], sc[nt][2 * hh + 1]));
    const float new_max = fmaxf(row_max[hh], quad_max(tile_max));
    // While a row has seen no visible key its max is -inf, and exp2(-inf - -inf) would
    // be NaN: subtract 0 instead (every term is then exp2(-inf) = 0).
    const float base = new_max == -kInf ? 0.0f : new_max;
    const float rescale = exp2f(row_max[hh] - base);
    row_max[hh] = new_max;
    float sum = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
      sc[nt][2 * hh] = exp2f(sc[nt][2 * hh] - base);
      sc[nt][2 * hh + 1] = exp2f(sc[nt][2 * hh + 1] - base);
      sum += sc[nt][2 * hh] + sc[nt][2 * hh + 1];
    }
    row_sum[hh] = row_sum[hh] * rescale + sum;
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      acc[dt][2 * hh] *= rescale;
      acc[dt][2 * hh + 1] *= rescale;
    }
  }
  // Dropout zeroes probabilities after the sum (the softmax is of the undropped scores);
  // the 1 / (1 - p) factor is applied once, to the output.
  if (p.dropout.active) {
    const uint32_t kept = kept_pairs<kBlockN / 8>(p.dropout,
                                                  stream_row(p, b, h, rows[0]) + n0 + 2 * t,
                                                  stream_row(p, b, h, rows[1]) + n0 + 2 * t);
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (!bit(kept, 2 * (8 * (e / 2) + nt) + e % 2)) sc[nt][e] = 0.0f;
  }
}

// O = acc / sum (times the dropout's 1 / (1 - p)) and the natural log-sum-exp of each of
// this thread's rows.
template <typename T, int D>
__device__ __forceinline__ void store_output(const float (&acc)[D / 8][4],
                                             const float (&row_max)[2], const float (&row_sum)[2],
                                             const Params<T>& p, int b, int h, const Seq& s,
                                             int m0) {
  const int t = threadIdx.x % 4;
  const int rows[2] = {fragment_row(m0, 0), fragment_row(m0, 1)};
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const float sum = quad_sum(row_sum[hh]);
    if (rows[hh] >= s.len_q) continue;
    // A row that saw no key has sum 0 and accumulator 0: its output is 0.
    const float inv = sum > 0.0f ? p.dropout.scale / sum : 0.0f;
    T* o = p.out.at(b, h, s.q0 + rows[hh]);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(o + dt * 8 + 2 * t) =
          pack<T>(acc[dt][2 * hh] * inv, acc[dt][2 * hh + 1] * inv);
    // lse = +inf for such a row makes the backward's exp(s - lse) zero.
    if (t == 0)
      *p.lse.at(b, h, s.q0 + rows[hh]) = sum > 0.0f ? (row_max[hh] + log2f(sum)) * kLn2 : kInf;
  }
}

// --- forward ------------------------------------------------------------------------------

template <typename T, int D, bool kResident>
__global__ void __launch_bounds__(Shape<kResident>::threads)
    attention_forward_kernel(const Params<T> p) {
  constexpr int P = kPitch<D>, kRows = Shape<kResident>::rows;
  constexpr int kThreads = Shape<kResident>::threads;
  T* q_tile = reinterpret_cast<T*>(dynamic_shared_memory());  // [kRows][P]
  const KeyTiles<T, D, kResident> keys(q_tile + kRows * P, p.seq_k);

  const int b = blockIdx.z, h = blockIdx.y;
  const Seq s = sequence(p, b);
  const int m0 = query_block(p.causal) * kRows;
  if (m0 >= s.len_q) return;
  const int warp = threadIdx.x / 32, hk = h / p.group;
  const TileSpan walk = keys.template walked<kRows>(p, s, m0);

  load_tile<kRows, D, kThreads>(q_tile, p.q.at(b, h, s.q0 + m0), p.q.row, s.len_q - m0);
  cp_async_commit();
  if constexpr (kResident) {
    prefetch_keys<D, kThreads>(keys.k, keys.v, keys.ok, p, b, hk, s, walk);
    cp_async_wait_runtime(walk.last - walk.first);  // Q; the key tiles may still be in flight
  } else {
    cp_async_wait<0>();
  }
  __syncthreads();
  uint32_t qf[D / 16][4];  // A fragments of the warp's rows, one per 16 columns of head_dim
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) load_a<P>(qf[kk], q_tile, warp * 16, kk * 16);

  float acc[D / 8][4] = {};  // O, n-tiles of 8 head_dim columns
  float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};  // base 2; sums per thread
  for (int tile = walk.first; tile < walk.last; ++tile) {
    const int n0 = tile * kBlockN;
    const T* k_tile = keys.k_at(tile);
    const T* v_tile = keys.v_at(tile);
    if constexpr (kResident) {
      cp_async_wait_runtime(walk.last - 1 - tile);  // K and V of this tile
      __syncthreads();
    } else {
      __syncthreads();  // every warp is done with the previous tiles
      load_tile<kBlockN, D, kThreads>(keys.k, p.k.at(b, hk, s.k0 + n0), p.k.row, s.len_k - n0);
      cp_async_commit();
      load_tile<kBlockN, D, kThreads>(keys.v, p.v.at(b, hk, s.k0 + n0), p.v.row, s.len_k - n0);
      cp_async_commit();
      stage_keys<kThreads>(keys.ok, p, b, s, n0, kBlockN);
      cp_async_wait<1>();  // K has landed; V may still be in flight
      __syncthreads();
    }

    // S = Q K^T: n-tile nt holds keys n0 + 8nt + 2t, +1 of rows g (sc[nt][0..1]) and g + 8.
    float sc[kBlockN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
      for (int np = 0; np < kBlockN / 16; ++np) {
        uint32_t kb[4];
        load_b_rows<P>(kb, k_tile, np * 16, kk * 16);
        mma<T>(sc[2 * np], qf[kk], kb[0], kb[1]);
        mma<T>(sc[2 * np + 1], qf[kk], kb[2], kb[3]);
      }
    }
    online_softmax<T, D>(sc, acc, row_max, row_sum, p, keys.ok_at(tile), b, h, s, m0, n0);
    if constexpr (!kResident) {
      cp_async_wait<0>();  // V
      __syncthreads();
    }
    add_product<T, D, kBlockN>(acc, sc, v_tile);  // O += P V
  }

  store_output<T, D>(acc, row_max, row_sum, p, b, h, s, m0);
}

// The forward on Hopper's warpgroup products (wgmma.cuh), for the streamed path on
// sm_90a: a block of two warpgroups owns 128 query rows, 64 each. Q sits in shared
// memory for the whole block and feeds S = Q K^T straight from there; the key tiles are
// double-buffered, the next one's copy in flight while this one is used; P stays in
// registers as the A operand of O += P V. The softmax between the two products is the
// other forward kernel's, on the same fragment layout.
constexpr int kSm90Rows = 128;
constexpr int kSm90Threads = 256;

template <int D>
constexpr size_t sm90_forward_smem() {
  // Q, two stages of K and V, two stages of key flags, and 1 KiB to align the tiles to
  // the 1024 bytes their swizzle needs.
  return size_t(kSm90Rows + 4 * kBlockN) * D * 2 + 2 * kBlockN + 1024;
}

template <typename T, int D>
__global__ void __launch_bounds__(kSm90Threads) attention_forward_sm90_kernel(const Params<T> p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kTile = kBlockN * D;  // elements of a K or V tile
  unsigned char* sm90_smem = dynamic_shared_memory();
  const uint32_t align = (1024 - smem_address(sm90_smem) % 1024) % 1024;
  T* q_tile = reinterpret_cast<T*>(sm90_smem + align);  // [kSm90Rows][D], swizzled
  T* k_tiles = q_tile + kSm90Rows * D;                   // [2][kBlockN][D], swizzled
  T* v_tiles = k_tiles + 2 * kTile;                      // [2][kBlockN][D], swizzled
  bool* key_ok = reinterpret_cast<bool*>(v_tiles + 2 * kTile);  // [2][kBlockN]

  const int b = blockIdx.z, h = blockIdx.y;
  const Seq s = sequence(p, b);
  const int m0 = query_block(p.causal) * kSm90Rows;
  if (m0 >= s.len_q) return;
  const int group_row = threadIdx.x / 128 * 64;  // the warpgroup's first row in the block
  const int hk = h / p.group;
  const TileSpan walk = tile_span(first_key(p.window, s, m0),
                                  key_end(p.window, s, min(m0 + kSm90Rows, s.len_q)), kBlockN,
                                  kAnyTile);

  // Key tile i into stage i % 2, one cp.async group.
  auto load_keys = [&](int i) {
    const int n0 = i * kBlockN;
    wg::load_tile<kBlockN, D, kSm90Threads>(k_tiles + i % 2 * kTile, p.k.at(b, hk, s.k0 + n0),
                                            p.k.row, s.len_k - n0);
    wg::load_tile<kBlockN, D, kSm90Threads>(v_tiles + i % 2 * kTile, p.v.at(b, hk, s.k0 + n0),
                                            p.v.row, s.len_k - n0);
    stage_keys<kSm90Threads>(key_ok + i % 2 * kBlockN, p, b, s, n0, kBlockN);
    cp_async_commit();
  };
  wg::load_tile<kSm90Rows, D, kSm90Threads>(q_tile, p.q.at(b, h, s.q0 + m0), p.q.row,
                                            s.len_q - m0);
  cp_async_commit();
  if (walk.first < walk.last) load_keys(walk.first);

  float acc[D / 8][4] = {};
  float row_max[2] = {-kInf, -kInf}, row_sum[2] = {0.0f, 0.0f};
  for (int tile = walk.first; tile < walk.last; ++tile) {
    const int n0 = tile * kBlockN;
    // The other stage was released by the __syncthreads that ended the last step.
    if (tile + 1 < walk.last) {
      load_keys(tile + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    wg::fence_shared_for_async();
    __syncthreads();
    const T* k_tile = k_tiles + tile % 2 * kTile;
    const T* v_tile = v_tiles + tile % 2 * kTile;

    float sc[kBlockN / 8][4] = {};
    wg::pin(sc);
    wg::fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)
      wg::mma_ss<T>(sc, wg::k_major<kSm90Rows>(q_tile, group_row, kk),
                    wg::k_major<kBlockN>(k_tile, 0, kk), 1);
    wg::commit();
    wg::wait<0>();
    wg::pin(sc);
    online_softmax<T, D>(sc, acc, row_max, row_sum, p, key_ok + tile % 2 * kBlockN, b, h, s, m0,
                         n0);

    uint32_t pa[kBlockN / 16][4];
#pragma unroll
    for (int kt = 0; kt < kBlockN / 16; ++kt) accumulator_as_a<T>(pa[kt], sc, kt);
    wg::pin(pa);
    wg::pin(acc);
    wg::fence();
#pragma unroll
    for (int kt = 0; kt < kBlockN / 16; ++kt)
      wg::mma_rs<T>(acc, pa[kt], wg::mn_major<kBlockN>(v_tile, kt), 1);
    wg::commit();
    wg::wait<0>();
    wg::pin(acc);
    __syncthreads();  // every warp is done with this stage before it is refilled
  }
  cp_async_wait<0>();  // the Q tile of a block that saw no key tile
  store_output<T, D>(acc, row_max, row_sum, p, b, h, s, m0);
#else
  __trap();  // launched only on devices the sm_90a code was built for
#endif
}

// --- backward -----------------------------------------------------------------------------

// Stores delta[i] = sum_d dO[i, d] * O[i, d] of query i of sequence b, head h (nothing
// past the sequence): D / 8 consecutive lanes a row, one 16-byte vector each, every lane of
// the warp taking part.
template <typename T, int D>
__device__ __forceinline__ void store_row_delta(const Params<T>& p, int b, int h, const Seq& s,
                                                int i) {
  constexpr int kLanes = D / 8;
  const int col = threadIdx.x % kLanes * 8;
  float sum = 0.0f;
  if (i < s.len_q) {
    float o[8], d[8];
    load<8>(p.out.at(b, h, s.q0 + i) + col, o);
    load<8>(p.dout.at(b, h, s.q0 + i) + col, d);
#pragma unroll
    for (int e = 0; e < 8; ++e) sum += o[e] * d[e];
  }
  // kLanes consecutive lanes share a row (kLanes divides 32).
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2)
    sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  if (i < s.len_q && threadIdx.x % kLanes == 0) *p.delta.at(b, h, s.q0 + i) = sum;
}

template <typename T, int D>
__global__ void __launch_bounds__(kDeltaThreads) attention_delta_kernel(const Params<T> p) {
  const int b = blockIdx.z, h = blockIdx.y;
  store_row_delta<T, D>(p, b, h, sequence(p, b),
                        blockIdx.x * (kDeltaThreads / (D / 8)) + threadIdx.x / (D / 8));
}

// lse2[r] = the base-2 log-sum-exp and delta[r] the delta of query m0 + r, for r < count;
// +inf past the sequence makes those probabilities exp2(-inf) = 0. A null delta stages
// lse2 alone (the one-kernel backward derives the delta itself).
template <int kThreads, typename T>
__device__ __forceinline__ void stage_stats(float* lse2, float* delta, const Params<T>& p, int b,
                                            int h, const Seq& s, int m0, int count) {
  for (int r = threadIdx.x; r < count; r += kThreads) {
    const bool in = m0 + r < s.len_q;
    lse2[r] = in ? *p.lse.at(b, h, s.q0 + m0 + r) * kLog2e : kInf;
    if (delta) delta[r] = in ? *p.delta.at(b, h, s.q0 + m0 + r) : 0.0f;
  }
}

// The next walked tile of a backward kernel (queries for dK/dV, keys for dQ), made ready
// for every warp. Resident: its copy was started up front, `later` groups after it; wait
// for it. Streamed: once every warp is done with the previous tile, copy x and y's rows
// first .. (zeros from `valid` on) into the one buffer, stage the tile's per-row data
// (stage()) while the copy is in flight, and wait for it.
template <bool kResident, int kRows, int D, int kThreads, typename T, typename Stage>
__device__ __forceinline__ void next_tile(T* x_tiles, T* y_tiles, const Rows<const T>& x,
                                          const Rows<const T>& y, int b, int h, int64_t first,
                                          int valid, int later, Stage&& stage) {
  if constexpr (kResident) {
    cp_async_wait_runtime(later);
    __syncthreads();
  } else {
    __syncthreads();  // every warp is done with the previous tile
    load_pair<kRows, D, kThreads>(x_tiles, y_tiles, x, y, b, h, first, valid);
    cp_async_commit();
    stage();
    cp_async_wait<0>();
    __syncthreads();
  }
}

// The two products that recompute a backward tile, for a warp's 16 rows (from `row` of
// the A tiles, the block's own) against the kN rows of the walked B tiles, over head_dim:
// x = A_x B_x^T and y = A_y B_y^T (S and dP in dQ, S^T and dP^T in dK/dV). The loop over
// head_dim is unrolled kUnrollK steps at a time.
template <typename T, int D, int kN, int kUnrollK>
__device__ __forceinline__ void recompute(float (&x)[kN / 8][4], float (&y)[kN / 8][4],
                                          const T* xa_tile, const T* ya_tile, int row,
                                          const T* xb_tile, const T* yb_tile) {
  constexpr int P = kPitch<D>;
#pragma unroll (kUnrollK)
  for (int kk = 0; kk < D / 16; ++kk) {
    uint32_t xa[4], ya[4];
    load_a<P>(xa, xa_tile, row, kk * 16);
    load_a<P>(ya, ya_tile, row, kk * 16);
#pragma unroll
    for (int np = 0; np < kN / 16; ++np) {
      uint32_t xb[4], yb[4];
      load_b_rows<P>(xb, xb_tile, np * 16, kk * 16);
      load_b_rows<P>(yb, yb_tile, np * 16, kk * 16);
      mma<T>(x[2 * np], xa, xb[0], xb[1]);
      mma<T>(x[2 * np + 1], xa, xb[2], xb[3]);
      mma<T>(y[2 * np], ya, yb[0], yb[1]);
      mma<T>(y[2 * np + 1], ya, yb[2], yb[3]);
    }
  }
}

// Bit 4nt + e: whether dropout keeps element e of n-tile nt of this thread's share of a
// transposed tile of kM queries from m0 (S^T: keys key0 and key0 + 8 its fragment rows,
// queries m0 + 8nt + 2t + e % 2). Here the pairs of a C fragment run along the queries, a
// stream row apart: one Philox call per element.
template <int kM, typename T>
__device__ __forceinline__ uint32_t kept_transposed(const Params<T>& p, int b, int h, int m0,
                                                    int key0) {
  const int t = threadIdx.x % 4;
  uint32_t kept = 0;
#pragma unroll 1
  for (int i = 0; i < kM / 2; ++i) {
    const int nt = i / 4, e = i % 4;
    bool k1[1];
    p.dropout.template keep<1>(
        stream_row(p, b, h, m0 + nt * 8 + 2 * t + e % 2) + key0 + 8 * (e / 2), k1);
    kept |= uint32_t(k1[0]) << i;
  }
  return kept;
}

// The raw S^T = K Q^T and dP^T = V dO^T of a transposed tile (st[nt][e]: key keys[e / 2],
// query m0 + 8nt + 2t + e % 2) become P^T (masked, before dropout) and the gradient that
// reaches P^T through the dropout (kept: kept_transposed's bits). key_ok flags the keys
// from n0; tile_lse2 holds the queries' base-2 log-sum-exps.
template <int kM, typename T>
__device__ __forceinline__ void transposed_probabilities(float (&st)[kM / 8][4],
                                                         float (&dpt)[kM / 8][4],
                                                         const Params<T>& p, const Seq& s,
                                                         const float* tile_lse2,
                                                         const bool* key_ok, int n0,
                                                         const int (&keys)[2], int m0,
                                                         bool masked, uint32_t kept) {
  const int t = threadIdx.x % 4, shift = s.len_k - s.len_q;
  const float c = p.scale * kLog2e;
#pragma unroll
  for (int nt = 0; nt < kM / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = nt * 8 + 2 * t + e % 2;
      float prob = exp2f(st[nt][e] * c - tile_lse2[col]);
      if (masked && !visible(key_ok, n0, m0 + col, keys[e / 2], p.window, shift)) prob = 0.0f;
      st[nt][e] = prob;
      dpt[nt][e] = bit(kept, 4 * nt + e) ? dpt[nt][e] * p.dropout.scale : 0.0f;
    }
  }
}

// From transposed_probabilities' P^T and dP^T: dS^T = P^T * (dP^T - delta) into dpt, and
// into st the probabilities that multiplied V (P^T after dropout). tile_delta holds the
// queries' deltas.
template <int kM, typename T>
__device__ __forceinline__ void transposed_score_gradients(float (&st)[kM / 8][4],
                                                           float (&dpt)[kM / 8][4],
                                                           const Params<T>& p,
                                                           const float* tile_delta,
                                                           uint32_t kept) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int nt = 0; nt < kM / 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = nt * 8 + 2 * t + e % 2;
      const float prob = st[nt][e];
      dpt[nt][e] = prob * (dpt[nt][e] - tile_delta[col]);
      st[nt][e] = bit(kept, 4 * nt + e) ? prob * p.dropout.scale : 0.0f;
    }
  }
}

// Stores dK (times the scale: the products used K and Q unscaled) and dV of this thread's
// keys keys[0] and keys[1] (its fragment rows) that the sequence has, as query head h's
// share. Keys no query sees, padding keys among them, have zero accumulators, so zeros.
// With grouped heads the share goes to the float32 dk_heads and dv_heads, which
// attention_group_sum_kernel then adds up over the group in a fixed order: no two blocks
// write one element, so the gradients take no atomics.
template <typename T, int D>
__device__ __forceinline__ void store_key_gradients(const float (&dk)[D / 8][4],
                                                    const float (&dv)[D / 8][4],
                                                    const Params<T>& p, int b, int h,
                                                    const Seq& s, const int (&keys)[2]) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if (keys[hh] >= s.len_k) continue;
    if (p.group > 1) {
      float* dk_row = p.dk_heads.at(b, h, s.k0 + keys[hh]);
      float* dv_row = p.dv_heads.at(b, h, s.k0 + keys[hh]);
#pragma unroll
      for (int dt = 0; dt < D / 8; ++dt) {
        const float dk_pair[2] = {dk[dt][2 * hh] * p.scale, dk[dt][2 * hh + 1] * p.scale};
        const float dv_pair[2] = {dv[dt][2 * hh], dv[dt][2 * hh + 1]};
        store<2>(dk_row + dt * 8 + 2 * t, dk_pair);
        store<2>(dv_row + dt * 8 + 2 * t, dv_pair);
      }
      continue;
    }
    T* dk_row = p.dk.at(b, h, s.k0 + keys[hh]);
    T* dv_row = p.dv.at(b, h, s.k0 + keys[hh]);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt) {
      *reinterpret_cast<uint32_t*>(dk_row + dt * 8 + 2 * t) =
          pack<T>(dk[dt][2 * hh] * p.scale, dk[dt][2 * hh + 1] * p.scale);
      *reinterpret_cast<uint32_t*>(dv_row + dt * 8 + 2 * t) =
          pack<T>(dv[dt][2 * hh], dv[dt][2 * hh + 1]);
    }
  }
}

// dK and dV of a block's keys. Each warp computes S^T = K Q^T and dP^T = V dO^T for its 16
// keys against kM queries at a time (keys are the rows of the C fragments: g and g + 8 of
// the warp's 16, queries the columns), then dV += P^T dO and dK += dS^T Q with those
// accumulators reused as A fragments (k = the queries).
template <typename T, int D, bool kResident>
__global__ void __launch_bounds__(Shape<kResident>::threads)
    attention_dkdv_kernel(const Params<T> p) {
  constexpr int P = kPitch<D>, kM = kBackwardM<D>, kKeys = Shape<kResident>::rows;
  constexpr int kThreads = Shape<kResident>::threads;
  const int held = held_tiles(kResident, p.seq_q, kM);
  unsigned char* smem = dynamic_shared_memory();
  T* k_tile = reinterpret_cast<T*>(smem);  // [kKeys][P]
  T* v_tile = k_tile + kKeys * P;          // [kKeys][P]
  T* q_tiles = v_tile + kKeys * P;         // [held][kM][P]
  T* do_tiles = q_tiles + held * kM * P;   // [held][kM][P]
  float* lse2 = reinterpret_cast<float*>(do_tiles + held * kM * P);  // [held * kM], base 2
  float* delta = lse2 + held * kM;                                    // [held * kM]
  bool* key_ok = reinterpret_cast<bool*>(delta + held * kM);          // [kKeys]

  const int b = blockIdx.z, h = blockIdx.y, n0 = blockIdx.x * kKeys;
  const Seq s = sequence(p, b);
  if (n0 >= s.len_k) return;
  const int warp = threadIdx.x / 32;
  const int keys[2] = {fragment_row(n0, 0), fragment_row(n0, 1)};

  load_pair<kKeys, D, kThreads>(k_tile, v_tile, p.k, p.v, b, h / p.group, s.k0 + n0,
                                s.len_k - n0);
  cp_async_commit();
  stage_keys<kThreads>(key_ok, p, b, s, n0, kKeys);

  // Query tiles first .. last - 1: those with queries that see the block's keys (under
  // causal masking the first is n0 - shift), the others skipped whole. A resident block
  // never walks past the tiles it holds.
  const int n1 = min(n0 + kKeys, s.len_k);
  const TileSpan walk = tile_span(first_query(p.window, s, n0), query_end(p.window, s, n1), kM,
                                  kResident ? held : kAnyTile);
  const int first = walk.first, last = walk.last;
  if constexpr (kResident) {
    // Every query tile at once, one group each, waited for one at a time.
    prefetch_tiles<kM, D, kThreads>(q_tiles, do_tiles, p.q, p.dout, b, h, s.q0, s.len_q, first,
                                    last);
    stage_stats<kThreads>(lse2 + first * kM, delta + first * kM, p, b, h, s, first * kM,
                          (last - first) * kM);
  }

  float dk[D / 8][4] = {}, dv[D / 8][4] = {};
  for (int tile = first; tile < last; ++tile) {
    const int m0 = tile * kM, slot = kResident ? tile : 0;
    const T* q_tile = q_tiles + slot * kM * P;
    const T* do_tile = do_tiles + slot * kM * P;
    const float* tile_lse2 = lse2 + slot * kM;
    const float* tile_delta = delta + slot * kM;
    // Q and dO of this tile (a resident block's K and V were committed before them).
    next_tile<kResident, kM, D, kThreads>(
        q_tiles, do_tiles, p.q, p.dout, b, h, s.q0 + m0, s.len_q - m0, last - 1 - tile,
        [&] { stage_stats<kThreads>(lse2, delta, p, b, h, s, m0, kM); });

    // st[nt][e]: key keys[e / 2], query m0 + 8nt + 2t + e % 2.
    float st[kM / 8][4] = {}, dpt[kM / 8][4] = {};
    recompute<T, D, kM, D / 16>(st, dpt, k_tile, v_tile, warp * 16, q_tile, do_tile);
    const bool masked = tile_needs_mask(p, s, warp_rows(n0), 16, m0, kM);
    const uint32_t kept = p.dropout.active ? kept_transposed<kM>(p, b, h, m0, keys[0]) : ~0u;
    transposed_probabilities<kM>(st, dpt, p, s, tile_lse2, key_ok, n0, keys, m0, masked, kept);
    transposed_score_gradients<kM>(st, dpt, p, tile_delta, kept);
    add_product<T, D, kM>(dv, st, do_tile);  // dV += P^T dO
    add_product<T, D, kM>(dk, dpt, q_tile);  // dK += dS^T Q
  }

  // A block whose keys no query sees never waited for its K and V tiles: no copy may
  // outlive it into the shared memory of the next block.
  cp_async_wait<0>();
  store_key_gradients<T, D>(dk, dv, p, b, h, s, keys);
}

// dQ of a block's queries: each warp recomputes S = Q K^T and dP = dO V^T for its 16 rows
// against each key tile, forms dS and adds dS K.
template <typename T, int D, bool kResident>
__global__ void __launch_bounds__(Shape<kResident>::threads)
    attention_dq_kernel(const Params<T> p) {
  constexpr int P = kPitch<D>, kRows = Shape<kResident>::rows;
  constexpr int kThreads = Shape<kResident>::threads;
  T* q_tile = reinterpret_cast<T*>(dynamic_shared_memory());  // [kRows][P]
  T* do_tile = q_tile + kRows * P;                              // [kRows][P]
  const KeyTiles<T, D, kResident> keys(do_tile + kRows * P, p.seq_k);

  const int b = blockIdx.z, h = blockIdx.y;
  const Seq s = sequence(p, b);
  const int m0 = query_block(p.causal) * kRows;
  if (m0 >= s.len_q) return;
  const int warp = threadIdx.x / 32, t = threadIdx.x % 4, hk = h / p.group;
  const int shift = s.len_k - s.len_q;
  const int rows[2] = {fragment_row(m0, 0), fragment_row(m0, 1)};
  const TileSpan walk = keys.template walked<kRows>(p, s, m0);
  // A sequence whose keys fit one tile (a short one in a packed batch whose longest is
  // past the one-kernel backward) takes its delta from its exact P and dP, rowsum(P * dP),
  // and stores it for the dK/dV kernel over the delta kernel's (taken from O as rounded
  // to T).
  const bool own_delta = s.len_k <= kBlockN;

  load_pair<kRows, D, kThreads>(q_tile, do_tile, p.q, p.dout, b, h, s.q0 + m0, s.len_q - m0);
  cp_async_commit();
  if constexpr (kResident) {
    prefetch_keys<D, kThreads>(keys.k, keys.v, keys.ok, p, b, hk, s, walk);
  }
  float lse2[2], delta[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const bool in = rows[hh] < s.len_q;
    lse2[hh] = in ? *p.lse.at(b, h, s.q0 + rows[hh]) * kLog2e : kInf;
    delta[hh] = in && !own_delta ? *p.delta.at(b, h, s.q0 + rows[hh]) : 0.0f;
  }

  float dq[D / 8][4] = {};
  const float c = p.scale * kLog2e;
  for (int tile = walk.first; tile < walk.last; ++tile) {
    const int n0 = tile * kBlockN;
    const T* k_tile = keys.k_at(tile);
    const bool* tile_ok = keys.ok_at(tile);
    // K and V of this tile (a resident block's Q and dO were committed before them).
    next_tile<kResident, kBlockN, D, kThreads>(
        keys.k, keys.v, p.k, p.v, b, hk, s.k0 + n0, s.len_k - n0, walk.last - 1 - tile,
        [&] { stage_keys<kThreads>(keys.ok, p, b, s, n0, kBlockN); });

    // sc[nt][e], dp[nt][e]: row rows[e / 2], key n0 + 8nt + 2t + e % 2.
    float sc[kBlockN / 8][4] = {}, dp[kBlockN / 8][4] = {};
    // Not unrolled over head_dim: hoisting the next steps' fragment loads spilled at head
    // dim 64 on sm_90a, and one step already issues 16 independent products.
    recompute<T, D, kBlockN, 1>(sc, dp, q_tile, do_tile, warp * 16, k_tile, keys.v_at(tile));
    const bool masked = tile_needs_mask(p, s, n0, kBlockN, warp_rows(m0), 16);
    uint32_t kept = ~0u;
    if (p.dropout.active) {
      kept = kept_pairs<kBlockN / 8>(p.dropout, stream_row(p, b, h, rows[0]) + n0 + 2 * t,
                                     stream_row(p, b, h, rows[1]) + n0 + 2 * t);
    }
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = n0 + nt * 8 + 2 * t + e % 2;
        sc[nt][e] = exp2f(sc[nt][e] * c - lse2[e / 2]);  // P
        if (masked && !visible(tile_ok, n0, rows[e / 2], j, p.window, shift)) sc[nt][e] = 0.0f;
        dp[nt][e] = bit(kept, 2 * (8 * (e / 2) + nt) + e % 2) ? dp[nt][e] * p.dropout.scale : 0.0f;
      }
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (own_delta) {  // this is the row's only key tile
        float sum = 0.0f, mass = 0.0f;
#pragma unroll
        for (int nt = 0; nt < kBlockN / 8; ++nt) {
          sum += sc[nt][2 * hh] * dp[nt][2 * hh] + sc[nt][2 * hh + 1] * dp[nt][2 * hh + 1];
          mass += sc[nt][2 * hh] + sc[nt][2 * hh + 1];
        }
        // rowsum(P * dP) / rowsum(P): see exact_delta in csrc/cpu/attention.cpp.
        sum = quad_sum(sum);
        mass = quad_sum(mass);
        delta[hh] = mass > 0.0f ? sum / mass : 0.0f;
      }
    }
#pragma unroll
    for (int nt = 0; nt < kBlockN / 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[nt][e] *= dp[nt][e] - delta[e / 2];  // dS
    add_product<T, D, kBlockN>(dq, sc, k_tile);  // dQ += dS K
  }

  cp_async_wait<0>();  // the Q and dO tiles of a block that saw no key tile
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    if (rows[hh] >= s.len_q) continue;
    // Every row's delta, 0 for a row that sees no key (the dK/dV kernel reads them all).
    if (own_delta && t == 0) *p.delta.at(b, h, s.q0 + rows[hh]) = delta[hh];
    T* dq_row = p.dq.at(b, h, s.q0 + rows[hh]);
#pragma unroll
    for (int dt = 0; dt < D / 8; ++dt)
      *reinterpret_cast<uint32_t*>(dq_row + dt * 8 + 2 * t) =
          pack<T>(dq[dt][2 * hh] * p.scale, dq[dt][2 * hh + 1] * p.scale);
  }
}

// --- the one-kernel backward ---------------------------------------------------------------

// The keys the one-kernel backward holds at a time, a chunk: one block's, 16 a warp. It
// takes key sequences of up to kFusedMaxKeys, a chunk after another.
constexpr int kFusedKeys = Shape<true>::rows;
constexpr int kFusedMaxKeys = kResidentMax;

// Shared memory of a block of the one-kernel backward; seq_q sizes the resident walk's
// query tiles.
template <int D, bool kResident>
size_t fused_smem(int64_t seq_q) {
  constexpr int kM = kBackwardM<D>;
  const int64_t queries = int64_t(held_tiles(kResident, seq_q, kM)) * kM;
  return size_t(2 * kFusedKeys + 2 * queries) * kPitch<D> * 2 +
         size_t(kFusedKeys) * (kM + 8) * 2 +
         size_t(2 * queries + (2 * Shape<true>::warps + 1) * kM) * sizeof(float) + kFusedKeys;
}

// The A fragment of rows m0 .. m0 + 15, columns k0 .. k0 + 15 of A = X^T, where X is a
// row-major tile [k][m] (pitch P): dS in dQ = dS K, from the dS^T the warps wrote with
// keys as rows. a0 needs A[g][2t, 2t+1] = X[2t, 2t+1][g], a column pair of X, which
// .trans gives from a matrix whose addressed rows are k. Lane l addresses X's row
// k0 + (l / 16) * 8 + l % 8 at column m0 + ((l / 8) % 2) * 8, so matrices 0..3 are
// (k 0-7, m 0-7), (k 0-7, m 8-15), (k 8-15, m 0-7), (k 8-15, m 8-15): a0..a3.
template <int P, typename T>
__device__ __forceinline__ void load_a_transposed(uint32_t (&a)[4], const T* tile, int m0,
                                                  int k0) {
  const int lane = threadIdx.x % 32;
  ldmatrix_x4_trans(a, smem_address(tile + (k0 + (lane / 16) * 8 + lane % 8) * P + m0 +
                                    ((lane / 8) % 2) * 8));
}

// One step of sum_over_rows_scattered: v[i] += the partner's v[i] for i < kHalf, where the
// partner is the lane lane_mask away, after each keeps the half of v[0 .. 2 kHalf) that
// `upper` picks and sends the other. Each step is its own instance so that every index
// is a constant: v stays in registers.
template <int kHalf, int kN>
__device__ __forceinline__ void trade_halves(float (&v)[kN], bool upper, int lane_mask) {
#pragma unroll
  for (int i = 0; i < kHalf; ++i) {
    const float lo = v[i], hi = v[i + kHalf];
    v[i] = (upper ? hi : lo) + __shfl_xor_sync(0xffffffffu, upper ? lo : hi, lane_mask);
  }
}

// v summed over the eight lanes that share t (the rows g of a C fragment's column pairs)
// and scattered: lane g ends with the sums of v[g * kN / 8 .. (g + 1) * kN / 8) in
// v[0 .. kN / 8). Each step trades half of the values still held with the lane that
// differs in one bit of g, 7 kN / 8 shuffles in all where a full sum on every lane
// would take 3 kN; the order of the additions is fixed.
template <int kN>
__device__ __forceinline__ void sum_over_rows_scattered(float (&v)[kN]) {
  const int g = threadIdx.x % 32 / 4;
  trade_halves<kN / 2>(v, g & 4, 16);
  trade_halves<kN / 4>(v, g & 2, 8);
  trade_halves<kN / 8>(v, g & 1, 4);
}

// The whole backward of a sequence of up to kFusedMaxKeys keys in one kernel: a block
// owns a (sequence, head) and takes its keys a chunk of kFusedKeys at a time, each warp
// 16 of the chunk's keys as in the dK/dV kernel, walking the query tiles that see the
// chunk (the others skipped whole, their dQ shares zero) with 5 products a tile. Each
// warp recomputes S^T and dP^T for its keys (2 products) and forms P^T and
// the dropped dP^T. The delta of each query sums over every key: where one chunk holds
// them all it is rowsum(P * dP) / rowsum(P), as the dQ kernel derives its own
// (exact_delta in csrc/cpu/attention.cpp), the warps' sums meeting in shared memory and
// adding up in warp order; past one chunk it is rowsum(dO * O), which the block computes
// for its queries first, as the delta kernel does. Then dS^T, dV += P^T dO and
// dK += dS^T Q (2), as in the dK/dV kernel; a chunk's dK and dV are complete after its
// walk. dS^T, rounded to T as the products round it, goes to shared memory, and the warps
// split the tile's dQ = dS K (1) over its rows and head_dim columns. With one chunk each
// dQ row is then complete and stored once; past one, the thread that owns a dQ element
// adds the chunks' shares in chunk order in float32 (dq_partial, which only it touches)
// and stores the sum after the last: no atomics, the same bits on every run. The query
// tiles are walked resident (copied up front, once for every chunk) or streamed (one
// buffer) as for dK/dV.
template <typename T, int D, bool kResident>
__global__ void __launch_bounds__(Shape<true>::threads)
    attention_fused_backward_kernel(const Params<T> p) {
  constexpr int P = kPitch<D>, kM = kBackwardM<D>, kDsPitch = kM + 8;
  constexpr int kThreads = Shape<true>::threads, kWarps = Shape<true>::warps;
  const int held = held_tiles(kResident, p.seq_q, kM);
  unsigned char* smem = dynamic_shared_memory();
  T* k_tile = reinterpret_cast<T*>(smem);   // [kFusedKeys][P]: the chunk's keys
  T* v_tile = k_tile + kFusedKeys * P;      // [kFusedKeys][P]
  T* q_tiles = v_tile + kFusedKeys * P;     // [held][kM][P]
  T* do_tiles = q_tiles + held * kM * P;    // [held][kM][P]
  T* ds_tile = do_tiles + held * kM * P;    // [kFusedKeys][kDsPitch]: the tile's dS^T
  float* lse2 = reinterpret_cast<float*>(ds_tile + kFusedKeys * kDsPitch);  // [held * kM]
  float* deltas = lse2 + held * kM;  // [held * kM]: the queries' deltas past one chunk
  float* sums = deltas + held * kM;  // [kWarps][kM][2]: a warp's rowsum(P * dP), rowsum(P)
  float* delta = sums + kWarps * kM * 2;                // [kM]: the deltas of one chunk
  bool* key_ok = reinterpret_cast<bool*>(delta + kM);   // [kFusedKeys]

  const int b = blockIdx.z, h = blockIdx.y;
  const Seq s = sequence(p, b);
  const int warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, t = threadIdx.x % 4;
  const int hk = h / p.group;
  const int chunks = max(1, (s.len_k + kFusedKeys - 1) / kFusedKeys);
  const bool one_chunk = chunks == 1;
  float* tile_deltas = one_chunk ? nullptr : deltas;
  // The query tiles that see keys n0 .. n1 - 1, the others skipped whole (n0 < n1; none
  // for no key). A resident block never walks past the tiles it holds.
  auto seeing = [&](int n0, int n1) {
    return n0 < n1 ? tile_span(first_query(p.window, s, n0), query_end(p.window, s, n1), kM,
                               kResident ? held : kAnyTile)
                   : TileSpan{0, 0};
  };
  const TileSpan walk = seeing(0, s.len_k);  // the tiles that see any key

  if (!one_chunk) {
    for (int r0 = 0; r0 < s.len_q; r0 += kThreads / (D / 8))
      store_row_delta<T, D>(p, b, h, s, r0 + threadIdx.x / (D / 8));
    __syncthreads();  // (the block's own global writes, read back by stage_stats)
  }
  load_pair<kFusedKeys, D, kThreads>(k_tile, v_tile, p.k, p.v, b, hk, s.k0, s.len_k);
  cp_async_commit();
  stage_keys<kThreads>(key_ok, p, b, s, 0, kFusedKeys);
  if constexpr (kResident) {
    prefetch_tiles<kM, D, kThreads>(q_tiles, do_tiles, p.q, p.dout, b, h, s.q0, s.len_q,
                                    walk.first, walk.last);
    const int r0 = walk.first * kM;
    stage_stats<kThreads>(lse2 + r0, one_chunk ? nullptr : deltas + r0, p, b, h, s, r0,
                          (walk.last - walk.first) * kM);
  }
  // No chunk walks a tile none of whose queries sees a key: their dQ rows are zeros.
  for (int i = threadIdx.x; i < s.len_q * (D / 8); i += kThreads) {
    const int row = i / (D / 8);
    if (row >= walk.first * kM && row < walk.last * kM) continue;
    const float zeros[8] = {};
    store<8>(p.dq.at(b, h, s.q0 + row) + i % (D / 8) * 8, zeros);
  }

  for (int chunk = 0; chunk < chunks; ++chunk) {
    const int n0 = chunk * kFusedKeys;
    if (chunk > 0) {  // the next chunk's K and V, once every warp is done with the last's
      cp_async_wait<0>();
      __syncthreads();
      load_pair<kFusedKeys, D, kThreads>(k_tile, v_tile, p.k, p.v, b, hk, s.k0 + n0,
                                         s.len_k - n0);
      cp_async_commit();
      stage_keys<kThreads>(key_ok, p, b, s, n0, kFusedKeys);
      cp_async_wait<0>();
      __syncthreads();
    }
    const int keys[2] = {fragment_row(n0, 0), fragment_row(n0, 1)};
    const TileSpan chunk_walk = seeing(n0, min(n0 + kFusedKeys, s.len_k));
    float dk[D / 8][4] = {}, dv[D / 8][4] = {};
    for (int tile = chunk_walk.first; tile < chunk_walk.last; ++tile) {
      const int m0 = tile * kM, slot = kResident ? tile : 0;
      const T* q_tile = q_tiles + slot * kM * P;
      const T* do_tile = do_tiles + slot * kM * P;
      const float* tile_lse2 = lse2 + slot * kM;
      // Q and dO of this tile (a resident block's K and V were committed before them;
      // after the first chunk nothing is in flight). The barrier also ends every warp's
      // use of the previous tile's dS^T, sums and deltas.
      next_tile<kResident, kM, D, kThreads>(
          q_tiles, do_tiles, p.q, p.dout, b, h, s.q0 + m0, s.len_q - m0,
          chunk == 0 ? walk.last - 1 - tile : 0,
          [&] { stage_stats<kThreads>(lse2, tile_deltas, p, b, h, s, m0, kM); });

      // The tile's queries see keys first .. end - 1 (a run that meets this chunk's): the
      // warps from first_warp to seen_warps - 1 hold those of the chunk, the others have
      // nothing to compute, and the dQ product covers those warps' keys alone. The run
      // also gives the chunks that add to the tile's dQ: from the first one's to the last.
      const int m1 = min(m0 + kM, s.len_q);
      const int first = first_key(p.window, s, m0), end = key_end(p.window, s, m1);
      const int first_warp = max(first - n0, 0) / 16;
      const int seen_warps = (min(end - n0, kFusedKeys) + 15) / 16;
      const bool active = warp >= first_warp && warp < seen_warps;
      const bool first_share = chunk == first / kFusedKeys;
      const bool last_share = chunk == (end - 1) / kFusedKeys;
      // st[nt][e], dpt[nt][e]: key keys[e / 2], query m0 + 8nt + 2t + e % 2.
      float st[kM / 8][4] = {}, dpt[kM / 8][4] = {};
      uint32_t kept = ~0u;
      if (active) {
        recompute<T, D, kM, D / 16>(st, dpt, k_tile, v_tile, warp * 16, q_tile, do_tile);
        const bool masked = tile_needs_mask(p, s, warp_rows(n0), 16, m0, kM);
        if (p.dropout.active) kept = kept_transposed<kM>(p, b, h, m0, keys[0]);
        transposed_probabilities<kM>(st, dpt, p, s, tile_lse2, key_ok, n0, keys, m0, masked,
                                     kept);
      }
      if (one_chunk) {
        if (active) {
          // v[2j], v[2j + 1]: rowsum(P * dP) and rowsum(P) of query column j = 2nt + e % 2
          // of this thread's, over its two keys, then over the warp's 16.
          float v[kM / 2];
#pragma unroll
          for (int nt = 0; nt < kM / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              v[2 * (2 * nt + e)] = st[nt][e] * dpt[nt][e] + st[nt][e + 2] * dpt[nt][e + 2];
              v[2 * (2 * nt + e) + 1] = st[nt][e] + st[nt][e + 2];
            }
          }
          sum_over_rows_scattered(v);
          // This lane holds v[g * kM / 16 ..] of the warp's sums: columns j from g * kM / 32.
#pragma unroll
          for (int r = 0; r < kM / 16; ++r) {
            const int j = g * kM / 32 + r / 2, col = j / 2 * 8 + 2 * t + j % 2;
            sums[(warp * kM + col) * 2 + r % 2] = v[r];
          }
        }
        __syncthreads();
        // One thread a query adds the warps' sums in warp order: the same bits on every run.
        if (threadIdx.x < kM) {
          float sum = 0.0f, mass = 0.0f;
          for (int w = first_warp; w < seen_warps; ++w) {
            sum += sums[(w * kM + threadIdx.x) * 2];
            mass += sums[(w * kM + threadIdx.x) * 2 + 1];
          }
          // A query that sees no key has no mass: delta 0 (its dS is 0 whatever the delta).
          delta[threadIdx.x] = mass > 0.0f ? sum / mass : 0.0f;
        }
        __syncthreads();
      }
      if (active) {
        transposed_score_gradients<kM>(st, dpt, p, one_chunk ? delta : deltas + slot * kM,
                                       kept);
        // dS^T rounded to T, the value dK's product takes from the same registers.
#pragma unroll
        for (int nt = 0; nt < kM / 8; ++nt)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh)
            *reinterpret_cast<uint32_t*>(ds_tile + (keys[hh] - n0) * kDsPitch + nt * 8 +
                                         2 * t) = pack<T>(dpt[nt][2 * hh], dpt[nt][2 * hh + 1]);
        add_product<T, D, kM>(dv, st, do_tile);   // dV += P^T dO
        add_product<T, D, kM>(dk, dpt, q_tile);   // dK += dS^T Q
      }
      __syncthreads();

      // dQ = dS K: warp w owns 16 rows (m-tile w % kMTiles) and kCols of head_dim's
      // columns from c0, over the chunk's keys the tile may see, 16 a step.
      constexpr int kMTiles = kM / 16, kCols = D * kMTiles / kWarps;
      const int row0 = warp % kMTiles * 16, c0 = warp / kMTiles * kCols;
      float dq[kCols / 8][4] = {};
      for (int kt = first_warp; kt < seen_warps; ++kt) {
        uint32_t a[4];
        load_a_transposed<kDsPitch>(a, ds_tile, row0, kt * 16);
#pragma unroll
        for (int dt = 0; dt < kCols / 16; ++dt) {
          uint32_t bf[4];
          load_b_cols<P>(bf, k_tile, kt * 16, c0 + dt * 16);
          mma<T>(dq[2 * dt], a, bf[0], bf[1]);
          mma<T>(dq[2 * dt + 1], a, bf[2], bf[3]);
        }
      }
      // The earlier chunks' shares added in, the sum stored after the last chunk that adds
      // one (queries of the tile that see no key get zeros).
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int row = m0 + row0 + g + 8 * hh;
        if (row >= s.len_q) continue;
        T* dq_row = p.dq.at(b, h, s.q0 + row);
        float* partial_row = one_chunk ? nullptr : p.dq_partial.at(b, h, s.q0 + row);
#pragma unroll
        for (int nt = 0; nt < kCols / 8; ++nt) {
          const int col = c0 + nt * 8 + 2 * t;
          float x = dq[nt][2 * hh], y = dq[nt][2 * hh + 1];
          if (!first_share) {
            x += partial_row[col];
            y += partial_row[col + 1];
          }
          if (last_share) {
            *reinterpret_cast<uint32_t*>(dq_row + col) = pack<T>(x * p.scale, y * p.scale);
          } else {
            partial_row[col] = x;
            partial_row[col + 1] = y;
          }
        }
      }
    }
    store_key_gradients<T, D>(dk, dv, p, b, h, s, keys);
  }
  // A block with no query never waited for its K and V tiles: no copy may outlive it into
  // the shared memory of the next block.
  cp_async_wait<0>();
}

// --- grouped heads: dK and dV summed over each key/value head's query heads ---------------

constexpr int kGroupSumThreads = 128;

// dK and dV of key/value head blockIdx.y, rows `rows` of sequence blockIdx.z (of the
// packed tensor for varlen): the float32 shares of its query heads added in head order,
// rounded to T once. D / 4 threads a row, 4 columns each.
template <typename T, int D>
__global__ void __launch_bounds__(kGroupSumThreads)
    attention_group_sum_kernel(const Params<T> p, int rows) {
  constexpr int kLanes = D / 4;
  const int b = blockIdx.z, hk = blockIdx.y;
  const int64_t row = int64_t(blockIdx.x) * (kGroupSumThreads / kLanes) + threadIdx.x / kLanes;
  if (row >= rows) return;
  const int col = threadIdx.x % kLanes * 4;
  float dk[4] = {}, dv[4] = {};
  for (int i = 0; i < p.group; ++i) {
    float x[4], y[4];
    load<4>(p.dk_heads.at(b, hk * p.group + i, row) + col, x);
    load<4>(p.dv_heads.at(b, hk * p.group + i, row) + col, y);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      dk[e] += x[e];
      dv[e] += y[e];
    }
  }
  store<4>(p.dk.at(b, hk, row) + col, dk);
  store<4>(p.dv.at(b, hk, row) + col, dv);
}

}  // namespace fusedlm::cuda::kernels::attention

// --- host side: checks, launch shapes and launches ------------------------------------
// The problem's layout and the choice of path.

namespace fusedlm::cuda {
namespace {

using namespace kernels::attention;

// Whether the kernels can read or write t in place: head_dim contiguous and every row
// 16-byte aligned (cp.async and the paired stores).
bool kernel_layout(const at::Tensor& t) {
  if (t.stride(-1) != 1 || !aligned16(t.data_ptr())) return false;
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  return true;
}

at::Tensor with_kernel_layout(const at::Tensor& t) {
  if (kernel_layout(t)) return t;
  auto copy = at::empty(t.sizes(), t.options());
  return copy.copy_(t);
}

// Output `like`-laid-out tensors the kernels write into: the tensor itself, or a buffer
// whose contents `finish` copies back.
struct Output {
  at::Tensor tensor, buffer;
  explicit Output(at::Tensor t)
      : tensor(t), buffer(kernel_layout(t) ? t : at::empty(t.sizes(), t.options())) {}
  at::Tensor finish() {
    if (!buffer.is_same(tensor)) tensor.copy_(buffer);
    return tensor;
  }
};

// One call's inputs, checked, in the kernels' layout (see kernel_layout).
struct Problem : AttentionProblem {
  at::Tensor q, k, v, key_padding, cu_q, cu_k, seed;

  Problem(const AttentionProblem& shape, const at::Tensor& q_, const at::Tensor& k_,
          const at::Tensor& v_, const at::Tensor& seed_)
      : AttentionProblem(shape),
        q(with_kernel_layout(q_)),
        k(with_kernel_layout(k_)),
        v(with_kernel_layout(v_)),
        seed(seed_) {
    check_kernel_limits(q_);
  }

 private:
  // What the kernels are compiled for, and the grid's limits.
  void check_kernel_limits(const at::Tensor& q_) const {
    TORCH_CHECK_TYPE(q_.scalar_type() == at::kBFloat16 || q_.scalar_type() == at::kHalf,
                     "the cuda attention takes bfloat16 or float16");
    TORCH_CHECK_VALUE((dk == 64 || dk == 128) && dv == dk,
                      "the cuda attention takes a head_dim of 64 or 128 for q, k and v alike");
    TORCH_CHECK_VALUE(batch <= 65535 && heads <= 65535 && seq_q < (int64_t(1) << 31) &&
                          seq_k < (int64_t(1) << 31),
                      "the cuda attention's grid takes at most 65535 sequences and heads");
  }
};

Problem padded_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& key_padding_mask,
                       const std::optional<at::Tensor>& attn_bias, bool causal,
                       int64_t window_left, int64_t window_right, double dropout_p, double scale,
                       const at::Tensor& seed) {
  TORCH_CHECK_VALUE(!present(attn_bias), "the cuda attention takes no attn_bias");
  Problem pb(padded_attention(q, k, v, key_padding_mask, causal, window_left, window_right,
                              dropout_p, scale, check_device_tensor),
             q, k, v, seed);
  if (present(key_padding_mask)) pb.key_padding = key_padding_mask->contiguous();
  return pb;
}

// The offsets are not checked against the tensors here: that would copy them to the host.
// A sequence longer than max_seqlen gets rows no block covers.
Problem varlen_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                       int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
                       int64_t window_left, int64_t window_right, double dropout_p, double scale,
                       const at::Tensor& seed) {
  Problem pb(varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, window_left, window_right, dropout_p, scale,
                              check_device_tensor),
             q, k, v, seed);
  pb.cu_q = cu_seqlens_q.contiguous();
  pb.cu_k = cu_seqlens_k.contiguous();
  return pb;
}

// Rows of a [batch, heads, seq, d] tensor, or of a packed [tokens, heads, d] one.
template <typename T>
Rows<T> rows_of(const at::Tensor& t, bool varlen) {
  T* p = ptr<T>(t);
  if (varlen) return {p, 0, t.stride(1), t.stride(0)};
  return {p, t.stride(0), t.stride(1), t.stride(2)};
}

// Rows of the float32 statistics: [batch, heads, seq_q], or [heads, tokens] (varlen); and
// of a float32 [batch, heads, seq_q, d] or [heads, tokens, d] tensor, rows of d.
Rows<float> stat_rows(const at::Tensor& t, bool varlen) {
  float* p = ptr<float>(t);
  if (varlen) return {p, 0, t.stride(0), t.stride(1)};
  return {p, t.stride(0), t.stride(1), t.stride(2)};
}

template <typename T>
Params<T> params(const Problem& pb) {
  Params<T> p;
  p.q = rows_of<const T>(pb.q, pb.varlen);
  p.k = rows_of<const T>(pb.k, pb.varlen);
  p.v = rows_of<const T>(pb.v, pb.varlen);
  p.key_padding = ptr<bool>(pb.key_padding);
  p.cu_q = pb.varlen ? ptr<int>(pb.cu_q) : nullptr;
  p.cu_k = pb.varlen ? ptr<int>(pb.cu_k) : nullptr;
  if (pb.varlen) {
    p.total_q = static_cast<int>(pb.q.size(0));
    p.total_k = static_cast<int>(pb.k.size(0));
  }
  p.heads = static_cast<int>(pb.heads);
  p.group = pb.kv_heads > 0 ? static_cast<int>(pb.heads / pb.kv_heads) : 1;
  p.seq_q = static_cast<int>(pb.seq_q);
  p.seq_k = static_cast<int>(pb.seq_k);
  p.causal = pb.causal;
  // Causal is a right bound of 0, tighter than any window's. A bound that no query of
  // the longest sequences reaches is none: the kernels then neither mask nor skip on
  // it, and their sums of rows and bounds stay within int.
  const int64_t right = pb.causal ? 0 : pb.window_right;
  p.window.left = pb.window_left < pb.seq_k ? static_cast<int>(pb.window_left) : -1;
  p.window.right = right < pb.seq_q ? static_cast<int>(right) : -1;
  p.scale = static_cast<float>(pb.scale);
  p.dropout = dropout_stream(pb.seed, pb.dropout_p);
  return p;
}

// Runs f(T{}, std::integral_constant<int, D>{}) for the problem's dtype and head dim.
template <typename F>
void dispatch_attention(const Problem& pb, F&& f) {
  auto with_dim = [&](auto tag) {
    if (pb.dk == 64) f(tag, std::integral_constant<int, 64>{});
    else f(tag, std::integral_constant<int, 128>{});
  };
  if (pb.q.scalar_type() == at::kBFloat16) with_dim(at::BFloat16{});
  else with_dim(at::Half{});
}

// Launches kernel over (blocks, heads, sequences).
template <typename T>
void launch_blocks(void (*kernel)(Params<T>), int64_t blocks, int threads, size_t smem,
                   const Problem& pb, const Params<T>& p) {
  if (blocks == 0 || pb.heads == 0 || pb.batch == 0) return;
  const Grid grid(blocks, pb.heads, pb.batch);
  launch(kernel, grid, threads, smem, p);
}

// Whether a kernel takes the resident path: when the rows it walks (keys, or queries for
// dK/dV) number at most kResidentMax and their tiles fit in shared memory, unless the
// attention_resident switch is off, which sends every sequence down the streamed path.
bool takes_resident_path(int64_t walked, size_t resident_smem) {
  return kernel_paths().attention_resident && walked <= kResidentMax &&
         resident_smem <= max_shared_memory();
}

// Launches kernel_of(path) over `own` rows a sequence (the queries of the forward and dQ
// kernels, the keys of dK/dV) on the path the sequence it walks takes. smem_of(path) is
// a block's shared memory on that path.
template <typename T, typename KernelOf, typename SmemOf>
void launch_path(KernelOf kernel_of, SmemOf smem_of, int64_t own, int64_t walked,
                 const Problem& pb, const Params<T>& p) {
  constexpr std::true_type resident;
  constexpr std::false_type streamed;
  if (takes_resident_path(walked, smem_of(resident)))
    launch_blocks<T>(kernel_of(resident), ceil_div(own, Shape<true>::rows),
                     Shape<true>::threads, smem_of(resident), pb, p);
  else
    launch_blocks<T>(kernel_of(streamed), ceil_div(own, Shape<false>::rows),
                     Shape<false>::threads, smem_of(streamed), pb, p);
}

void forward(const Problem& pb, const at::Tensor& out, const at::Tensor& lse) {
  dispatch_attention(pb, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    Params<T> p = params<T>(pb);
    p.out = rows_of<T>(out, pb.varlen);
    p.lse = stat_rows(lse, pb.varlen);
#if defined(FUSEDLM_SM90A)
    if (!takes_resident_path(pb.seq_k, forward_smem<D, true>(pb.seq_k)) &&
        hopper_path(kernel_paths().attention_wgmma)) {
      launch_blocks<T>(attention_forward_sm90_kernel<T, D>, ceil_div(pb.seq_q, kSm90Rows),
                       kSm90Threads, sm90_forward_smem<D>(), pb, p);
      return;
    }
#endif
    launch_path<T>(
        [](auto path) { return attention_forward_kernel<T, D, decltype(path)::value>; },
        [&](auto path) { return forward_smem<D, decltype(path)::value>(pb.seq_k); }, pb.seq_q,
        pb.seq_k, pb, p);
  });
}

void backward(const Problem& pb, const at::Tensor& grad, const at::Tensor& out,
              const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
              const at::Tensor& dv) {
  dispatch_attention(pb, [&](auto tag, auto dim) {
    using T = decltype(tag);
    constexpr int D = decltype(dim)::value;
    Params<T> p = params<T>(pb);
    p.dout = rows_of<const T>(grad, pb.varlen);
    p.lse = stat_rows(lse, pb.varlen);
    p.dq = rows_of<T>(dq, pb.varlen);
    p.dk = rows_of<T>(dk, pb.varlen);
    p.dv = rows_of<T>(dv, pb.varlen);
    // Grouped heads: each query head's share of dK and dV goes to float32 buffers, summed
    // per key/value head after the kernels (no two blocks write one element).
    at::Tensor dk_heads, dv_heads;
    if (p.group > 1) {
      const int64_t d = D;
      const auto shape = pb.varlen ? std::vector<int64_t>{dk.size(0), pb.heads, d}
                                   : std::vector<int64_t>{pb.batch, pb.heads, pb.seq_k, d};
      dk_heads = at::empty(shape, lse.options());
      dv_heads = at::empty(shape, lse.options());
      p.dk_heads = rows_of<float>(dk_heads, pb.varlen);
      p.dv_heads = rows_of<float>(dv_heads, pb.varlen);
    }
    auto sum_groups = [&] {
      if (p.group == 1) return;
      const int64_t rows = pb.varlen ? dk.size(0) : pb.seq_k;
      const int64_t per_block = kGroupSumThreads / (D / 4);
      const Grid grid(ceil_div(rows, per_block), pb.kv_heads, pb.varlen ? 1 : pb.batch);
      launch(attention_group_sum_kernel<T, D>, grid, kGroupSumThreads, 0, p,
             static_cast<int>(rows));
    };
    if (pb.seq_k <= kFusedMaxKeys && kernel_paths().attention_fused_backward) {
      // One block a (sequence, head); its query tiles resident where they fit. Past one
      // chunk of keys, the queries' deltas and dQ's partial sums in float32 go through
      // global memory.
      at::Tensor delta, dq_partial;
      if (pb.seq_k > kFusedKeys) {
        delta = at::empty(lse.sizes(), lse.options());
        p.out = rows_of<T>(out, pb.varlen);
        p.delta = stat_rows(delta, pb.varlen);
        const int64_t d = D;
        dq_partial = pb.varlen ? at::empty({pb.heads, dq.size(0), d}, lse.options())
                               : at::empty({pb.batch, pb.heads, pb.seq_q, d}, lse.options());
        p.dq_partial = stat_rows(dq_partial, pb.varlen);
      }
      if (takes_resident_path(pb.seq_q, fused_smem<D, true>(pb.seq_q)))
        launch_blocks<T>(attention_fused_backward_kernel<T, D, true>, 1, Shape<true>::threads,
                         fused_smem<D, true>(pb.seq_q), pb, p);
      else
        launch_blocks<T>(attention_fused_backward_kernel<T, D, false>, 1, Shape<true>::threads,
                         fused_smem<D, false>(pb.seq_q), pb, p);
      sum_groups();
      return;
    }
    auto delta = at::empty(lse.sizes(), lse.options());
    p.out = rows_of<T>(out, pb.varlen);
    p.delta = stat_rows(delta, pb.varlen);
    launch_blocks<T>(attention_delta_kernel<T, D>, ceil_div(pb.seq_q, kDeltaThreads / (D / 8)),
                     kDeltaThreads, 0, pb, p);
    // The dQ kernel overwrites the delta of each sequence whose keys fit one tile with its
    // own, which the dK/dV kernel then reads.
    launch_path<T>(
        [](auto path) { return attention_dq_kernel<T, D, decltype(path)::value>; },
        [&](auto path) { return dq_smem<D, decltype(path)::value>(pb.seq_k); }, pb.seq_q,
        pb.seq_k, pb, p);
    launch_path<T>(
        [](auto path) { return attention_dkdv_kernel<T, D, decltype(path)::value>; },
        [&](auto path) { return dkdv_smem<D, decltype(path)::value>(pb.seq_q); }, pb.seq_k,
        pb.seq_q, pb, p);
    sum_groups();
  });
}

// The saved output and the incoming gradient, checked against the problem (with the
// log-sum-exp), in the kernels' layout.
std::pair<at::Tensor, at::Tensor> saved(const Problem& pb, const at::Tensor& q,
                                        const at::Tensor& grad, const at::Tensor& out,
                                        const at::Tensor& lse) {
  check_saved(pb, q, grad, out, lse, at::kFloat, check_device_tensor);
  return {with_kernel_layout(grad), with_kernel_layout(out)};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_bias,
    bool causal, int64_t window_left, int64_t window_right, double dropout_p, double scale,
    const at::Tensor& seed) {
  const DeviceGuard guard(q, "q");
  const Problem pb =
      padded_problem(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                     dropout_p, scale, seed);
  Output out(empty_like_layout(q, q.sizes(), q.scalar_type()));
  auto lse = at::empty({pb.batch, pb.heads, pb.seq_q}, q.options().dtype(at::kFloat));
  forward(pb, out.buffer, lse);
  return {out.finish(), lse};
}
FUSEDLM_KERNEL(attention_forward);

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_bias, bool causal, int64_t window_left,
    int64_t window_right, double dropout_p, double scale, const at::Tensor& seed, bool bias_grad) {
  const DeviceGuard guard(q, "q");
  TORCH_CHECK_VALUE(!bias_grad, "the cuda attention takes no attn_bias, so no bias gradient");
  const Problem pb =
      padded_problem(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                     dropout_p, scale, seed);
  const auto [g, o] = saved(pb, q, grad, out, lse);
  Output dq(empty_like_layout(q, q.sizes(), q.scalar_type()));
  Output dk(empty_like_layout(k, k.sizes(), k.scalar_type()));
  Output dv(empty_like_layout(v, v.sizes(), v.scalar_type()));
  backward(pb, g, o, lse, dq.buffer, dk.buffer, dv.buffer);
  return {dq.finish(), dk.finish(), dv.finish(), at::Tensor()};
}
FUSEDLM_KERNEL(attention_backward);

std::tuple<at::Tensor, at::Tensor> attention_varlen_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    int64_t window_left, int64_t window_right, double dropout_p, double scale,
    const at::Tensor& seed) {
  const DeviceGuard guard(q, "q");
  const Problem pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, window_left, window_right, dropout_p,
                                    scale, seed);
  Output out(empty_like_layout(q, q.sizes(), q.scalar_type()));
  auto lse = at::empty({pb.heads, q.size(0)}, q.options().dtype(at::kFloat));
  forward(pb, out.buffer, lse);
  return {out.finish(), lse};
}
FUSEDLM_KERNEL(attention_varlen_forward);

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    int64_t window_left, int64_t window_right, double dropout_p, double scale,
    const at::Tensor& seed) {
  const DeviceGuard guard(q, "q");
  const Problem pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, window_left, window_right, dropout_p,
                                    scale, seed);
  const auto [g, o] = saved(pb, q, grad, out, lse);
  Output dq(empty_like_layout(q, q.sizes(), q.scalar_type()));
  Output dk(empty_like_layout(k, k.sizes(), k.scalar_type()));
  Output dv(empty_like_layout(v, v.sizes(), v.scalar_type()));
  backward(pb, g, o, lse, dq.buffer, dk.buffer, dv.buffer);
  return {dq.finish(), dk.finish(), dv.finish()};
}
FUSEDLM_KERNEL(attention_varlen_backward);

}  // namespace fusedlm::cuda
