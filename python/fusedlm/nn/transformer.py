"""TransformerEncoderLayer and TransformerEncoder: drop-ins for torch.nn's, on fusedlm's ops.

A layer is attention, then an FFN, each a residual branch with dropout, and a
LayerNorm after each (post-LN, BERT) or before each (pre-LN, GPT-2). Here each
branch's dropout, residual add and LayerNorm are one add_layer_norm, the attention
is fused, and a GELU FFN is one gelu_ffn.

With a bool ``src_key_padding_mask`` the tokens are packed (fusedlm.ops.unpad) and
every product skips the padding; a TransformerEncoder packs once for its whole
stack. Outputs at padding positions then are zeros (torch computes values there
that no real token can see, or zeros in its nested-tensor fast path); every other
output, and so the gradients of any loss over real tokens, match torch's.
"""
import copy
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ._checks import check_mask, check_shape, sequence_dims
from ._eager import EagerModule
from .attention import MultiheadAttention
from .ffn import linear_gelu_linear
from .layer_norm import LayerNorm
from .stack import run_stack

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


class TransformerEncoderLayer(EagerModule, nn.Module):
    """torch.nn.TransformerEncoderLayer: same arguments, submodule and parameter names
    (``self_attn.in_proj_weight``, ``linear1``, ``linear2``, ``norm1``, ``norm2``, ...),
    so state_dicts load both ways, and the same ``forward(src, src_mask,
    src_key_padding_mask, is_causal)``.

    ``activation`` is "relu", "gelu" or any callable, kept as torch keeps it (a module
    such as ``nn.GELU()`` is a submodule). A GELU (F.gelu, or an ``nn.GELU`` of either
    ``approximate``) runs fused with the two products in one gelu_ffn; anything else
    runs as torch's Linear-activation-Linear. With a bool ``src_key_padding_mask`` the
    activation sees the packed tokens, [tokens, dim_feedforward]. ``is_causal=True`` is
    trusted, as torch documents, to mean that ``src_mask`` is the causal mask; it may
    then be None.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: Union[str, Callable[[Tensor], Tensor]] = F.relu,
                 layer_norm_eps: float = 1e-5, batch_first: bool = False, norm_first: bool = False,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.self_attn = MultiheadAttention(d_model, nhead, dropout=dropout, bias=bias,
                                            batch_first=batch_first, **factory)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.norm2 = LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = _activation(activation)  # last, as torch registers it

    def forward(self, src: Tensor, src_mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None, is_causal: bool = False) -> Tensor:
        self._check_inputs(src, src_mask, src_key_padding_mask, mask_name="src_mask")
        if _packable(src_mask, src_key_padding_mask, is_causal):
            return _packed_stack([self], src, src_key_padding_mask, is_causal,
                                 self.self_attn.batch_first)

        def attend(x):
            return self.self_attn(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                                  need_weights=False, is_causal=is_causal)[0]
        return self._layer(src, attend)

    def _check_inputs(self, src, mask, key_padding_mask, *, mask_name: str) -> None:
        """The shapes torch's layer accepts (fusedlm.nn._checks)."""
        if isinstance(src, Tensor) and src.is_nested:
            raise TypeError("src must be a padded tensor, not a NestedTensor: with a bool "
                            "src_key_padding_mask fusedlm packs the real tokens itself")
        attn = self.self_attn
        batched = not (isinstance(src, Tensor) and src.dim() == 2)
        width = ("d_model", attn.embed_dim)
        check_shape("src", src, sequence_dims(batched, attn.batch_first, None, "seq", width),
                    f" or, unbatched, (seq, d_model={attn.embed_dim})" if batched else "")
        seq = src.shape[1 if batched and attn.batch_first else 0]
        batch = src.shape[0 if attn.batch_first else 1] if batched else None
        if key_padding_mask is not None:
            check_mask("src_key_padding_mask", key_padding_mask,
                       {(batch, seq): "(batch, seq)"} if batched else {(seq,): "(seq,)"})
        if mask is not None:
            heads = (batch if batched else 1) * attn.num_heads
            check_mask(mask_name, mask, {
                (seq, seq): "(seq, seq)",
                (heads, seq, seq): "(batch * nhead, seq, seq)" if batched else "(nhead, seq, seq)"})

    def forward_packed(self, x: Tensor, cu_seqlens: Tensor, max_seqlen, is_causal: bool = False) -> Tensor:
        """The layer over packed sequences x [tokens, d_model], as fusedlm.ops.unpad gives them."""
        return self._layer(x, lambda h: self.self_attn._self_attend_packed(h, cu_seqlens, max_seqlen,
                                                                          is_causal))

    def _layer(self, x: Tensor, attend: Callable[[Tensor], Tensor]) -> Tensor:
        p1, p2 = self._p(self.dropout1), self._p(self.dropout2)
        if self.norm_first:
            h, x = self.norm2(attend(self.norm1(x)), x, dropout_p=p1)
            return x + F.dropout(self._ffn(h), p2, self.training)
        x, _ = self.norm1(attend(x), x, dropout_p=p1)
        out, _ = self.norm2(self._ffn(x), x, dropout_p=p2)
        return out

    def _ffn(self, x: Tensor) -> Tensor:
        approximate = _fused_gelu(self.activation)
        if approximate is not None:
            return linear_gelu_linear(x, self.linear1, self.linear2, approximate=approximate,
                                      dropout_p=self._p(self.dropout))
        return self.linear2(self.dropout(self.activation(self.linear1(x))))

    def _p(self, dropout: nn.Dropout) -> float:
        return dropout.p if self.training else 0.0


