"""add_layer_norm: the residual add (with dropout on the added branch) fused with
the LayerNorm after it, forward and backward.

It returns both the normalised output and the sum: in post-LN stacks (BERT) the
output feeds the next layer, in pre-LN stacks (GPT) the sum is the residual
stream and receives its own gradient, which the backward adds in. Only the sum
and a mean and rstd per row are saved for backward; the dropout mask is
regenerated there from its seed.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import Supports, choose, planner
from ..backends.reference import keep_mask
from ..dtypes import GPU_FLOATS, acc_dtype
from . import _validate as check
from ._dropout import next_seed
from ._op import Op
from ._probe import Probe, randn
from .reference import dropped

__all__ = ["add_layer_norm"]


@planner("add_layer_norm")
def plan_add_layer_norm(x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0, backend=None):
    check.tensor("x", x, min_ndim=1)
    check.tensor("residual", residual, optional=True)
    check.tensor("weight", weight, ndim=1, optional=True)
    check.tensor("bias", bias, ndim=1, optional=True)
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    check.shape("residual", residual, tuple(x.shape))
    check.shape("weight", weight, (hidden,))
    check.shape("bias", bias, (hidden,))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    check.probability("dropout_p", dropout_p)
    check.same_dtype(x=x, residual=residual, weight=weight, bias=bias)
    device = check.same_device(x=x, residual=residual, weight=weight, bias=bias)
    return choose("add_layer_norm", device, backend, dtype=x.dtype, dropout=dropout_p > 0,
                  width=hidden)


def add_layer_norm(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                   bias: Optional[Tensor], eps: float = 1e-5, *, dropout_p: float = 0.0,
                   backend: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """(layer_norm(summed) * weight + bias, summed) with summed = dropout(x) + residual.

    The norm is over the last dimension; residual, weight and bias may be None
    (residual=None is a plain LayerNorm of dropout(x)).
    """
    choice = plan_add_layer_norm(x, residual, weight, bias, eps, dropout_p=dropout_p,
                                 backend=backend)
    out, summed, _, _ = ADD_LAYER_NORM.call(choice.backend, x, residual, weight, bias, float(eps),
                                       float(dropout_p), next_seed(dropout_p))
    return out, summed


def _fake(x, residual, weight, bias, eps, dropout_p, seed):
    rows = x.numel() // x.shape[-1]
    stats = acc_dtype(x.dtype)
    return (x.new_empty(x.shape), x.new_empty(x.shape), x.new_empty((rows,), dtype=stats),
            x.new_empty((rows,), dtype=stats))


def _fake_backward(grad_out, grad_summed, summed, mean, rstd, weight, has_bias, has_residual,
                   dropout_p, seed):
    dropout = dropout_p > 0
    hidden = (summed.shape[-1],)
    return (summed.new_empty(summed.shape) if not dropout or has_residual else None,
            summed.new_empty(summed.shape) if dropout else None,
            summed.new_empty(hidden) if weight is not None else None,
            summed.new_empty(hidden) if has_bias else None)


# --- reference ---------------------------------------------------------------------------------

def add_layer_norm_reference(x, residual, weight, bias, eps=1e-5, *, dropout_p=0.0,
                             dropout_mask=None):
    """(layer_norm(summed), summed) with summed = dropout(x) + residual over the last dim."""
    acc = acc_dtype(x.dtype)
    summed = dropped(x.to(acc), dropout_p, dropout_mask)
    if residual is not None:
        summed = summed + residual.to(acc)
    out = F.layer_norm(
        summed, summed.shape[-1:], None if weight is None else weight.to(acc),
        None if bias is None else bias.to(acc), eps,
    )
    return out.to(x.dtype), summed.to(x.dtype)


def _reference_forward(x, residual, weight, bias, eps, dropout_p, seed):
    keep = keep_mask(seed, x.shape, dropout_p, x.device)
    out, summed = add_layer_norm_reference(x, residual, weight, bias, eps, dropout_p=dropout_p,
                                           dropout_mask=keep)
    rows = summed.reshape(-1, summed.shape[-1]).to(acc_dtype(x.dtype))
    var, mean = torch.var_mean(rows, dim=-1, unbiased=False)
    return out, summed, mean, torch.rsqrt(var + eps)


def _reference_backward(grad_out, grad_summed, summed, mean, rstd, weight, has_bias, has_residual,
                        dropout_p, seed):
    """torch's LayerNorm backward from the saved statistics, in the accumulation dtype;
    the bias gradient is grad_out's column sum."""
    acc = acc_dtype(summed.dtype)
    hidden = summed.shape[-1]
    per_row = (-1, 1)
    dy = grad_out.reshape(-1, hidden).to(acc)
    ds, dweight, _ = torch.ops.aten.native_layer_norm_backward(
        dy, summed.reshape(-1, hidden).to(acc), (hidden,), mean.view(per_row), rstd.view(per_row),
        None if weight is None else weight.to(acc), None, [True, weight is not None, False])
    if grad_summed is not None:
        ds = ds + grad_summed.reshape(-1, hidden).to(acc)
    dweight = dweight.to(weight.dtype) if weight is not None else None
    dbias = dy.sum(0).to(summed.dtype) if has_bias else None
    dsummed = ds.view(summed.shape).to(summed.dtype)
    if dropout_p == 0.0:
        return dsummed, None, dweight, dbias
    keep = keep_mask(seed, summed.shape, dropout_p, summed.device)
    dx = (ds.view(summed.shape) * keep / (1.0 - dropout_p)).to(summed.dtype)
    return (dsummed if has_residual else None), dx, dweight, dbias


# --- PyTorch's composition (the torch backend) ---------------------------------------------------

def _composition(x, residual, weight, bias, eps, dropout_p, seed):
    summed = F.dropout(x, dropout_p) if dropout_p > 0 else x
    if residual is not None:
        summed = summed + residual
    elif summed is x:
        summed = x.clone()  # (an output of its own, as every backend's, never x itself)
    return F.layer_norm(summed, summed.shape[-1:], weight, bias, eps), summed, None, None


def _probe(rows, hidden):
    def make(g):
        return (randn(g, rows, hidden), randn(g, rows, hidden), 1 + 0.1 * randn(g, hidden),
                0.1 * randn(g, hidden)), {}
    return make


# --- the op --------------------------------------------------------------------------------------

ADD_LAYER_NORM = Op(
    "add_layer_norm", _fake,
    reference=add_layer_norm_reference,
    reference_kernels=(_reference_forward, _reference_backward),
    composition=_composition,
    probes=(Probe("hidden 256", _probe(40, 256)), Probe("hidden 100", _probe(40, 100)),
            # Past what the cuda kernels hold in registers.
            Probe("hidden 9000", _probe(6, 9000)),
            Probe.real("BERT-base, 1024 x 768", _probe(1024, 768))),
    # The triton kernel holds a row whole in registers: past 32768 elements spills would
    # cost more than two passes.
    supports={"triton": Supports(dtypes=GPU_FLOATS, max_width=32768)},
).differentiable(_fake_backward)
