"""The reference backend: each op's plain-PyTorch reference (fusedlm.ops.reference) as
kernels of the op's schemas, for every op, on any device and dtype.

An op declares these kernels beside its reference, in its own file (fusedlm/ops/<op>.py),
with the helpers here. They take and return what every backend's do, so a call runs
through the same registered op on each backend. A backward kernel takes the gradient by
differentiating the reference again from the saved inputs (:func:`vjp`; add_layer_norm
saves no input, so its backward is the LayerNorm gradient written out). Dropout masks are
drawn from a generator seeded with the call's seed (:func:`keep_mask`), so the backward
replays the forward's.
"""
from typing import Callable, Optional

import torch

from .registry import Backend, register


def keep_mask(seed: torch.Tensor, shape, p: float, device) -> Optional[torch.Tensor]:
    """The keep mask (bool) of the dropout stream `seed`, or None when p == 0."""
    if p == 0.0:
        return None
    generator = torch.Generator().manual_seed(int(seed))
    return (torch.rand(shape, generator=generator) >= p).to(device)


def vjp(fn: Callable, inputs: tuple, grads: tuple, wrt: Optional[tuple] = None) -> tuple:
    """The gradients of fn(*inputs)'s outputs, weighted by grads (None: unused), with
    respect to the inputs ``wrt`` marks (default: every tensor); the others' are None.
    torch.func, not torch.autograd: a registered op's kernel runs below autograd, where
    no graph is recorded."""
    wrt = wrt or tuple(t is not None for t in inputs)
    present = [i for i, (t, w) in enumerate(zip(inputs, wrt)) if w and t is not None]

    def of_present(*tensors):
        full = list(inputs)
        for i, t in zip(present, tensors):
            full[i] = t
        return fn(*full)

    outputs, pull = torch.func.vjp(of_present, *(inputs[i] for i in present))
    single = not isinstance(outputs, tuple)
    cotangents = tuple(torch.zeros_like(o) if g is None else g
                       for o, g in zip((outputs,) if single else outputs, grads))
    taken = iter(pull(cotangents[0] if single else cotangents))
    return tuple(next(taken) if i in present else None for i in range(len(inputs)))


def _owned(kernel: Callable) -> Callable:
    """kernel, with each output that shares memory with an input or an earlier output
    copied: a registered op's outputs must be its own (plain PyTorch may hand back an
    input, as x.to(x.dtype) does)."""
    def run(*args):
        outputs = kernel(*args)
        single = not isinstance(outputs, tuple)
        seen = {t.untyped_storage().data_ptr() for t in args
                if isinstance(t, torch.Tensor) and t.numel()}
        owned = []
        for out in (outputs,) if single else outputs:
            if isinstance(out, torch.Tensor) and out.numel():
                if out.untyped_storage().data_ptr() in seen:
                    out = out.clone()
                seen.add(out.untyped_storage().data_ptr())
            owned.append(out)
        return owned[0] if single else tuple(owned)

    run.__name__ = kernel.__name__
    return run


def _find(op):
    """The kernels the op declares for the reference backend."""
    forward, backward = op.reference_kernels
    return _owned(forward), _owned(backward) if backward else None


BACKEND = register(Backend("reference", ("any",), None, _find))
