"""MultiheadAttention: a drop-in for torch.nn.MultiheadAttention on fusedlm's attention."""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops


class MultiheadAttention(nn.MultiheadAttention):
    """torch.nn.MultiheadAttention (same arguments, parameters, state_dict and forward),
    with the attention itself fused: the [batch, heads, seq_q, seq_k] scores are never
    stored.

    ``need_weights=True`` (torch's default) has to return those weights, so that call
    runs torch's own implementation and pays for them: O(batch * heads * seq_q * seq_k)
    memory and no fusion. Pass ``need_weights=False`` to get the fused path.

    Masks keep torch's meaning: ``key_padding_mask`` bool (True = ignore) or float
    (added); ``attn_mask`` [seq_q, seq_k] or [batch * heads, seq_q, seq_k], bool
    (True = not allowed) or float (added), becomes the op's ``attn_bias``.
    ``is_causal=True`` is taken as torch documents it, a promise that ``attn_mask`` is
    the causal mask: the mask is then not read (and may be None). Rows whose keys are
    all masked give zeros where torch gives NaN. ``add_bias_kv`` and ``add_zero_attn``
    are not supported.
    """


    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None):
        if add_bias_kv or add_zero_attn:
            raise ValueError("fusedlm.nn.MultiheadAttention does not support add_bias_kv or "
                             "add_zero_attn: use torch.nn.MultiheadAttention")
        super().__init__(embed_dim, num_heads, dropout=dropout, bias=bias, kdim=kdim, vdim=vdim,
                         batch_first=batch_first, device=device, dtype=dtype)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple:
        if need_weights:
            return super().forward(query, key, value, key_padding_mask=key_padding_mask,
                                   need_weights=True, attn_mask=attn_mask,
                                   average_attn_weights=average_attn_weights, is_causal=is_causal)
        if query.dim() not in (2, 3):
            raise ValueError(f"query must be [seq, embed_dim] or batched (3 dimensions), got shape "
                             f"{tuple(query.shape)}")
        batched = query.dim() == 3
        if not batched:  # an unbatched call is a batch of one
            batch_dim = 0 if self.batch_first else 1
            query, key, value = (t.unsqueeze(batch_dim) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        out = self._attend(query, key, value, key_padding_mask, attn_mask, is_causal)
        return (out if batched else out.squeeze(0 if self.batch_first else 1)), None

    def _attend(self, query, key, value, key_padding_mask, attn_mask, is_causal):
        q, k, v = self._project(query, key, value)  # each [batch, heads, seq, head_dim]
        batch, heads, seq_q, head_dim = q.shape
        seq_k = k.shape[2]
        if is_causal and seq_q != seq_k:
            raise ValueError(f"is_causal needs as many queries as keys, got {seq_q} and {seq_k}")
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
        """(attn_bias, bool key_padding_mask) for the op from torch's two masks."""
        batch, heads, seq_q, seq_k = full
        bias = None
        if attn_mask is not None and not is_causal:
            if attn_mask.dim() == 3:
                if tuple(attn_mask.shape) != (batch * heads, seq_q, seq_k):
                    raise ValueError(f"attn_mask must have shape {(seq_q, seq_k)} or "
                                     f"{(batch * heads, seq_q, seq_k)}, got {tuple(attn_mask.shape)}")
                attn_mask = attn_mask.view(batch, heads, seq_q, seq_k)
            elif tuple(attn_mask.shape) != (seq_q, seq_k):
                raise ValueError(f"attn_mask must have shape {(seq_q, seq_k)} or "
                                 f"{(batch * heads, seq_q, seq_k)}, got {tuple(attn_mask.shape)}")
            bias = _additive(attn_mask, dtype)
        if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
            if tuple(key_padding_mask.shape) != (batch, seq_k):
                raise ValueError(f"key_padding_mask must have shape {(batch, seq_k)}, got "
                                 f"{tuple(key_padding_mask.shape)}")
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
                           scale: Optional[float] = None, dropout_p: float = 0.0) -> tuple:
    """(softmax(q k^T * scale, masked) with dropout @ v, the attention weights), for q/k/v
    [batch, heads, seq, head_dim]: the plain-PyTorch path for callers that ask to see the
    weights, which the fused kernels never materialise. key_padding_mask is bool [batch,
    seq_k], True = padding; attn_mask, broadcastable to the scores [batch, heads, seq_q,
    seq_k], is bool (True = may attend, as SDPA's) or added to the scores. Masked scores
    take the dtype's lowest value, as transformers' eager attention does, so a row with
    every key masked is uniform."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [batch, heads, seq_q, seq_k]
    lowest = torch.finfo(scores.dtype).min
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(seq_k - seq_q + 1)
        scores = scores.masked_fill(future, lowest)
    if key_padding_mask is not None:
        scores = scores.masked_fill(key_padding_mask[:, None, None, :], lowest)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, lowest)
    elif attn_mask is not None:
        scores = scores + attn_mask.to(scores.dtype)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(F.dropout(weights, dropout_p), v), weights
