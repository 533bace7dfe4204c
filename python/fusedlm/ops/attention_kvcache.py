"""attention_with_kvcache: one decoding step of causal attention over a preallocated KV cache.

The layout and semantics are flash-attn's op of the same name. Shapes are static (the
caches keep max_cache_len, the lengths are data), so a decoding step can be captured in
a CUDA graph and compiled once. It is an inference op: it writes into the caches and has
no backward, so calling it on tensors that require grad (with grad mode on) raises.
"""
from typing import Optional

import torch
from torch import Tensor

from ..backends import check_index_data, choose, planner
from . import _validate as check
from ._op import Op
from ._probe import Probe, randn
from .attention import _check_groups, _check_head_dims, _resolve_scale, _sdpa, attend

__all__ = ["attention_with_kvcache"]


def _check_lengths(cache_seqlens: Tensor, cache_leftpad: Optional[Tensor], seq_new: int,
                   max_len: int) -> None:
    # As Python ints: a decoding step's batch is small, and tensor ops on it would cost
    # more than the step's kernels.
    cached = cache_seqlens.tolist()
    for b, length in enumerate(cached):
        if not 0 <= length <= max_len - seq_new:
            raise ValueError(f"cache_seqlens[{b}] + seqlen_new = {length} + {seq_new} must lie "
                             f"in [0, max_cache_len = {max_len}]")
    if cache_leftpad is not None:
        for b, (pad, length) in enumerate(zip(cache_leftpad.tolist(), cached)):
            if not 0 <= pad <= length + seq_new:
                raise ValueError(f"cache_leftpad[{b}] = {pad} must lie in [0, cache_seqlens[{b}]"
                                 f" + seqlen_new = {length + seq_new}]")


def _check_no_grad(**tensors: Optional[Tensor]) -> None:
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if t is not None and t.requires_grad:
            raise RuntimeError(f"attention_with_kvcache has no backward (an inference op), but "
                               f"{name} requires grad: call it under torch.no_grad() or "
                               f"torch.inference_mode()")


@planner("attention_with_kvcache")
def plan_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *,
                                cache_leftpad=None, scale=None, backend=None):
    check.tensor("q", q, ndim=4)
    check.tensor("k_cache", k_cache, ndim=4)
    check.tensor("v_cache", v_cache, ndim=4)
    check.tensor("cache_seqlens", cache_seqlens, ndim=1, dtypes=(torch.int32,))
    check.tensor("k_new", k_new, ndim=4, optional=True)
    check.tensor("v_new", v_new, ndim=4, optional=True)
    check.tensor("cache_leftpad", cache_leftpad, ndim=1, dtypes=(torch.int32,), optional=True)
    batch, _, heads, head_dim = q.shape
    max_len, kv_heads, head_dim_v = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    check.shape("k_cache", k_cache, (batch, max_len, kv_heads, head_dim))
    _check_groups(heads, k_cache, kv_heads, key="k_cache", value="v_cache")
    check.shape("v_cache", v_cache, (batch, max_len, kv_heads, head_dim_v))
    check.shape("cache_seqlens", cache_seqlens, (batch,))
    check.shape("cache_leftpad", cache_leftpad, (batch,))
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together (or neither)")
    seq_new = 0 if k_new is None else k_new.shape[1]
    check.shape("k_new", k_new, (batch, seq_new, kv_heads, head_dim))
    check.shape("v_new", v_new, (batch, seq_new, kv_heads, head_dim_v))
    if seq_new > max_len:
        raise ValueError(f"k_new has seqlen_new = {seq_new}, more than max_cache_len = {max_len}")
    _check_head_dims(q, v_cache)
    _resolve_scale(scale, head_dim)
    check.same_dtype(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    device = check.same_device(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=cache_seqlens,
                               k_new=k_new, v_new=v_new, cache_leftpad=cache_leftpad)
    _check_no_grad(q=q, k_cache=k_cache, v_cache=v_cache, k_new=k_new, v_new=v_new)
    choice = choose("attention_with_kvcache", device, backend, dtype=q.dtype, head_dim=head_dim,
                    grouped=kv_heads != heads)
    if check_index_data(device, choice.backend):
        _check_lengths(cache_seqlens, cache_leftpad, seq_new, max_len)
    return choice.copying(cache_seqlens=cache_seqlens, cache_leftpad=cache_leftpad)


def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
                           k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None, *,
                           cache_leftpad: Optional[Tensor] = None, scale: Optional[float] = None,
                           backend: Optional[str] = None) -> Tensor:
    """Causal attention of q [batch, seqlen_q, heads, head_dim] over a KV cache.

    k_cache/v_cache are [batch, max_cache_len, kv_heads, head_dim], kv_heads dividing heads
    (grouped-query and multi-query attention: query head h reads key/value head
    h // (heads // kv_heads)); cache_seqlens (int32 [batch]) counts the tokens already in
    each sequence's cache. k_new/v_new [batch, seqlen_new, kv_heads, head_dim] are written
    IN PLACE into the caches at positions
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (cache_seqlens itself is not
    changed: the caller advances it). Query i then attends to the keys up to total_b -
    seqlen_q + i, total_b = cache_seqlens[b] + seqlen_new (causal, aligned to the bottom
    right); keys before cache_leftpad[b] (int32 [batch]) are padding. Returns out [batch,
    seqlen_q, heads, head_dim]; rows that see no key are zeros. scale defaults to 1 /
    sqrt(head_dim). No backward.

    Lengths past max_cache_len raise for CPU tensors; on a GPU they are checked only under
    FUSEDLM_DEBUG=1 (the check copies them to the host), and otherwise the triton kernel
    drops the writes and keys past the cache.
    """
    choice = plan_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                         cache_leftpad=cache_leftpad, scale=scale, backend=backend)
    return ATTENTION_WITH_KVCACHE.call(choice.backend, q, k_cache, v_cache, cache_seqlens.contiguous(),
                                  k_new, v_new, None if cache_leftpad is None else cache_leftpad.contiguous(),
                                  _resolve_scale(scale, q.shape[-1]))


