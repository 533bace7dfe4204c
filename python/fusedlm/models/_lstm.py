"""The step loop of the recurrent models (ELMo's biLSTM, the AWD-LSTM) over padded batches.

Each step's matrix product is torch's and its pointwise part fusedlm's ``lstm_cell``. A
batch is padded on the right (``mask`` True = token); past a sequence's end its state is
kept and its output is zero, so that the final state is each sequence's own and a
direction that reads backwards starts each sequence at its own end.
"""
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor


def recur(step: Callable, inputs: Sequence[Tensor], state: tuple, mask: Optional[Tensor],
          forward: bool = True) -> tuple[Tensor, tuple]:
    """Runs ``step(x_t, state) -> (output, new state)`` over ``inputs`` (one [batch, ...]
    tensor per position) in reading order, ``state`` a tuple of [batch, ...] tensors.
    Returns the outputs stacked [batch, seq, ...] in their positions, and the last state."""
    outputs = [None] * len(inputs)
    for t, everyone in _steps(mask, len(inputs), forward):
        out, new = step(inputs[t], state)
        if everyone:
            state, outputs[t] = new, out
            continue
        keep = mask[:, t, None]
        state = tuple(torch.where(keep, n.to(s.dtype), s) for n, s in zip(new, state))
        outputs[t] = out * keep
    return torch.stack(outputs, dim=1), state


def _steps(mask: Optional[Tensor], seq: int, forward: bool):
    """(t, whether every sequence has a token at t) in reading order. Those steps need no
    masking; which they are is data, read once per call (not traced)."""
    order = range(seq) if forward else reversed(range(seq))
    if mask is None:
        return ((t, True) for t in order)
    if torch.compiler.is_compiling():
        return ((t, False) for t in order)
    full = mask.all(dim=0).tolist()
    return ((t, full[t]) for t in order)


def time_major(x: Tensor) -> tuple:
    """x [batch, seq, ...] as seq contiguous [batch, ...] steps. One unbind, not x[:, t]
    per step: the backward of one unbind stacks the steps' gradients once, where each
    select's would add a whole [batch, seq, ...] gradient per step."""
    return x.transpose(0, 1).contiguous().unbind(0)


def reverse_within(x: Tensor, lengths: Tensor) -> Tensor:
    """Each sequence of x [batch, seq, ...] reversed over its first lengths[b] positions
    (the padding after them stays in place)."""
    seq = x.shape[1]
    steps = torch.arange(seq, device=x.device)
    index = torch.where(steps < lengths[:, None], lengths[:, None] - 1 - steps, steps)
    index = index.view(*index.shape, *([1] * (x.dim() - 2))).expand_as(x)
    return x.gather(1, index)
