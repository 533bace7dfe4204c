"""bias_gelu and gelu_ffn: bias + GELU fused with its backward, and the
Linear -> GELU -> dropout -> Linear block built around it.

gelu_ffn saves only the pre-activation (x @ w1^T, with b1 on the cuda backend) for
backward; the activation is recomputed there instead of being kept in memory.
"""
from typing import Optional

import torch
from torch import Tensor

from ..backends import choose, kernel, planner
from . import _validate as check
from . import reference
from ._direct import may_call_kernel
from ._dropout import next_seed

APPROXIMATIONS = ("none", "tanh")


def _empty(t: Optional[Tensor], like: Tensor) -> Tensor:
    """Custom ops cannot return None: an absent gradient travels as an empty tensor."""
    return t if t is not None else like.new_empty(0)


# --- bias_gelu -----------------------------------------------------------------------------------

@planner("bias_gelu")
def plan_bias_gelu(x, bias=None, approximate="none", *, backend=None):
    check.tensor("x", x, min_ndim=1)
    check.tensor("bias", bias, ndim=1, optional=True)
    check.choice("approximate", approximate, APPROXIMATIONS)
    check.shape("bias", bias, (x.shape[-1],))
    check.same_dtype(x=x, bias=bias)
    device = check.same_device(x=x, bias=bias)
    return choose("bias_gelu", device, backend, dtype=x.dtype)


def bias_gelu(x: Tensor, bias: Optional[Tensor] = None, approximate: str = "none", *,
              backend: Optional[str] = None) -> Tensor:
    """gelu(x + bias), bias over the last dimension; approximate is "none" (erf) or "tanh"."""
    choice = plan_bias_gelu(x, bias, approximate, backend=backend)
    if choice.backend == "reference":
        return reference.bias_gelu(x, bias, approximate)
    if may_call_kernel():
        return kernel(choice.backend, "bias_gelu").forward(x, bias, approximate)
    return torch.ops.fusedlm.bias_gelu(x, bias, approximate, choice.backend)


@torch.library.custom_op("fusedlm::bias_gelu", mutates_args=())
def _bias_gelu(x: Tensor, bias: Optional[Tensor], approximate: str, backend: str) -> Tensor:
    return kernel(backend, "bias_gelu").forward(x, bias, approximate)


@_bias_gelu.register_fake
def _(x, bias, approximate, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("fusedlm::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward(grad: Tensor, x: Tensor, bias: Optional[Tensor], approximate: str,
                        backend: str) -> tuple[Tensor, Tensor]:
    dx, dbias = kernel(backend, "bias_gelu").backward(grad, x, bias, approximate)
    return dx, _empty(dbias, x)


@_bias_gelu_backward.register_fake
def _(grad, x, bias, approximate, backend):
    return x.new_empty(x.shape), x.new_empty(bias.shape if bias is not None else (0,))


def _bias_gelu_setup(ctx, inputs, output):
    x, bias, ctx.approximate, ctx.backend = inputs
    ctx.save_for_backward(x, bias)


def _bias_gelu_grad(ctx, grad):
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.fusedlm.bias_gelu_backward(grad, x, bias, ctx.approximate, ctx.backend)
    return dx, dbias if bias is not None else None, None, None


_bias_gelu.register_autograd(_bias_gelu_grad, setup_context=_bias_gelu_setup)


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
                  sizes=(d_in, d_ff, d_out))


def gelu_ffn(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], *,
             approximate: str = "none", dropout_p: float = 0.0,
             backend: Optional[str] = None) -> Tensor:
    """Linear(w1, b1) -> GELU -> dropout -> Linear(w2, b2), weights as in nn.Linear."""
    choice = plan_gelu_ffn(x, w1, b1, w2, b2, approximate=approximate, dropout_p=dropout_p,
                           backend=backend)
    if choice.backend == "reference":
        return reference.gelu_ffn(x, w1, b1, w2, b2, approximate=approximate, dropout_p=dropout_p)
    seed = next_seed(dropout_p)
    out, _ = torch.ops.fusedlm.gelu_ffn(x, w1, b1, w2, b2, approximate, float(dropout_p), seed,
                                        choice.backend)
    return out


@torch.library.custom_op("fusedlm::gelu_ffn", mutates_args=())
def _gelu_ffn(x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor],
              approximate: str, dropout_p: float, seed: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return kernel(backend, "gelu_ffn").forward(x, w1, b1, w2, b2, approximate, dropout_p, seed)


@_gelu_ffn.register_fake
def _(x, w1, b1, w2, b2, approximate, dropout_p, seed, backend):
    rows = x.numel() // x.shape[-1]
    return x.new_empty((*x.shape[:-1], w2.shape[0])), x.new_empty((rows, w1.shape[0]))


@torch.library.custom_op("fusedlm::gelu_ffn_backward", mutates_args=())
def _gelu_ffn_backward(grad: Tensor, x: Tensor, pre: Tensor, w1: Tensor, b1: Optional[Tensor],
                       w2: Tensor, b2: Optional[Tensor], approximate: str, dropout_p: float,
                       seed: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    dx, dw1, db1, dw2, db2 = kernel(backend, "gelu_ffn").backward(
        grad, x, pre, w1, b1, w2, b2, approximate, dropout_p, seed)
    return dx, dw1, _empty(db1, w1), dw2, _empty(db2, w2)


@_gelu_ffn_backward.register_fake
def _(grad, x, pre, w1, b1, w2, b2, approximate, dropout_p, seed, backend):
    def like(b, w):
        return w.new_empty(b.shape if b is not None else (0,))
    return (x.new_empty(x.shape), w1.new_empty(w1.shape), like(b1, w1), w2.new_empty(w2.shape),
            like(b2, w2))


def _gelu_ffn_setup(ctx, inputs, output):
    x, w1, b1, w2, b2, ctx.approximate, ctx.dropout_p, seed, ctx.backend = inputs
    ctx.save_for_backward(x, output[1], w1, b1, w2, b2, seed)
    ctx.mark_non_differentiable(output[1])
    # The saved pre-activation never has a gradient: no zero-filled tensor for it.
    ctx.set_materialize_grads(False)


def _gelu_ffn_grad(ctx, grad, _grad_pre):
    if grad is None:  # the output was not used either
        return (None,) * 9
    x, pre, w1, b1, w2, b2, seed = ctx.saved_tensors
    dx, dw1, db1, dw2, db2 = torch.ops.fusedlm.gelu_ffn_backward(
        grad, x, pre, w1, b1, w2, b2, ctx.approximate, ctx.dropout_p, seed, ctx.backend)
    return (dx, dw1, db1 if b1 is not None else None, dw2, db2 if b2 is not None else None,
            None, None, None, None)


_gelu_ffn.register_autograd(_gelu_ffn_grad, setup_context=_gelu_ffn_setup)
