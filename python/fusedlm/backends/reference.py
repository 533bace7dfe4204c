"""The reference backend: fusedlm.ops.reference (plain PyTorch) as kernels of the ops' schemas,
for every op, on any device and dtype.

Its kernels take and return what every backend's do (fusedlm.ops.<op>'s schemas), so a
call runs through the same registered op on each backend. The backward kernels take the
gradient by differentiating the reference again from the saved inputs (add_layer_norm
saves no input, so its backward is the LayerNorm gradient written out). Dropout masks
are drawn from a generator seeded with the call's seed, so the backward replays the
forward's.
"""
import math
import sys
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..ops import reference
from . import Backend, register


def _keep(seed: torch.Tensor, shape, p: float, device) -> Optional[torch.Tensor]:
    """The keep mask (bool) of the dropout stream `seed`, or None when p == 0."""
    if p == 0.0:
        return None
    generator = torch.Generator().manual_seed(int(seed))
    return (torch.rand(shape, generator=generator) >= p).to(device)


def _like(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t laid out in memory in the order of ref's strides, as every backend returns it."""
    order = sorted(range(ref.dim()), key=lambda d: -ref.stride(d))
    return torch.empty_permuted(t.shape, order, dtype=t.dtype, device=t.device).copy_(t)


def _vjp(fn: Callable, inputs: tuple, grads: tuple, wrt: Optional[tuple] = None) -> tuple:
    """The gradients of fn(*inputs)'s outputs, weighted by grads (None: unused), with
    respect to the inputs ``wrt`` marks (default: every tensor); the others' are None.
    torch.func, not torch.autograd: a registered op's kernel runs below autograd, where
    no graph is recorded."""
    wrt = wrt or tuple(t is not None for t in inputs)
    present = [i for i, (t, w) in enumerate(zip(inputs, wrt)) if w and t is not None]

    def of_present(*tensors):
        full = list(inputs)
        for i, t in zip(present, tensors):
            full[i] = t
        return fn(*full)

    outputs, pull = torch.func.vjp(of_present, *(inputs[i] for i in present))
    single = not isinstance(outputs, tuple)
    cotangents = tuple(torch.zeros_like(o) if g is None else g
                       for o, g in zip((outputs,) if single else outputs, grads))
    taken = iter(pull(cotangents[0] if single else cotangents))
    return tuple(next(taken) if i in present else None for i in range(len(inputs)))


def _owned(kernel: Callable) -> Callable:
    """kernel, with each output that shares memory with an input or an earlier output
    copied: a registered op's outputs must be its own (plain PyTorch may hand back an
    input, as x.to(x.dtype) does)."""
    def run(*args):
        outputs = kernel(*args)
        single = not isinstance(outputs, tuple)
        seen = {t.untyped_storage().data_ptr() for t in args
                if isinstance(t, torch.Tensor) and t.numel()}
        owned = []
        for out in (outputs,) if single else outputs:
            if isinstance(out, torch.Tensor) and out.numel():
                if out.untyped_storage().data_ptr() in seen:
                    out = out.clone()
                seen.add(out.untyped_storage().data_ptr())
            owned.append(out)
        return owned[0] if single else tuple(owned)

    run.__name__ = kernel.__name__
    return run


# --- attention -----------------------------------------------------------------------------------

def _attention(q, k, v, key_padding_mask, attn_bias, causal, dropout_p, scale, seed, *,
               return_lse=False):
    keep = _keep(seed, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]), dropout_p, q.device)
    return reference.attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask,
                               attn_bias=attn_bias, dropout_p=dropout_p, scale=scale,
                               dropout_mask=keep, return_lse=return_lse)


def attention_forward(q, k, v, key_padding_mask, attn_bias, causal, dropout_p, scale, seed):
    out, lse = _attention(q, k, v, key_padding_mask, attn_bias, causal, dropout_p, scale, seed,
                          return_lse=True)
    return _like(q, out), lse


def attention_backward(grad, q, k, v, out, lse, key_padding_mask, attn_bias, causal, dropout_p,
                       scale, seed, bias_grad):
    def run(q, k, v, bias):
        return _attention(q, k, v, key_padding_mask, bias, causal, dropout_p, scale, seed)
    dq, dk, dv, dbias = _vjp(run, (q, k, v, attn_bias), (grad,), (True, True, True, bias_grad))
    return _like(q, dq), _like(k, dk), _like(v, dv), dbias


