// attention and attention_varlen on the CPU: FlashAttention-2's tiling around ATen's
// matrix products, with the softmax, masking, dropout and their backward fused in
// between (the kernels of csrc/cpu/attention.cpp).
//
// Forward: one at::parallel_for task per (sequence, head, block of kBlockQ queries).
// It packs the block's queries times the softmax scale, and the keys and values the
// block may attend to, into dense buffers in the accumulation type (one read of each
// input, any strides), then for each block of kBlockK keys: S = Q K^T (at::mm), the
// fused online-softmax step, O += P V (at::addmm_). It writes O / l and each row's
// log-sum-exp, the one statistic backward needs.
//
// Backward: one task per (sequence, head), which owns dK and dV, so their sums need no
// reduction across threads. Per query block it recomputes P = exp(S - lse) tile by
// tile and accumulates dV += P^T dO, dK += dS^T Q and dQ += dS K.
//
// Padding keys never enter a tile: the valid keys of each sequence are gathered when
// K and V are packed, so the work follows the real lengths, and a causal row's allowed
// keys stay a prefix of the gathered ones (the walk stops at a block's last allowed
// key, which skips the causal-masked blocks). Only [kBlockQ, kBlockK] tiles are held,
// never a [seq_q, seq_k] matrix. Every reduction runs in a fixed order inside one
// task, so results do not depend on the number of threads.
#include <algorithm>
#include <limits>
#include <numeric>
#include <vector>

#include "common.h"
#include "ops.h"

namespace fusedlm {
namespace {

// A tile is [kBlockQ, kBlockK] scores: 128 KiB in float32, resident in L2 with the
// operands, and large enough that each ATen product (a few microseconds of dispatch)
// does over a million multiply-adds at head_dim 64.
constexpr int64_t kBlockQ = 128;
constexpr int64_t kBlockK = 256;

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

// One call: the sequences, their layout, and the keys each may attend to.
struct Problem {
  cpu::DType dtype;
  at::ScalarType acc;
  int64_t batch = 0, heads = 0, dk = 0, dv = 0;
  std::vector<int64_t> q_row0, q_len, k_row0, k_len;
  // The dropout stream is laid out as [batch, heads, pitch_q, pitch_k], each sequence
  // in its top-left corner.
  int64_t pitch_q = 0, pitch_k = 0;
  bool causal = false;
  double p = 0.0, scale = 1.0;
  uint64_t seed = 0;
  Rows q, k, v, bias;
  bool has_bias = false;

  // The gathered keys of sequence b: key_pos[key_start[b] + j] is the position of its
  // j-th valid key; slot[slot_start[b] + t] is the gathered index of position t (-1
  // for padding); below[slot_start[b] + b + t] counts the valid keys before position
  // t, for t in [0, k_len[b]].
  std::vector<int32_t> key_pos, slot, below;
  std::vector<int64_t> key_start, slot_start;

  int64_t keys(int64_t b) const { return key_start[b + 1] - key_start[b]; }
  const int32_t* positions(int64_t b) const { return key_pos.data() + key_start[b]; }
  const int32_t* slots(int64_t b) const { return slot.data() + slot_start[b]; }

  // Query i of sequence b attends to the first limit(b, i) gathered keys.
  int32_t limit(int64_t b, int64_t i) const {
    if (!causal) return static_cast<int32_t>(keys(b));
    // Bottom-right alignment: query i sees the keys at positions <= i + k_len - q_len.
    const int64_t end = std::clamp<int64_t>(i + k_len[b] - q_len[b] + 1, 0, k_len[b]);
    return below[slot_start[b] + b + end];
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
    }
  }
};

// One thread's buffers, in the accumulation type. Sized for a query block and for
// all the keys of the longest sequence.
struct Workspace {
  at::Tensor storage;
  at::TensorOptions options;
  size_t acc_size;
  void *q, *k, *v, *s, *dp, *o, *dout, *dk, *dv, *m, *l, *delta;
  std::vector<int32_t> limit, relative;
  std::vector<uint8_t> keep, scratch;

