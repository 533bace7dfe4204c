"""unpad and pad: between padded [batch, seq, ...] tensors and the packed [tokens, ...]
layout of attention_varlen, both differentiable (each is the other's backward).

unpad's outputs have data-dependent sizes, so it is one registered op: under
torch.compile its token count and ``max_seqlen`` are unbacked SymInts (in eager,
``max_seqlen`` is a Python int). They flow into attention_varlen and pad without a
graph break; branching on them in Python inside a compiled region raises torch's
data-dependent error, as for any unbacked size.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import check_index_data, choose, planner
from . import _validate as check
from ._op import Op
from ._probe import Probe, padding, randn

__all__ = ["unpad", "pad"]


def _check_size(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be non-negative, got {value}")


def _check_indices(indices: Tensor, slots: int) -> None:
    if indices.numel() == 0:
        return
    if indices.min().item() < 0 or indices.max().item() >= slots:
        raise ValueError(f"indices must lie in [0, batch * seqlen = {slots})")
    if torch.unique(indices).numel() != indices.numel():
        raise ValueError("indices must not repeat a position")


# --- unpad ---------------------------------------------------------------------------------------

@planner("unpad")
def plan_unpad(hidden, key_padding_mask, *, backend=None):
    check.tensor("hidden", hidden, min_ndim=2, dtypes=None)
    check.tensor("key_padding_mask", key_padding_mask, ndim=2, dtypes=(torch.bool,))
    check.shape("key_padding_mask", key_padding_mask, tuple(hidden.shape[:2]))
    device = check.same_device(hidden=hidden, key_padding_mask=key_padding_mask)
    return choose("unpad", device, backend)


def unpad(hidden: Tensor, key_padding_mask: Tensor, *, backend: Optional[str] = None):
    """(packed [tokens, ...], indices, cu_seqlens, max_seqlen) of the non-padding tokens of
    hidden [batch, seq, ...]; key_padding_mask is bool [batch, seq], True = padding.

    indices (int64) are the tokens' positions in hidden.flatten(0, 1); cu_seqlens is int32
    [batch + 1]; max_seqlen bounds the sequences' lengths, as attention_varlen takes it: on
    the CPU the longest sequence (a Python int in eager, an unbacked SymInt under
    torch.compile), on a GPU the padded length seq, since reading the longest back would
    synchronise the host with the device.
    """
    choice = plan_unpad(hidden, key_padding_mask, backend=backend)
    return UNPAD.call(choice.backend, hidden, key_padding_mask)


def _unpad_fake(hidden, key_padding_mask):
    ctx = torch.library.get_ctx()
    tokens = ctx.new_dynamic_size()
    max_seqlen = ctx.new_dynamic_size() if hidden.device.type == "cpu" else hidden.shape[1]
    return (hidden.new_empty((tokens, *hidden.shape[2:])),
            hidden.new_empty((tokens,), dtype=torch.int64),
            hidden.new_empty((hidden.shape[0] + 1,), dtype=torch.int32),
            max_seqlen)


def unpad_reference(hidden, key_padding_mask):
    """(packed [tokens, ...], indices, cu_seqlens int32 [batch + 1], max_seqlen) of the
    non-padding positions of hidden [batch, seq, ...]; True in the mask = padding.
    max_seqlen: the longest sequence on the CPU, the padded length elsewhere (fusedlm.ops.unpad)."""
    keep = ~key_padding_mask
    lengths = keep.sum(dim=1, dtype=torch.int32)
    indices = torch.nonzero(keep.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    packed = hidden.flatten(0, 1)[indices]
    if hidden.device.type != "cpu":
        return packed, indices, cu_seqlens, key_padding_mask.shape[1]
    return packed, indices, cu_seqlens, int(lengths.max()) if lengths.numel() else 0


def _unpad_reference_backward(grad, indices, batch, seqlen):
    """unpad's gradient, pad, in plain PyTorch: for a gradient differentiated again or batched."""
    return pad_reference(grad, indices, batch, seqlen)


def _unpad_probe(batch, seq, width):
    def make(g):
        return (randn(g, batch, seq, width), padding(g, batch, seq)), {}
    return make


# unpad's gradient is the pad op: no backward kernel of its own.
UNPAD = Op(
    "unpad", _unpad_fake, reference=unpad_reference,
    reference_kernels=(unpad_reference, _unpad_reference_backward),
    composition=unpad_reference,
    probes=(Probe("3 x 20", _unpad_probe(3, 20, 64), differentiable=False),),
).differentiable(None)


# --- pad -----------------------------------------------------------------------------------------

@planner("pad")
def plan_pad(packed, indices, batch, seqlen, *, backend=None):
    check.tensor("packed", packed, min_ndim=1, dtypes=None)
    check.tensor("indices", indices, ndim=1, dtypes=(torch.int64,))
    check.shape("indices", indices, (packed.shape[0],))
    _check_size("batch", batch)
    _check_size("seqlen", seqlen)
    device = check.same_device(packed=packed, indices=indices)
    choice = choose("pad", device, backend)
    if check_index_data(device, choice.backend):
        _check_indices(indices, batch * seqlen)
    return choice.copying(indices=indices)


def pad(packed: Tensor, indices: Tensor, batch: int, seqlen: int, *,
        backend: Optional[str] = None) -> Tensor:
    """The inverse of unpad: [batch, seqlen, ...] with packed's rows at ``indices`` (positions
    in the flattened batch * seqlen) and zeros elsewhere."""
    choice = plan_pad(packed, indices, batch, seqlen, backend=backend)
    return PAD.call(choice.backend, packed, indices.contiguous(), batch, seqlen)


def pad_reference(packed, indices, batch, seqlen):
    """Inverse of unpad: [batch, seqlen, ...] with zeros at the padding positions."""
    # (out of place, and reshape: autograd's own vmap takes those)
    out = packed.new_zeros((batch * seqlen, *packed.shape[1:])).index_put((indices,), packed)
    return out.reshape(batch, seqlen, *packed.shape[1:])


def _pad_reference_backward(grad, indices):
    # (reshape, not flatten: autograd's own vmap, is_grads_batched, has no rule for flatten)
    return grad.reshape(-1, *grad.shape[2:])[indices]


def _pad_probe(batch, seq, width):
    def make(g):
        keep = ~padding(g, batch, seq)
        indices = torch.nonzero(keep.flatten()).flatten()
        return (randn(g, indices.numel(), width), indices, batch, seq), {}
    return make


PAD = Op(
    "pad", lambda packed, indices, batch, seqlen: packed.new_empty((batch, seqlen, *packed.shape[1:])),
    reference=pad_reference, reference_kernels=(pad_reference, _pad_reference_backward),
    composition=pad_reference,
    probes=(Probe("3 x 20", _pad_probe(3, 20, 64)),),
).differentiable(
    lambda grad, indices: grad.new_empty((indices.shape[0], *grad.shape[2:])))
