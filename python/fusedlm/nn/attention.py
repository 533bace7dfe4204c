"""MultiheadAttention: a drop-in for torch.nn.MultiheadAttention on fusedlm's attention."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..ops.attention import visible_keys
from ._checks import check_mask, check_shape, sequence_dims
from ._eager import EagerModule


class MultiheadAttention(EagerModule, nn.MultiheadAttention):
    """torch.nn.MultiheadAttention (same arguments, parameters, state_dict and forward),
    with the attention itself fused: the [batch, heads, seq_q, seq_k] scores are never
    stored.

    ``need_weights=True`` (torch's default) has to return those weights, so that call
    runs torch's own implementation and pays for them: O(batch * heads * seq_q * seq_k)
    memory and no fusion. Pass ``need_weights=False`` to get the fused path. A module
    built with ``add_bias_kv`` or ``add_zero_attn`` (the extra key and value positions
    they append) runs torch's implementation on every call, and so do NestedTensor
    inputs (which torch takes in its inference fast path).

    Masks keep torch's meaning: ``key_padding_mask`` bool (True = ignore) or float
    (added); ``attn_mask`` [seq_q, seq_k] or [batch * heads, seq_q, seq_k], bool
    (True = not allowed) or float (added), becomes the op's ``attn_bias``.
    ``is_causal=True`` is taken as torch documents it, a promise that ``attn_mask`` is
    the causal mask: the mask is then not read (and may be None). Rows whose keys are
    all masked give zeros where torch gives NaN.
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple:
        if need_weights or self._unfused(query, key, value):
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=need_weights, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal)
        self._check_inputs(query, key, value, key_padding_mask, attn_mask, is_causal)
        batched = query.dim() == 3
        if not batched:  # an unbatched call is a batch of one
            batch_dim = 0 if self.batch_first else 1
            query, key, value = (t.unsqueeze(batch_dim) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        out = self._attend(query, key, value, key_padding_mask, attn_mask, is_causal)
        return (out if batched else out.squeeze(0 if self.batch_first else 1)), None

    def _unfused(self, query, key, value) -> bool:
        """Whether the call needs what only torch's implementation has: the key and value
        positions of add_bias_kv and add_zero_attn, or NestedTensor inputs."""
        nested = any(isinstance(t, Tensor) and t.is_nested for t in (query, key, value))
        return nested or self.bias_k is not None or self.add_zero_attn

    def _check_inputs(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        """The shapes torch accepts (fusedlm.nn._checks)."""
        batched = not (isinstance(query, Tensor) and query.dim() == 2)

        def dims(batch, seq, width):
            return sequence_dims(batched, self.batch_first, batch, seq, width)
        check_shape("query", query, dims(None, "seq_q", ("embed_dim", self.embed_dim)),
                    f" or, unbatched, (seq_q, embed_dim={self.embed_dim})" if batched else "")
        batch = query.shape[0 if self.batch_first else 1] if batched else None
        whose = " for a batched query" if batched else " for an unbatched query"
        check_shape("key", key, dims(batch, "seq_k", ("kdim", self.kdim)), whose)
        seq_dim = 1 if batched and self.batch_first else 0
        seq_q, seq_k = query.shape[seq_dim], key.shape[seq_dim]
        check_shape("value", value, dims(batch, ("seq_k", seq_k), ("vdim", self.vdim)), whose)
        if is_causal and seq_q != seq_k:
            raise ValueError(f"is_causal needs as many queries as keys, got {seq_q} and {seq_k}")
        if key_padding_mask is not None:
            check_mask("key_padding_mask", key_padding_mask,
                       {(batch, seq_k): "(batch, seq_k)"} if batched else {(seq_k,): "(seq_k,)"})
        if attn_mask is not None:
            heads = (batch if batched else 1) * self.num_heads
            check_mask("attn_mask", attn_mask, {
                (seq_q, seq_k): "(seq_q, seq_k)",
                (heads, seq_q, seq_k): ("(batch * num_heads, seq_q, seq_k)" if batched
                                        else "(num_heads, seq_q, seq_k)")})

    def _attend(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        q, k, v = self._project(query, key, value)  # each [batch, heads, seq, head_dim]
        batch, heads, seq_q, head_dim = q.shape
        seq_k = k.shape[2]
        bias, key_padding_mask = self._bias(attn_mask, key_padding_mask, is_causal, q.dtype,
                                            (batch, heads, seq_q, seq_k))
        out = ops.attention(q, k, v, causal=is_causal, key_padding_mask=key_padding_mask,
                            attn_bias=bias, dropout_p=self.dropout if self.training else 0.0)
        # out is laid out like q, i.e. like the projection's [.., seq, .., heads, head_dim].
        out = out.transpose(1, 2) if self.batch_first else out.permute(2, 0, 1, 3)
        return F.linear(out.flatten(2), self.out_proj.weight, self.out_proj.bias)

    def _self_attend_packed(self, x: Tensor, cu_seqlens: Tensor, max_seqlen, causal: bool) -> Tensor:
        """Self-attention over packed sequences x [tokens, embed_dim] (fusedlm.ops.unpad's
        layout): no work is spent on padding."""
        qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(1)
        out = ops.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                   causal=causal, dropout_p=self.dropout if self.training else 0.0)
        return F.linear(out.flatten(1), self.out_proj.weight, self.out_proj.bias)

    def _project(self, query, key, value):
        """q, k, v as [batch, heads, seq, head_dim] views of the input projections."""
        weight, bias = self.in_proj_weight, self.in_proj_bias
        if weight is not None and query is key and key is value:  # self-attention: one product
            qkv = F.linear(query, weight, bias).unflatten(-1, (3, self.num_heads, self.head_dim))
            projected = qkv.unbind(-3)
        else:
            weights = ((self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
                       if weight is None else weight.chunk(3))
            biases = (None,) * 3 if bias is None else bias.chunk(3)
            projected = [F.linear(x, w, b).unflatten(-1, (self.num_heads, self.head_dim))
                         for x, w, b in zip((query, key, value), weights, biases)]
        if self.batch_first:  # [batch, seq, heads, dim]
            return [t.transpose(1, 2) for t in projected]
        return [t.permute(1, 2, 0, 3) for t in projected]  # from [seq, batch, heads, dim]

    @staticmethod
    def _bias(attn_mask, key_padding_mask, is_causal, dtype, full):
        """(attn_bias, bool key_padding_mask) for the op from torch's two masks, whose
        shapes _check_inputs has checked."""
        batch, heads, seq_q, seq_k = full
        bias = None
        if attn_mask is not None and not is_causal:
            if attn_mask.dim() == 3:
                attn_mask = attn_mask.view(batch, heads, seq_q, seq_k)
            bias = _additive(attn_mask, dtype)
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            padding = key_padding_mask.to(dtype).view(batch, 1, 1, seq_k)
            bias = padding if bias is None else bias + padding
            key_padding_mask = None
        return bias, key_padding_mask


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A torch attention mask as an additive bias: bool True (not allowed) becomes -inf."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def attention_with_weights(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False,
                           key_padding_mask: Optional[Tensor] = None, attn_mask: Optional[Tensor] = None,
                           attn_bias: Optional[Tensor] = None, scale: Optional[float] = None,
                           dropout_p: float = 0.0, window_size: tuple = (-1, -1),
                           softcap: Optional[float] = None,
                           softmax_dtype: Optional[torch.dtype] = None) -> tuple:
    """(softmax(q k^T * scale, masked) with dropout @ v, the attention weights), for q/k/v
    [batch, heads, seq, head_dim] (k and v may have fewer heads, a divisor of q's: each
    serves a group of query heads): the plain-PyTorch path for callers that ask to see the
    weights, which the fused kernels never materialise. The scores are softcapped
    (softcap * tanh(s / softcap)) where ``softcap`` is given, then take ``attn_bias`` and
    ``attn_mask`` (broadcastable to [batch, heads, seq_q, seq_k]; a bool mask is True =
    may attend, as SDPA's, any other is added); key_padding_mask is bool [batch, seq_k],
    True = padding; ``causal`` and ``window_size`` (keys left and right of the diagonal,
    -1 unbounded) are aligned to the bottom right. Masked scores take the dtype's lowest
    value, as transformers' eager attention does, so a row with every key masked is
    uniform. The softmax runs in ``softmax_dtype`` (default the scores'), the weights
    return in q's dtype."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [batch, heads, seq_q, seq_k]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attn_bias is not None:
        scores = scores + attn_bias.to(scores.dtype)
    lowest = torch.finfo(scores.dtype).min
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, lowest)
    elif attn_mask is not None:
        scores = scores + attn_mask.to(scores.dtype)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], lowest)
    visible = visible_keys(scores.shape[-2], scores.shape[-1], causal, window_size, q.device)
    if visible is not None:
        scores = scores.masked_fill(~visible, lowest)
    weights = torch.softmax(scores, dim=-1, dtype=softmax_dtype).to(q.dtype)
    return torch.matmul(F.dropout(weights, dropout_p), v), weights
