"""GPT (the GPT-2 architecture) on fusedlm's ops, with checkpoints in transformers' layout.

Pre-LN blocks whose residual adds are fused into the next LayerNorm: a block takes the
residual stream and the previous sublayer's output x, and ``add_layer_norm`` returns
both LayerNorm(dropout(x) + residual) and the new stream. Attention is
``fusedlm.ops.attention`` (causal), the MLP ``fusedlm.ops.gelu_ffn`` (GELU tanh), the
training loss ``fusedlm.ops.masked_lm_loss`` against the tied embedding, which never
builds the [tokens, vocab] logits. ``generate`` decodes over a static KV cache with
``fusedlm.ops.attention_with_kvcache``.

Shapes: B batch, T tokens, C n_embd, nh heads, hs head size (C = nh * hs), V vocab.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .. import ops
from ..nn._autocast import lower, widen
from ._pretrained import Config, KeyMap, KeyRule, PreTrainedModel
from .outputs import CausalLMOutput, ModelOutput


@dataclasses.dataclass
class GPTConfig(Config):
    """transformers' GPT2Config fields (and defaults: GPT-2 small)."""

    model_type = "gpt2"
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: Optional[int] = None  # None: 4 * n_embd
    activation_function: str = "gelu_new"
    resid_pdrop: float = 0.1
    embd_pdrop: float = 0.1
    attn_pdrop: float = 0.1
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    bos_token_id: int = 50256
    eos_token_id: int = 50256
    scale_attn_weights: bool = True  # False: scores are q.k, unscaled
    scale_attn_by_inverse_layer_idx: bool = False  # layer i's scores also divided by i + 1
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if not self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings must be True: GPT's head is its token embedding")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        # GPT-2's "gelu_new" and "gelu_pytorch_tanh" are both the tanh approximation.
        if self.activation_function not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"activation_function must be 'gelu_new' or 'gelu_pytorch_tanh', "
                             f"got {self.activation_function!r}")


@dataclasses.dataclass
class KVCache:
    """A static cache for generation: keys and values [n_layer, B, max_len, nh, hs] each,
    the tokens already in it per sequence (int32 [B]), and each sequence's left padding."""

    keys: Tensor
    values: Tensor
    seqlens: Tensor
    leftpad: Optional[Tensor] = None

    @classmethod
    def empty(cls, config: GPTConfig, batch: int, max_len: int, like: Tensor,
              leftpad: Optional[Tensor] = None) -> "KVCache":
        shape = (config.n_layer, batch, max_len, config.n_head, config.n_embd // config.n_head)
        return cls(like.new_zeros(shape), like.new_zeros(shape),
                   torch.zeros(batch, dtype=torch.int32, device=like.device), leftpad)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.dropout = config.attn_pdrop
        self.scale = (config.n_embd // config.n_head) ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= layer + 1

    def forward(self, x: Tensor, padding: Optional[Tensor], cache: Optional[KVCache],
                layer: int) -> Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head)
        q, k, v = qkv.unbind(2)  # (B, T, nh, hs)
        if cache is None:
            y = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True,
                              key_padding_mask=padding, scale=self.scale,
                              dropout_p=self.dropout if self.training else 0.0)  # (B, nh, T, hs)
            y = y.transpose(1, 2)
        else:
            keys, values = cache.keys[layer], cache.values[layer]  # (B, max_len, nh, hs)
            q, k, v = (t.to(keys.dtype) for t in (q, k, v))
            y = ops.attention_with_kvcache(q, keys, values, cache.seqlens, k, v,
                                           cache_leftpad=cache.leftpad, scale=self.scale)
        return self.c_proj(y.reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, inner)
        self.c_proj = nn.Linear(inner, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        x, w1, b1, w2, b2 = lower(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                                  self.c_proj.bias)
        return ops.gelu_ffn(x, w1, b1, w2, b2, approximate="tanh")


class LayerNorm(nn.LayerNorm):
    """LayerNorm(dropout(x) + residual), returning the sum too: the residual add fused in."""

    def forward(self, x: Tensor, residual: Optional[Tensor], dropout_p: float):
        x, residual, weight, bias = widen(x, residual, self.weight, self.bias)
        return ops.add_layer_norm(x, residual, weight, bias, self.eps, dropout_p=dropout_p)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        # Dropout of what enters the residual stream here: the embeddings' for the first
        # block, the previous MLP's output for the others.
        self.dropout_in = config.embd_pdrop if layer == 0 else config.resid_pdrop
        self.dropout = config.resid_pdrop

    def forward(self, x: Tensor, residual: Optional[Tensor], padding: Optional[Tensor] = None,
                cache: Optional[KVCache] = None, layer: int = 0):
        # x: the previous sublayer's output (B, T, C), not yet added to the stream.
        p_in, p = (self.dropout_in, self.dropout) if self.training else (0.0, 0.0)
        h, residual = self.ln_1(x, residual, p_in)
        h, residual = self.ln_2(self.attn(h, padding, cache, layer), residual, p)
        return self.mlp(h), residual


class GPTModel(PreTrainedModel):
    """The transformer: embeddings, n_layer blocks, the final LayerNorm."""

    config_class = GPTConfig
    key_map = KeyMap([
        KeyRule("h.*.attn.c_attn.weight", "h.*.attn.c_attn.weight", transpose=True),
        KeyRule("h.*.attn.c_proj.weight", "h.*.attn.c_proj.weight", transpose=True),
        KeyRule("h.*.mlp.c_fc.weight", "h.*.mlp.c_fc.weight", transpose=True),
        KeyRule("h.*.mlp.c_proj.weight", "h.*.mlp.c_proj.weight", transpose=True),
    ])
    # Older GPT-2 checkpoints carry the causal mask as buffers.
    ignored_keys = (r"h\.\d+\.attn\.(bias|masked_bias)",)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        self.apply(self._init_weights)
        # GPT-2's scaled init of the projections into the residual stream.
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=config.initializer_range / (2 * config.n_layer) ** 0.5)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)

    def gradient_checkpointing_enable(self) -> None:
        """Recompute each block in the backward instead of keeping its activations. The
        dropout seeds come from torch's generator, whose state the recomputation replays."""
        self.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.gradient_checkpointing = False

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, *,
                kv_cache: Optional[KVCache] = None) -> ModelOutput:
        """input_ids (B, T); attention_mask (B, T), 1 = token, 0 = padding; position_ids
        (B, T), by default 0 .. T - 1 (after the cache's tokens when decoding with kv_cache,
        whose lengths the caller advances)."""
        B, T = _check_ids(input_ids, self.config)
        padding = _padding(attention_mask, (B, T))
        if padding is not None and kv_cache is not None:
            raise ValueError("attention_mask cannot be combined with kv_cache: the cache's leftpad "
                             "marks the padding")
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
            if kv_cache is not None:
                position_ids = position_ids + kv_cache.seqlens[:, None]
        elif tuple(position_ids.shape) != (B, T):
            raise ValueError(f"position_ids must have input_ids' shape {(B, T)}, "
                             f"got {tuple(position_ids.shape)}")
        x = self.wte(input_ids) + self.wpe(position_ids)  # (B, T, C)
        residual = None
        for layer, block in enumerate(self.h):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x, residual = checkpoint(block, x, residual, padding, use_reentrant=False)
            else:
                x, residual = block(x, residual, padding, kv_cache, layer)
        p = self.config.resid_pdrop if self.training else 0.0
        hidden, _ = self.ln_f(x, residual, p)
        return ModelOutput(last_hidden_state=hidden)