def attention_with_kvcache_reference(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *,
                                     cache_leftpad=None, scale=None):
    """One decoding step: q [batch, seqlen_q, heads, head_dim] over caches [batch,
    max_cache_len, kv_heads, head_dim], each key/value head repeated for its group of
    query heads.

    k_new/v_new [batch, seqlen_new, ...] are written into the caches (in place) at
    positions cache_seqlens[b] onwards; query i then sees the keys in
    [cache_leftpad[b], total_b - seqlen_q + i], total_b = cache_seqlens[b] + seqlen_new.
    """
    allowed = _write_new_keys(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad)
    group = q.shape[2] // max(k_cache.shape[2], 1)
    k, v = (cache.repeat_interleave(group, dim=2) for cache in (k_cache, v_cache))
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), allowed, scale=scale)
    return out.transpose(1, 2)


def _write_new_keys(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad):
    """Writes k_new/v_new into the caches at each sequence's length; returns the keys each
    query sees, bool [batch, 1, seq_q, max_cache_len]."""
    batch, seq_q = q.shape[:2]
    seq_new = 0 if k_new is None else k_new.shape[1]
    if seq_new:
        rows = torch.arange(batch, device=q.device)[:, None]
        cols = cache_seqlens.long()[:, None] + torch.arange(seq_new, device=q.device)
        k_cache[rows, cols] = k_new
        v_cache[rows, cols] = v_new
    total = cache_seqlens.long() + seq_new
    first = torch.zeros_like(total) if cache_leftpad is None else cache_leftpad.long()
    last = total[:, None] - seq_q + torch.arange(seq_q, device=q.device)  # [batch, seq_q]
    pos = torch.arange(k_cache.shape[1], device=q.device)
    return ((pos >= first[:, None, None]) & (pos <= last[:, :, None]))[:, None]


def _composition(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, scale):
    """The new keys written by indexing, then SDPA over the caches with the mask of the keys
    each query sees."""
    allowed = _write_new_keys(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad)
    out = _sdpa(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2), allowed,
                None, False, 0.0, scale)
    return out.transpose(1, 2)


def _reference_kernel(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad, scale):
    return attention_with_kvcache_reference(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                            cache_leftpad=cache_leftpad, scale=scale)


def _probe(batch, cache, heads, head_dim):
    def make(g):
        q, k_new, v_new = (randn(g, batch, 1, heads, head_dim) for _ in range(3))
        k_cache, v_cache = (randn(g, batch, cache, heads, head_dim) for _ in range(2))
        lengths = torch.randint(1, cache, (batch,), generator=g, dtype=torch.int32)
        return (q, k_cache, v_cache, lengths, k_new, v_new), {}
    return make


ATTENTION_WITH_KVCACHE = Op(
    "attention_with_kvcache",
    lambda q, k_cache, v_cache, *_rest: q.new_empty((*q.shape[:3], v_cache.shape[3])),
    reference=attention_with_kvcache_reference,
    reference_kernels=(_reference_kernel, None),
    composition=_composition,
    probes=(Probe("decoding step", _probe(2, 24, 2, 64), differentiable=False),))
