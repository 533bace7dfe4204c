"""fusedlm as a Hugging Face attention implementation: ``config._attn_implementation = "fusedlm"``.

Attention modules of transformers 5 (and the 4.5x releases that have its
AttentionInterface) project q, k and v themselves and hand them to the function
registered under their config's implementation name; this module registers
fusedlm's. Its mask function keeps a plain padding mask compact, as a bool
[batch, 1, 1, seq_k] (True = attend): the attention function reads that shape as
a key_padding_mask, plus causal when the module is causal. Every other mask
(caches, offsets, custom mask functions) is materialised as SDPA's is and runs
as an additive bias, with causality already inside it.

A call that asks for the attention weights (``output_attentions=True``) runs the plain
softmax(q k^T * scale + mask) v of transformers' eager attention instead, which builds
them: fused attention never does.
"""
from typing import Optional

import torch
from torch import Tensor, nn

from ... import ops
from ...nn.attention import attention_with_weights

try:  # imported here, not where it is used: torch 2.11's compiler cannot trace the import
    from transformers import masking_utils
except ImportError:  # transformers < 4.53: register() says why
    masking_utils = None
try:  # transformers 5 records the weights from the attention modules' outputs (below)
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # earlier releases pass output_attentions down to the attention function
    _active_collector = None

NAME = "fusedlm"
MARK = "_fusedlm_attention"  # set on an attention module patched to call attention_forward


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                      dropout: float = 0.0, **kwargs):
    """q/k/v [batch, heads, seq, head_dim] -> ([batch, seq, heads, head_dim], the weights
    [batch, heads, seq_q, seq_k] when the caller asks for them, else None)."""
    if kwargs.get("head_mask") is not None:
        raise ValueError("fusedlm attention does not take a head_mask: patch the model without it")
    causal = bool(getattr(module, "is_causal", False))
    if _weights_wanted(kwargs):
        return _eager(query, key, value, attention_mask, causal, scaling, dropout)
    key_padding_mask = attn_bias = None
    if attention_mask is not None:
        if _is_compact(attention_mask):
            key_padding_mask = ~attention_mask[:, 0, 0, :]
        else:
            causal = False
            attn_bias = _additive(attention_mask, query.dtype)
    out = ops.attention(query, key, value, causal=causal, key_padding_mask=key_padding_mask,
                        attn_bias=attn_bias, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2), None


def _weights_wanted(kwargs) -> bool:
    """Whether this call's caller asked for the attention weights. transformers 5 keeps
    them while its collector is gathering "attentions" (GPT-2 does not pass
    output_attentions on to the attention function; BERT does)."""
    if kwargs.get("output_attentions"):
        return True
    collecting = _active_collector.get() if _active_collector is not None else None
    return bool(collecting) and "attentions" in collecting


def _eager(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], causal: bool,
           scaling: Optional[float], dropout: float):
    """transformers' eager attention on either mask (SDPA's full masks hold causality)."""
    out, weights = attention_with_weights(query, key, value, attn_mask=mask, scale=scaling,
                                          causal=causal and (mask is None or _is_compact(mask)),
                                          dropout_p=dropout)
    return out.transpose(1, 2), weights


def _is_compact(mask: Tensor) -> bool:
    """compact_mask's padding mask, bool [batch, 1, 1, seq_k]."""
    return mask.dtype == torch.bool and mask.shape[1:3] == (1, 1)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    # -inf rather than the dtype's minimum: a row with every key masked is then zeros
    # (fusedlm's convention) instead of a uniform average over padding.
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def compact_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=None, attention_mask: Optional[Tensor] = None, **kwargs):
    """transformers' mask interface: the compact padding mask where it is enough, else SDPA's."""
    mu = masking_utils
    plain = mask_function in (mu.causal_mask_function, mu.bidirectional_mask_function)
    if plain and q_length == kv_length and _is_zero(q_offset) and _is_zero(kv_offset):
        if attention_mask is None:
            return None
        return attention_mask[:, None, None, :kv_length].to(torch.bool)
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, **kwargs)


def _is_zero(offset) -> bool:
    return isinstance(offset, int) and offset == 0


def register() -> Optional[str]:
    """Registers the "fusedlm" implementation; returns why it cannot, or None."""
    import transformers

    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError:
        AttentionInterface = None
    if masking_utils is None or AttentionInterface is None:
        return (f"transformers {transformers.__version__} has no AttentionInterface/masking_utils "
                f"(fusedlm patches the attention of transformers >= 4.53)")
    AttentionInterface.register(NAME, attention_forward)
    masking_utils.AttentionMaskInterface.register(NAME, compact_mask)
    return None