class GPTLMHeadModel(PreTrainedModel):
    """GPTModel with the language-model head tied to the token embedding."""

    config_class = GPTConfig
    key_map = KeyMap([KeyRule(f"transformer.{r.ours}", f"transformer.{r.theirs}", r.transpose)
                      for r in GPTModel.key_map.rules])
    tied_keys = ("lm_head.weight",)
    ignored_keys = tuple(rf"transformer\.{p}" for p in GPTModel.ignored_keys)

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = GPTModel(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.lm_head.weight = self.transformer.wte.weight

    def gradient_checkpointing_enable(self) -> None:
        self.transformer.gradient_checkpointing_enable()

    def gradient_checkpointing_disable(self) -> None:
        self.transformer.gradient_checkpointing_disable()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None, *,
                return_logits: bool = False, kv_cache: Optional[KVCache] = None) -> CausalLMOutput:
        """labels (B, T) are input_ids' positions (shifted inside: position t predicts
        token t + 1), -100 ignored. With labels in training the logits are not built
        (logits=None) unless return_logits."""
        hidden = self.transformer(input_ids, attention_mask, position_ids,
                                  kv_cache=kv_cache).last_hidden_state  # (B, T, C)
        loss = None
        if labels is not None:
            if tuple(labels.shape) != tuple(input_ids.shape):
                raise ValueError(f"labels must have input_ids' shape {tuple(input_ids.shape)}, "
                                 f"got {tuple(labels.shape)}")
            h, weight = lower(hidden[:, :-1], self.lm_head.weight)
            loss = ops.masked_lm_loss(h, weight, None, labels[:, 1:])
        logits = None
        if labels is None or return_logits or not self.training:
            logits = self.lm_head(hidden)  # (B, T, V)
        return CausalLMOutput(loss=loss, logits=logits, last_hidden_state=hidden,
                              past_key_values=kv_cache)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None, *,
                 max_new_tokens: int, do_sample: bool = False, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Union[int, Sequence[int], None] = None,
                 pad_token_id: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 use_cache: bool = True) -> Tensor:
        """Continues input_ids (B, T) by up to max_new_tokens tokens: (B, T + new).

        A batch of prompts of different lengths is left-padded, with attention_mask (B,
        T) 0 at the padding; positions count from each sequence's first real token. A
        sequence stops at a token of eos_token_id (an id or several; default the
        config's) and is filled with pad_token_id (default: the first eos id) after it;
        generation ends when every sequence has stopped. Greedy unless do_sample, which
        draws from softmax(logits / temperature) restricted to the top_k tokens and the
        smallest set of top probability >= top_p, with ``generator``. use_cache=False
        recomputes the whole prefix at every step (the cache's ground truth).
        """
        B, T = _check_ids(input_ids, self.config)
        _check_generation(max_new_tokens, temperature, top_k, top_p, T, self.config)
        stops = _token_ids(self.config.eos_token_id if eos_token_id is None else eos_token_id,
                           input_ids.device)
        pad = pad_token_id if pad_token_id is not None else (int(stops[0]) if stops.numel() else 0)
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        _padding(attention_mask, (B, T))
        attention_mask = attention_mask.to(torch.bool)
        leftpad = (T - attention_mask.sum(1)).to(torch.int32)  # (B,)
        if bool((leftpad == T).any()):
            raise ValueError("attention_mask: every sequence needs at least one token")
        real = torch.arange(T, device=input_ids.device) >= leftpad[:, None]  # (B, T)
        if not torch.equal(attention_mask, real):
            raise ValueError("attention_mask must pad on the left only (0s, then 1s): generate "
                             "appends tokens at the right")
        positions = (attention_mask.long().cumsum(1) - 1).clamp(min=0)  # (B, T)
        cache = None
        if use_cache:
            cache = KVCache.empty(self.config, B, T + max_new_tokens, self.lm_head.weight,
                                  leftpad=leftpad)
        tokens, done = input_ids, torch.zeros(B, dtype=torch.bool, device=input_ids.device)
        step_ids, step_positions = input_ids, positions
        for _ in range(max_new_tokens):
            if use_cache:
                logits = self(step_ids, position_ids=step_positions, kv_cache=cache).logits
                cache.seqlens += step_ids.shape[1]
            else:
                logits = self(tokens, attention_mask, positions).logits
            nxt = _next_token(logits[:, -1].float(), do_sample, temperature, top_k, top_p,
                              generator)  # (B,)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            done = done | torch.isin(nxt, stops)
            tokens = torch.cat([tokens, nxt[:, None]], dim=1)
            step_ids, step_positions = nxt[:, None], positions[:, -1:] + 1
            positions = torch.cat([positions, step_positions], dim=1)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(B, 1)], dim=1)
            if bool(done.all()):
                break
        return tokens