def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                      dropout_p, scale, seed, *, return_lse=False):
    batch = cu_seqlens_q.shape[0] - 1
    keep = _keep(seed, (batch, q.shape[1], max_seqlen_q, max_seqlen_k), dropout_p, q.device)
    return reference.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                      max_seqlen_k, causal=causal, dropout_p=dropout_p,
                                      scale=scale, dropout_mask=keep, return_lse=return_lse)


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                             causal, dropout_p, scale, seed):
    out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 causal, dropout_p, scale, seed, return_lse=True)
    return _like(q, out), lse


def attention_varlen_backward(grad, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                              max_seqlen_k, causal, dropout_p, scale, seed):
    dq, dk, dv = _vjp(lambda q, k, v: _attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, dropout_p, scale,
        seed), (q, k, v), (grad,))
    return _like(q, dq), _like(k, dk), _like(v, dv)


def attention_with_kvcache_forward(q, k_cache, v_cache, cache_seqlens, k_new, v_new, cache_leftpad,
                                   scale):
    return reference.attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new, v_new,
                                            cache_leftpad=cache_leftpad, scale=scale)


# --- unpad and pad -------------------------------------------------------------------------------

def pad_backward(grad, indices):
    return grad.flatten(0, 1)[indices]


# --- add_layer_norm ------------------------------------------------------------------------------

def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def add_layer_norm_forward(x, residual, weight, bias, eps, dropout_p, seed):
    keep = _keep(seed, x.shape, dropout_p, x.device)
    out, summed = reference.add_layer_norm(x, residual, weight, bias, eps, dropout_p=dropout_p,
                                           dropout_mask=keep)
    rows = summed.reshape(-1, summed.shape[-1]).to(_stats_dtype(x.dtype))
    var, mean = torch.var_mean(rows, dim=-1, unbiased=False)
    return out, summed, mean, torch.rsqrt(var + eps)


def add_layer_norm_backward(grad_out, grad_summed, summed, mean, rstd, weight, has_bias,
                            has_residual, dropout_p, seed):
    """The LayerNorm gradient from the saved statistics: with xhat = (s - mean) * rstd and
    g = grad_out * weight, ds = rstd * (g - mean(g) - xhat * mean(g * xhat))."""
    acc = _stats_dtype(summed.dtype)
    hidden = summed.shape[-1]
    dy = grad_out.reshape(-1, hidden).to(acc)
    xhat = (summed.reshape(-1, hidden).to(acc) - mean[:, None]) * rstd[:, None]
    g = dy * weight.to(acc) if weight is not None else dy
    ds = rstd[:, None] * (g - g.mean(-1, keepdim=True) - xhat * (g * xhat).mean(-1, keepdim=True))
    if grad_summed is not None:
        ds = ds + grad_summed.reshape(-1, hidden).to(acc)
    dweight = (dy * xhat).sum(0).to(weight.dtype) if weight is not None else None
    dbias = dy.sum(0).to(summed.dtype) if has_bias else None
    dsummed = ds.view(summed.shape).to(summed.dtype)
    if dropout_p == 0.0:
        return dsummed, None, dweight, dbias
    keep = _keep(seed, summed.shape, dropout_p, summed.device)
    dx = (ds.view(summed.shape) * keep / (1.0 - dropout_p)).to(summed.dtype)
    return (dsummed if has_residual else None), dx, dweight, dbias


# --- bias_gelu and gelu_ffn ----------------------------------------------------------------------

def bias_gelu_backward(grad, x, bias, approximate):
    return _vjp(lambda x, b: reference.bias_gelu(x, b, approximate), (x, bias), (grad,))


def _gelu_ffn(x, w1, b1, w2, b2, approximate, dropout_p, seed):
    keep = _keep(seed, (*x.shape[:-1], w1.shape[0]), dropout_p, x.device)
    return reference.gelu_ffn(x, w1, b1, w2, b2, approximate=approximate, dropout_p=dropout_p,
                              dropout_mask=keep)


