"""Argument checks shared by the ops: each error names the argument and what was expected."""
from typing import Optional

import torch

from .. import dtypes as dtype_rules


def tensor(name: str, t, *, ndim=None, min_ndim=None, dtypes=dtype_rules.FLOATS, optional=False):
    """Checks that ``t`` is a tensor with an allowed dtype and number of dimensions."""
    if t is None and optional:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(dtype_rules.name(d) for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}; got {dtype_rules.name(t.dtype)}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if min_ndim is not None and t.dim() < min_ndim:
        raise ValueError(f"{name} must have at least {min_ndim} dimensions, got shape {tuple(t.shape)}")


def _first_mismatch(attribute: str, tensors: dict) -> tuple:
    """((name, value) of the first tensor that is not None, (name, value) of the first
    whose ``attribute`` differs from it, or None). A plain loop: it runs on every call."""
    first = None
    for name, t in tensors.items():
        if t is None:
            continue
        value = getattr(t, attribute)
        if first is None:
            first = (name, value)
        elif value != first[1]:
            return first, (name, value)
    return first, None


def same_device(**tensors: Optional[torch.Tensor]) -> torch.device:
    """The one device of the given tensors (None entries are skipped; the first is not)."""
    (first_name, device), mismatch = _first_mismatch("device", tensors)
    if mismatch:
        name, other = mismatch
        raise ValueError(
            f"{name} is on {other} but {first_name} is on {device}: all tensors must be on one device"
        )
    return device


def same_dtype(**tensors: Optional[torch.Tensor]) -> None:
    (first_name, dtype), mismatch = _first_mismatch("dtype", tensors)
    if mismatch:
        name, other = mismatch
        raise TypeError(f"{name} has dtype {other} but {first_name} has {dtype}: they must match")


def shape(name: str, t: Optional[torch.Tensor], expected: tuple) -> None:
    if t is not None and tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def probability(name: str, p: float) -> None:
    if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"{name} must be a float in [0, 1), got {p!r}")


def choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
