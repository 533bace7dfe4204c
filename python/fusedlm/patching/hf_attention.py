"""fusedlm as a Hugging Face attention implementation: ``attn_implementation="fusedlm"``.

Attention modules of transformers 5 (and the 4.5x releases that have its
AttentionInterface) project q, k and v themselves and hand them to the function
registered under their config's implementation name; this module registers fusedlm's
(``import fusedlm`` does, once transformers is imported: transformers_hook.py).

The contract is FlashAttention's in transformers: a padding mask, the module's causality
and its ``sliding_window`` describe the attention. The mask function keeps a padding mask
compact, as a bool [batch, 1, 1, seq_k] (True = attend), wherever transformers' mask is
that padding combined with a causal or bidirectional pattern, plain or in a sliding
window, aligned to the bottom right (a prefill, or a decoding step over a cache that
keeps every key). The attention function reads that shape as a key_padding_mask plus
causal when the module is causal and the window its ``sliding_window`` gives (inclusive
on both sides, ``sliding_window - 1`` keys, as flash_attention_2 reads it). Every other
mask (custom mask functions, packed sequences, caches that drop keys) is materialised as
SDPA's is and runs as an additive bias, with causality and the window already inside it.
Grouped key/value heads are read in place.

What the fused kernels never compute runs the plain softmax(q k^T * scale + mask) v of
transformers' eager attention instead, with one warning naming the reason: a call that
asks for the attention weights (``output_attentions=True``), logit softcapping (Gemma 2),
an additive ``position_bias``. Attention sinks (``s_aux``) and a ``head_mask`` are refused.
"""
import warnings
from typing import Optional

import torch
from torch import Tensor, nn

from .. import ops
from ..nn.attention import attention_with_weights

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
_WARNED: set = set()


def attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                      attention_mask: Optional[Tensor], dropout: float = 0.0,
                      scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                      **kwargs):
    """q [batch, heads, seq, head_dim], k/v [batch, kv_heads, seq_k, head_dim] ->
    ([batch, seq, heads, head_dim], the weights [batch, heads, seq_q, seq_k] when the
    caller asks for them, else None)."""
    for name, what in (("head_mask", "a head_mask"), ("s_aux", "attention sinks (s_aux)")):
        if kwargs.get(name) is not None:
            raise ValueError(f"fusedlm attention does not take {what}: load the model with "
                             f"attn_implementation='eager'")
    # As SDPA's: the call's is_causal, else the module's (decoders by default).
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    compact = attention_mask is None or _is_compact(attention_mask)
    window = _window(kwargs.get("sliding_window")) if compact else (-1, -1)
    plain_why = _plain_reason(kwargs)
    if plain_why is not None:
        _warn_once(plain_why)
        return _plain(query, key, value, attention_mask, causal and compact, window, scaling,
                      dropout, kwargs.get("softcap"), kwargs.get("position_bias"))
    key_padding_mask = attn_bias = None
    if not compact:
        causal = False
        attn_bias = _additive(attention_mask, query.dtype)
    elif attention_mask is not None:
        key_padding_mask = ~attention_mask[:, 0, 0, :]
    out = ops.attention(query, key, value, causal=causal, key_padding_mask=key_padding_mask,
                        attn_bias=attn_bias, dropout_p=dropout, scale=scaling, window_size=window)
    return out.transpose(1, 2), None


def _window(sliding_window) -> tuple:
    """flash_attention_2's reading of a module's sliding_window: the keys within
    sliding_window - 1 positions on either side (causality then cuts the right one)."""
    if sliding_window is None:
        return (-1, -1)
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    return (sliding_window - 1, sliding_window - 1)


def _plain_reason(kwargs) -> Optional[str]:
    """Why this call runs the plain attention instead of the kernels, or None."""
    if _weights_wanted(kwargs):
        return "output_attentions=True asks for the attention weights, which fused attention never forms"
    if kwargs.get("softcap") is not None:
        return "logit softcapping (softcap) is not fused"
    if kwargs.get("position_bias") is not None:
        return "a position_bias is not fused"
    return None


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"fusedlm attention: {reason}; these calls run plain PyTorch attention",
                      stacklevel=3)


def _weights_wanted(kwargs) -> bool:
    """Whether this call's caller asked for the attention weights. transformers 5 keeps
    them while its collector is gathering "attentions" (GPT-2 does not pass
    output_attentions on to the attention function; BERT does)."""
    if kwargs.get("output_attentions"):
        return True
    collecting = _active_collector.get() if _active_collector is not None else None
    return bool(collecting) and "attentions" in collecting


def _plain(query: Tensor, key: Tensor, value: Tensor, mask: Optional[Tensor], causal: bool,
           window: tuple, scaling: Optional[float], dropout: float, softcap=None,
           position_bias=None):
    """transformers' eager attention: softmax in float32 of the (softcapped) scores plus the
    position_bias and the mask, masked scores at the dtype's lowest value (a row with every
    key masked is uniform, as there), grouped key/value heads repeated."""
    out, weights = attention_with_weights(query, key, value, causal=causal, attn_mask=mask,
                                          attn_bias=position_bias, scale=scaling,
                                          dropout_p=dropout, window_size=window, softcap=softcap,
                                          softmax_dtype=torch.float32)
    return out.transpose(1, 2), weights


def _is_compact(mask: Tensor) -> bool:
    """compact_mask's padding mask, bool [batch, 1, 1, seq_k]."""
    return mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1:3] == (1, 1)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    # -inf rather than the dtype's minimum: a row with every key masked is then zeros
    # (fusedlm's convention) instead of a uniform average over padding.
    if mask.dtype == torch.bool:
        return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return mask.to(dtype)


def compact_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=None, attention_mask: Optional[Tensor] = None,
                 local_size: Optional[int] = None, use_vmap: bool = False,
                 allow_is_causal_skip: bool = True, allow_is_bidirectional_skip: bool = False,
                 **kwargs):
    """transformers' mask interface: the compact padding mask where it is enough, else SDPA's."""
    mu = masking_utils
    plain = mask_function in (mu.causal_mask_function, mu.bidirectional_mask_function)
    # A sliding-window mask transformers built with no mask function of the caller's
    # (use_vmap) and no packed sequences (which turn both skips off).
    windowed = (local_size is not None and not use_vmap
                and (allow_is_causal_skip or allow_is_bidirectional_skip))
    # Queries aligned to the bottom right of keys that start at position 0.
    aligned = (_is_int(q_offset) and _is_int(kv_offset) and kv_offset == 0
               and q_offset == kv_length - q_length)
    if (plain or windowed) and aligned:
        if attention_mask is None:
            return None
        return attention_mask[:, None, None, :kv_length].to(torch.bool)
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, local_size=local_size, use_vmap=use_vmap,
                        allow_is_causal_skip=allow_is_causal_skip,
                        allow_is_bidirectional_skip=allow_is_bidirectional_skip, **kwargs)


def _is_int(offset) -> bool:
    return isinstance(offset, int) and not isinstance(offset, bool)


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
