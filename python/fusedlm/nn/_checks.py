"""Argument checks of the modules' forwards: the shapes torch's modules accept, checked
where the caller passed them, so that an error names the argument as passed (query,
src_key_padding_mask, ...), never a tensor built from it."""
import torch
from torch import Tensor


def sequence_dims(batched: bool, batch_first: bool, batch, seq, width) -> list:
    """The dimensions of a sequence input (query, key, value, src): (seq, width), and when
    batched the batch first (batch_first) or second. Each is a name, or (name, the size it
    must have)."""
    dims = [seq, width]
    if batched:
        dims.insert(0 if batch_first else 1, "batch" if batch is None else ("batch", batch))
    return dims


def check_shape(name: str, t, dims: list, alternative: str = "") -> None:
    """That t is a tensor with the given dimensions (as sequence_dims gives them)."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    sizes = [None if isinstance(d, str) else d[1] for d in dims]
    if t.dim() == len(dims) and all(n is None or n == m for n, m in zip(sizes, t.shape)):
        return
    shape = ", ".join(d if isinstance(d, str) else f"{d[0]}={d[1]}" for d in dims)
    raise ValueError(f"{name} must have shape ({shape}){alternative}, got {tuple(t.shape)}")


def check_mask(name: str, mask, shapes: dict) -> None:
    """That mask is a bool or floating-point tensor (torch takes no other) of one of
    ``shapes``, {shape: what it means}."""
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"{name} must be bool or floating point, got {mask.dtype}")
    if tuple(mask.shape) not in shapes:
        allowed = " or ".join(f"{meaning} = {shape}" for shape, meaning in shapes.items())
        raise ValueError(f"{name} must have shape {allowed}, got {tuple(mask.shape)}")
