"""Fused replacements for the blocks around attention in Hugging Face models.

Each keeps the submodules (and so the parameter names and state_dict keys) of the
block it replaces, and computes the same function:

- AddNormOutput: BERT's SelfOutput/Output, LayerNorm(dropout(dense(h)) + input),
  with the dropout, residual add and LayerNorm in one add_layer_norm.
- GeluIntermediate: BERT's Intermediate, gelu(dense(h)), with the bias add fused
  into the GELU.
- GeluMLP: GPT-2's MLP, dropout(c_proj(gelu(c_fc(h)))) over Conv1D weights
  ([in, out]), with c_fc's bias fused into the GELU.

Under autocast the products run in the autocast dtype and the norms in float32,
as in the unpatched blocks; the fused ops take one dtype, so their inputs are
cast to the one torch's type promotion would give.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import ops


class AddNormOutput(nn.Module):
    def __init__(self, dense: nn.Linear, layer_norm: nn.LayerNorm, dropout: nn.Dropout,
                 backend: Optional[str]):
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = dense, layer_norm, dropout
        self.backend = backend

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        x = self.dense(hidden_states)
        norm = self.LayerNorm
        dtype = torch.promote_types(torch.promote_types(x.dtype, input_tensor.dtype), norm.weight.dtype)
        out, _ = ops.add_layer_norm(x.to(dtype), input_tensor.to(dtype), norm.weight.to(dtype),
                                    norm.bias.to(dtype), norm.eps,
                                    dropout_p=self.dropout.p if self.training else 0.0,
                                    backend=self.backend)
        return out


class GeluIntermediate(nn.Module):
    def __init__(self, dense: nn.Linear, approximate: str, backend: Optional[str]):
        super().__init__()
        self.dense = dense
        self.approximate, self.backend = approximate, backend

    def forward(self, hidden_states: Tensor) -> Tensor:
        pre = F.linear(hidden_states, self.dense.weight)
        return ops.bias_gelu(pre, self.dense.bias.to(pre.dtype), self.approximate, backend=self.backend)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class GeluMLP(nn.Module):
    def __init__(self, c_fc: nn.Module, c_proj: nn.Module, dropout: nn.Dropout, approximate: str,
                 backend: Optional[str]):
        super().__init__()
        self.c_fc, self.c_proj, self.dropout = c_fc, c_proj, dropout
        self.approximate, self.backend = approximate, backend

    def forward(self, hidden_states: Tensor) -> Tensor:
        pre = torch.matmul(hidden_states, self.c_fc.weight)  # Conv1D: weight is [in, out]
        act = ops.bias_gelu(pre, self.c_fc.bias.to(pre.dtype), self.approximate, backend=self.backend)
        return self.dropout(self.c_proj(act))

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