class TransformerEncoder(EagerModule, nn.Module):
    """torch.nn.TransformerEncoder over fusedlm.nn.TransformerEncoderLayer: same arguments,
    ``layers.<i>.`` and ``norm.`` parameter names and forward. With a bool
    ``src_key_padding_mask`` the stack packs the tokens once and unpacks them after
    the last layer, for any padding pattern. ``enable_nested_tensor`` and ``mask_check``
    are accepted for compatibility; the packing replaces torch's nested tensors.
    """

    def __init__(self, encoder_layer: "TransformerEncoderLayer", num_layers: int,
                 norm: Optional[nn.Module] = None, enable_nested_tensor: bool = True,
                 mask_check: bool = True):
        super().__init__()
        if not isinstance(encoder_layer, TransformerEncoderLayer):
            raise TypeError(f"encoder_layer must be a fusedlm.nn.TransformerEncoderLayer, got "
                            f"{type(encoder_layer).__name__}")
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.norm = norm
        self.enable_nested_tensor = enable_nested_tensor
        self.mask_check = mask_check

    def forward(self, src: Tensor, mask: Optional[Tensor] = None,
                src_key_padding_mask: Optional[Tensor] = None,
                is_causal: Optional[bool] = None) -> Tensor:
        self.layers[0]._check_inputs(src, mask, src_key_padding_mask, mask_name="mask")
        batch_first = self.layers[0].self_attn.batch_first
        if is_causal is None:  # as torch: a mask equal to the causal mask is taken as one
            is_causal = _is_causal_mask(mask, src.shape[1 if src.dim() == 3 and batch_first else 0])
        if _packable(mask, src_key_padding_mask, is_causal):
            out = _packed_stack(self.layers, src, src_key_padding_mask, is_causal, batch_first)
        else:
            out = src
            for layer in self.layers:
                out = layer(out, src_mask=mask, src_key_padding_mask=src_key_padding_mask,
                            is_causal=is_causal)
        return out if self.norm is None else self.norm(out)


def _activation(activation):
    """The activation as torch's layer keeps it: a name becomes F.relu or F.gelu."""
    if isinstance(activation, str):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
        return ACTIVATIONS[activation]
    if not callable(activation):
        raise TypeError(f"activation must be 'relu', 'gelu' or a callable, got {activation!r}")
    return activation


def _fused_gelu(activation) -> Optional[str]:
    """gelu_ffn's ``approximate`` for an activation that is exactly a GELU it computes, or
    None: an nn.GELU counts when it is not a subclass and no hook watches it."""
    if activation is F.gelu:
        return "none"
    if (type(activation) is nn.GELU and activation.approximate in ("none", "tanh")
            and not activation._forward_hooks and not activation._forward_pre_hooks):
        return activation.approximate
    return None


def _packable(attn_mask, key_padding_mask, is_causal) -> bool:
    """Whether a call can run on packed tokens: a bool padding mask and no mask but causal."""
    return (key_padding_mask is not None and key_padding_mask.dtype == torch.bool
            and (attn_mask is None or is_causal))


def _packed_stack(layers, src: Tensor, key_padding_mask: Tensor, is_causal: bool,
                  batch_first: bool) -> Tensor:
    batched = src.dim() == 3
    if batched:
        x = src if batch_first else src.transpose(0, 1)  # [batch, seq, d_model]
    else:  # an unbatched call is a batch of one
        x, key_padding_mask = src.unsqueeze(0), key_padding_mask.unsqueeze(0)

    def step(layer, h, packing):
        return layer.forward_packed(h, *packing, is_causal)
    out, _ = run_stack(layers, x, key_padding_mask, step=step)
    if not batched:
        return out.squeeze(0)
    return out if batch_first else out.transpose(0, 1)


def _is_causal_mask(mask: Optional[Tensor], seq: int) -> bool:
    if mask is None or tuple(mask.shape) != (seq, seq):
        return False
    causal = nn.Transformer.generate_square_subsequent_mask(seq, device=mask.device)
    if mask.dtype == torch.bool:
        return bool(torch.equal(mask, causal.isinf()))
    return bool(torch.equal(mask, causal.to(mask.dtype)))
