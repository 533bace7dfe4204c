"""FusedKVCache: a transformers Cache whose decoding step is fusedlm.ops.attention_with_kvcache.

Each layer keeps its keys and values preallocated in flash-attn's layout, [B, capacity,
nh, hs] (B batch, nh heads, hs head size), which attention_with_kvcache writes in place:
a decoding step neither concatenates nor copies the past. The first ``length``
positions hold tokens, the same number in every row (a left-padded batch keeps its
padding in the cache, and the attention mask marks it). When a write would pass the
capacity, the buffers are reallocated to twice their size; ``generate`` sizes them for
its whole output up front, so it never reallocates.

transformers' Cache drives the rest: beam search's ``reorder_cache``, ``crop``,
``batch_repeat_interleave`` and ``batch_select_indices`` work on dimension 0, the
batch, in either layout.
"""
from typing import Optional

import torch
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import ops


class FusedKVLayer(CacheLayerMixin):
    """One layer's keys and values, [B, capacity, nh, hs] each."""

    is_compileable = False  # it grows by reallocating, which a compiled graph cannot follow
    is_croppable = True
    is_sliding = False

    def __init__(self, max_cache_len: int = 0):
        super().__init__()
        self.capacity = max_cache_len  # a hint until the first write allocates
        self.length = 0

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        # key_states/value_states in transformers' layout, (B, nh, T, hs): their batch,
        # heads, head sizes, dtype and device.
        B, nh, _, hs = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(B, self.capacity, nh, hs)
        self.values = value_states.new_zeros(B, self.capacity, nh, value_states.shape[-1])
        self.is_initialized = True

    def _append(self, k: Tensor, v: Tensor) -> int:
        """Makes room for k, v (B, T, nh, hs) after the cached tokens; returns where they go."""
        if not self.is_initialized:
            self.lazy_initialization(k.transpose(1, 2), v.transpose(1, 2))
        start, end = self.length, self.length + k.shape[1]
        if end > self.keys.shape[1]:
            self.keys, self.values = (_grown(t, start, max(end, 2 * t.shape[1]))
                                      for t in (self.keys, self.values))
        self.length = end
        return start

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache_leftpad: Optional[Tensor],
               scale: float) -> Tensor:
        """q, k, v (B, T, nh, hs): writes k, v after the cached tokens and returns q's causal
        attention over them all (B, T, nh, hs); keys before cache_leftpad (int32 [B]) are
        padding. One fused op, no backward: for inference."""
        start = self._append(k, v)
        q, k, v = (t.to(self.keys.dtype) for t in (q, k, v))
        seqlens = torch.full((q.shape[0],), start, dtype=torch.int32, device=q.device)
        return ops.attention_with_kvcache(q, self.keys, self.values, seqlens, k, v,
                                          cache_leftpad=cache_leftpad, scale=scale)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple:
        """transformers' interface, for attention that does not run the fused step: appends
        key/value_states (B, nh, T, hs) and returns every cached key and value (B, nh, S, hs).
        The writes are differentiable, so a forward that needs gradients may use it."""
        start = self._append(key_states.transpose(1, 2), value_states.transpose(1, 2))
        self.keys[:, start:self.length] = key_states.transpose(1, 2)
        self.values[:, start:self.length] = value_states.transpose(1, 2)
        return (self.keys[:, :self.length].transpose(1, 2),
                self.values[:, :self.length].transpose(1, 2))

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # it grows

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, max_length: int) -> None:
        """transformers' crop: keep the first max_length tokens; a negative max_length drops
        that many from the end."""
        if max_length < 0:
            max_length = self.length + max_length
        self.length = max(0, min(self.length, max_length))

    def reset(self) -> None:
        self.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.keys = self.keys.repeat_interleave(repeats, dim=0)
            self.values = self.values.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            self.keys, self.values = self.keys[indices], self.values[indices]


def _grown(buffer: Tensor, filled: int, capacity: int) -> Tensor:
    """buffer (B, old capacity, nh, hs) reallocated to capacity, its first `filled` positions kept."""
    grown = buffer.new_zeros(buffer.shape[0], capacity, *buffer.shape[2:])
    grown[:, :filled] = buffer[:, :filled]
    return grown


class FusedKVCache(Cache):
    """The cache of fusedlm's GPT-2: one FusedKVLayer per layer. ``max_cache_len``
    preallocates that many positions per layer (0: as many as the first write needs)."""

    def __init__(self, config, max_cache_len: int = 0):
        super().__init__(layers=[FusedKVLayer(max_cache_len) for _ in range(config.n_layer)])
