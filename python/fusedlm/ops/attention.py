"""attention and attention_varlen: fused softmax(q k^T * scale + bias) v, FlashAttention style.

k and v may have fewer heads than q (grouped-query and multi-query attention): query head
h reads key/value head h // (heads // kv_heads), in place. A sliding window
``window_size=(left, right)`` lets query i see the keys j with
i + off - left <= j <= i + off + right (off = seq_k - seq_q, the bottom-right alignment of
causal; -1 leaves a side unbounded), alone or with causal and padding masks.

Forward keeps only the output and each row's log-sum-exp (float32; float64 for
float64 inputs); backward recomputes the probabilities from them. Dropout draws a
seed from torch's generator, and backward regenerates the mask from that seed.

Outputs and gradients are laid out in memory like the inputs they belong to (the
output of a transposed [batch, seq, heads, head_dim] view is itself one), so the
usual reshape back to [batch, seq, hidden] needs no copy.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import Supports, check_index_data, choose, planner
from ..backends.reference import keep_mask, vjp
from ..dtypes import GPU_FLOATS, HALVES, acc_dtype, empty_like_layout, laid_out_like
from . import _validate as check
from ._dropout import next_seed
from ._op import Op
from ._probe import RESIDENT, WGMMA, Probe, padding, randn
from .reference import dropped

__all__ = ["attention", "attention_varlen"]


# The cuda kernels instantiate one tile width per head_dim (BERT's and GPT's 64, and 128)
# and have no bias operand. The triton kernels hold a block of q's rows and of the output
# in registers: head dims up to 256.
_SUPPORTS = {
    # The cuda kernels' grid is (query blocks, heads, sequences): y and z at most 65535.
    "cuda": Supports(dtypes=HALVES, head_dims=(64, 128), same_head_dim_v=True, bias=False,
                     max_counts=(("heads", 65535), ("sequences", 65535))),
    "triton": Supports(dtypes=GPU_FLOATS, max_head_dim=256),
}


def _check_flag(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _resolve_scale(scale, head_dim) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float or None, got {scale!r}")
    return float(scale)


def _resolve_window(window_size) -> tuple:
    """(left, right) as ints, each -1 (unbounded) or >= 0."""
    ok = isinstance(window_size, (tuple, list)) and len(window_size) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)
    if not ok:
        raise ValueError(f"window_size must be (left, right), each an int >= 0 or -1 for no "
                         f"bound, got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _check_groups(heads: int, k: Tensor, kv_heads: int, key: str = "k", value: str = "v") -> None:
    if kv_heads < 1 and heads > 0 or kv_heads and heads % kv_heads:
        raise ValueError(f"{key} and {value} must have a number of heads that divides q's "
                         f"({heads}), got {key} of shape {tuple(k.shape)}")


def visible_keys(seq_q, seq_k, causal, window_size, device, len_q=None, len_k=None):
    """bool [.., seq_q, seq_k]: the keys each query may see under ``causal`` and
    ``window_size``, aligned to the bottom right of lengths len_q and len_k (tensors
    [..., 1, 1] for one offset per sequence; default seq_q and seq_k). None: every key."""
    left, right = window_size
    if not causal and left < 0 and right < 0:
        return None
    rows = torch.arange(seq_q, device=device)[:, None]
    keys = torch.arange(seq_k, device=device)
    diagonal = rows + ((seq_k if len_k is None else len_k) - (seq_q if len_q is None else len_q))
    allowed = torch.ones((), dtype=torch.bool, device=device)
    if causal:
        right = 0
    if right >= 0:
        allowed = allowed & (keys <= diagonal + right)
    if left >= 0:
        allowed = allowed & (keys >= diagonal - left)
    return allowed.expand(*allowed.shape[:-2], seq_q, seq_k)


def _check_head_dims(q: Tensor, v: Tensor) -> None:
    if q.shape[-1] == 0:
        raise ValueError(f"q must have a head_dim of at least 1, got shape {tuple(q.shape)}")
    if v.shape[-1] == 0:
        raise ValueError(f"v must have a head_dim of at least 1, got shape {tuple(v.shape)}")


def _check_bias(attn_bias: Optional[Tensor], full: tuple) -> None:
    if attn_bias is None:
        return
    aligned = (1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape)
    if attn_bias.dim() > 4 or any(a != 1 and a != f for a, f in zip(aligned, full)):
        raise ValueError(f"attn_bias must be broadcastable to [batch, heads, seq_q, seq_k] = "
                         f"{tuple(full)}, got shape {tuple(attn_bias.shape)}")


def _check_cu_seqlens(name: str, cu: Tensor, total: int, max_seqlen: int, max_name: str) -> None:
    cu = cu.cpu().long()
    lengths = cu[1:] - cu[:-1]
    if cu[0].item() != 0:
        raise ValueError(f"{name} must start at 0, got {cu[0].item()}")
    if (lengths < 0).any():
        raise ValueError(f"{name} must be non-decreasing")
    if cu[-1].item() != total:
        raise ValueError(f"{name} must end at the number of tokens, {total}, got {cu[-1].item()}")
    if lengths.numel() and lengths.max().item() > max_seqlen:
        raise ValueError(f"{name} has a sequence of {lengths.max().item()} tokens, more than "
                         f"{max_name} = {max_seqlen}")


# --- attention -----------------------------------------------------------------------------------

@planner("attention")
def plan_attention(q, k, v, *, causal=False, key_padding_mask=None, attn_bias=None, dropout_p=0.0,
                   scale=None, window_size=(-1, -1), backend=None):
    check.tensor("q", q, ndim=4)
    check.tensor("k", k, ndim=4)
    check.tensor("v", v, ndim=4)
    check.tensor("key_padding_mask", key_padding_mask, ndim=2, dtypes=(torch.bool,), optional=True)
    check.tensor("attn_bias", attn_bias, optional=True)
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    check.shape("k", k, (batch, kv_heads, seq_k, head_dim))
    _check_groups(heads, k, kv_heads)
    check.shape("v", v, (batch, kv_heads, seq_k, v.shape[3]))
    check.shape("key_padding_mask", key_padding_mask, (batch, seq_k))
    _check_head_dims(q, v)
    _check_bias(attn_bias, (batch, heads, seq_q, seq_k))
    _check_flag("causal", causal)
    check.probability("dropout_p", dropout_p)
    _resolve_scale(scale, head_dim)
    window = _resolve_window(window_size)
    check.same_dtype(q=q, k=k, v=v, attn_bias=attn_bias)
    device = check.same_device(q=q, k=k, v=v, key_padding_mask=key_padding_mask, attn_bias=attn_bias)
    return choose("attention", device, backend, dtype=q.dtype, head_dim=head_dim,
                  head_dim_v=v.shape[3], causal=causal, dropout=dropout_p > 0,
                  bias=attn_bias is not None, mask=key_padding_mask is not None, heads=heads,
                  sequences=batch, grouped=kv_heads != heads, window=window != (-1, -1))


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
              key_padding_mask: Optional[Tensor] = None, attn_bias: Optional[Tensor] = None,
              dropout_p: float = 0.0, scale: Optional[float] = None,
              window_size: tuple = (-1, -1), backend: Optional[str] = None) -> Tensor:
    """softmax(q k^T * scale + attn_bias) v over q [batch, heads, seq, head_dim] and k/v
    [batch, kv_heads, seq_k, head_dim], kv_heads dividing heads.

    Like ``F.scaled_dot_product_attention`` (with ``enable_gqa``): k/v may have another seq
    than q, and any strides (e.g. transposed views of [batch, seq, heads, head_dim]).
    window_size is (left, right) as in the module docstring. key_padding_mask
    is bool [batch, seq_k], True = padding. attn_bias is an additive float bias
    broadcastable to [batch, heads, seq_q, seq_k] (never expanded in memory); when it
    requires grad its gradient is summed to its shape. causal aligns to the bottom
    right when seq_q != seq_k. Rows with every key masked are zeros. scale defaults
    to 1 / sqrt(head_dim).
    """
    choice = plan_attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                            attn_bias=attn_bias, dropout_p=dropout_p, scale=scale,
                            window_size=window_size, backend=backend)
    out, _ = ATTENTION.call(choice.backend, q, k, v, key_padding_mask, attn_bias, causal,
                            *_resolve_window(window_size), float(dropout_p),
                            _resolve_scale(scale, q.shape[-1]), next_seed(dropout_p))
    return out


def _attention_fake(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                    dropout_p, scale, seed):
    batch, heads, seq_q, _ = q.shape
    return (empty_like_layout(q, (batch, heads, seq_q, v.shape[3])),
            q.new_empty((batch, heads, seq_q), dtype=acc_dtype(q.dtype)))


def _attention_fake_backward(grad, q, k, v, out, lse, key_padding_mask, attn_bias, causal,
                             window_left, window_right, dropout_p, scale, seed, bias_grad):
    return (empty_like_layout(q, q.shape), empty_like_layout(k, k.shape),
            empty_like_layout(v, v.shape),
            attn_bias.new_empty(attn_bias.shape) if bias_grad else None)


def attention_reference(q, k, v, *, causal=False, key_padding_mask=None, attn_bias=None,
                        dropout_p=0.0, scale=None, window_size=(-1, -1), dropout_mask=None,
                        return_lse=False):
    """softmax(q k^T * scale + bias, masked) v for q [batch, heads, seq, head_dim] and k/v
    [batch, kv_heads, seq_k, head_dim] (each key/value head repeated for its group of
    query heads).

    key_padding_mask is bool [batch, seq_k], True = padding. causal and window_size align
    to the bottom right when seq_q != seq_k. Rows with every key masked are zeros. With
    return_lse, also each row's log-sum-exp [batch, heads, seq_q] (+inf for such rows).
    """
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    allowed = visible_keys(seq_q, seq_k, causal, window_size, q.device)
    if allowed is None:
        allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    group = q.shape[-3] // max(k.shape[-3], 1)
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    return attend(q, k, v, allowed, attn_bias, scale, dropout_p, dropout_mask, return_lse)


def attend(q, k, v, allowed, attn_bias=None, scale=None, dropout_p=0.0, dropout_mask=None,
           return_lse=False):
    """The references' softmax(q k^T * scale + bias) v over the keys ``allowed`` (bool,
    broadcastable to the scores [batch, heads, seq_q, seq_k]); rows with no allowed key are
    zeros."""
    acc = acc_dtype(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if attn_bias is not None:
        scores = scores + attn_bias.to(acc)
    allowed = allowed.expand(scores.shape)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))
    probs = dropped(probs, dropout_p, dropout_mask)
    out = torch.matmul(probs, v.to(acc)).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.logsumexp(scores, dim=-1)
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))


def _attention_seeded(q, k, v, key_padding_mask, attn_bias, causal, window_left, window_right,
                      dropout_p, scale, seed, *, return_lse=False):
    keep = keep_mask(seed, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), dropout_p, q.device)
    return attention_reference(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                               attn_bias=attn_bias, dropout_p=dropout_p, scale=scale,
                               window_size=(window_left, window_right), dropout_mask=keep,
                               return_lse=return_lse)


def _attention_reference_forward(q, k, v, key_padding_mask, attn_bias, causal, window_left,
                                 window_right, dropout_p, scale, seed):
    out, lse = _attention_seeded(q, k, v, key_padding_mask, attn_bias, causal, window_left,
                                 window_right, dropout_p, scale, seed, return_lse=True)
    return laid_out_like(q, out), lse


def _attention_reference_backward(grad, q, k, v, out, lse, key_padding_mask, attn_bias, causal,
                                  window_left, window_right, dropout_p, scale, seed, bias_grad):
    def run(q, k, v, bias):
        return _attention_seeded(q, k, v, key_padding_mask, bias, causal, window_left,
                                 window_right, dropout_p, scale, seed)
    dq, dk, dv, dbias = vjp(run, (q, k, v, attn_bias), (grad,), (True, True, True, bias_grad))
    return laid_out_like(q, dq), laid_out_like(k, dk), laid_out_like(v, dv), dbias


# --- PyTorch's composition (the torch backend) ---------------------------------------------------

def _sdpa(q, k, v, allowed, attn_bias, top_left_causal, dropout_p, scale):
    """torch's scaled_dot_product_attention over the keys ``allowed`` (bool, broadcastable
    to the scores; None: every key) with the additive attn_bias, k and v grouped when they
    have fewer heads than q. A row with no allowed key is zeros, as the op promises: SDPA
    would make it NaN, so it attends every key and is zeroed after, which zeroes its
    gradients too."""
    mask = empty = None
    if allowed is not None:
        empty = ~allowed.any(-1, keepdim=True)
        mask = allowed | empty
    if attn_bias is not None:
        mask = attn_bias if mask is None else torch.where(mask, attn_bias, float("-inf"))
    grouped = {"enable_gqa": True} if k.shape[-3] != q.shape[-3] else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                         is_causal=top_left_causal, scale=scale, **grouped)
    return out if empty is None else out.masked_fill(empty, 0)


def _attention_composition(q, k, v, key_padding_mask, attn_bias, causal, window_left,
                           window_right, dropout_p, scale, seed):
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    window = (window_left, window_right)
    allowed = None if key_padding_mask is None else ~key_padding_mask[:, None, None, :]
    # SDPA's own causal mask (its fastest kernels) aligns to the top left, and takes no
    # other mask beside it.
    top_left = (causal and seq_q == seq_k and allowed is None and attn_bias is None
                and window == (-1, -1))
    visible = None if top_left else visible_keys(seq_q, seq_k, causal, window, q.device)
    if visible is not None:
        allowed = visible if allowed is None else allowed & visible
    out = _sdpa(q, k, v, allowed, attn_bias, top_left, dropout_p, scale)
    return laid_out_like(q, out), None


def _attention_probe(batch, heads, seq, head_dim, *, causal=False, masked=False, seq_k=None,
                     kv_heads=None, window_size=(-1, -1)):
    seq_k = seq_k or seq

    def make(g):
        q = randn(g, batch, heads, seq, head_dim)
        k, v = (randn(g, batch, kv_heads or heads, seq_k, head_dim) for _ in range(2))
        mask = padding(g, batch, seq_k) if masked else None
        return (q, k, v), {"causal": causal, "key_padding_mask": mask, "window_size": window_size}
    return make


ATTENTION = Op(
    "attention", _attention_fake,
    supports=_SUPPORTS, reference=attention_reference,
    reference_kernels=(_attention_reference_forward, _attention_reference_backward),
    composition=_attention_composition,
    probes=(
        Probe("padded, head dim 64", _attention_probe(2, 3, 80, 64, masked=True), paths=RESIDENT),
        Probe("causal, head dim 128", _attention_probe(2, 2, 70, 128, causal=True),
              paths=RESIDENT),
        Probe("seq 600 (streamed K/V)", _attention_probe(1, 2, 600, 64), paths=WGMMA),
        # The one-kernel backward over three chunks of keys; the three-kernel one past 512
        # keys, with more queries than keys under a causal mask.
        Probe("260 keys, padded", _attention_probe(2, 2, 260, 64, masked=True), paths=RESIDENT),
        Probe("603 queries over 600 keys, causal, head dim 128",
              _attention_probe(1, 2, 603, 128, causal=True, seq_k=600), paths=WGMMA),
        Probe.real("BERT-base, padded 8 x 128", _attention_probe(8, 12, 128, 64, masked=True),
                   paths=RESIDENT),
        Probe.real("GPT-2 small, causal 2 x 1024", _attention_probe(2, 12, 1024, 64, causal=True),
                   paths=WGMMA)),
).differentiable(_attention_fake_backward)


# --- attention_varlen ----------------------------------------------------------------------------

def _check_max_seqlen(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")


@planner("attention_varlen")
def plan_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                          causal=False, dropout_p=0.0, scale=None, window_size=(-1, -1),
                          backend=None):
    check.tensor("q", q, ndim=3)
    check.tensor("k", k, ndim=3)
    check.tensor("v", v, ndim=3)
    check.tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=(torch.int32,))
    check.tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=(torch.int32,))
    total_q, heads, head_dim = q.shape
    total_k, kv_heads = k.shape[0], k.shape[1]
    check.shape("k", k, (total_k, kv_heads, head_dim))
    _check_groups(heads, k, kv_heads)
    check.shape("v", v, (v.shape[0], kv_heads, v.shape[2]))
    if torch.compiler.is_compiling():
        # k and v unpadded by separate unpad calls have token counts that torch.compile
        # cannot compare while tracing: the check runs when the graph does. (torch._check:
        # torch 2.11's compiler does not trace torch._check_with.)
        torch._check(v.shape[0] == total_k, lambda: "v must have as many tokens as k")
    elif v.shape[0] != total_k:
        raise ValueError(f"v must have as many tokens as k ({total_k}), got {v.shape[0]}")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must have batch + 1 >= 1 entries, got 0")
    check.shape("cu_seqlens_k", cu_seqlens_k, tuple(cu_seqlens_q.shape))
    _check_max_seqlen("max_seqlen_q", max_seqlen_q)
    _check_max_seqlen("max_seqlen_k", max_seqlen_k)
    _check_head_dims(q, v)
    _check_flag("causal", causal)
    check.probability("dropout_p", dropout_p)
    _resolve_scale(scale, head_dim)
    window = _resolve_window(window_size)
    check.same_dtype(q=q, k=k, v=v)
    device = check.same_device(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    choice = choose("attention_varlen", device, backend, dtype=q.dtype, head_dim=head_dim,
                    head_dim_v=v.shape[2], causal=causal, dropout=dropout_p > 0,
                    heads=q.shape[1], sequences=cu_seqlens_q.shape[0] - 1,
                    grouped=kv_heads != heads, window=window != (-1, -1))
    if check_index_data(device, choice.backend):
        _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q")
        _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k")
    return choice.copying(cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)


def attention_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     max_seqlen_q: int, max_seqlen_k: int, *, causal: bool = False,
                     dropout_p: float = 0.0, scale: Optional[float] = None,
                     window_size: tuple = (-1, -1), backend: Optional[str] = None) -> Tensor:
    """Attention over packed sequences: q [total_q, heads, head_dim], k/v
    [total_k, kv_heads, head_dim], kv_heads dividing heads.

    Sequence b is rows cu_seqlens[b] .. cu_seqlens[b + 1] (int32 [batch + 1]); causal
    and window_size align each sequence to its bottom right. max_seqlen_q/k bound the lengths and lay
    out the dropout stream as [batch, heads, max_seqlen_q, max_seqlen_k]. They may be
    the unbacked ints that unpad returns under torch.compile.

    Offsets that are not increasing, fall outside the tensors or exceed max_seqlen raise
    for CPU tensors; on a GPU they are checked only under FUSEDLM_DEBUG=1 (the check
    copies them to the host), and otherwise the kernels clamp each sequence into the
    tensors and to max_seqlen: a wrong answer, never an access outside them.
    """
    choice = plan_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   causal=causal, dropout_p=dropout_p, scale=scale,
                                   window_size=window_size, backend=backend)
    out, _ = ATTENTION_VARLEN.call(choice.backend, q, k, v, cu_seqlens_q.contiguous(),
                                   cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k, causal,
                                   *_resolve_window(window_size), float(dropout_p),
                                   _resolve_scale(scale, q.shape[-1]), next_seed(dropout_p))
    return out


def _varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                 window_left, window_right, dropout_p, scale, seed):
    total_q, heads, _ = q.shape
    return (empty_like_layout(q, (total_q, heads, v.shape[2])),
            q.new_empty((heads, total_q), dtype=acc_dtype(q.dtype)))


def _varlen_fake_backward(grad, q, k, v, out, lse, *_options):
    return tuple(empty_like_layout(t, t.shape) for t in (q, k, v))


def attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                               causal=False, dropout_p=0.0, scale=None, window_size=(-1, -1),
                               dropout_mask=None, return_lse=False):
    """Attention over packed sequences: q [total_q, heads, head_dim], k/v
    [total_k, kv_heads, head_dim].

    Sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]. dropout_mask, if given, is
    [batch, heads, max_seqlen_q, max_seqlen_k] (each sequence in its top-left corner).
    With return_lse, also each row's log-sum-exp [heads, total_q].
    """
    outs, lses = [], []
    for i in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        keep = None if dropout_mask is None else dropout_mask[i : i + 1, :, : q1 - q0, : k1 - k0]
        seq, seq_lse = attention_reference(
            q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
            v[k0:k1].transpose(0, 1)[None], causal=causal, dropout_p=dropout_p, scale=scale,
            window_size=window_size, dropout_mask=keep, return_lse=True,
        )
        outs.append(seq[0].transpose(0, 1))
        lses.append(seq_lse[0])
    # v's head_dim may differ from q's
    out = torch.cat(outs) if outs else q.new_empty((*q.shape[:-1], v.shape[-1]))
    if not return_lse:
        return out
    return out, (torch.cat(lses, dim=1) if lses
                 else q.new_empty((q.shape[1], 0), dtype=acc_dtype(q.dtype)))


def _varlen_seeded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                   window_left, window_right, dropout_p, scale, seed, *, return_lse=False):
    batch = cu_seqlens_q.shape[0] - 1
    keep = keep_mask(seed, (batch, q.shape[1], max_seqlen_q, max_seqlen_k), dropout_p, q.device)
    return attention_varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, causal=causal, dropout_p=dropout_p,
                                      scale=scale, window_size=(window_left, window_right),
                                      dropout_mask=keep, return_lse=return_lse)


def _varlen_reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, window_left, window_right, dropout_p, scale, seed):
    out, lse = _varlen_seeded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                              causal, window_left, window_right, dropout_p, scale, seed,
                              return_lse=True)
    return laid_out_like(q, out), lse


def _varlen_reference_backward(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, causal, window_left, window_right, dropout_p, scale,
                               seed):
    dq, dk, dv = vjp(lambda q, k, v: _varlen_seeded(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_left,
        window_right, dropout_p, scale, seed), (q, k, v), (grad,))
    return laid_out_like(q, dq), laid_out_like(k, dk), laid_out_like(v, dv)


def _packed_slots(cu_seqlens, total, max_seqlen):
    """(sequence, position) of each of ``total`` packed rows, clamped into [batch, max_seqlen]
    (offsets a GPU call does not check give a wrong answer, never an access outside)."""
    rows = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    sequence = torch.searchsorted(cu_seqlens[1:], rows, right=True)
    sequence = sequence.clamp(max=max(cu_seqlens.shape[0] - 2, 0))
    position = (rows - cu_seqlens[sequence]).long().clamp(0, max(max_seqlen - 1, 0))
    return sequence, position


def _varlen_composition(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                        window_left, window_right, dropout_p, scale, seed):
    """The sequences padded to [batch, heads, max_seqlen, head_dim], SDPA over them, and the
    real rows gathered back: what a padded model runs."""
    batch = cu_seqlens_q.shape[0] - 1
    slots_q = _packed_slots(cu_seqlens_q, q.shape[0], max_seqlen_q)
    slots_k = _packed_slots(cu_seqlens_k, k.shape[0], max_seqlen_k)

    def padded(x, slots, length):
        return x.new_zeros(batch, length, *x.shape[1:]).index_put(slots, x).transpose(1, 2)

    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()[:, None, None, None]
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()[:, None, None, None]
    keys = torch.arange(max_seqlen_k, device=q.device)
    allowed = keys < lengths_k
    # each sequence aligned to its own bottom right
    visible = visible_keys(max_seqlen_q, max_seqlen_k, causal, (window_left, window_right),
                           q.device, lengths_q, lengths_k)
    if visible is not None:
        allowed = allowed & visible
    out = _sdpa(padded(q, slots_q, max_seqlen_q), padded(k, slots_k, max_seqlen_k),
                padded(v, slots_k, max_seqlen_k), allowed, None, False, dropout_p, scale)
    return laid_out_like(q, out.transpose(1, 2)[slots_q]), None


def _varlen_probe(lengths, heads, head_dim):
    def make(g):
        total = sum(lengths)
        q, k, v = (randn(g, total, heads, head_dim) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        return (q, k, v, cu, cu.clone(), max(lengths), max(lengths)), {"causal": True}
    return make


ATTENTION_VARLEN = Op(
    "attention_varlen", _varlen_fake, supports=_SUPPORTS,
    reference=attention_varlen_reference,
    reference_kernels=(_varlen_reference_forward, _varlen_reference_backward),
    composition=_varlen_composition,
    probes=(Probe("causal, 3 sequences", _varlen_probe([37, 1, 70], 2, 64), paths=RESIDENT),
            Probe.real("BERT-base, 8 sequences",
                       _varlen_probe([128, 77, 100, 64, 128, 90, 111, 70], 12, 64),
                       paths=RESIDENT)),
).differentiable(_varlen_fake_backward)
