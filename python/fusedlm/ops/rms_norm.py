"""rms_norm: RMSNorm (Zhang and Sennrich, 2019), LayerNorm without the mean, as T5 and
the LLaMA family normalise; forward and backward.

out = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension,
computed in the accumulation dtype. The forward saves x and one rstd per row; the backward
reads them back:
    dx = rstd * (g - x * rstd^2 * mean(g * x)),  g = grad_out * weight,
    dweight = the column sums of grad_out * x * rstd.
"""
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import Supports, choose, planner
from ..dtypes import GPU_FLOATS, acc_dtype
from . import _validate as check
from ._op import Op
from ._probe import Probe, randn

__all__ = ["rms_norm"]


@planner("rms_norm")
def plan_rms_norm(x, weight, eps=1e-6, *, backend=None):
    check.tensor("x", x, min_ndim=1)
    check.tensor("weight", weight, ndim=1, optional=True)
    hidden = x.shape[-1]
    if hidden == 0:
        raise ValueError(f"x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    check.shape("weight", weight, (hidden,))
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0.0 <= eps < math.inf:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")
    check.same_dtype(x=x, weight=weight)
    device = check.same_device(x=x, weight=weight)
    return choose("rms_norm", device, backend, dtype=x.dtype, width=hidden)


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, eps: float = 1e-6, *,
             backend: Optional[str] = None) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension (weight may be None), as
    ``torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps)`` computes it."""
    choice = plan_rms_norm(x, weight, eps, backend=backend)
    return RMS_NORM.call(choice.backend, x, weight, float(eps))[0]


def _fake(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty((x.numel() // x.shape[-1],), dtype=acc_dtype(x.dtype))


def _fake_backward(grad_out, x, rstd, weight, eps):
    return x.new_empty(x.shape), (x.new_empty(x.shape[-1:]) if weight is not None else None)


# --- reference ---------------------------------------------------------------------------------

def _rstd(x, eps):
    """1 / sqrt(mean(x^2) + eps) of each row, [..., 1], in the accumulation dtype."""
    xa = x.to(acc_dtype(x.dtype))
    return torch.rsqrt(xa.square().mean(-1, keepdim=True) + eps)


def _normalised(x, weight, eps):
    """(the output, its rstd [..., 1])."""
    rstd = _rstd(x, eps)
    out = x.to(rstd.dtype) * rstd
    if weight is not None:
        out = out * weight.to(rstd.dtype)
    return out.to(x.dtype), rstd


def rms_norm_reference(x, weight=None, eps=1e-6):
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, in the accumulation dtype."""
    return _normalised(x, weight, eps)[0]


def _reference_forward(x, weight, eps):
    out, rstd = _normalised(x, weight, eps)
    return out, rstd.reshape(-1)


def _reference_backward(grad_out, x, rstd, weight, eps):
    """The backward's formula in the accumulation dtype. rstd is recomputed from x (equal to
    the saved one) so that, recorded by autograd, it differentiates again through x."""
    acc = acc_dtype(x.dtype)
    hidden = x.shape[-1]
    xa = x.reshape(-1, hidden).to(acc)
    dy = grad_out.reshape(-1, hidden).to(acc)
    r = _rstd(x, eps).reshape(-1, 1)
    xhat = xa * r
    g = dy if weight is None else dy * weight.to(acc)
    dx = r * (g - xhat * (g * xhat).mean(-1, keepdim=True))
    dweight = (dy * xhat).sum(0).to(weight.dtype) if weight is not None else None
    return dx.view(x.shape).to(x.dtype), dweight


# --- PyTorch's composition (the torch backend) ---------------------------------------------------

def _composition(x, weight, eps):
    return F.rms_norm(x, x.shape[-1:], weight, eps), None


def _probe(rows, hidden, weight=True):
    def make(g):
        return (randn(g, rows, hidden), 1 + 0.1 * randn(g, hidden) if weight else None), {}
    return make


# --- the op --------------------------------------------------------------------------------------

RMS_NORM = Op(
    "rms_norm", _fake,
    reference=rms_norm_reference,
    reference_kernels=(_reference_forward, _reference_backward),
    composition=_composition,
    probes=(Probe("hidden 256", _probe(40, 256)),
            Probe("hidden 100, no weight", _probe(40, 100, False)),
            # Past what the GPU kernels hold in registers.
            Probe("hidden 9000", _probe(6, 9000)),
            Probe.real("LLaMA-7B, 1024 x 4096", _probe(1024, 4096))),
    # The triton kernel holds a row whole in registers: past 32768 elements spills would
    # cost more than two passes.
    supports={"triton": Supports(dtypes=GPU_FLOATS, max_width=32768)},
).differentiable(_fake_backward)