  Workspace(const Problem& pb, bool backward) : options(at::dtype(pb.acc)) {
    const int64_t n = pb.max_keys(), tile = kBlockQ * kBlockK;
    // Offsets (in elements) of each buffer in one allocation; backward-only ones are empty in forward.
    const int64_t sizes[] = {kBlockQ * pb.dk, n * pb.dk, n * pb.dv, tile, backward ? tile : 0,
                             kBlockQ * std::max(pb.dk, pb.dv), backward ? kBlockQ * pb.dv : 0,
                             backward ? n * pb.dk : 0, backward ? n * pb.dv : 0, kBlockQ, kBlockQ,
                             kBlockQ};
    void** slots[] = {&q, &k, &v, &s, &dp, &o, &dout, &dk, &dv, &m, &l, &delta};
    storage = at::empty({std::accumulate(std::begin(sizes), std::end(sizes), int64_t(0))}, options);
    acc_size = storage.element_size();
    char* at = static_cast<char*>(storage.data_ptr());
    for (size_t i = 0; i < std::size(sizes); ++i) {
      *slots[i] = at;
      at += sizes[i] * acc_size;
    }
    limit.resize(kBlockQ);
    relative.resize(kBlockQ);
    if (pb.p > 0) {
      keep.resize(tile);
      scratch.resize(*std::max_element(pb.k_len.begin(), pb.k_len.end()));
    }
  }

  // A [rows, cols] matrix over an acc buffer, starting `offset` elements in.
  at::Tensor mat(void* data, int64_t rows, int64_t cols, int64_t offset = 0) const {
    return at::from_blob(static_cast<char*>(data) + offset * acc_size, {rows, cols}, options);
  }
  void* ptr(void* data, int64_t offset) const { return static_cast<char*>(data) + offset * acc_size; }

  // Fills limit for queries i0 .. i0 + rows of sequence b; returns how many gathered
  // keys the block needs (the largest limit).
  int64_t set_limits(const Problem& pb, int64_t b, int64_t i0, int64_t rows) {
    int32_t reach = 0;
    for (int64_t r = 0; r < rows; ++r) {
      limit[r] = pb.limit(b, i0 + r);
      reach = std::max(reach, limit[r]);
    }
    return reach;
  }

  // The limits relative to a key block [k0, k0 + cols).
  const int32_t* relative_limits(int64_t rows, int64_t k0, int64_t cols) {
    for (int64_t r = 0; r < rows; ++r)
      relative[r] = static_cast<int32_t>(std::clamp<int64_t>(limit[r] - k0, 0, cols));
    return relative.data();
  }

  // The keep mask of a tile (null without dropout): the stream's elements at
  // [b, h, i0 + r, position of key k0 + j].
  const uint8_t* keep_mask(const Problem& pb, int64_t b, int64_t h, int64_t i0, int64_t rows,
                           int64_t k0, int64_t cols) {
    if (pb.p <= 0) return nullptr;
    const uint64_t offset = static_cast<uint64_t>(((b * pb.heads + h) * pb.pitch_q + i0) * pb.pitch_k);
    cpu_kernels().attn_dropout_keep(pb.seed, pb.p, offset, pb.pitch_k, rows,
                                    pb.positions(b) + k0, cols, scratch.data(), keep.data());
    return keep.data();
  }

