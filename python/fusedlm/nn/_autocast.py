"""torch.autocast for fusedlm's modules.

The ops take one dtype for all their inputs; under autocast a module's inputs arrive
mixed (bfloat16 activations, float32 weights and residual stream). These helpers
give the ops the dtypes torch's own modules would compute in: matrix products in
the autocast dtype, additions in the wider of their operands.
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
