"""GPT-2 as a transformers model whose forward runs on fusedlm's fused ops.

GPT2Model and GPT2LMHeadModel take transformers' GPT2Config and have transformers'
GPT-2 parameter names and shapes (Conv1D weights are [in, out]), so transformers'
from_pretrained / save_pretrained move checkpoints both ways unchanged, forward returns
transformers' output classes, and transformers' GenerationMixin generates. Inside:

- Pre-LN blocks whose residual adds happen inside the next LayerNorm:
  fusedlm.nn.LayerNorm's ``norm(x, residual, dropout_p=p)`` returns LN(dropout(x) +
  residual) and that sum, the residual stream, in one pass.
- Causal attention is ops.attention; over a FusedKVCache (what generate decodes with)
  ops.attention_with_kvcache writes the new keys and values into the cache in place.
- The MLP is two products on the Conv1D weights as they are, with the bias and GELU's
  tanh form between them one fused ops.bias_gelu.
- The LM loss is ops.masked_lm_loss: it projects only the labelled positions, never
  building the [tokens, vocab] logits.

Where the results differ from transformers' GPT-2, on purpose:
- Outputs at padding positions whose query sees only padding (left padding) are what
  the fused kernels give there (attention rows of zeros), not transformers' values
  computed from padding; every output at a real token matches.
- In training with labels, logits are None unless forward gets return_logits=True.
- output_attentions=True runs attention in plain PyTorch (the fused kernels never
  build the weights), as slow as transformers' eager attention. Every attn_implementation
  transformers takes runs this same attention, and the config keeps the name it was
  given (bert.AnyAttnImplementation).
- attention_mask is 2-D (1 = token, 0 = padding): the kernels take key padding, not
  4-D masks.
- Gradient checkpointing (with transformers' options) refuses a cache in the forwards
  it recomputes, where transformers drops the cache with a warning.

Shapes: B batch, T new tokens, S = cached + new tokens, C n_embd, nh heads, hs head
size (C = nh * hs), V vocab.
"""
import dataclasses
import math
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, GPT2Config, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (BaseModelOutputWithPastAndCrossAttentions,
                                           CausalLMOutputWithCrossAttentions)
from transformers.pytorch_utils import Conv1D

from .. import ops
from ..nn import LayerNorm, is_plain_linear, padding_of, run_layers
from ..nn._autocast import lower
from ..nn.attention import attention_with_weights
from .bert import AnyAttnImplementation, finish
from .kv_cache import FusedKVCache

IGNORE_INDEX = -100
# transformers' names for GELU's tanh approximation, the form the fused MLP computes.
TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_python_tanh")
# The cache's name in forward's arguments, the output classes and generate: transformers
# renamed past_key_values to cache after 5.17.
CACHE = ("cache" if "cache" in BaseModelOutputWithPastAndCrossAttentions.__dataclass_fields__
         else "past_key_values")


def check_config(config: GPT2Config) -> None:
    """Settings the fused path cannot honour are refused, by name, never ignored."""
    if config.activation_function not in TANH_GELUS:
        raise ValueError(f"activation_function={config.activation_function!r}: fusedlm's GPT-2 "
                         f"computes GELU's tanh form, one of {TANH_GELUS}")
    if config.add_cross_attention:
        raise ValueError("add_cross_attention=True: fusedlm's GPT-2 has no cross-attention")
    if config.reorder_and_upcast_attn:
        raise ValueError("reorder_and_upcast_attn=True is not supported: fusedlm's attention "
                         "kernels choose their own accumulation")
    if config.n_embd % config.n_head:
        raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")


