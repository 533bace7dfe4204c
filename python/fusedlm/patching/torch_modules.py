"""Rules for torch.nn's modules.

Replacements are built on the meta device and then given the original's own
Parameters and submodules, so optimizers and anything else holding them keep working.
"""
from torch import nn

from .. import nn as fused
from .rules import Rule, register


def _layer_norm(module: nn.LayerNorm):
    new = fused.LayerNorm(module.normalized_shape, eps=module.eps,
                          elementwise_affine=module.elementwise_affine,
                          bias=module.bias is not None, device="meta")
    new.weight, new.bias = module.weight, module.bias
    return new


def _multihead_attention(module: nn.MultiheadAttention):
    new = fused.MultiheadAttention(module.embed_dim, module.num_heads, dropout=module.dropout,
                                   bias=module.in_proj_bias is not None,
                                   add_bias_kv=module.bias_k is not None,
                                   add_zero_attn=module.add_zero_attn, kdim=module.kdim,
                                   vdim=module.vdim, batch_first=module.batch_first, device="meta")
    for name in ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                 "in_proj_bias", "bias_k", "bias_v"):
        setattr(new, name, getattr(module, name))
    new.out_proj = module.out_proj
    return new


def _encoder_layer(module: nn.TransformerEncoderLayer):
    attn = _multihead_attention(module.self_attn)
    new = fused.TransformerEncoderLayer(module.linear1.in_features, module.self_attn.num_heads,
                                        module.linear1.out_features, activation=module.activation,
                                        batch_first=module.self_attn.batch_first,
                                        norm_first=module.norm_first, device="meta")
    new.self_attn = attn
    new.norm1, new.norm2 = _layer_norm(module.norm1), _layer_norm(module.norm2)
    for name in ("linear1", "linear2", "dropout", "dropout1", "dropout2"):
        setattr(new, name, getattr(module, name))
    return new


def _encoder(module: nn.TransformerEncoder):
    layers = [_encoder_layer(layer) if type(layer) is nn.TransformerEncoderLayer
              else f"layer of type {type(layer).__name__}" for layer in module.layers]
    whys = [f"layers.{i}: {why}" for i, why in enumerate(layers) if isinstance(why, str)]
    if whys:
        return "; ".join(whys)
    new = fused.TransformerEncoder(layers[0], 0, norm=module.norm,
                                   enable_nested_tensor=module.enable_nested_tensor,
                                   mask_check=module.mask_check)
    new.layers = nn.ModuleList(layers)
    new.num_layers = len(layers)
    return new


register(
    Rule("torch.nn.LayerNorm -> fusedlm.nn.LayerNorm", lambda m: type(m) is nn.LayerNorm,
         _layer_norm),
    Rule("torch.nn.MultiheadAttention -> fusedlm.nn.MultiheadAttention (fused where need_weights=False)",
         lambda m: type(m) is nn.MultiheadAttention, _multihead_attention),
    Rule("torch.nn.TransformerEncoderLayer -> fusedlm.nn.TransformerEncoderLayer",
         lambda m: type(m) is nn.TransformerEncoderLayer, _encoder_layer),
    Rule("torch.nn.TransformerEncoder -> fusedlm.nn.TransformerEncoder (packs tokens once per stack)",
         lambda m: type(m) is nn.TransformerEncoder, _encoder),
)