  // Packs the first n gathered keys and values of (b, h).
  void pack_keys(const Problem& pb, int64_t b, int64_t h, int64_t n) {
    const auto& kern = cpu_kernels();
    kern.attn_pack(pb.dtype, pb.k.at(b, h, pb.k_row0[b]), pb.k.row, pb.k.col, pb.positions(b), n,
                   pb.dk, 1.0, k);
    kern.attn_pack(pb.dtype, pb.v.at(b, h, pb.k_row0[b]), pb.v.row, pb.v.col, pb.positions(b), n,
                   pb.dv, 1.0, v);
  }
};

void forward_query_block(const Problem& pb, Workspace& ws, int64_t b, int64_t h, int64_t i0,
                         const Rows& out, const Rows& lse) {
  const auto& kern = cpu_kernels();
  const int64_t rows = std::min(kBlockQ, pb.q_len[b] - i0), row = pb.q_row0[b] + i0;
  const int64_t reach = ws.set_limits(pb, b, i0, rows);
  ws.pack_keys(pb, b, h, reach);
  kern.attn_pack(pb.dtype, pb.q.at(b, h, row), pb.q.row, pb.q.col, nullptr, rows, pb.dk, pb.scale,
                 ws.q);
  auto m = ws.mat(ws.m, 1, rows), l = ws.mat(ws.l, 1, rows), o = ws.mat(ws.o, rows, pb.dv);
  m.fill_(-std::numeric_limits<double>::infinity());
  l.zero_();
  o.zero_();
  const auto q = ws.mat(ws.q, rows, pb.dk);
  for (int64_t k0 = 0; k0 < reach; k0 += kBlockK) {
    const int64_t cols = std::min(kBlockK, reach - k0);
    auto s = ws.mat(ws.s, rows, cols);
    at::mm_out(s, q, ws.mat(ws.k, cols, pb.dk, k0 * pb.dk).t());
    if (pb.has_bias)
      kern.attn_add_bias(pb.dtype, ws.s, rows, cols, pb.bias.at(b, h, i0), pb.bias.row,
                         pb.bias.col, pb.positions(b) + k0);
    kern.attn_forward_block(pb.dtype, rows, cols, ws.relative_limits(rows, k0, cols),
                            ws.keep_mask(pb, b, h, i0, rows, k0, cols), pb.p, ws.s, ws.m, ws.l,
                            ws.o, pb.dv);
    o.addmm_(s, ws.mat(ws.v, cols, pb.dv, k0 * pb.dv));
  }
  kern.attn_forward_finish(pb.dtype, rows, pb.dv, ws.m, ws.l, ws.o, lse.at(b, h, row));
  kern.attn_unpack(pb.dtype, ws.o, nullptr, rows, pb.dv, 1.0, out.at(b, h, row), out.row, out.col);
}

void forward(const Problem& pb, const Rows& out, const Rows& lse) {
  const int64_t longest = pb.batch ? *std::max_element(pb.q_len.begin(), pb.q_len.end()) : 0;
  const int64_t blocks = (longest + kBlockQ - 1) / kBlockQ;
  at::parallel_for(0, pb.batch * pb.heads * blocks, 1, [&](int64_t begin, int64_t end) {
    Workspace ws(pb, false);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (pb.heads * blocks), h = t / blocks % pb.heads, i0 = t % blocks * kBlockQ;
      if (i0 < pb.q_len[b]) forward_query_block(pb, ws, b, h, i0, out, lse);
    }
  });
}

struct Grads {
  Rows out, lse, grad, dq, dk, dv;
  const Rows* dbias;  // null without a bias gradient; strides 0 where it is broadcast
};

