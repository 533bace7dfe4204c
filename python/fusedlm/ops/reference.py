"""Plain-PyTorch references of every fusedlm op: the ``reference`` backend and the ground
truth of every test. ``fusedlm.ops.reference.<op>`` is the reference its op declares
beside itself (fusedlm/ops/<op>.py); this module holds the conventions they share.

They compute in the inputs' dtype promoted to at least float32 and return the inputs'
dtype (losses stay in float32 or wider). Where an op draws a dropout mask,
``dropout_mask`` (bool, True = keep) replays the one a kernel used.
"""
from typing import Optional

import torch

from ..backends import declared


def dropped(x: torch.Tensor, p: float, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """x with the elements ``keep`` drops zeroed and the rest scaled by 1 / (1 - p); a
    fresh mask from torch's generator when keep is None."""
    if p == 0.0:
        return x
    if keep is None:
        keep = torch.rand(x.shape, device=x.device) >= p
    return x * keep.to(x.dtype) / (1.0 - p)


def __getattr__(name: str):
    op = declared().get(name)
    if op is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return op.reference


def __dir__():
    return sorted([*globals(), *declared()])
