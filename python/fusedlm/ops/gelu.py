"""bias_gelu and gelu_ffn: bias + GELU fused with its backward, and the
Linear -> GELU -> dropout -> Linear block built around it.

gelu_ffn saves only the pre-activation (x @ w1^T, with b1 on the cuda backend) for
backward; the activation is recomputed there instead of being kept in memory.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..backends import Supports, choose, planner
from ..backends.reference import keep_mask, vjp
from ..dtypes import HALVES, acc_dtype
from . import _validate as check
from ._dropout import next_seed
from ._op import Op
from ._probe import FFN_PATHS, Probe, randn
from .reference import dropped

__all__ = ["bias_gelu", "gelu_ffn"]

APPROXIMATIONS = ("none", "tanh")


# --- bias_gelu -----------------------------------------------------------------------------------

@planner("bias_gelu")
def plan_bias_gelu(x, bias=None, approximate="none", *, backend=None):
    check.tensor("x", x, min_ndim=1)
    check.tensor("bias", bias, ndim=1, optional=True)
    check.choice("approximate", approximate, APPROXIMATIONS)
    check.shape("bias", bias, (x.shape[-1],))
    check.same_dtype(x=x, bias=bias)
    device = check.same_device(x=x, bias=bias)
    grad = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
    return choose("bias_gelu", device, backend, dtype=x.dtype, grad=grad)


def bias_gelu(x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none", *,
              backend: Optional[str] = None) -> Tensor:
    """gelu(x + bias), bias over the last dimension; approximate is "none" (erf) or "tanh"."""
    choice = plan_bias_gelu(x, bias, approximate, backend=backend)
    return BIAS_GELU.call(choice.backend, x, bias, approximate)


def bias_gelu_reference(x, bias=None, approximate="none"):
    """gelu(x + bias) with bias over the last dimension."""
    acc = acc_dtype(x.dtype)
    z = x.to(acc) if bias is None else x.to(acc) + bias.to(acc)
    return F.gelu(z, approximate=approximate).to(x.dtype)


def _bias_gelu_reference_forward(x, bias, approximate):
    """What eager code runs: torch's GELU of the sum, in x's dtype."""
    return F.gelu(x if bias is None else x + bias, approximate=approximate)


def _bias_gelu_reference_backward(grad, x, bias, approximate):
    """torch's GELU backward, as eager code runs it; the bias gradient is the column sum."""
    z = x if bias is None else x + bias
    dz = torch.ops.aten.gelu_backward(grad, z, approximate=approximate)
    return dz, None if bias is None else dz.reshape(-1, dz.shape[-1]).sum(0)


def _bias_gelu_probe(rows, cols, approximate):
    def make(g):
        return (randn(g, rows, cols), randn(g, cols), approximate), {}
    return make


BIAS_GELU = Op(
    "bias_gelu", lambda x, bias, approximate: x.new_empty(x.shape),
    reference=bias_gelu_reference,
    reference_kernels=(_bias_gelu_reference_forward, _bias_gelu_reference_backward),
    composition=_bias_gelu_reference_forward,
    probes=(Probe("erf", _bias_gelu_probe(64, 384, "none")),
            Probe("tanh", _bias_gelu_probe(64, 384, "tanh")),
            Probe.real("BERT-base, 1024 x 3072", _bias_gelu_probe(1024, 3072, "none"))),
    # On the CPU, bfloat16's forward alone (inference) gains nothing fused: torch's own GELU,
    # which skips the accuracy work in the tail, times within a few percent of it (0.91-1.07x
    # across runs); with its backward the fused kernel is faster (benchmarks/README.md).
    supports={"cpu": Supports(slower=({"dtype": torch.bfloat16, "grad": False},))},
).differentiable(
    lambda grad, x, bias, approximate: (x.new_empty(x.shape),
                                        None if bias is None else x.new_empty(bias.shape)))


# --- gelu_ffn ------------------------------------------------------------------------------------