void backward_head(const Problem& pb, Workspace& ws, int64_t b, int64_t h, const Grads& g) {
  const auto& kern = cpu_kernels();
  const int64_t n = pb.keys(b);
  ws.pack_keys(pb, b, h, n);
  auto dk = ws.mat(ws.dk, n, pb.dk), dv = ws.mat(ws.dv, n, pb.dv);
  dk.zero_();
  dv.zero_();
  for (int64_t i0 = 0; i0 < pb.q_len[b]; i0 += kBlockQ) {
    const int64_t rows = std::min(kBlockQ, pb.q_len[b] - i0), row = pb.q_row0[b] + i0;
    const int64_t reach = ws.set_limits(pb, b, i0, rows);
    kern.attn_pack(pb.dtype, pb.q.at(b, h, row), pb.q.row, pb.q.col, nullptr, rows, pb.dk,
                   pb.scale, ws.q);
    kern.attn_pack(pb.dtype, g.grad.at(b, h, row), g.grad.row, g.grad.col, nullptr, rows, pb.dv,
                   1.0, ws.dout);
    kern.attn_delta(pb.dtype, g.out.at(b, h, row), g.out.row, g.out.col, ws.dout, rows, pb.dv,
                    ws.delta);
    const void* lse = g.lse.at(b, h, row);
    const auto q = ws.mat(ws.q, rows, pb.dk), dout = ws.mat(ws.dout, rows, pb.dv);
    auto dq = ws.mat(ws.o, rows, pb.dk);
    dq.zero_();
    for (int64_t k0 = 0; k0 < reach; k0 += kBlockK) {
      const int64_t cols = std::min(kBlockK, reach - k0);
      const auto kb = ws.mat(ws.k, cols, pb.dk, k0 * pb.dk);
      auto s = ws.mat(ws.s, rows, cols), dp = ws.mat(ws.dp, rows, cols);
      at::mm_out(s, q, kb.t());
      if (pb.has_bias)
        kern.attn_add_bias(pb.dtype, ws.s, rows, cols, pb.bias.at(b, h, i0), pb.bias.row,
                           pb.bias.col, pb.positions(b) + k0);
      at::mm_out(dp, dout, ws.mat(ws.v, cols, pb.dv, k0 * pb.dv).t());
      kern.attn_backward_block(pb.dtype, rows, cols, ws.relative_limits(rows, k0, cols),
                               ws.keep_mask(pb, b, h, i0, rows, k0, cols), pb.p, lse, ws.delta,
                               ws.s, ws.dp);
      // s now holds the weights that multiplied V, dp holds dS.
      ws.mat(ws.dv, cols, pb.dv, k0 * pb.dv).addmm_(s.t(), dout);
      ws.mat(ws.dk, cols, pb.dk, k0 * pb.dk).addmm_(dp.t(), q);
      dq.addmm_(dp, kb);
      if (g.dbias)
        kern.attn_bias_grad(pb.dtype, ws.dp, rows, cols, pb.positions(b) + k0,
                            g.dbias->at(b, h, i0), g.dbias->row, g.dbias->col);
    }
    kern.attn_unpack(pb.dtype, ws.o, nullptr, rows, pb.dk, pb.scale, g.dq.at(b, h, row), g.dq.row,
                     g.dq.col);
  }
  // Padding keys get zero gradients.
  const int64_t key_row = pb.k_row0[b];
  kern.attn_unpack(pb.dtype, ws.dk, pb.slots(b), pb.k_len[b], pb.dk, 1.0,
                   g.dk.at(b, h, key_row), g.dk.row, g.dk.col);
  kern.attn_unpack(pb.dtype, ws.dv, pb.slots(b), pb.k_len[b], pb.dv, 1.0,
                   g.dv.at(b, h, key_row), g.dv.row, g.dv.col);
}

void backward(const Problem& pb, const Grads& g) {
  // A task owns the (sequence, head) pairs whose bias gradients add into one slice of
  // dbias: all sequences when the bias is shared across the batch, all heads when
  // shared across heads. It visits them in order.
  const bool all_b = g.dbias && g.dbias->batch == 0, all_h = g.dbias && g.dbias->head == 0;
  const int64_t tb = all_b ? 1 : pb.batch, th = all_h ? 1 : pb.heads;
  at::parallel_for(0, tb * th, 1, [&](int64_t begin, int64_t end) {
    Workspace ws(pb, true);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t bo = t / th, ho = t % th;
      for (int64_t b = all_b ? 0 : bo; b < (all_b ? pb.batch : bo + 1); ++b)
        for (int64_t h = all_h ? 0 : ho; h < (all_h ? pb.heads : ho + 1); ++h)
          backward_head(pb, ws, b, h, g);
    }
  });
}

// A new tensor of `sizes` whose dimensions lie in memory in the order of ref's strides
// (so an output of a [batch, seq, heads, dim] view is laid out the same way). The
// Python fake implementations compute the same order.
at::Tensor empty_like_layout(const at::Tensor& ref, at::IntArrayRef sizes, at::ScalarType dtype) {
  std::vector<int64_t> order(ref.dim());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return ref.stride(a) > ref.stride(b); });
  return at::empty_permuted(sizes, order, ref.options().dtype(dtype));
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t ndim) {
  check_cpu(q, "q");
  check_cpu(k, "k");
  check_cpu(v, "v");
  TORCH_CHECK_VALUE(q.dim() == ndim && k.dim() == ndim && v.dim() == ndim, "q, k and v must have ",
                    ndim, " dimensions");
  TORCH_CHECK_TYPE(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
                   "q, k and v must have one dtype");
  kernel_dtype(q);
}

