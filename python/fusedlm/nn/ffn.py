"""The GELU feed-forward block: Linear -> GELU -> dropout -> Linear as one gelu_ffn.

``linear_gelu_linear`` runs the block over any two ``nn.Linear``; ``GeluFFN`` is the
module that owns them. Models whose parameter names must stay those of another
library (BERT's ``intermediate.dense`` / ``output.dense``) call the function with
their own Linear layers.
"""
from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ._autocast import lower
from ._eager import EagerModule


def is_plain_linear(module: nn.Module) -> bool:
    """Whether module computes exactly F.linear(x, weight, bias), so a fused op may read its
    weights instead of calling it: not a subclass (a LoRA adapter, a quantised layer) and
    no hooks that would change its output."""
    return (type(module) is nn.Linear and not module._forward_hooks
            and not module._forward_pre_hooks)


def linear_gelu_linear(x: Tensor, fc1: nn.Linear, fc2: nn.Linear, *, approximate: str = "none",
                       dropout_p: float = 0.0) -> Tensor:
    """fc2(dropout(GELU(fc1(x)))) in one fused op: [..., fc1.in_features] -> [..., fc2.out_features].
    Under autocast it runs in the autocast dtype, as torch's Linear layers would. When
    either layer is not a plain nn.Linear (an adapter wraps it, a hook watches it) the
    layers are called as modules instead, so what they add is never skipped."""
    if not (is_plain_linear(fc1) and is_plain_linear(fc2)):
        return fc2(F.dropout(F.gelu(fc1(x), approximate=approximate), dropout_p))
    x, w1, b1, w2, b2 = lower(x, fc1.weight, fc1.bias, fc2.weight, fc2.bias)
    return ops.gelu_ffn(x, w1, b1, w2, b2, approximate=approximate, dropout_p=dropout_p)


class GeluFFN(EagerModule, nn.Module):
    """The transformer feed-forward block with bias+GELU fused into one op.

    Parameters are two ``nn.Linear`` (``fc1``: d_model -> d_ff, ``fc2``: d_ff -> d_out),
    so weights load from any Linear-GELU-Linear block. ``dropout`` applies to the
    activation between the two products, in training only.
    """

    def __init__(self, d_model: int, d_ff: int, d_out: Optional[int] = None, *, approximate: str = "none",
                 dropout: float = 0.0, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(d_ff, d_out or d_model, bias=bias, device=device, dtype=dtype)
        self.approximate = approximate
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        return linear_gelu_linear(x, self.fc1, self.fc2, approximate=self.approximate,
                                  dropout_p=self.dropout if self.training else 0.0)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, dropout={self.dropout}"
