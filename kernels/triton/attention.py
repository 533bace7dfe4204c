"""attention and attention_varlen in Triton: FlashAttention-2.

Forward: one program per (block of BLOCK_M queries, batch * head) walks the key blocks
with the online softmax (scores in log2 units, scale * log2(e) folded into one multiply,
exp2), and writes O / l and each row's log-sum-exp (float32, +inf for a row that sees no
key, which makes backward's probabilities zeros). Q, K and V are read once per query
block: HBM traffic is O(seq * head_dim) per query block, and the kernel is bound by its
two products.

Grouped heads: query head h reads key/value head h // group (group = heads // kv_heads)
in place, and the programs of a group's query heads run side by side, sharing its K and V
in L2.

Which keys a row sees is a band: query i of a sequence sees keys
i + lo <= j <= i + hi, lo = off - window_left and hi = off + window_right (off =
k_len - q_len, the bottom-right alignment; causal makes hi = off; an unbounded side is
passed as a bound past every key), within the sequence's keys and the padding mask. A
program walks only the blocks its band reaches, from the first block its first row sees
to the last block its last row sees, and puts each block in one of two loops: blocks that
a band edge or the end of the keys crosses compute the element masks, blocks every row
sees whole take no mask but the padding one.

Backward recomputes the probabilities from the log-sum-exp. A preprocess kernel forms
delta = rowsum(dO * O); one program per (key block, batch * kv head) accumulates dK and
dV over the query heads of its group and, for each, the query blocks whose band reaches
its keys, and a second kernel, one program per query block, accumulates dQ over the key
blocks its band reaches. Every sum stays inside one program and every gradient element is
written once (no atomics), so gradients are the same bit for bit on every run. When a
row's keys fit one key block (every row's, a packed sequence's, or in a block a band edge
crosses, the row's own), delta is taken from the exact probabilities (rowsum(P * dP))
instead of from the rounded output.

A bias gradient is dS summed over the bias's broadcast dimensions: the dQ kernel,
which visits every (query, key) pair of the blocks its band reaches once, writes dS into
a zeroed float32 [batch, heads, seq_q, seq_k] buffer that torch then sums; that buffer
(4 bytes per score) is the cost of a bias that requires grad.

attention_varlen runs the same kernels with per-sequence row offsets (VARLEN): the
batch stride is 0 and each program reads its sequence's bounds from cu_seqlens.

Products of float32 inputs use TF32 when torch.backends.cuda.matmul.allow_tf32 is
set, exact float32 ("ieee") otherwise; every product accumulates in float32 and the
softmax runs in float32. Head dims up to 256 (padded to a power of two with masks).
"""
import torch
import triton
import triton.language as tl

from fusedlm.dtypes import empty_like_layout