Problem padded_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& key_padding_mask,
                       const std::optional<at::Tensor>& attn_bias, bool causal, double dropout_p,
                       double scale, const at::Tensor& seed) {
  check_inputs(q, k, v, 4);
  Problem pb;
  pb.dtype = kernel_dtype(q);
  pb.acc = acc_dtype(q.scalar_type());
  pb.batch = q.size(0);
  pb.heads = q.size(1);
  pb.dk = q.size(3);
  pb.dv = v.size(3);
  const int64_t seq_q = q.size(2), seq_k = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == pb.batch && k.size(1) == pb.heads && k.size(3) == pb.dk,
                    "k must have shape ", at::IntArrayRef{pb.batch, pb.heads, seq_k, pb.dk});
  TORCH_CHECK_VALUE(v.sizes().slice(0, 3).equals(k.sizes().slice(0, 3)),
                    "v must match k in batch, heads and seq");
  pb.q_row0.assign(pb.batch, 0);
  pb.k_row0.assign(pb.batch, 0);
  pb.q_len.assign(pb.batch, seq_q);
  pb.k_len.assign(pb.batch, seq_k);
  pb.pitch_q = seq_q;
  pb.pitch_k = seq_k;
  pb.causal = causal;
  pb.p = dropout_p;
  pb.scale = scale;
  pb.seed = dropout_p > 0 ? seed_value(seed) : 0;
  pb.q = padded_rows(q);
  pb.k = padded_rows(k);
  pb.v = padded_rows(v);
  at::Tensor mask;
  if (key_padding_mask && key_padding_mask->defined()) {
    mask = *key_padding_mask;
    check_cpu(mask, "key_padding_mask");
    TORCH_CHECK_VALUE(mask.scalar_type() == at::kBool && mask.dim() == 2 &&
                          mask.size(0) == pb.batch && mask.size(1) == seq_k,
                      "key_padding_mask must be bool [batch, seq_k]");
  }
  pb.gather_keys(mask);
  if (attn_bias && attn_bias->defined()) {
    check_cpu(*attn_bias, "attn_bias");
    TORCH_CHECK_TYPE(attn_bias->scalar_type() == q.scalar_type(), "attn_bias must have q's dtype");
    // Broadcast dimensions become stride 0: the bias is read in place, never expanded.
    pb.bias = padded_rows(attn_bias->expand({pb.batch, pb.heads, seq_q, seq_k}));
    pb.has_bias = true;
  }
  return pb;
}

Problem varlen_problem(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                       int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal, double dropout_p,
                       double scale, const at::Tensor& seed) {
  check_inputs(q, k, v, 3);
  Problem pb;
  pb.dtype = kernel_dtype(q);
  pb.acc = acc_dtype(q.scalar_type());
  pb.heads = q.size(1);
  pb.dk = q.size(2);
  pb.dv = v.size(2);
  TORCH_CHECK_VALUE(k.size(1) == pb.heads && k.size(2) == pb.dk && v.size(0) == k.size(0) &&
                        v.size(1) == pb.heads,
                    "k and v must be [total_k, heads, head_dim] with q's heads");
  // Each sequence is checked against the tensors here, on the CPU tensors' data.
  auto offsets = [&](const at::Tensor& cu, const char* name, int64_t total, int64_t max_len,
                     const char* max_name, std::vector<int64_t>& row0, std::vector<int64_t>& len) {
    check_cpu(cu, name);
    TORCH_CHECK_VALUE(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.size(0) >= 1, name,
                      " must be a 1-d int32 tensor [batch + 1]");
    const int32_t* c = cu.data_ptr<int32_t>();
    const int64_t st = cu.stride(0), n = cu.size(0) - 1;
    TORCH_CHECK_VALUE(c[0] == 0, name, " must start at 0, got ", c[0]);
    for (int64_t b = 0; b < n; ++b) {
      const int64_t len_b = int64_t(c[(b + 1) * st]) - c[b * st];
      TORCH_CHECK_VALUE(len_b >= 0, name, " must be non-decreasing, but entry ", b + 1,
                        " is below entry ", b);
      TORCH_CHECK_VALUE(len_b <= max_len, name, ": sequence ", b, " has ", len_b, " tokens, more than ",
                        max_name, " = ", max_len);
      row0.push_back(c[b * st]);
      len.push_back(len_b);
    }
    TORCH_CHECK_VALUE(c[n * st] == total, name, " must end at the number of tokens, ", total,
                      ", got ", c[n * st]);
    return n;
  };
  pb.batch = offsets(cu_seqlens_q, "cu_seqlens_q", q.size(0), max_seqlen_q, "max_seqlen_q",
                     pb.q_row0, pb.q_len);
  const int64_t batch_k = offsets(cu_seqlens_k, "cu_seqlens_k", k.size(0), max_seqlen_k,
                                  "max_seqlen_k", pb.k_row0, pb.k_len);
  TORCH_CHECK_VALUE(batch_k == pb.batch, "cu_seqlens_k must have as many entries as cu_seqlens_q");
  pb.pitch_q = max_seqlen_q;
  pb.pitch_k = max_seqlen_k;
  pb.causal = causal;
  pb.p = dropout_p;
  pb.scale = scale;
  pb.seed = dropout_p > 0 ? seed_value(seed) : 0;
  pb.q = packed_rows(q);
  pb.k = packed_rows(k);
  pb.v = packed_rows(v);
  pb.gather_keys(at::Tensor());
  return pb;
}

