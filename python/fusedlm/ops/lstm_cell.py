"""lstm_cell: the pointwise part of one LSTM step, with the cell clip of AllenNLP's
LstmCellWithProjection (ELMo), forward and backward.

The matrix products around it (W_i x_t + W_h h_{t-1} + b before, the projection after) are
torch's; cuDNN's LSTM cannot clip the cell, so this is what a clipped LSTM fuses. Only the
gate pre-activations and c_prev are saved for backward; the activations are recomputed.
"""
import math
from typing import Optional

import torch
from torch import Tensor

from ..backends import choose, planner
from ..backends.reference import vjp
from ..dtypes import acc_dtype
from . import _validate as check
from ._op import Op
from ._probe import Probe, randn

__all__ = ["lstm_cell"]


def _clip_value(cell_clip: Optional[float]) -> float:
    """The clip the kernels take: +inf when there is none."""
    return math.inf if cell_clip is None else float(cell_clip)


@planner("lstm_cell")
def plan_lstm_cell(gates, c_prev, *, cell_clip=None, backend=None):
    check.tensor("gates", gates, min_ndim=1)
    check.tensor("c_prev", c_prev, min_ndim=1)
    if gates.shape[-1] % 4:
        raise ValueError("gates must have a last dimension of 4 * cell (input, forget, cell and "
                         f"output gates), got shape {tuple(gates.shape)}")
    check.shape("c_prev", c_prev, (*gates.shape[:-1], gates.shape[-1] // 4))
    if cell_clip is not None and (isinstance(cell_clip, bool) or not isinstance(cell_clip, (int, float))
                                  or not 0.0 < cell_clip <= math.inf):
        raise ValueError(f"cell_clip must be None or a float > 0, got {cell_clip!r}")
    check.same_dtype(gates=gates, c_prev=c_prev)
    device = check.same_device(gates=gates, c_prev=c_prev)
    return choose("lstm_cell", device, backend, dtype=gates.dtype)


def lstm_cell(gates: Tensor, c_prev: Tensor, *, cell_clip: Optional[float] = None,
              backend: Optional[str] = None) -> tuple[Tensor, Tensor]:
    """(h, c) of an LSTM step from gates [..., 4 * cell] and c_prev [..., cell].

    gates holds the pre-activations (biases included) of the input, forget, cell and output
    gates, in that order (AllenNLP's and torch.nn.LSTM's): c = i * g + f * c_prev, clamped
    to [-cell_clip, cell_clip] when cell_clip is set, and h = o * tanh(c).
    """
    choice = plan_lstm_cell(gates, c_prev, cell_clip=cell_clip, backend=backend)
    return LSTM_CELL.call(choice.backend, gates, c_prev, _clip_value(cell_clip))


# --- reference ---------------------------------------------------------------------------------

def lstm_cell_reference(gates, c_prev, *, cell_clip=None):
    """(h, c) of an LSTM step: gates [..., 4 * cell] are the input, forget, cell and output
    pre-activations; c = clamp(i * g + f * c_prev, -cell_clip, cell_clip), h = o * tanh(c)."""
    acc = acc_dtype(gates.dtype)
    i, f, g, o = gates.to(acc).chunk(4, dim=-1)
    c = torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * c_prev.to(acc)
    if cell_clip is not None:
        c = torch.clamp(c, -cell_clip, cell_clip)
    h = torch.sigmoid(o) * torch.tanh(c)
    return h.to(gates.dtype), c.to(gates.dtype)


def _reference_forward(gates, c_prev, cell_clip):
    return lstm_cell_reference(gates, c_prev, cell_clip=None if math.isinf(cell_clip) else cell_clip)


def _reference_backward(grad_h, grad_c, gates, c_prev, cell_clip):
    return vjp(lambda g, c: _reference_forward(g, c, cell_clip), (gates, c_prev), (grad_h, grad_c))


def _composition(gates, c_prev, cell_clip):
    """The LSTM step in torch's elementwise ops, in the inputs' dtype: what nn.LSTMCell's
    eager code runs after its products."""
    i, f, g, o = gates.chunk(4, dim=-1)
    c = torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * c_prev
    if not math.isinf(cell_clip):
        c = torch.clamp(c, -cell_clip, cell_clip)
    return torch.sigmoid(o) * torch.tanh(c), c


def _probe(rows, cell):
    def make(g):
        return (randn(g, rows, 4 * cell), randn(g, rows, cell)), {"cell_clip": 3.0}
    return make


# --- the op --------------------------------------------------------------------------------------

LSTM_CELL = Op(
    "lstm_cell", lambda gates, c_prev, cell_clip: (c_prev.new_empty(c_prev.shape), c_prev.new_empty(c_prev.shape)),
    reference=lstm_cell_reference, reference_kernels=(_reference_forward, _reference_backward),
    composition=_composition,
    probes=(Probe("cell 32", _probe(16, 32)), Probe.real("ELMo, 64 x 4096", _probe(64, 4096))),
).differentiable(
    lambda grad_h, grad_c, gates, c_prev, cell_clip: (gates.new_empty(gates.shape),
                                                      c_prev.new_empty(c_prev.shape)))