def filter_logits(logits: Tensor, top_k: Optional[int] = None,
                  top_p: Optional[float] = None) -> Tensor:
    """logits (B, V) with -inf outside each row's top_k tokens and outside the smallest set of
    most probable tokens whose probability reaches top_p (the most probable one always kept)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens before it already reach top_p.
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def _next_token(logits: Tensor, do_sample: bool, temperature: float, top_k: Optional[int],
                top_p: Optional[float], generator: Optional[torch.Generator]) -> Tensor:
    if not do_sample:
        return logits.argmax(-1)
    probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def _check_ids(input_ids, config: GPTConfig) -> tuple:
    if not isinstance(input_ids, Tensor) or input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError("input_ids must be an int64 or int32 tensor")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, seq) with seq >= 1, got shape "
                         f"{tuple(input_ids.shape)}")
    if input_ids.shape[1] > config.n_positions:
        raise ValueError(f"input_ids has {input_ids.shape[1]} tokens, more than n_positions = "
                         f"{config.n_positions}")
    return tuple(input_ids.shape)


def _padding(attention_mask: Optional[Tensor], shape: tuple) -> Optional[Tensor]:
    """The key padding mask (True = padding) of a transformers-style attention_mask."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, Tensor) or tuple(attention_mask.shape) != shape:
        got = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else attention_mask
        raise ValueError(f"attention_mask must be a tensor of input_ids' shape {shape}, got {got}")
    return attention_mask == 0


def _check_generation(max_new_tokens, temperature, top_k, top_p, prompt: int,
                      config: GPTConfig) -> None:
    if (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
            or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if prompt + max_new_tokens > config.n_positions:
        raise ValueError(f"the prompt ({prompt} tokens) + max_new_tokens ({max_new_tokens}) "
                         f"exceeds n_positions = {config.n_positions}")
    if not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"temperature must be a positive float, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a float in (0, 1] or None, got {top_p!r}")


def _token_ids(ids, device) -> Tensor:
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    return torch.tensor(ids, dtype=torch.long, device=device)