from ._common import autotune, dot_precision, keep, seed_of, upcast_products

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Sequences up to this length (BERT's) tune over smaller query blocks: more programs.
_SHORT = 512


def _configs():
    # The first is the interpreter's: 32 keys per block gives the tests several key blocks.
    shapes = [(64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2), (64, 32, 8, 2),
              (128, 32, 4, 2), (128, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s)
            for m, n, w, s in shapes]


def _prune(configs, named_args, **kwargs):
    """Short sequences take 64-query blocks, long ones 128; head dims past 128 and exact
    float32 products the smaller tiles: their registers (ieee products run on the FMA
    units, which hold both operands of every product in registers)."""
    args = {**named_args, **kwargs}
    short = args["seq_bucket"] <= _SHORT
    small = args["BLOCK_D"] > 128 or args["BLOCK_DV"] > 128 or args["PRECISION"] == "ieee"
    kept = [c for c in configs
            if (c.kwargs["BLOCK_M"] == 64) == (short or small)
            and not (small and c.kwargs["BLOCK_N"] > 64)]
    return kept or configs


def _tuned(kernel, key=()):
    # window_bucket: a narrow window makes a program's work its band's, not the sequence's,
    # and the blocks the band crosses (masked) a larger share of it.
    return autotune(_configs(), key=["BLOCK_D", "BLOCK_DV", "seq_bucket", "window_bucket",
                                     "CAUSAL", "DROPOUT", *key],
                    prune_configs_by={"early_config_prune": _prune})(kernel)


def _one_key_block(args):
    """Whether one key block holds every row's keys. By the sequence, not the window: a
    window narrower than a block may still straddle two, and delta from one block's
    probabilities would miss the other's."""
    return args["seq_k"] <= args["BLOCK_N"]


# The window's bounds change from model to model: one compiled kernel serves them all,
# rather than one per kind of value Triton specializes an int on (1, multiples of 16).
_RUNTIME = ["seed", "window_left", "window_right"]


def _backward(*key):
    """A dK/dV or dQ kernel: autotuned (on ``key`` as well), and EXACT_DELTA when one key
    block holds every row's keys."""
    def wrap(kernel):
        jitted = triton.jit(kernel, do_not_specialize=_RUNTIME)
        return _tuned(triton.heuristics({"EXACT_DELTA": _one_key_block})(jitted), key)
    return wrap


# --- shared pieces -------------------------------------------------------------------------------

@triton.jit
def _position(seq, heads, BLOCK: tl.constexpr):
    """(block index, batch, head) of this program. The grid is flat (batch * heads can pass
    the 65535 limit of a second axis), and one head's blocks run side by side, sharing its
    K and V in L2."""
    blocks = tl.cdiv(seq, BLOCK)
    pid = tl.program_id(0)
    bh = pid // blocks
    return pid % blocks, (bh // heads).to(tl.int64), (bh % heads).to(tl.int64)


@triton.jit
def _sequence(CU_Q, CU_K, b, seq_q, seq_k, total_q, total_k, VARLEN: tl.constexpr):
    """(first row, length) of sequence b's queries and keys."""
    if VARLEN:
        q_start, q_len = _span(CU_Q, b, total_q, seq_q)
        k_start, k_len = _span(CU_K, b, total_k, seq_k)
    else:
        q_start = 0
        q_len = seq_q
        k_start = 0
        k_len = seq_k
    return q_start, q_len, k_start, k_len


@triton.jit
def _span(CU, b, total, longest):
    """(first row, length) of packed sequence b, clamped into the tensor's ``total`` rows and
    to max_seqlen (the grid's reach): cu_seqlens' values are not checked on a GPU
    (fusedlm.backends.check_index_data), and bad ones must give wrong rows, never a read or
    write outside the tensors."""
    start = tl.minimum(tl.maximum(tl.load(CU + b), 0), total)
    end = tl.minimum(tl.maximum(tl.load(CU + b + 1), start), total)
    return start, tl.minimum(end - start, longest)


@triton.jit
def _program(CU_Q, CU_K, heads, seq_q, seq_k, total_q, total_k, VARLEN: tl.constexpr,
             BLOCK: tl.constexpr, OVER_KEYS: tl.constexpr):
    """(b, h, q_start, q_len, k_start, k_len, first) of this program: its batch and head (of
    ``heads``: q's, or k's when OVER_KEYS), the first row and length of its sequence's
    queries and keys, and the first row of its block of BLOCK queries (of keys when
    OVER_KEYS)."""
    if OVER_KEYS:
        block, b, h = _position(seq_k, heads, BLOCK)
    else:
        block, b, h = _position(seq_q, heads, BLOCK)
    q_start, q_len, k_start, k_len = _sequence(CU_Q, CU_K, b, seq_q, seq_k, total_q, total_k,
                                               VARLEN)
    return b, h, q_start, q_len, k_start, k_len, block * BLOCK


@triton.jit
def _band(q_len, k_len, window_left, window_right, CAUSAL: tl.constexpr):
    """(lo, hi): query i of the sequence sees keys i + lo <= j <= i + hi."""
    off = k_len - q_len
    hi = off
    if not CAUSAL:
        hi += window_right
    return off - window_left, hi


@triton.jit
def _blocks(a0, a_len, b_len, lo, hi, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """The blocks of BLOCK_B rows of the other axis (b < b_len) that the band of this
    axis's block [a0, a0 + BLOCK_A) reaches, row a seeing b in [a + lo, a + hi]:
    (first, full_first, full_end, end), the blocks from ``first`` up to ``end`` (exclusive),
    and among them those from ``full_first`` to ``full_end`` that every real row of the
    block sees whole (below b_len: no element masks). All but ``end`` are multiples of
    BLOCK_B, or equal to ``end``. Divisions take no negative operand: a negative quotient
    rounds differently in the compiler and the interpreter."""
    last = tl.minimum(a0 + BLOCK_A, a_len) - 1
    end = tl.minimum(tl.maximum(last + hi + 1, 0), b_len)
    first = tl.minimum(tl.maximum(a0 + lo, 0) // BLOCK_B * BLOCK_B, end)
    full_first = tl.minimum(tl.cdiv(tl.maximum(last + lo, 0), BLOCK_B) * BLOCK_B, end)
    full_end = tl.minimum(tl.maximum(a0 + hi + 1, 0), b_len) // BLOCK_B * BLOCK_B
    return first, full_first, tl.maximum(full_end, full_first), end


@triton.jit
def _edge_blocks(first, full_first, full_end, end, BLOCK: tl.constexpr):
    """How many blocks of [first, end) lie outside [full_first, full_end): the masked ones."""
    return tl.cdiv(full_first - first, BLOCK) + tl.cdiv(end - full_end, BLOCK)


@triton.jit
def _edge_block(t, first, full_first, full_end, BLOCK: tl.constexpr):
    """The first row of masked block t: those below full_first, then those from full_end."""
    start = first + t * BLOCK
    return tl.where(start < full_first, start, start + (full_end - full_first))


@triton.jit
def _tile(PTR, b, h, start, rows, sb, sh, ss, sd, length, width, BLOCK_W: tl.constexpr,
          UPCAST: tl.constexpr):
    """The [rows, BLOCK_W] tile of head h of sequence b (zeros outside the sequence and past
    column ``width``), in float32 when UPCAST (the products then take float32 operands)."""
    cols = tl.arange(0, BLOCK_W)
    offsets = (b * sb + h * sh + (start + rows).to(tl.int64)[:, None] * ss
               + cols[None, :] * sd)
    x = tl.load(PTR + offsets, mask=(rows[:, None] < length) & (cols[None, :] < width), other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _key_tiles(K, V, b, h, k_start, cols, k_len, head_dim, head_dim_v,
               skb, skh, sks, skd, svb, svh, svs, svd,
               UPCAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(k, v) of keys ``cols`` of key/value head h."""
    k = _tile(K, b, h, k_start, cols, skb, skh, sks, skd, k_len, head_dim, BLOCK_D, UPCAST)
    v = _tile(V, b, h, k_start, cols, svb, svh, svs, svd, k_len, head_dim_v, BLOCK_DV, UPCAST)
    return k, v


@triton.jit
def _store_tile(PTR, value, b, h, start, rows, sb, sh, ss, sd, length, width,
                BLOCK_W: tl.constexpr):
    cols = tl.arange(0, BLOCK_W)
    offsets = (b * sb + h * sh + (start + rows).to(tl.int64)[:, None] * ss
               + cols[None, :] * sd)
    tl.store(PTR + offsets, value.to(PTR.dtype.element_ty),
             mask=(rows[:, None] < length) & (cols[None, :] < width))


@triton.jit
def _scores(q, k, b, h, rows, cols, q_len, k_len, lo, hi, qk_scale, PAD, spb, spk,
            BIAS, sbb, sbh, sbq, sbk, HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
            MASKED: tl.constexpr, PRECISION: tl.constexpr):
    """Scores of queries `rows` (of query head h) against keys `cols` in log2 units, -inf
    where not allowed. Unless MASKED, every key is a real one inside every row's band:
    only padding masks. (Rows past the sequence need no mask: their output is never stored,
    and backward gives them a log-sum-exp of +inf, so probabilities of zero.)"""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    inside = (rows[:, None] < q_len) & (cols[None, :] < k_len)
    if HAS_BIAS:
        offsets = (b * sbb + h * sbh + rows.to(tl.int64)[:, None] * sbq
                   + cols.to(tl.int64)[None, :] * sbk)
        s += tl.load(BIAS + offsets, mask=inside, other=0.0).to(tl.float32) * LOG2E
    if MASKED:
        diagonal = cols[None, :] - rows[:, None]
        s = tl.where(inside & (diagonal >= lo) & (diagonal <= hi), s, float("-inf"))
    if HAS_PAD:
        padding = tl.load(PAD + b * spb + cols * spk, mask=cols < k_len, other=1)
        s = tl.where((padding == 0)[None, :], s, float("-inf"))
    return s


@triton.jit
def _kept(seed, p, b, h, heads, rows, cols, pitch_q, pitch_k):
    """Dropout's keep mask of the tile: element ((b * heads + h) * pitch_q + i) * pitch_k + j
    of the stream."""
    first = (b * heads + h) * pitch_q
    offsets = (first + rows.to(tl.int64)[:, None]) * pitch_k + cols[None, :]
    return keep(seed, offsets, p)


# --- forward -------------------------------------------------------------------------------------

@triton.jit
def _forward_block(q, m_i, l_i, acc, K, V, b, h, kh, heads, k_start, rows, n0, q_len, k_len, lo, hi,
                   head_dim, head_dim_v, skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, p, seed,
                   PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
                   HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                   MASKED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax's state (m_i, l_i, acc) after the key block from n0."""
    cols = n0 + tl.arange(0, BLOCK_N)
    k, v = _key_tiles(K, V, b, kh, k_start, cols, k_len, head_dim, head_dim_v,
                      skb, skh, sks, skd, svb, svh, svs, svd, UPCAST, BLOCK_D, BLOCK_DV)
    s = _scores(q, k, b, h, rows, cols, q_len, k_len, lo, hi, qk_scale, PAD, spb, spk,
                BIAS, sbb, sbh, sbq, sbk, HAS_PAD, HAS_BIAS, MASKED, PRECISION)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with no allowed key yet subtracts 0, so its exp2(-inf) stay zeros.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    prob = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(prob, 1)
    if DROPOUT:
        kept = _kept(seed, p, b, h, heads, rows, cols, seq_q, seq_k)
        prob = tl.where(kept, prob * (1.0 / (1.0 - p)), 0.0)
    # P rounded to V's dtype, as the tensor cores take it.
    prob = prob.to(V.dtype.element_ty).to(v.dtype)
    acc = acc * alpha[:, None] + tl.dot(prob, v, input_precision=PRECISION)
    return m_new, l_i, acc


@_tuned
@triton.jit(do_not_specialize=_RUNTIME)
def _forward_kernel(Q, K, V, OUT, LSE, PAD, BIAS, CU_Q, CU_K,
                    sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                    sob, soh, sos, sod, slb, slh, spb, spk, sbb, sbh, sbq, sbk,
                    heads, group, seq_q, seq_k, total_q, total_k, head_dim, head_dim_v,
                    window_left, window_right, qk_scale, p, seed, seq_bucket, window_bucket,
                    HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
                    DROPOUT: tl.constexpr, VARLEN: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    b, h, q_start, q_len, k_start, k_len, m0 = _program(
        CU_Q, CU_K, heads, seq_q, seq_k, total_q, total_k, VARLEN, BLOCK_M, False)
    if m0 >= q_len:
        return
    kh = h // group
    lo, hi = _band(q_len, k_len, window_left, window_right, CAUSAL)
    first, full_first, full_end, end = _blocks(m0, q_len, k_len, lo, hi, BLOCK_M, BLOCK_N)
    rows = m0 + tl.arange(0, BLOCK_M)
    q = _tile(Q, b, h, q_start, rows, sqb, sqh, sqs, sqd, q_len, head_dim, BLOCK_D, UPCAST)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for t in range(0, _edge_blocks(first, full_first, full_end, end, BLOCK_N)):
        n0 = _edge_block(t, first, full_first, full_end, BLOCK_N)
        m_i, l_i, acc = _forward_block(
            q, m_i, l_i, acc, K, V, b, h, kh, heads, k_start, rows, n0, q_len, k_len, lo, hi,
            head_dim, head_dim_v, skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, p, seed,
            PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k, HAS_PAD, HAS_BIAS, DROPOUT,
            True, PRECISION, UPCAST, BLOCK_D, BLOCK_DV, BLOCK_N)
    for n0 in range(full_first, full_end, BLOCK_N):
        m_i, l_i, acc = _forward_block(
            q, m_i, l_i, acc, K, V, b, h, kh, heads, k_start, rows, n0, q_len, k_len, lo, hi,
            head_dim, head_dim_v, skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, p, seed,
            PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k, HAS_PAD, HAS_BIAS, DROPOUT,
            False, PRECISION, UPCAST, BLOCK_D, BLOCK_DV, BLOCK_N)

    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    _store_tile(OUT, out, b, h, q_start, rows, sob, soh, sos, sod, q_len, head_dim_v, BLOCK_DV)
    lse = tl.where(empty, float("inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * LN2)
    tl.store(LSE + b * slb + h * slh + q_start + rows, lse, mask=rows < q_len)


# --- backward ------------------------------------------------------------------------------------

@triton.jit
def _delta_kernel(OUT, DO, DELTA, CU_Q, CU_K, sob, soh, sos, sod, sgb, sgh, sgs, sgd, slb, slh,
                  heads, seq_q, seq_k, total_q, total_k, head_dim_v, VARLEN: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    b, h, q_start, q_len, _, _, m0 = _program(
        CU_Q, CU_K, heads, seq_q, seq_k, total_q, total_k, VARLEN, BLOCK_M, False)
    rows = m0 + tl.arange(0, BLOCK_M)
    o = _tile(OUT, b, h, q_start, rows, sob, soh, sos, sod, q_len, head_dim_v, BLOCK_DV, False)
    do = _tile(DO, b, h, q_start, rows, sgb, sgh, sgs, sgd, q_len, head_dim_v, BLOCK_DV, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + b * slb + h * slh + q_start + rows, delta, mask=rows < q_len)


@triton.jit
def _score_grads(q, k, v, do, lse, delta, b, h, heads, rows, cols, q_len, k_len, lo, hi, qk_scale,
                 p, seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
                 HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                 VARLEN: tl.constexpr, EXACT_DELTA: tl.constexpr, MASKED: tl.constexpr,
                 PRECISION: tl.constexpr):
    """(P after dropout, dS) of a tile: P recomputed from the log-sum-exp, dS = P (dP - delta)."""
    s = _scores(q, k, b, h, rows, cols, q_len, k_len, lo, hi, qk_scale, PAD, spb, spk,
                BIAS, sbb, sbh, sbq, sbk, HAS_PAD, HAS_BIAS, MASKED, PRECISION)
    prob = tl.math.exp2(s - lse[:, None] * LOG2E)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    dropped = prob
    if DROPOUT:
        kept = _kept(seed, p, b, h, heads, rows, cols, seq_q, seq_k)
        dropped = tl.where(kept, prob * (1.0 / (1.0 - p)), 0.0)
        dp = tl.where(kept, dp * (1.0 / (1.0 - p)), 0.0)
    if EXACT_DELTA:
        delta = _exact_delta(prob, dp)
    elif MASKED:
        # Rows whose band lies inside this block (a window narrower than a block, a causal
        # sequence's first rows, a packed sequence no longer than a block) take the exact
        # delta: a row that sees one key has no score gradient, and only the tile's own
        # sum cancels to zero exactly.
        n0 = tl.min(cols, 0)
        whole = ((tl.maximum(rows + lo, 0) >= n0)
                 & (tl.minimum(rows + hi, k_len - 1) < n0 + prob.shape[1]))
        delta = tl.where(whole, _exact_delta(prob, dp), delta)
    elif VARLEN:
        if k_len <= prob.shape[1]:  # this sequence's keys fit the block
            delta = _exact_delta(prob, dp)
    return dropped, prob * (dp - delta[:, None])


@triton.jit
def _exact_delta(prob, dp):
    """rowsum(P * dP) / rowsum(P) of a tile holding whole rows: see exact_delta in
    csrc/cpu/attention.cpp."""
    mass = tl.sum(prob, 1)
    return tl.sum(prob * dp, 1) / tl.where(mass > 0, mass, 1.0)


@triton.jit
def _query_tiles(Q, DO, LSE, DELTA, b, h, q_start, rows, q_len, head_dim, head_dim_v,
                 sqb, sqh, sqs, sqd, sgb, sgh, sgs, sgd, slb, slh,
                 UPCAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """(q, dO, log-sum-exp, delta) of queries ``rows``: +inf and 0 past the sequence."""
    q = _tile(Q, b, h, q_start, rows, sqb, sqh, sqs, sqd, q_len, head_dim, BLOCK_D, UPCAST)
    do = _tile(DO, b, h, q_start, rows, sgb, sgh, sgs, sgd, q_len, head_dim_v, BLOCK_DV, UPCAST)
    stats = b * slb + h * slh + q_start + rows
    lse = tl.load(LSE + stats, mask=rows < q_len, other=float("inf"))
    delta = tl.load(DELTA + stats, mask=rows < q_len, other=0.0)
    return q, do, lse, delta


@triton.jit
def _dkdv_block(dk, dv, k, v, Q, DO, LSE, DELTA, b, h, heads, q_start, rows, cols, q_len, k_len,
                lo, hi, head_dim, head_dim_v, sqb, sqh, sqs, sqd, sgb, sgh, sgs, sgd, slb, slh,
                qk_scale, p, seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
                HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                VARLEN: tl.constexpr, EXACT_DELTA: tl.constexpr, MASKED: tl.constexpr,
                PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr):
    """(dK, dV) after the queries ``rows`` of query head h."""
    q, do, lse, delta = _query_tiles(Q, DO, LSE, DELTA, b, h, q_start, rows, q_len, head_dim,
                                     head_dim_v, sqb, sqh, sqs, sqd, sgb, sgh, sgs, sgd,
                                     slb, slh, UPCAST, BLOCK_D, BLOCK_DV)
    dropped, ds = _score_grads(q, k, v, do, lse, delta, b, h, heads, rows, cols, q_len, k_len,
                               lo, hi, qk_scale, p, seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk,
                               seq_q, seq_k, HAS_PAD, HAS_BIAS, DROPOUT, VARLEN, EXACT_DELTA,
                               MASKED, PRECISION)
    # P and dS rounded to the inputs' dtype, as the tensor cores take them.
    dropped = dropped.to(DO.dtype.element_ty).to(do.dtype)
    dv += tl.dot(tl.trans(dropped), do, input_precision=PRECISION)
    ds = ds.to(Q.dtype.element_ty).to(q.dtype)
    dk += tl.dot(tl.trans(ds), q, input_precision=PRECISION)
    return dk, dv


# group: a program walks its group's query heads, so the grid has group times fewer, longer
# programs than the other kernels'.
@_backward("group")
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, PAD, BIAS, CU_Q, CU_K,
                 sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
                 sgb, sgh, sgs, sgd, slb, slh, spb, spk, sbb, sbh, sbq, sbk,
                 sdkb, sdkh, sdks, sdkd, sdvb, sdvh, sdvs, sdvd,
                 heads, group, seq_q, seq_k, total_q, total_k, head_dim, head_dim_v,
                 window_left, window_right, scale, qk_scale, p, seed, seq_bucket, window_bucket,
                 HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
                 DROPOUT: tl.constexpr, VARLEN: tl.constexpr, EXACT_DELTA: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # One program per key block of a key/value head: the sums over its group's query heads
    # stay in registers, and each dK and dV element is written once.
    b, kh, q_start, q_len, k_start, k_len, n0 = _program(
        CU_Q, CU_K, heads // group, seq_q, seq_k, total_q, total_k, VARLEN, BLOCK_N, True)
    if n0 >= k_len:
        return
    lo, hi = _band(q_len, k_len, window_left, window_right, CAUSAL)
    # The query blocks whose band reaches these keys: query i sees key j when
    # j - hi <= i <= j - lo.
    first, full_first, full_end, end = _blocks(n0, k_len, q_len, -hi, -lo, BLOCK_N, BLOCK_M)
    # A block past the sequence's last key masks those columns in every query block (a row's
    # sum over the block, the exact delta, must not meet them).
    partial = n0 + BLOCK_N > k_len
    full_first = tl.where(partial, end, full_first)
    full_end = tl.where(partial, end, full_end)
    cols = n0 + tl.arange(0, BLOCK_N)
    k, v = _key_tiles(K, V, b, kh, k_start, cols, k_len, head_dim, head_dim_v,
                      skb, skh, sks, skd, svb, svh, svs, svd, UPCAST, BLOCK_D, BLOCK_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(0, group):
        h = kh * group + g
        for t in range(0, _edge_blocks(first, full_first, full_end, end, BLOCK_M)):
            rows = _edge_block(t, first, full_first, full_end, BLOCK_M) + tl.arange(0, BLOCK_M)
            dk, dv = _dkdv_block(
                dk, dv, k, v, Q, DO, LSE, DELTA, b, h, heads, q_start, rows, cols, q_len, k_len,
                lo, hi, head_dim, head_dim_v, sqb, sqh, sqs, sqd, sgb, sgh, sgs, sgd, slb, slh,
                qk_scale, p, seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
                HAS_PAD, HAS_BIAS, DROPOUT, VARLEN, EXACT_DELTA, True, PRECISION, UPCAST,
                BLOCK_D, BLOCK_DV)
        for m0 in range(full_first, full_end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            dk, dv = _dkdv_block(
                dk, dv, k, v, Q, DO, LSE, DELTA, b, h, heads, q_start, rows, cols, q_len, k_len,
                lo, hi, head_dim, head_dim_v, sqb, sqh, sqs, sqd, sgb, sgh, sgs, sgd, slb, slh,
                qk_scale, p, seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
                HAS_PAD, HAS_BIAS, DROPOUT, VARLEN, EXACT_DELTA, False, PRECISION, UPCAST,
                BLOCK_D, BLOCK_DV)
    _store_tile(DK, dk * scale, b, kh, k_start, cols, sdkb, sdkh, sdks, sdkd, k_len, head_dim,
                BLOCK_D)
    _store_tile(DV, dv, b, kh, k_start, cols, sdvb, sdvh, sdvs, sdvd, k_len, head_dim_v, BLOCK_DV)


@triton.jit
def _dq_block(dq, q, do, lse, delta, K, V, DS, b, h, kh, heads, k_start, rows, n0, q_len, k_len,
              lo, hi, head_dim, head_dim_v, skb, skh, sks, skd, svb, svh, svs, svd, qk_scale, p,
              seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
              HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
              VARLEN: tl.constexpr, EXACT_DELTA: tl.constexpr, WRITE_DS: tl.constexpr,
              MASKED: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr):
    """dQ after the key block from n0."""
    cols = n0 + tl.arange(0, BLOCK_N)
    k, v = _key_tiles(K, V, b, kh, k_start, cols, k_len, head_dim, head_dim_v,
                      skb, skh, sks, skd, svb, svh, svs, svd, UPCAST, BLOCK_D, BLOCK_DV)
    _, ds = _score_grads(q, k, v, do, lse, delta, b, h, heads, rows, cols, q_len, k_len, lo, hi,
                         qk_scale, p, seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
                         HAS_PAD, HAS_BIAS, DROPOUT, VARLEN, EXACT_DELTA, MASKED, PRECISION)
    if WRITE_DS:  # a dense float32 [batch, heads, seq_q, seq_k] buffer
        offsets = ((b * heads + h) * seq_q + rows)[:, None] * seq_k + cols[None, :]
        tl.store(DS + offsets, ds, mask=(rows[:, None] < q_len) & (cols[None, :] < k_len))
    ds = ds.to(K.dtype.element_ty).to(k.dtype)
    return dq + tl.dot(ds, k, input_precision=PRECISION)


@_backward()
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, DS, PAD, BIAS, CU_Q, CU_K,
               sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svs, svd,
               sgb, sgh, sgs, sgd, slb, slh, spb, spk, sbb, sbh, sbq, sbk,
               sdqb, sdqh, sdqs, sdqd,
               heads, group, seq_q, seq_k, total_q, total_k, head_dim, head_dim_v,
               window_left, window_right, scale, qk_scale, p, seed, seq_bucket, window_bucket,
               HAS_PAD: tl.constexpr, HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr,
               DROPOUT: tl.constexpr, VARLEN: tl.constexpr, EXACT_DELTA: tl.constexpr,
               WRITE_DS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):
    b, h, q_start, q_len, k_start, k_len, m0 = _program(
        CU_Q, CU_K, heads, seq_q, seq_k, total_q, total_k, VARLEN, BLOCK_M, False)
    if m0 >= q_len:
        return
    kh = h // group
    lo, hi = _band(q_len, k_len, window_left, window_right, CAUSAL)
    first, full_first, full_end, end = _blocks(m0, q_len, k_len, lo, hi, BLOCK_M, BLOCK_N)
    rows = m0 + tl.arange(0, BLOCK_M)
    q, do, lse, delta = _query_tiles(Q, DO, LSE, DELTA, b, h, q_start, rows, q_len, head_dim,
                                     head_dim_v, sqb, sqh, sqs, sqd, sgb, sgh, sgs, sgd, slb, slh,
                                     UPCAST, BLOCK_D, BLOCK_DV)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for t in range(0, _edge_blocks(first, full_first, full_end, end, BLOCK_N)):
        n0 = _edge_block(t, first, full_first, full_end, BLOCK_N)
        dq = _dq_block(dq, q, do, lse, delta, K, V, DS, b, h, kh, heads, k_start, rows, n0, q_len,
                       k_len, lo, hi, head_dim, head_dim_v, skb, skh, sks, skd, svb, svh, svs, svd,
                       qk_scale, p, seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
                       HAS_PAD, HAS_BIAS, DROPOUT, VARLEN, EXACT_DELTA, WRITE_DS, True, PRECISION,
                       UPCAST, BLOCK_D, BLOCK_DV, BLOCK_N)
    for n0 in range(full_first, full_end, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, K, V, DS, b, h, kh, heads, k_start, rows, n0, q_len,
                       k_len, lo, hi, head_dim, head_dim_v, skb, skh, sks, skd, svb, svh, svs, svd,
                       qk_scale, p, seed, PAD, spb, spk, BIAS, sbb, sbh, sbq, sbk, seq_q, seq_k,
                       HAS_PAD, HAS_BIAS, DROPOUT, VARLEN, EXACT_DELTA, WRITE_DS, False, PRECISION,
                       UPCAST, BLOCK_D, BLOCK_DV, BLOCK_N)
    _store_tile(DQ, dq * scale, b, h, q_start, rows, sdqb, sdqh, sdqs, sdqd, q_len, head_dim,
                BLOCK_D)


# --- launchers -----------------------------------------------------------------------------------

def _padded_strides(t):  # [batch, heads, seq, dim]
    return tuple(t.stride())


def _packed_strides(t):  # [tokens, heads, dim]: batch stride 0, rows from cu_seqlens
    return (0, t.stride(1), t.stride(0), t.stride(2))


def _block(dim: int) -> int:
    return max(16, triton.next_power_of_2(dim))


def _bias_args(attn_bias):
    """attn_bias and its strides over [batch, heads, seq_q, seq_k], 0 where broadcast."""
    if attn_bias is None:
        return None, (0, 0, 0, 0)
    aligned = attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))
    return attn_bias, tuple(0 if n == 1 else s for n, s in zip(aligned.shape, aligned.stride()))


def _mask_args(key_padding_mask):
    if key_padding_mask is None:
        return None, (0, 0)
    return key_padding_mask.view(torch.uint8), tuple(key_padding_mask.stride())


def _seq_bucket(seq_q, seq_k):
    return max(64, triton.next_power_of_2(max(seq_q, seq_k, 1)))


def _window_bucket(window_left, window_right, causal, seq_bucket):
    """The keys a row may see, to a power of two, when a window bounds both sides to fewer
    than the sequence's; 0 otherwise."""
    right = 0 if causal else window_right
    if window_left < 0 or right < 0:
        return 0
    span = triton.next_power_of_2(window_left + right + 1)
    return span if span < seq_bucket else 0


class _Problem:
    """One call's tensors and sizes, as the kernels take them."""

    def __init__(self, q, k, v, key_padding_mask, attn_bias, cu_q, cu_k, batch, seq_q, seq_k,
                 causal, window_left, window_right, dropout_p, scale, seed, strides):
        self.q, self.k, self.v, self.cu_q, self.cu_k = q, k, v, cu_q, cu_k
        self.strides = strides
        self.pad, self.pad_strides = _mask_args(key_padding_mask)
        self.bias, self.bias_strides = _bias_args(attn_bias)
        # k and v are [batch, kv_heads, seq_k, dim] or [tokens, kv_heads, dim]
        self.batch, self.heads, self.kv_heads = batch, q.shape[1], k.shape[1]
        self.seq_q, self.seq_k = seq_q, seq_k
        self.head_dim, self.head_dim_v = q.shape[-1], v.shape[-1]
        self.causal, self.p, self.scale = causal, dropout_p, scale
        # An unbounded side (-1) as a bound past every key, and a wider one clamped to it:
        # the kernels' band arithmetic stays in int32 and needs no case for it.
        unbounded = seq_q + seq_k
        self.window = tuple(unbounded if w < 0 else min(w, unbounded)
                            for w in (window_left, window_right))
        self.seq_bucket = _seq_bucket(seq_q, seq_k)
        self.window_bucket = _window_bucket(window_left, window_right, causal, self.seq_bucket)
        self.seed = seed_of(seed, dropout_p)

    def empty(self):
        return self.batch * self.heads == 0

    def grid(self, over_keys=False):
        """Query blocks of every (sequence, head), or key blocks of every (sequence, kv head)."""
        if over_keys:
            return lambda meta: (triton.cdiv(self.seq_k, meta["BLOCK_N"]) * self.batch
                                 * self.kv_heads,)
        return lambda meta: (triton.cdiv(self.seq_q, meta["BLOCK_M"]) * self.batch * self.heads,)

    def common(self):
        """The arguments every kernel after the pointers takes, in order."""
        return (*self.strides(self.q), *self.strides(self.k), *self.strides(self.v))

    def sizes(self, with_scale=False):
        scale = (self.scale,) if with_scale else ()
        return (self.heads, self.heads // self.kv_heads, self.seq_q, self.seq_k, *self.totals(),
                self.head_dim, self.head_dim_v, *self.window, *scale,
                self.scale * LOG2E.value, self.p, self.seed, self.seq_bucket, self.window_bucket)

    def totals(self):
        """The rows of packed q, and of packed k and v (the bounds of every sequence)."""
        return (self.q.shape[0], self.k.shape[0]) if self.cu_q is not None else (0, 0)

    def flags(self):
        dtype = self.q.dtype
        return dict(HAS_PAD=self.pad is not None, HAS_BIAS=self.bias is not None,
                    CAUSAL=self.causal, DROPOUT=self.p > 0, VARLEN=self.cu_q is not None,
                    PRECISION=dot_precision(dtype), UPCAST=upcast_products(dtype),
                    BLOCK_D=_block(self.head_dim), BLOCK_DV=_block(self.head_dim_v))

    def lse_strides(self, lse):
        # [batch, heads, seq_q], or [heads, total_q] for packed sequences
        return (0, lse.stride(0)) if self.cu_q is not None else (lse.stride(0), lse.stride(1))

    def forward(self, out, lse):
        if self.empty() or self.seq_q == 0:
            return
        _forward_kernel[self.grid()](
            self.q, self.k, self.v, out, lse, self.pad, self.bias, self.cu_q, self.cu_k,
            *self.common(), *self.strides(out), *self.lse_strides(lse), *self.pad_strides,
            *self.bias_strides, *self.sizes(), **self.flags())

    def backward(self, grad, out, lse, dq, dk, dv, ds):
        if self.empty():
            return
        delta = torch.empty_like(lse)
        flags = self.flags()
        if self.seq_q:
            _delta_kernel[(triton.cdiv(self.seq_q, 64) * self.batch * self.heads,)](
                out, grad, delta, self.cu_q, self.cu_k, *self.strides(out), *self.strides(grad),
                *self.lse_strides(lse), self.heads, self.seq_q, self.seq_k, *self.totals(),
                self.head_dim_v,
                VARLEN=flags["VARLEN"], BLOCK_M=64, BLOCK_DV=flags["BLOCK_DV"])
        head = (self.q, self.k, self.v, grad, lse, delta)
        tail = (*self.common(), *self.strides(grad), *self.lse_strides(lse), *self.pad_strides,
                *self.bias_strides)
        if self.seq_k:
            _dkdv_kernel[self.grid(over_keys=True)](
                *head, dk, dv, self.pad, self.bias, self.cu_q, self.cu_k, *tail,
                *self.strides(dk), *self.strides(dv), *self.sizes(with_scale=True), **flags)
        if self.seq_q:
            _dq_kernel[self.grid()](
                *head, dq, ds, self.pad, self.bias, self.cu_q, self.cu_k, *tail,
                *self.strides(dq), *self.sizes(with_scale=True), WRITE_DS=ds is not None, **flags)


# --- attention -----------------------------------------------------------------------------------

def _padded(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right, dropout_p,
            scale, seed):
    batch, _, seq_q, _ = q.shape
    return _Problem(q, k, v, key_padding_mask, attn_bias, None, None, batch, seq_q, k.shape[2],
                    causal, window_left, window_right, dropout_p, scale, seed, _padded_strides)


def attention_forward(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                      dropout_p, scale, seed):
    problem = _padded(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                      dropout_p, scale, seed)
    batch, heads, seq_q, _ = q.shape
    out = empty_like_layout(q, (batch, heads, seq_q, v.shape[3]))
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    problem.forward(out, lse)
    return out, lse


def attention_backward(grad, q, k, v, out, lse, key_padding_mask, attn_bias, causal, window_left,
                       window_right, dropout_p, scale, seed, bias_grad):
    problem = _padded(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                      dropout_p, scale, seed)
    dq, dk, dv = (empty_like_layout(t, t.shape) for t in (q, k, v))
    if not bias_grad:
        problem.backward(grad, out, lse, dq, dk, dv, None)
        return dq, dk, dv, None
    pairs = (*q.shape[:3], k.shape[2])
    aligned = (1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape)
    summed = [d for d, n in enumerate(aligned) if n == 1 and pairs[d] != 1]
    # Zeros: pairs outside the band (causal, window) are never visited. The kernel writes ds as
    # [batch, heads, seq_q, seq_k]; a bias of that size gets it in its own shape, and a
    # broadcast one the sums written into its shape: dbias is no view (FSDP2 cannot follow
    # in-place changes to a view a module returns).
    ds = torch.zeros(pairs if summed else attn_bias.shape, dtype=torch.float32, device=q.device)
    problem.backward(grad, out, lse, dq, dk, dv, ds.view(pairs))
    dbias = ds
    if summed:
        dbias = ds.new_empty(attn_bias.shape)
        torch.sum(ds, summed, keepdim=True, out=dbias.view(aligned))
    return dq, dk, dv, dbias.to(attn_bias.dtype)


# --- attention_varlen ----------------------------------------------------------------------------

def _packed(q, k, v, cu_q, cu_k, max_q, max_k, causal, window_left, window_right, dropout_p,
            scale, seed):
    return _Problem(q, k, v, None, None, cu_q, cu_k, cu_q.shape[0] - 1, max_q, max_k, causal,
                    window_left, window_right, dropout_p, scale, seed, _packed_strides)


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             causal, window_left, window_right, dropout_p, scale, seed):
    problem = _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                      window_left, window_right, dropout_p, scale, seed)
    total_q, heads, _ = q.shape
    out = empty_like_layout(q, (total_q, heads, v.shape[2]))
    lse = torch.empty((heads, total_q), dtype=torch.float32, device=q.device)
    problem.forward(out, lse)
    return out, lse


def attention_varlen_backward(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, causal, window_left, window_right, dropout_p, scale,
                              seed):
    problem = _packed(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                      window_left, window_right, dropout_p, scale, seed)
    # Zeros: rows of sequences with no keys (or no queries) are never written.
    dq, dk, dv = (empty_like_layout(t, t.shape).zero_() for t in (q, k, v))
    problem.backward(grad, out, lse, dq, dk, dv, None)
    return dq, dk, dv