Rows lse_rows(const at::Tensor& lse, bool varlen) {
  // Padded: [batch, heads, seq_q]. Varlen: [heads, total_q], rows indexed by token.
  return {static_cast<char*>(lse.data_ptr()), static_cast<int64_t>(lse.element_size()),
          varlen ? 0 : lse.stride(0), lse.stride(varlen ? 0 : 1), 1, 0};
}

void check_saved(const at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad,
                 const Problem& pb) {
  TORCH_CHECK_VALUE(out.scalar_type() == grad.scalar_type() && out.sizes().equals(grad.sizes()),
                    "grad must match the attention output");
  TORCH_CHECK_VALUE(lse.scalar_type() == pb.acc && lse.stride(-1) == 1,
                    "lse must be the forward's log-sum-exp");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& key_padding_mask, const std::optional<at::Tensor>& attn_bias,
    bool causal, double dropout_p, double scale, const at::Tensor& seed) {
  const Problem pb =
      padded_problem(q, k, v, key_padding_mask, attn_bias, causal, dropout_p, scale, seed);
  auto out = empty_like_layout(q, {pb.batch, pb.heads, q.size(2), pb.dv}, q.scalar_type());
  auto lse = at::empty({pb.batch, pb.heads, q.size(2)}, q.options().dtype(pb.acc));
  forward(pb, padded_rows(out), lse_rows(lse, false));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& key_padding_mask,
    const std::optional<at::Tensor>& attn_bias, bool causal, double dropout_p, double scale,
    const at::Tensor& seed, bool bias_grad) {
  const Problem pb =
      padded_problem(q, k, v, key_padding_mask, attn_bias, causal, dropout_p, scale, seed);
  check_saved(out, lse, grad, pb);
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
    dbias_acc = at::zeros(aligned, q.options().dtype(pb.acc));
    dbias = padded_rows(dbias_acc);
    int64_t* strides[] = {&dbias.batch, &dbias.head, &dbias.row, &dbias.col};
    for (int d = 0; d < 4; ++d)
      if (aligned[d] == 1) *strides[d] = 0;
    g.dbias = &dbias;
  }
  backward(pb, g);
  at::Tensor db = bias_grad ? dbias_acc.to(attn_bias->scalar_type()).view(attn_bias->sizes())
                            : at::Tensor();
  return {dq, dk, dv, db};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_forward(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed) {
  const Problem pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, dropout_p, scale, seed);
  auto out = empty_like_layout(q, {q.size(0), pb.heads, pb.dv}, q.scalar_type());
  auto lse = at::empty({pb.heads, q.size(0)}, q.options().dtype(pb.acc));
  forward(pb, packed_rows(out), lse_rows(lse, true));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& grad, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, bool causal,
    double dropout_p, double scale, const at::Tensor& seed) {
  const Problem pb = varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, dropout_p, scale, seed);
  check_saved(out, lse, grad, pb);
  auto dq = empty_like_layout(q, q.sizes(), q.scalar_type());
  auto dk = empty_like_layout(k, k.sizes(), k.scalar_type());
  auto dv = empty_like_layout(v, v.sizes(), v.scalar_type());
  backward(pb, Grads{packed_rows(out), lse_rows(lse, true), packed_rows(grad), packed_rows(dq),
                     packed_rows(dk), packed_rows(dv), nullptr});
  return {dq, dk, dv};
}

}  // namespace fusedlm
