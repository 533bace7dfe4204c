"""attention_with_kvcache in Triton: one decoding step over a KV cache.

First _append_kernel writes k_new/v_new into the caches at each sequence's length, one
program per (sequence, new token). Then _forward_kernel: one program per (sequence, query head,
block of BLOCK_M queries) walks that sequence's keys [leftpad, reach) in blocks of
BLOCK_N with the online softmax (running row max and sum in float32, the output
accumulator rescaled as the max grows), where reach is one past the last key the block's
last query sees. The loop follows each sequence's real length, never max_cache_len, and
the grid depends only on the shapes, so a step can be captured in a CUDA graph.

Memory traffic: each program reads its rows of the cache once, so a decoding step
(seqlen_q = 1) moves the live part of the cache once per head; that read bounds it. With
one query per sequence most of a BLOCK_M block is idle: splitting the keys of a long
cache across programs (flash-decoding) would raise the parallelism; not done here.
"""
import torch
import triton
import triton.language as tl

from ._common import dot_precision, upcast_products

BLOCK_M = 16
BLOCK_N = 64


@triton.jit
def _append_kernel(NEW, CACHE, SEQLENS, heads, dim, max_len, snb, sns, snh, snd, scb, scs, sch,
                   scd, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    pos = tl.load(SEQLENS + b).to(tl.int64) + t
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < dim)
    # Lengths are checked on the host only under FUSEDLM_DEBUG (it costs a sync): past the
    # cache, a write is dropped rather than landing in another sequence's memory.
    if pos < max_len:
        x = tl.load(NEW + b * snb + t * sns + h * snh + d * snd, mask=mask)
        tl.store(CACHE + b * scb + pos * scs + h * sch + d * scd, x, mask=mask)


@triton.jit
def _forward_kernel(Q, K, V, OUT, SEQLENS, LEFTPAD, scale, seq_q, seq_new, max_len, heads, group,
                    dk, dv, sqb, sqs, sqh, sqd, skb, sks, skh, skd, svb, svs, svh, svd,
                    sob, sos, soh, sod, HAS_LEFTPAD: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    b = (tl.program_id(0) // heads).to(tl.int64)
    h = tl.program_id(0) % heads
    i0 = tl.program_id(1) * BLOCK_M
    total = tl.minimum(tl.load(SEQLENS + b) + seq_new, max_len)
    first = tl.load(LEFTPAD + b) if HAS_LEFTPAD else 0
    rows = i0 + tl.arange(0, BLOCK_M)
    ck = tl.arange(0, BLOCK_DK)
    cv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + ck[None, :] * sqd,
                mask=(rows[:, None] < seq_q) & (ck[None, :] < dk), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    # Query i sees the keys up to total - seq_q + i (bottom-right causal alignment).
    last = total - seq_q + rows
    reach = tl.minimum(total, total - seq_q + i0 + BLOCK_M)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    K += b * skb + (h // group) * skh  # query head h reads key/value head h // group
    V += b * svb + (h // group) * svh
    for j0 in range(first, reach, BLOCK_N):
        keys = j0 + tl.arange(0, BLOCK_N)
        k = tl.load(K + keys[:, None] * sks + ck[None, :] * skd,
                    mask=(keys[:, None] < reach) & (ck[None, :] < dk), other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        allowed = (keys[None, :] <= last[:, None]) & (keys[None, :] < reach)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row with no allowed key yet keeps every weight at exp(-inf) = 0.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m - shift)
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(V + keys[:, None] * svs + cv[None, :] * svd,
                    mask=(keys[:, None] < reach) & (cv[None, :] < dv), other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    # Rows that see no key (leftpad past them, or more queries than keys) are zeros.
    out = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
    tl.store(OUT + b * sob + h * soh + rows[:, None] * sos + cv[None, :] * sod,
             out.to(OUT.dtype.element_ty), mask=(rows[:, None] < seq_q) & (cv[None, :] < dv))


def _append(new, cache, seqlens):
    batch, seq_new, heads, dim = new.shape
    if batch == 0 or seq_new == 0:
        return
    _append_kernel[(batch, seq_new)](
        new, cache, seqlens, heads, dim, cache.shape[1], *new.stride(), *cache.stride(),
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim))


def attention_with_kvcache_forward(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad,
                                   scale):
    if k_new is not None:
        _append(k_new, k_cache, cache_seqlens)
        _append(v_new, v_cache, cache_seqlens)
    batch, seq_q, heads, dk = q.shape
    dv = v_cache.shape[3]
    out = q.new_empty((batch, seq_q, heads, dv))
    if out.numel() == 0:
        return out
    grid = (batch * heads, triton.cdiv(seq_q, BLOCK_M))
    _forward_kernel[grid](
        q, k_cache, v_cache, out, cache_seqlens,
        cache_leftpad if cache_leftpad is not None else cache_seqlens, scale, seq_q,
        0 if k_new is None else k_new.shape[1], k_cache.shape[1], heads, heads // k_cache.shape[2],
        dk, dv, *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        HAS_LEFTPAD=cache_leftpad is not None,
        PRECISION=dot_precision(q.dtype), UPCAST=upcast_products(q.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_DK=max(16, triton.next_power_of_2(dk)), BLOCK_DV=max(16, triton.next_power_of_2(dv)))
    return out
