"""Dropout seeds.

Every dropout in fusedlm is a counter-based stream: element e of a call is kept
or dropped by a hash of (seed, e), so a backward pass regenerates the forward's
mask from the seed alone and never stores it. The seed is drawn from torch's
default generator, so ``torch.manual_seed`` repeats a run on one backend.
"""
import torch

from .._extension import _C
from ..backends import unobserved

# The seed of every call without dropout, whose value changes nothing: one tensor for all of
# them in eager code. Traced code (torch.compile, fake tensors) makes its own, in its mode.
_NO_DROPOUT = torch.zeros((), dtype=torch.int64)


def next_seed(p: float) -> torch.Tensor:
    """A fresh int64 seed (0-d, on the CPU) from torch's generator; a constant when p == 0."""
    if p == 0.0:
        return _NO_DROPOUT if unobserved() else torch.zeros((), dtype=torch.int64)
    return torch.randint(0, 2**62, (), dtype=torch.int64)


def cpu_keep_mask(seed: torch.Tensor, shape, p: float, offset: int = 0) -> torch.Tensor:
    """The keep mask (bool, True = keep) the cpu backend uses for stream ``seed``."""
    return _C.dropout_mask(seed, offset, list(shape), p)