@dataclasses.dataclass
class BlockArgs:
    """What every block takes from one forward call."""

    padding: Optional[Tensor]  # bool (B, S), True = padding; None: no padding
    cache: Optional[Cache]
    length: int  # S
    fused: bool  # the cache is a FusedKVCache and any padding is on the left
    leftpad: Optional[Tensor]  # int32 (B,): each row's leading padding, for the fused step
    output_attentions: bool
    output_hidden_states: bool

    @classmethod
    def of(cls, attention_mask: Optional[Tensor], cache: Optional[Cache], batch: int, length: int,
           output_attentions: bool, output_hidden_states: bool) -> "BlockArgs":
        if attention_mask is not None and tuple(attention_mask.shape) != (batch, length):
            raise ValueError(f"attention_mask must be 2-D, (batch, cached + new tokens) = "
                             f"{(batch, length)}, 1 = token, 0 = padding; got shape "
                             f"{tuple(attention_mask.shape)}")
        padding = padding_of(attention_mask)
        fused = isinstance(cache, FusedKVCache) and not output_attentions
        leftpad = None
        if fused and padding is not None:
            leftpad = _left_padding(padding)
            fused = leftpad is not None
        return cls(padding, cache, length, fused, leftpad, output_attentions,
                   bool(output_hidden_states))


def _left_padding(padding: Tensor) -> Optional[Tensor]:
    """Each row's count of leading padding (int32 [B]) if padding (bool [B, S]) has no
    other padding, else None."""
    leading = padding.int().cumprod(1).sum(1)
    return leading.int() if bool((padding.sum(1) == leading).all()) else None


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        C = config.n_embd
        self.c_attn = Conv1D(3 * C, C)
        self.c_proj = Conv1D(C, C)
        self.n_head, self.layer_idx, self.dropout = config.n_head, layer_idx, config.attn_pdrop
        self.scale = (C // config.n_head) ** -0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1

    def forward(self, x: Tensor, args: BlockArgs) -> tuple:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).unbind(2)  # (B, T, nh, hs)
        p = self.dropout if self.training else 0.0
        weights = None
        if args.fused and not q.requires_grad and p == 0.0:  # the fused step: no backward, no dropout
            y = args.cache.layers[self.layer_idx].attend(q, k, v, args.leftpad, self.scale)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
            if args.cache is not None:
                # The cached keys and values, then these: (B, nh, S, hs). (A StaticCache
                # returns its whole buffer.)
                k, v = (t[:, :, :args.length] for t in args.cache.update(k, v, self.layer_idx))
            if args.output_attentions:
                y, weights = attention_with_weights(q, k, v, causal=True, key_padding_mask=args.padding,
                                                    scale=self.scale, dropout_p=p)
            else:
                y = ops.attention(q, k, v, causal=True, key_padding_mask=args.padding,
                                  scale=self.scale, dropout_p=p)
            y = y.transpose(1, 2)
        return self.c_proj(y.reshape(B, T, C)), weights


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        inner = config.n_inner or 4 * config.n_embd
        self.c_fc = Conv1D(inner, config.n_embd)
        self.c_proj = Conv1D(config.n_embd, inner)

    def forward(self, x: Tensor) -> Tensor:
        if not (_is_plain_conv1d(self.c_fc) and _is_plain_conv1d(self.c_proj)):
            # an adapter's or a hook's product must run
            return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))
        # The products read the Conv1D weights [in, out] as they are (gelu_ffn takes
        # nn.Linear's [out, in] and would copy their transposes at every call, forward and
        # backward); the bias and GELU between them are one fused op.
        x, w1, b1, w2, b2 = lower(x, self.c_fc.weight, self.c_fc.bias, self.c_proj.weight,
                                  self.c_proj.bias)
        h = ops.bias_gelu(x @ w1, b1, "tanh")
        return torch.addmm(b2, h.flatten(0, -2), w2).view(*h.shape[:-1], w2.shape[1])


def _is_plain_conv1d(module: nn.Module) -> bool:
    """Whether module computes exactly Conv1D's product, so a fused op may read its weights:
    not a subclass (an adapter) and no hooks (as fusedlm.nn.is_plain_linear)."""
    return type(module) is Conv1D and not module._forward_hooks and not module._forward_pre_hooks


def add_norm(norm: LayerNorm, x: Tensor, residual: Optional[Tensor], dropout_p: float) -> tuple:
    """(norm(dropout(x) + residual), dropout(x) + residual) in one fused op. With no residual
    yet (the first block) x is the stream itself."""
    if residual is None:
        return norm(x), x
    return norm(x, residual, dropout_p=dropout_p)


