"""Mixed dtypes for fusedlm's modules: torch.autocast, and torch's own mixed LayerNorm.

The ops take one dtype for all their inputs; under autocast a module's inputs arrive
mixed (bfloat16 activations, float32 weights and residual stream). These helpers
give the ops the dtypes torch's own modules would compute in: matrix products in
the autocast dtype, additions in the wider of their operands, and a LayerNorm of a
bfloat16 or float16 input with float32 parameters in float32.
"""
from typing import Optional

import torch
from torch import Tensor


def _enabled(t: Tensor) -> bool:
    return torch.is_autocast_enabled(t.device.type)


def lower(*tensors: Optional[Tensor]) -> tuple:
    """The inputs of a matrix product, in the autocast dtype (as F.linear casts them)."""
    first = next(t for t in tensors if t is not None)
    if not _enabled(first):
        return tensors
    dtype = torch.get_autocast_dtype(first.device.type)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def widen(*tensors: Optional[Tensor]) -> tuple:
    """The operands of an addition and its affine parameters, in their widest dtype
    (type promotion, as ``x + residual`` gives under autocast)."""
    present = [t for t in tensors if t is not None]
    if not _enabled(present[0]):
        return tensors
    dtype = present[0].dtype
    for t in present[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def norm_operands(x: Tensor, residual: Optional[Tensor], weight: Optional[Tensor],
                  bias: Optional[Tensor]) -> tuple:
    """((x, residual, weight, bias) in the dtype a LayerNorm computes in, the dtype it
    returns). Under autocast that is widen's, both. Otherwise it is torch's mixed-dtype
    rule: a bfloat16 or float16 x (and residual) with float32 parameters computes in
    float32 and returns x's dtype. Any other mix goes to the op as it is, whose error
    names the tensors that differ."""
    if _enabled(x):
        operands = widen(x, residual, weight, bias)
        return operands, operands[0].dtype
    params = [t for t in (weight, bias) if t is not None]
    mixed = (x.dtype in (torch.bfloat16, torch.float16) and params
             and all(t.dtype == torch.float32 for t in params)
             and (residual is None or residual.dtype == x.dtype))
    if not mixed:
        return (x, residual, weight, bias), x.dtype
    return (x.float(), None if residual is None else residual.float(), weight, bias), x.dtype
