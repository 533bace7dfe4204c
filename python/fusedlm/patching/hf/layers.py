"""Fused replacements for the blocks around attention in Hugging Face models.

Each keeps the submodules (and so the parameter names and state_dict keys) of the
block it replaces, and computes the same function:

- AddNormOutput: BERT's SelfOutput/Output, LayerNorm(dropout(dense(h)) + input),
  with the dropout, residual add and LayerNorm in one add_layer_norm.
- GeluIntermediate: BERT's Intermediate, gelu(dense(h)), with the bias add fused
  into the GELU.
- GeluMLP: GPT-2's MLP, dropout(c_proj(gelu(c_fc(h)))) over Conv1D weights
  ([in, out]), with c_fc's bias fused into the GELU.
- DistilBertBlock: DistilBERT's TransformerBlock, whose two residual adds and
  LayerNorms sit in the block: each in one add_layer_norm (the FFN's dropout in the
  second), lin1's bias fused into the GELU.
- AlbertAttentionAddNorm: ALBERT's AlbertAttention, fused attention then
  LayerNorm(dropout(dense(a)) + h) in one add_layer_norm.
- AlbertFusedLayer: ALBERT's AlbertLayer (one object, shared by every layer of its
  group), LayerNorm(ffn_output(gelu(ffn(a))) + a) with ffn's bias fused into the GELU
  and the add and norm in one add_layer_norm.

Under autocast they compute in the dtypes the unpatched blocks do (fusedlm.nn's
autocast rules): GELU in the autocast dtype of the product before it, the norm in
the widest dtype of its inputs.

A block that replaces one of the modules transformers records a model's outputs from
(``_can_record_outputs``: hidden_states from each layer, attentions from each attention
module) derives from that module's class: transformers finds those modules by
``isinstance``, so the fused block's output is recorded in its place. It skips that
class's ``__init__``, which would build new weights, and holds the replaced block's.
"""

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.albert.modeling_albert import AlbertAttention, AlbertLayer
from transformers.models.distilbert.modeling_distilbert import TransformerBlock

from ... import ops
from ...nn._autocast import lower, widen
from .. import hf_attention as attention


def _add_norm(x: Tensor, residual: Tensor, layer_norm: nn.LayerNorm, dropout_p: float) -> Tensor:
    """layer_norm(dropout(x) + residual) in one add_layer_norm."""
    x, residual, weight, bias = widen(x, residual, layer_norm.weight, layer_norm.bias)
    out, _ = ops.add_layer_norm(x, residual, weight, bias, layer_norm.eps, dropout_p=dropout_p)
    return out


def _gelu_linear(x: Tensor, linear: nn.Linear, approximate: str) -> Tensor:
    """gelu(linear(x)), the bias added inside the GELU."""
    pre, bias = lower(F.linear(x, linear.weight), linear.bias)
    return ops.bias_gelu(pre, bias, approximate)


class AddNormOutput(nn.Module):
    def __init__(self, dense: nn.Linear, layer_norm: nn.LayerNorm, dropout: nn.Dropout):
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = dense, layer_norm, dropout

    def forward(self, hidden_states: Tensor, input_tensor: Tensor) -> Tensor:
        return _add_norm(self.dense(hidden_states), input_tensor, self.LayerNorm,
                         self.dropout.p if self.training else 0.0)


class GeluIntermediate(nn.Module):
    def __init__(self, dense: nn.Linear, approximate: str):
        super().__init__()
        self.dense = dense
        self.approximate = approximate

    def forward(self, hidden_states: Tensor) -> Tensor:
        return _gelu_linear(hidden_states, self.dense, self.approximate)

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


class DistilBertBlock(TransformerBlock):  # a GradientCheckpointingLayer, as TransformerBlock is
    def __init__(self, block: nn.Module, approximate: str):
        nn.Module.__init__(self)
        self.attention, self.ffn = block.attention, block.ffn
        self.sa_layer_norm, self.output_layer_norm = block.sa_layer_norm, block.output_layer_norm
        self.approximate = approximate
        # Gradient checkpointing switched on before patching stays on.
        for name in ("gradient_checkpointing", "_gradient_checkpointing_func"):
            if name in vars(block):
                setattr(self, name, vars(block)[name])

    def forward(self, hidden_states: Tensor, attention_mask=None, **kwargs) -> Tensor:
        attention_output, _ = self.attention(hidden_states, attention_mask=attention_mask, **kwargs)
        attention_output = _add_norm(attention_output, hidden_states, self.sa_layer_norm, 0.0)
        ffn = self.ffn
        ffn_output = ffn.lin2(_gelu_linear(attention_output, ffn.lin1, self.approximate))
        return _add_norm(ffn_output, attention_output, self.output_layer_norm,
                         ffn.dropout.p if self.training else 0.0)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class AlbertAttentionAddNorm(AlbertAttention):
    def __init__(self, module: nn.Module):
        nn.Module.__init__(self)
        self.config, self.is_causal = module.config, module.is_causal
        self.attention_head_size, self.scaling = module.attention_head_size, module.scaling
        self.query, self.key, self.value, self.dense = module.query, module.key, module.value, module.dense
        self.attention_dropout, self.output_dropout = module.attention_dropout, module.output_dropout
        self.LayerNorm = module.LayerNorm

    def forward(self, hidden_states: Tensor, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.attention_head_size)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        out, weights = attention.attention_forward(
            self, q, k, v, attention_mask, scaling=self.scaling,
            dropout=self.attention_dropout.p if self.training else 0.0, **kwargs)
        out = self.dense(out.reshape(*hidden_states.shape[:-1], -1))
        return _add_norm(out, hidden_states, self.LayerNorm,
                         self.output_dropout.p if self.training else 0.0), weights


class AlbertFusedLayer(AlbertLayer):
    def __init__(self, layer: nn.Module, approximate: str):
        nn.Module.__init__(self)
        self.config = layer.config
        self.attention, self.ffn, self.ffn_output = layer.attention, layer.ffn, layer.ffn_output
        self.full_layer_layer_norm = layer.full_layer_layer_norm
        self.approximate = approximate

    def forward(self, hidden_states: Tensor, attention_mask=None, **kwargs) -> Tensor:
        attention_output, _ = self.attention(hidden_states, attention_mask, **kwargs)
        ffn_output = self.ffn_output(_gelu_linear(attention_output, self.ffn, self.approximate))
        return _add_norm(ffn_output, attention_output, self.full_layer_layer_norm, 0.0)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