class Block(GradientCheckpointingLayer):
    """A pre-LN block whose residual adds happen in its LayerNorms: it takes the previous
    sublayer's output x (B, T, C) and the residual stream before it, and returns its own
    MLP's output and stream, then, when asked, its input hidden state (which ln_1
    completes) and its attention weights. Under gradient checkpointing transformers'
    GradientCheckpointingLayer runs it through the model's checkpoint function (x and
    residual positional, as reentrant checkpointing needs)."""

    def __init__(self, config: GPT2Config, layer_idx: int):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)
        self.dropout = config.resid_pdrop

    def forward(self, x: Tensor, residual: Optional[Tensor], args: BlockArgs) -> tuple:
        p = self.dropout if self.training else 0.0
        h, hidden = add_norm(self.ln_1, x, residual, p)
        a, weights = self.attn(h, args)
        h, residual = self.ln_2(a, hidden, dropout_p=p)
        # (Only when asked: the first block's hidden state is its input, which FSDP does
        # not expect back.)
        return self.mlp(h), residual, hidden if args.output_hidden_states else None, weights


def _run_block(block: Block, h: tuple, args: BlockArgs) -> tuple:
    x, residual = h[:2]
    return block(x, residual, args)


class GPT2PreTrainedModel(AnyAttnImplementation, PreTrainedModel):
    config_class = GPT2Config
    base_model_prefix = "transformer"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Block"]
    _input_embed_layer = "wte"
    # Older checkpoints carry each layer's causal mask as a buffer, h.N.attn.bias: skipped,
    # as transformers' GPT-2 does.
    _keys_to_ignore_on_load_unexpected = [r"attn\.bias"]

    def __init__(self, config: GPT2Config, *args, **kwargs):
        check_config(config)
        super().__init__(config, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear and Embedding: normal(initializer_range); LayerNorm
        std = self.config.initializer_range
        if isinstance(module, Conv1D):
            init.normal_(module.weight, std=std)
            init.zeros_(module.bias)
        if isinstance(module, (CausalSelfAttention, MLP)):
            # GPT-2 starts the projections into the residual stream smaller: the stream
            # sums 2 * n_layer of them.
            init.normal_(module.c_proj.weight, std=std / math.sqrt(2 * self.config.n_layer))


class GPT2Model(GPT2PreTrainedModel):
    """The transformer: token and position embeddings, n_layer blocks, the final LayerNorm."""

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False  # transformers' checkpointing_enable sets it
        self.post_init()

    def forward(self, input_ids: Optional[Tensor] = None, cache: Optional[Cache] = None,
                attention_mask: Optional[Tensor] = None, token_type_ids: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None,
                encoder_hidden_states: Optional[Tensor] = None,
                encoder_attention_mask: Optional[Tensor] = None, use_cache: Optional[bool] = None,
                *, output_attentions: Optional[bool] = None,
                output_hidden_states: Union[bool, int, list, None] = None,
                return_dict: Optional[bool] = None,
                past_key_values: Optional[Cache] = None) -> BaseModelOutputWithPastAndCrossAttentions:
        """transformers' GPT2Model.forward. input_ids (B, T), or inputs_embeds (B, T, C);
        cache: a transformers Cache holding earlier tokens (past_key_values, its name up to
        transformers 5.17, is accepted too); attention_mask (B, S), 1 = token, 0 = padding; position_ids
        (B or 1, T), by default counting on from the cache's length. use_cache (default
        config.use_cache) returns the cache, a new FusedKVCache if none was given.
        output_attentions computes the weights in plain PyTorch, not the fused kernels.
        output_hidden_states: True, or the indices of the states to return (others None).
        """
        config = self.config
        cache = _cache_argument(cache, past_key_values)
        if encoder_hidden_states is not None or encoder_attention_mask is not None:
            raise ValueError("encoder_hidden_states/encoder_attention_mask need cross-attention, "
                             "which fusedlm's GPT-2 does not have")
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids and inputs_embeds")
        checkpointing = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        if checkpointing and (use_cache or cache is not None):
            raise ValueError("gradient checkpointing recomputes each block in the backward, which "
                             "would write the cache twice: pass use_cache=False and no cache")
        use_cache = (config.use_cache and not checkpointing) if use_cache is None else use_cache
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        if output_hidden_states is None:
            output_hidden_states = config.output_hidden_states

        if inputs_embeds is None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
            inputs_embeds = self.wte(input_ids)  # (B, T, C)
        B, T = inputs_embeds.shape[:2]
        if use_cache and cache is None:
            cache = FusedKVCache(config)
        past = 0 if cache is None else int(cache.get_seq_length())
        if position_ids is None:
            position_ids = torch.arange(past, past + T, device=inputs_embeds.device)[None]
        x = inputs_embeds + self.wpe(position_ids)
        if token_type_ids is not None:
            x = x + self.wte(token_type_ids)  # GPT-2 embeds token types as tokens
        x = self.drop(x)

        args = BlockArgs.of(attention_mask, cache, B, past + T, output_attentions,
                            output_hidden_states)
        states = [] if output_hidden_states or output_attentions else None
        x, residual, _, _ = run_layers(self.h, (x, None, None, None), args, step=_run_block,
                                       states=states)
        hidden, _ = add_norm(self.ln_f, x, residual, config.resid_pdrop if self.training else 0.0)

        hidden_states = attentions = None
        # states[i + 1] is block i's output: its input hidden state and attention weights.
        if output_hidden_states:
            hidden_states = _selected(tuple(s[2] for s in states[1:]) + (hidden,),
                                      output_hidden_states)
        if output_attentions:
            attentions = tuple(s[3] for s in states[1:])
        return finish(BaseModelOutputWithPastAndCrossAttentions(
            last_hidden_state=hidden, hidden_states=hidden_states, attentions=attentions,
            **{CACHE: cache if use_cache else None}), config, return_dict)


class GPT2LMHeadModel(GPT2PreTrainedModel, GenerationMixin):
    """GPT2Model and the language-model head, tied to the token embedding unless
    config.tie_word_embeddings is False."""

    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}
    # transformers' Trainer passes num_items_in_batch to a model that says it takes it (its
    # own models take **kwargs), and then does not divide the loss by the accumulation steps.
    accepts_loss_kwargs = True

    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids: Optional[Tensor] = None, cache: Optional[Cache] = None,
                attention_mask: Optional[Tensor] = None, token_type_ids: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None,
                encoder_hidden_states: Optional[Tensor] = None,
                encoder_attention_mask: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                use_cache: Optional[bool] = None, logits_to_keep: Union[int, Tensor] = 0, *,
                output_attentions: Optional[bool] = None,
                output_hidden_states: Union[bool, int, list, None] = None,
                return_dict: Optional[bool] = None, return_logits: bool = False,
                past_key_values: Optional[Cache] = None, num_items_in_batch: Union[Tensor, int, None] = None,
                ignore_index: int = IGNORE_INDEX,
                shift_labels: Optional[Tensor] = None) -> CausalLMOutputWithCrossAttentions:
        """transformers' GPT2LMHeadModel.forward (see GPT2Model.forward). labels (B, T) are
        input_ids' positions, shifted inside (position t predicts token t + 1), ignore_index
        ignored. In training with labels the logits are not built (logits=None) unless
        return_logits; logits_to_keep keeps the last n positions' logits (0: all).

        The loss arguments of transformers' causal LM loss: shift_labels (B, T), already
        shifted (position t predicts shift_labels[:, t]), replaces labels' shift (labels
        must still be given, as transformers computes a loss only then);
        num_items_in_batch makes the loss the sum over the labelled tokens divided by it
        (the labelled tokens of all the accumulated batches) instead of their mean."""
        out = self.transformer(input_ids, cache, attention_mask, token_type_ids, position_ids,
                               inputs_embeds, encoder_hidden_states, encoder_attention_mask,
                               use_cache, output_attentions=output_attentions,
                               output_hidden_states=output_hidden_states, return_dict=True,
                               past_key_values=past_key_values)
        hidden = out.last_hidden_state  # (B, T, C)
        loss = logits = None
        if shift_labels is not None and labels is None:
            raise ValueError("shift_labels needs labels too: transformers computes the loss only "
                             "when labels is given (and then reads shift_labels alone)")
        if labels is not None:
            loss = self._lm_loss(hidden, labels, shift_labels, ignore_index, num_items_in_batch)
        if labels is None or return_logits or not self.training:
            if isinstance(logits_to_keep, Tensor) and logits_to_keep.dim() != 1:
                raise ValueError("logits_to_keep must be an int or a 1-D tensor of positions")
            kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden[:, kept])  # (B, T or as kept, V)
        return finish(CausalLMOutputWithCrossAttentions(
            loss=loss, logits=logits, hidden_states=out.hidden_states, attentions=out.attentions,
            **{CACHE: getattr(out, CACHE)}), self.config, return_dict)

    def _lm_loss(self, hidden: Tensor, labels: Tensor, shift_labels: Optional[Tensor],
                 ignore_index: int, num_items_in_batch: Union[Tensor, int, None]) -> Tensor:
        """The cross-entropy of position t's prediction of labels[:, t + 1] (or of
        shift_labels[:, t]); hidden (B, T, C). Its mean over the labelled tokens, or its sum
        divided by num_items_in_batch."""
        if shift_labels is None:
            _check_labels("labels", labels, hidden)
            hidden, targets = hidden[:, :-1], labels[:, 1:]
        else:
            _check_labels("shift_labels", shift_labels, hidden)
            targets = shift_labels.to(hidden.device)
        reduction = "mean" if num_items_in_batch is None else "sum"
        if is_plain_linear(self.lm_head):
            h, weight = lower(hidden, self.lm_head.weight)
            loss = ops.masked_lm_loss(h, weight, None, targets, ignore_index=ignore_index,
                                      reduction=reduction)
        else:  # an adapter's or a hook's product must run
            loss = ops.cross_entropy(self.lm_head(hidden).flatten(0, 1), targets.flatten(),
                                     ignore_index=ignore_index, reduction=reduction)
        if num_items_in_batch is not None:
            loss = loss / (num_items_in_batch.to(loss.device) if isinstance(num_items_in_batch, Tensor)
                           else num_items_in_batch)
        return loss

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode,
                                      batch_size: int, max_cache_length: int) -> None:
        # generate's own default is a DynamicCache; decoding over a FusedKVCache sized for the
        # whole output makes each step one attention_with_kvcache per layer. A cache passed
        # in, use_cache=False and other cache_implementations stay transformers' to handle
        # (their caches then run the unfused attention).
        if (model_kwargs.get(CACHE) is None and generation_config.use_cache
                and generation_config.cache_implementation in (None, "dynamic", "static")):
            model_kwargs[CACHE] = FusedKVCache(self.config, max_cache_len=max_cache_length)
            return
        super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode,
                                              batch_size, max_cache_length)


def _check_labels(name: str, labels: Tensor, hidden: Tensor) -> None:
    if tuple(labels.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"{name} must be (batch, seq) = {tuple(hidden.shape[:2])}, got shape "
                         f"{tuple(labels.shape)}")


def _cache_argument(cache: Optional[Cache], past_key_values: Optional[Cache]) -> Optional[Cache]:
    if past_key_values is not None:
        if cache is not None:
            raise ValueError("pass cache or past_key_values (its name up to transformers 5.17), not both")
        cache = past_key_values
    if cache is not None and not isinstance(cache, Cache):
        raise TypeError(f"cache must be a transformers Cache, got {type(cache).__name__}")
    return cache


def _selected(states: tuple, which: Union[bool, int, list]) -> tuple:
    """transformers' output_hidden_states: True keeps every state; an index or a list of
    indices keeps those, the others None."""
    if which is True:
        return states
    keep = {i % len(states) for i in ([which] if isinstance(which, int) else which)}
    return tuple(s if i in keep else None for i, s in enumerate(states))