def gelu_ffn_forward(x, w1, b1, w2, b2, approximate, dropout_p, seed):
    # The pre-activation every backend saves; this one's backward recomputes it instead.
    pre = F.linear(x, w1).reshape(-1, w1.shape[0])
    return _gelu_ffn(x, w1, b1, w2, b2, approximate, dropout_p, seed), pre


def gelu_ffn_backward(grad, x, pre, w1, b1, w2, b2, approximate, dropout_p, seed):
    return _vjp(lambda *weights: _gelu_ffn(*weights, approximate, dropout_p, seed),
                (x, w1, b1, w2, b2), (grad,))


# --- cross_entropy and masked_lm_loss ------------------------------------------------------------

def _scaled(saved: torch.Tensor, grad: torch.Tensor, reduction: str) -> torch.Tensor:
    """A gradient saved for grad_output 1, scaled by grad_output (one value per row for "none")."""
    scale = grad[..., None] if reduction == "none" else grad
    return (saved.to(grad.dtype) * scale).to(saved.dtype)


def cross_entropy_forward(logits, labels, ignore_index, label_smoothing, reduction, with_grad):
    def loss(logits):
        return reference.cross_entropy(logits, labels, ignore_index=ignore_index,
                                       label_smoothing=label_smoothing, reduction=reduction)
    value = loss(logits)
    grad = _vjp(loss, (logits,), (torch.ones_like(value),))[0] if with_grad else None
    return value, grad


def cross_entropy_backward(grad, saved_grad, reduction):
    return _scaled(saved_grad, grad, reduction)


def _masked_lm_loss(hidden, weight, bias, labels, ignore_index, label_smoothing, reduction):
    return reference.masked_lm_loss(hidden, weight, bias, labels, ignore_index=ignore_index,
                                    label_smoothing=label_smoothing, reduction=reduction)


def masked_lm_loss_forward(hidden, weight, bias, labels, ignore_index, label_smoothing, reduction,
                           chunk_rows, *needs):
    options = (labels, ignore_index, label_smoothing, reduction)
    loss = _masked_lm_loss(hidden, weight, bias, *options)
    if reduction == "none":  # the backward weighs each row: it computes the gradients
        return loss, None, None, None
    grads = _vjp(lambda h, w, b: _masked_lm_loss(h, w, b, *options), (hidden, weight, bias),
                 (torch.ones_like(loss),), needs)
    return (loss, *grads)


def masked_lm_loss_backward(grad, hidden, weight, bias, labels, dhidden, dweight, dbias,
                            ignore_index, label_smoothing, reduction, chunk_rows, *needs):
    if reduction != "none":
        return tuple(_scaled(saved, grad, "sum") if need else None
                     for saved, need in zip((dhidden, dweight, dbias), needs))
    options = (labels, ignore_index, label_smoothing, reduction)
    return _vjp(lambda h, w, b: _masked_lm_loss(h, w, b, *options), (hidden, weight, bias), (grad,),
                needs)


# --- lstm_cell -----------------------------------------------------------------------------------

def _clip(cell_clip: float) -> Optional[float]:
    return None if math.isinf(cell_clip) else cell_clip


def lstm_cell_forward(gates, c_prev, cell_clip):
    return reference.lstm_cell(gates, c_prev, cell_clip=_clip(cell_clip))


def lstm_cell_backward(grad_h, grad_c, gates, c_prev, cell_clip):
    return _vjp(lambda g, c: reference.lstm_cell(g, c, cell_clip=_clip(cell_clip)),
                (gates, c_prev), (grad_h, grad_c))


# The ops whose reference already takes the kernels' arguments.
bias_gelu_forward, unpad_forward, pad_forward = reference.bias_gelu, reference.unpad, reference.pad


def _find(op):
    """The kernels of an op are <op>_forward and <op>_backward here."""
    # getattr on the module, not globals(): torch.compile may be tracing the first lookup.
    module = sys.modules[__name__]
    forward = getattr(module, f"{op.name}_forward", None)
    backward = getattr(module, f"{op.name}_backward", None)
    return None if forward is None else (_owned(forward), _owned(backward) if backward else None)


BACKEND = register(Backend("reference", ("any",), None, _find))
