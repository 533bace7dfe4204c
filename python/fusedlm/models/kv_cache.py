"""FusedKVCache: a transformers Cache whose decoding step is fusedlm.ops.attention_with_kvcache.

Each layer keeps its keys and values preallocated in flash-attn's layout, ``key_buffer``
and ``value_buffer`` [B, capacity, nh, hs] (B batch, nh heads, hs head size), which
attention_with_kvcache writes in place: a decoding step neither concatenates nor copies
the past. The first ``length`` positions hold tokens, the same number in every row (a
left-padded batch keeps its padding in the cache, and the attention mask marks it). When
a write would pass the capacity, the buffers are reallocated to twice their size;
``generate`` sizes them for its whole output up front, so it never reallocates.

To everything else a layer is a transformers DynamicLayer: ``keys`` and ``values`` are
[B, nh, S, hs] (S = length), here views of the buffers, and ``crop``,
``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``, ``reset``,
``get_seq_length`` and iterating over the cache behave as DynamicCache's.
"""
from typing import Optional

import torch
import transformers
from packaging.version import Version
from torch import Tensor
from transformers.cache_utils import Cache, CacheLayerMixin

from .. import ops

# transformers up to 5.17 reads crop(n > 0) as the length to keep (deprecated there);
# later releases refuse it.
POSITIVE_CROP_KEEPS = Version(transformers.__version__).release[:2] < (5, 18)


class FusedKVLayer(CacheLayerMixin):
    """One layer's keys and values: buffers [B, capacity, nh, hs], seen as [B, nh, S, hs]."""

    is_compileable = False  # it grows by reallocating, which a compiled graph cannot follow
    is_croppable = True
    is_sliding = False

    def __init__(self, max_cache_len: int = 0):
        # (Not CacheLayerMixin.__init__: it assigns keys and values, here views of the buffers.)
        self.is_initialized = False
        self.key_buffer: Optional[Tensor] = None
        self.value_buffer: Optional[Tensor] = None
        self.capacity = max_cache_len  # a hint until the first write allocates
        self.length = 0

    @property
    def keys(self) -> Optional[Tensor]:
        """The cached keys (B, nh, S, hs), as a DynamicLayer holds them: a view of key_buffer."""
        return None if self.key_buffer is None else self.key_buffer[:, :self.length].transpose(1, 2)

    @property
    def values(self) -> Optional[Tensor]:
        """The cached values (B, nh, S, hs): a view of value_buffer."""
        return None if self.value_buffer is None else self.value_buffer[:, :self.length].transpose(1, 2)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        # key_states/value_states in transformers' layout, (B, nh, T, hs): their batch,
        # heads, head sizes, dtype and device.
        B, nh, _, hs = key_states.shape
        self.device = key_states.device
        self.key_buffer = key_states.new_zeros(B, self.capacity, nh, hs)
        self.value_buffer = value_states.new_zeros(B, self.capacity, nh, value_states.shape[-1])
        self.is_initialized = True

    def _append(self, k: Tensor, v: Tensor) -> int:
        """Makes room for k, v (B, T, nh, hs) after the cached tokens; returns where they go."""
        if not self.is_initialized:
            self.lazy_initialization(k.transpose(1, 2), v.transpose(1, 2))
        start, end = self.length, self.length + k.shape[1]
        if end > self.key_buffer.shape[1]:
            self.key_buffer, self.value_buffer = (_grown(t, start, max(end, 2 * t.shape[1]))
                                                  for t in (self.key_buffer, self.value_buffer))
        self.length = end
        return start

    def attend(self, q: Tensor, k: Tensor, v: Tensor, cache_leftpad: Optional[Tensor],
               scale: float) -> Tensor:
        """q, k, v (B, T, nh, hs): writes k, v after the cached tokens and returns q's causal
        attention over them all (B, T, nh, hs); keys before cache_leftpad (int32 [B]) are
        padding. One fused op, no backward: for inference."""
        start = self._append(k, v)
        q, k, v = (t.to(self.key_buffer.dtype) for t in (q, k, v))
        seqlens = torch.full((q.shape[0],), start, dtype=torch.int32, device=q.device)
        return ops.attention_with_kvcache(q, self.key_buffer, self.value_buffer, seqlens, k, v,
                                          cache_leftpad=cache_leftpad, scale=scale)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple:
        """transformers' interface, for attention that does not run the fused step: appends
        key/value_states (B, nh, T, hs) and returns every cached key and value (B, nh, S, hs).
        The writes are differentiable, so a forward that needs gradients may use it."""
        start = self._append(key_states.transpose(1, 2), value_states.transpose(1, 2))
        self.key_buffer[:, start:self.length] = key_states.transpose(1, 2)
        self.value_buffer[:, start:self.length] = value_states.transpose(1, 2)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # it grows

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: removes -tokens_to_remove tokens from the end (crop(0) removes
        none). A positive count is the length to keep where transformers reads it so (up to
        5.17); later transformers refuse it, and so does this."""
        if tokens_to_remove > 0:
            if not POSITIVE_CROP_KEEPS:
                raise ValueError(f"crop({tokens_to_remove}): pass a negative count, the tokens to remove "
                                 f"from the end (transformers {transformers.__version__} refuses a "
                                 f"positive one)")
            tokens_to_remove = min(0, tokens_to_remove - self.length)
        self.length = max(0, self.length + tokens_to_remove)

    def reset(self) -> None:
        """Empties the layer as DynamicLayer.reset does (the next write may bring another batch
        size); the next allocation is as large as this one."""
        if self.is_initialized:
            self.capacity = self.key_buffer.shape[1]
        self.key_buffer = self.value_buffer = None
        self.length = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: Tensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        if self.is_initialized:
            indices = indices.to(self.device)
            self.key_buffer, self.value_buffer = (t.index_select(0, indices)
                                                  for t in (self.key_buffer, self.value_buffer))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.key_buffer, self.value_buffer = (t.repeat_interleave(repeats, dim=0)
                                                  for t in (self.key_buffer, self.value_buffer))

    def offload(self) -> None:
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self) -> None:
        if self.is_initialized and self.key_buffer.device != self.device:
            self._move(self.device)

    def _move(self, device) -> None:
        self.key_buffer, self.value_buffer = (t.to(device, non_blocking=True)
                                              for t in (self.key_buffer, self.value_buffer))


def _grown(buffer: Tensor, filled: int, capacity: int) -> Tensor:
    """buffer (B, old capacity, nh, hs) reallocated to capacity, its first `filled` positions kept."""
    grown = buffer.new_zeros(buffer.shape[0], capacity, *buffer.shape[2:])
    grown[:, :filled] = buffer[:, :filled]
    return grown


class FusedKVCache(Cache):
    """The cache of fusedlm's GPT-2: one FusedKVLayer per layer. ``max_cache_len``
    preallocates that many positions per layer (0: as many as the first write needs).
    Iterating yields (keys, values, None) per layer, as over a DynamicCache, so
    ``DynamicCache(fused_cache)`` copies one into the other."""

    def __init__(self, config, max_cache_len: int = 0):
        super().__init__(layers=[FusedKVLayer(max_cache_len) for _ in range(config.n_layer)])

    def __iter__(self):
        for layer in self.layers:
            yield layer.keys, layer.values, None
