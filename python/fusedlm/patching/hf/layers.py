"""Fused replacements for the blocks around attention in Hugging Face models.

Each keeps the submodules (and so the parameter names and state_dict keys) of the
block it replaces, and computes the same function:

- AddNormOutput: BERT's SelfOutput/Output, LayerNorm(dropout(dense(h)) + input),
  with the dropout, residual add and LayerNorm in one add_layer_norm.
- GeluIntermediate: BERT's Intermediate, gelu(dense(h)), with the bias add fused
  into the GELU.
- GeluMLP: GPT-2's MLP, dropout(c_proj(gelu(c_fc(h)))) over Conv1D weights
  ([in, out]), with c_fc's bias fused into the GELU.

Under autocast they compute in the dtypes the unpatched blocks do (fusedlm.nn's
autocast rules): GELU in the autocast dtype of the product before it, the norm in
the widest dtype of its inputs.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import ops
from ...nn._autocast import lower, widen


class AddNormOutput(nn.Module):
    def __init__(self, dense: nn.Linear, layer_norm: nn.LayerNorm, dropout: nn.Dropout):
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = dense, layer_norm, dropout

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        x, residual, weight, bias = widen(self.dense(hidden_states), input_tensor,
                                          self.LayerNorm.weight, self.LayerNorm.bias)
        out, _ = ops.add_layer_norm(x, residual, weight, bias, self.LayerNorm.eps,
                                    dropout_p=self.dropout.p if self.training else 0.0)
        return out


class GeluIntermediate(nn.Module):
    def __init__(self, dense: nn.Linear, approximate: str):
        super().__init__()
        self.dense = dense
        self.approximate = approximate

    def forward(self, hidden_states: Tensor) -> Tensor:
        pre, bias = lower(F.linear(hidden_states, self.dense.weight), self.dense.bias)
        return ops.bias_gelu(pre, bias, self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class GeluMLP(nn.Module):
    def __init__(self, c_fc: nn.Module, c_proj: nn.Module, dropout: nn.Dropout, approximate: str):
        super().__init__()
        self.c_fc, self.c_proj, self.dropout = c_fc, c_proj, dropout
        self.approximate = approximate

    def forward(self, hidden_states: Tensor) -> Tensor:
        # Conv1D: weight is [in, out]
        pre, bias = lower(torch.matmul(hidden_states, self.c_fc.weight), self.c_fc.bias)
        act = ops.bias_gelu(pre, bias, self.approximate)
        return self.dropout(self.c_proj(act))

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