@planner("gelu_ffn")
def plan_gelu_ffn(x, w1, b1, w2, b2, *, approximate="none", dropout_p=0.0, backend=None):
    check.tensor("x", x, min_ndim=1)
    check.tensor("w1", w1, ndim=2)
    check.tensor("b1", b1, ndim=1, optional=True)
    check.tensor("w2", w2, ndim=2)
    check.tensor("b2", b2, ndim=1, optional=True)
    check.choice("approximate", approximate, APPROXIMATIONS)
    check.probability("dropout_p", dropout_p)
    d_in, d_ff, d_out = x.shape[-1], w1.shape[0], w2.shape[0]
    check.shape("w1", w1, (d_ff, d_in))
    check.shape("b1", b1, (d_ff,))
    check.shape("w2", w2, (d_out, d_ff))
    check.shape("b2", b2, (d_out,))
    check.same_dtype(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    device = check.same_device(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
    return choose("gelu_ffn", device, backend, dtype=x.dtype, dropout=dropout_p > 0,
                  sizes=(d_in, d_ff, d_out), rows=x.numel() // d_in)


def gelu_ffn(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], *,
             approximate: str = "none", dropout_p: float = 0.0,
             backend: Optional[str] = None) -> Tensor:
    """Linear(w1, b1) -> GELU -> dropout -> Linear(w2, b2), weights as in nn.Linear."""
    choice = plan_gelu_ffn(x, w1, b1, w2, b2, approximate=approximate, dropout_p=dropout_p,
                           backend=backend)
    out, _ = GELU_FFN.call(choice.backend, x, w1, b1, w2, b2, approximate, float(dropout_p),
                      next_seed(dropout_p))
    return out


def _gelu_ffn_fake(x, w1, b1, w2, b2, approximate, dropout_p, seed):
    rows = x.numel() // x.shape[-1]
    return x.new_empty((*x.shape[:-1], w2.shape[0])), x.new_empty((rows, w1.shape[0]))


def _gelu_ffn_fake_backward(grad, x, pre, w1, b1, w2, b2, approximate, dropout_p, seed):
    return (x.new_empty(x.shape), w1.new_empty(w1.shape),
            None if b1 is None else w1.new_empty(b1.shape), w2.new_empty(w2.shape),
            None if b2 is None else w2.new_empty(b2.shape))


def gelu_ffn_reference(x, w1, b1, w2, b2, *, approximate="none", dropout_p=0.0,
                       dropout_mask=None):
    """Linear(w1, b1) -> GELU -> dropout -> Linear(w2, b2)."""
    hidden = bias_gelu_reference(F.linear(x, w1), b1, approximate)
    return F.linear(dropped(hidden, dropout_p, dropout_mask), w2, b2)


def _gelu_ffn_seeded(x, w1, b1, w2, b2, approximate, dropout_p, seed):
    keep = keep_mask(seed, (*x.shape[:-1], w1.shape[0]), dropout_p, x.device)
    return gelu_ffn_reference(x, w1, b1, w2, b2, approximate=approximate, dropout_p=dropout_p,
                              dropout_mask=keep)


def _gelu_ffn_reference_forward(x, w1, b1, w2, b2, approximate, dropout_p, seed):
    # The pre-activation every backend saves; this one's backward recomputes it instead.
    pre = F.linear(x, w1).reshape(-1, w1.shape[0])
    return _gelu_ffn_seeded(x, w1, b1, w2, b2, approximate, dropout_p, seed), pre


def _gelu_ffn_reference_backward(grad, x, pre, w1, b1, w2, b2, approximate, dropout_p, seed):
    return vjp(lambda *weights: _gelu_ffn_seeded(*weights, approximate, dropout_p, seed),
               (x, w1, b1, w2, b2), (grad,))


def _gelu_ffn_composition(x, w1, b1, w2, b2, approximate, dropout_p, seed):
    """Two products, with their biases in cuBLAS's epilogue, and torch's GELU and dropout
    between them: what eager code runs."""
    hidden = F.gelu(F.linear(x, w1, b1), approximate=approximate)
    return F.linear(F.dropout(hidden, dropout_p) if dropout_p > 0 else hidden, w2, b2), None


def _gelu_ffn_probe(rows, d_in, d_ff):
    def make(g):
        return (randn(g, rows, d_in), randn(g, d_ff, d_in, scale=d_in ** -0.5), randn(g, d_ff),
                randn(g, d_in, d_ff, scale=d_ff ** -0.5), randn(g, d_in)), {}
    return make


GELU_FFN = Op(
    "gelu_ffn", _gelu_ffn_fake,
    reference=gelu_ffn_reference,
    reference_kernels=(_gelu_ffn_reference_forward, _gelu_ffn_reference_backward),
    composition=_gelu_ffn_composition,
    probes=(Probe("130 rows", _gelu_ffn_probe(130, 128, 256), paths=FFN_PATHS),
            # A K tail inside the fused product's step, past its pipeline's stages.
            Probe("7 rows, d_in 264", _gelu_ffn_probe(7, 264, 256), paths=FFN_PATHS),
            Probe.real("BERT-base, 1024 x 768 -> 3072", _gelu_ffn_probe(1024, 768, 3072),
                       paths=FFN_PATHS)),
    # The cuda kernel's tensor-core tiles load 16-byte vectors of 8 halves; its grid's y
    # dimension (at most 65535) counts tiles of 128 rows.
    supports={"cuda": Supports(dtypes=HALVES, multiple_of=8, max_counts=(("rows", 65535 * 128),))},
).differentiable(_gelu_ffn_fake_backward)
