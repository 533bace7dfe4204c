"""Plain-PyTorch references of every fusedlm op: the ``reference`` backend and
the ground truth of every test.

They compute in the inputs' dtype promoted to at least float32 and return the
inputs' dtype (losses stay in float32 or wider). Where an op draws a dropout
mask, ``dropout_mask`` (bool, True = keep) replays the one a kernel used.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = [
    "attention", "attention_varlen", "attention_with_kvcache", "unpad", "pad", "add_layer_norm",
    "bias_gelu", "gelu_ffn", "cross_entropy", "masked_lm_loss", "lstm_cell",
]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _dropout(x: torch.Tensor, p: float, keep: Optional[torch.Tensor]) -> torch.Tensor:
    if p == 0.0:
        return x
    if keep is None:
        keep = torch.rand(x.shape, device=x.device) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


def attention(q, k, v, *, causal=False, key_padding_mask=None, attn_bias=None, dropout_p=0.0,
              scale=None, dropout_mask=None, return_lse=False):
    """softmax(q k^T * scale + bias, masked) v for q/k/v [batch, heads, seq, head_dim].

    key_padding_mask is bool [batch, seq_k], True = padding. causal aligns to the
    bottom right when seq_q != seq_k. Rows with every key masked are zeros. With
    return_lse, also each row's log-sum-exp [batch, heads, seq_q] (+inf for such rows).
    """
    seq_q, seq_k = q.shape[-2], k.shape[-2]
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if causal:
        allowed = torch.tril(allowed, diagonal=seq_k - seq_q)
    if key_padding_mask is not None:
        allowed = allowed & ~key_padding_mask[:, None, None, :]
    return _attend(q, k, v, allowed, attn_bias, scale, dropout_p, dropout_mask, return_lse)


def _attend(q, k, v, allowed, attn_bias=None, scale=None, dropout_p=0.0, dropout_mask=None,
            return_lse=False):
    """softmax(q k^T * scale + bias) v over the keys `allowed` (bool, broadcastable to the
    scores [batch, heads, seq_q, seq_k]); rows with no allowed key are zeros."""
    acc = _acc(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if attn_bias is not None:
        scores = scores + attn_bias.to(acc)
    allowed = allowed.expand(scores.shape)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(allowed.any(dim=-1, keepdim=True), probs, torch.zeros_like(probs))
    probs = _dropout(probs, dropout_p, dropout_mask)
    out = torch.matmul(probs, v.to(acc)).to(q.dtype)
    if not return_lse:
        return out
    lse = torch.logsumexp(scores, dim=-1)
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))


def attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=None, v_new=None, *,
                           cache_leftpad=None, scale=None):
    """One decoding step: q [batch, seqlen_q, heads, head_dim] over caches [batch,
    max_cache_len, heads, head_dim].

    k_new/v_new [batch, seqlen_new, ...] are written into the caches (in place) at
    positions cache_seqlens[b] onwards; query i then sees the keys in
    [cache_leftpad[b], total_b - seqlen_q + i], total_b = cache_seqlens[b] + seqlen_new.
    """
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
    allowed = (pos >= first[:, None, None]) & (pos <= last[:, :, None])  # [batch, seq_q, keys]
    out = _attend(q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
                  allowed[:, None], scale=scale)
    return out.transpose(1, 2)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                     causal=False, dropout_p=0.0, scale=None, dropout_mask=None, return_lse=False):
    """Attention over packed sequences: q [total_q, heads, head_dim], k/v [total_k, heads, head_dim].

    Sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]. dropout_mask, if given, is
    [batch, heads, max_seqlen_q, max_seqlen_k] (each sequence in its top-left corner).
    With return_lse, also each row's log-sum-exp [heads, total_q].
    """
    outs, lses = [], []
    for i in range(cu_seqlens_q.numel() - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        k0, k1 = int(cu_seqlens_k[i]), int(cu_seqlens_k[i + 1])
        keep = None if dropout_mask is None else dropout_mask[i : i + 1, :, : q1 - q0, : k1 - k0]
        seq, seq_lse = attention(
            q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None],
            v[k0:k1].transpose(0, 1)[None], causal=causal, dropout_p=dropout_p, scale=scale,
            dropout_mask=keep, return_lse=True,
        )
        outs.append(seq[0].transpose(0, 1))
        lses.append(seq_lse[0])
    # v's head_dim may differ from q's
    out = torch.cat(outs) if outs else q.new_empty((*q.shape[:-1], v.shape[-1]))
    if not return_lse:
        return out
    return out, torch.cat(lses, dim=1) if lses else q.new_empty((q.shape[1], 0), dtype=_acc(q.dtype))


def unpad(hidden, key_padding_mask):
    """(packed [tokens, ...], indices, cu_seqlens int32 [batch + 1], max_seqlen) of the
    non-padding positions of hidden [batch, seq, ...]; True in the mask = padding."""
    keep = ~key_padding_mask
    lengths = keep.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    packed = hidden.flatten(0, 1)[indices]
    return packed, indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0


def pad(packed, indices, batch, seqlen):
    """Inverse of unpad: [batch, seqlen, ...] with zeros at the padding positions."""
    out = packed.new_zeros((batch * seqlen, *packed.shape[1:]))
    out[indices] = packed
    return out.view(batch, seqlen, *packed.shape[1:])


def add_layer_norm(x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0, dropout_mask=None):
    """(layer_norm(summed), summed) with summed = dropout(x) + residual over the last dim."""
    acc = _acc(x.dtype)
    summed = _dropout(x.to(acc), dropout_p, dropout_mask)
    if residual is not None:
        summed = summed + residual.to(acc)
    out = F.layer_norm(
        summed, summed.shape[-1:], None if weight is None else weight.to(acc),
        None if bias is None else bias.to(acc), eps,
    )
    return out.to(x.dtype), summed.to(x.dtype)


def bias_gelu(x, bias=None, approximate="none"):
    """gelu(x + bias) with bias over the last dimension."""
    acc = _acc(x.dtype)
    z = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    return F.gelu(z, approximate=approximate).to(x.dtype)


def gelu_ffn(x, w1, b1, w2, b2, *, approximate="none", dropout_p=0.0, dropout_mask=None):
    """Linear(w1, b1) -> GELU -> dropout -> Linear(w2, b2)."""
    hidden = bias_gelu(F.linear(x, w1), b1, approximate)
    return F.linear(_dropout(hidden, dropout_p, dropout_mask), w2, b2)


def cross_entropy(logits, labels, *, ignore_index=-100, label_smoothing=0.0, reduction="mean"):
    """F.cross_entropy over the last dim of logits [..., classes]; float32 or wider.

    Unlike torch, a mean over no labelled rows is 0 rather than NaN.
    """
    logits2 = logits.reshape(-1, logits.shape[-1]).to(_acc(logits.dtype))
    labels1 = labels.reshape(-1)
    losses = F.cross_entropy(logits2, labels1, ignore_index=ignore_index,
                             label_smoothing=label_smoothing, reduction="none")
    if reduction == "none":
        return losses.view(labels.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (labels1 != ignore_index).sum().clamp(min=1)


def masked_lm_loss(hidden, weight, bias, labels, *, ignore_index=-100, label_smoothing=0.0,
                   reduction="mean"):
    """cross_entropy(hidden @ weight^T + bias, labels): the full-vocabulary computation."""
    return cross_entropy(F.linear(hidden, weight, bias), labels, ignore_index=ignore_index,
                         label_smoothing=label_smoothing, reduction=reduction)


def lstm_cell(gates, c_prev, *, cell_clip=None):
    """(h, c) of an LSTM step: gates [..., 4 * cell] are the input, forget, cell and output
    pre-activations; c = clamp(i * g + f * c_prev, -cell_clip, cell_clip), h = o * tanh(c)."""
    acc = _acc(gates.dtype)
    i, f, g, o = gates.to(acc).chunk(4, dim=-1)
    c = torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * c_prev.to(acc)
    if cell_clip is not None:
        c = torch.clamp(c, -cell_clip, cell_clip)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h.to(gates.dtype), c.to(gates.dtype)
