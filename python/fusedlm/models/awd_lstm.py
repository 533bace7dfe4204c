"""The AWD-LSTM (Merity et al., 2018) and ULMFiT's models on it (Howard and Ruder, 2018), as
fastai builds them (``AWD_LSTM``, ``get_language_model``, ``get_text_classifier``), on
fusedlm's lstm_cell and masked_lm_loss.

The AWD-LSTM embeds words, then runs a stack of LSTMs (the last as wide as the embedding,
so that the language model's decoder can share the embedding's weights). Its
regularisation is fastai's:

- embedding dropout drops whole words (rows of the embedding) for a batch;
- locked ("variational") dropout drops the same features at every position of a sequence:
  on the embeddings (``input_p``), between layers (``hidden_p``) and on the output
  (``output_p``, in the heads);
- DropConnect drops entries of each layer's hidden-to-hidden weights, one mask per batch
  (``weight_p``). Every step runs ``lstm_cell`` on the dropped weight directly: there is no
  weight copy for cuDNN's LSTM to flatten;
- in training, the losses add activation regularisation (``ar_alpha`` times the mean square
  of the dropped output) and temporal activation regularisation (``tar_beta`` times the
  mean square of the change of the output between positions), over the real tokens.

``directions="both"`` holds a forward and a backward AWD-LSTM side by side (separate
weights; the backward one reads each text from its end), as ULMFiT's best results ensemble
them: the language models' loss is the mean of the two, a classifier's probabilities are.

Batches are padded on the right (``attention_mask``); padding never enters a state, a
loss or a pooling. ``from_fastai`` / ``to_fastai`` convert fastai's state dicts (the
layout of its pretrained WikiText-103 weights) both ways.
"""
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.nn.functional as F
from huggingface_hub.dataclasses import strict
from torch import Tensor, nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.utils import ModelOutput

from .. import ops
from ..nn._autocast import lower
from ..ops.lstm_cell import lstm_cell
from . import _fastai
from ._lstm import recur, reverse_within, time_major

# fastai's dropout rates: awd_lstm_lm_config (the config's defaults) and awd_lstm_clas_config.
LM_DROPOUT = dict(embed_p=0.02, input_p=0.25, hidden_p=0.15, weight_p=0.2, output_p=0.1)
CLASSIFIER_DROPOUT = dict(embed_p=0.05, input_p=0.4, hidden_p=0.3, weight_p=0.5, output_p=0.4)
DIRECTIONS = {"forward": ("forward",), "backward": ("backward",), "both": ("forward", "backward")}


def dropout_rates(rates: dict, drop_mult: float) -> dict:
    """fastai's ``drop_mult``: every rate of ``rates`` scaled by it."""
    return {name: p * drop_mult for name, p in rates.items()}


# --- config --------------------------------------------------------------------------------------

@strict
class AWDLSTMConfig(PretrainedConfig):
    """fastai's AWD_LSTM settings, its language model's dropout rates by default, and the
    classifier's head (``classifier_hidden``: fastai's ``lin_ftrs``; the first block's
    dropout is ``output_p``, the others' ``classifier_p``). Keyword arguments only; a value
    of the wrong type or out of range raises, naming the field."""

    model_type = "awd_lstm"

    vocab_size: int = 60000
    emb_size: int = 400
    hidden_size: int = 1152
    n_layers: int = 3
    pad_token_id: Optional[int] = 1
    embed_p: float | int = LM_DROPOUT["embed_p"]
    input_p: float | int = LM_DROPOUT["input_p"]
    hidden_p: float | int = LM_DROPOUT["hidden_p"]
    weight_p: float | int = LM_DROPOUT["weight_p"]
    output_p: float | int = LM_DROPOUT["output_p"]
    directions: str = "forward"  # "forward", "backward" or "both"
    ar_alpha: float | int = 2.0
    tar_beta: float | int = 1.0
    classifier_hidden: list = field(default_factory=lambda: [50])
    classifier_p: float | int = 0.1

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        for name in ("vocab_size", "emb_size", "hidden_size", "n_layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        for name in ("embed_p", "input_p", "hidden_p", "weight_p", "output_p", "classifier_p"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        for name in ("ar_alpha", "tar_beta"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)!r}")
        if self.directions not in DIRECTIONS:
            raise ValueError(f"directions must be one of {', '.join(DIRECTIONS)}, got "
                             f"{self.directions!r}")
        if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id must be None or in [0, vocab_size), got "
                             f"{self.pad_token_id!r}")
        if any(not isinstance(n, int) or n < 1 for n in self.classifier_hidden):
            raise ValueError(f"classifier_hidden must be a list of widths >= 1, got "
                             f"{self.classifier_hidden!r}")

    def layer_width(self, layer: int) -> int:
        """The output width of LSTM layer ``layer``: the last one's is the embedding's."""
        return self.emb_size if layer == self.n_layers - 1 else self.hidden_size


# --- modules -------------------------------------------------------------------------------------

def dropout_mask(like: Tensor, shape, p: float) -> Tensor:
    """A mask of ``shape`` in ``like``'s dtype and device: 0 with probability p, else
    1 / (1 - p). Drawn in float32 whatever the dtype (fastai's draw for float32), so that
    a model draws the same masks in every precision."""
    mask = torch.empty(shape, dtype=torch.float32, device=like.device).bernoulli_(1 - p)
    return mask.div_(1 - p).to(like.dtype)


class LockedDropout(nn.Module):
    """Dropout of the same features at every position of a sequence [batch, seq, features]
    (fastai's RNNDropout)."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0:
            return x
        return x * dropout_mask(x.detach(), (x.shape[0], 1, x.shape[2]), self.p)


class AWDLSTMLayer(nn.Module):
    """One LSTM layer with DropConnect on its hidden-to-hidden weights (torch.nn.LSTM's
    parameters, fastai's WeightDropout). The input's share of the gates is one product
    over all positions; each step adds W_hh h on the dropped weight and runs lstm_cell."""

    def __init__(self, input_size: int, hidden_size: int, weight_p: float):
        super().__init__()
        self.weight_p = weight_p
        self.weight_ih = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias_ih = nn.Parameter(torch.empty(4 * hidden_size))
        self.bias_hh = nn.Parameter(torch.empty(4 * hidden_size))

    def forward(self, x: Tensor, mask: Optional[Tensor], state: Optional[tuple]) -> tuple:
        """x [batch, seq, input] in reading order -> ([batch, seq, hidden], (h, c))."""
        weight = self.weight_hh
        if self.training and self.weight_p > 0:
            weight = weight * dropout_mask(weight.detach(), weight.shape, self.weight_p)
        inputs = time_major(F.linear(x, self.weight_ih, self.bias_ih + self.bias_hh))
        if state is None:
            zeros = self.weight_hh.new_zeros(x.shape[0], self.weight_hh.shape[1])
            state = (zeros, zeros)
        weight_t = weight.t()
        return recur(lambda x_t, s: _lstm_step(x_t, s, weight_t), inputs, state, mask)


def _lstm_step(x_t: Tensor, state: tuple, weight_t: Tensor) -> tuple:
    h, c = state
    gates = torch.addmm(x_t, h, weight_t)
    # The state stays in the parameters' dtype under autocast.
    h_new, c_new = lstm_cell(gates.to(c.dtype), c)
    return h_new, (h_new, c_new)


class AWDLSTM(nn.Module):
    """One direction of the encoder: fastai's AWD_LSTM (its parameter names where they
    are its own modules'). Reads [batch, seq] ids in its own reading order."""

    def __init__(self, config: AWDLSTMConfig):
        super().__init__()
        self.embed_p = config.embed_p
        self.encoder = nn.Embedding(config.vocab_size, config.emb_size,
                                    padding_idx=config.pad_token_id)
        widths = [config.emb_size] + [config.layer_width(i) for i in range(config.n_layers)]
        self.rnns = nn.ModuleList(AWDLSTMLayer(widths[i], widths[i + 1], config.weight_p)
                                  for i in range(config.n_layers))
        self.input_dp = LockedDropout(config.input_p)
        self.hidden_dps = nn.ModuleList(LockedDropout(config.hidden_p)
                                        for _ in range(config.n_layers - 1))

    def embed(self, ids: Tensor) -> Tensor:
        """The embeddings with whole words dropped (the same words at every position of
        the batch): the rows of the mask fastai multiplies the whole matrix by."""
        x = self.encoder(ids)
        if self.training and self.embed_p > 0:
            weight = self.encoder.weight
            rows = dropout_mask(weight.detach(), (weight.shape[0], 1), self.embed_p)
            x = x * F.embedding(ids, rows)
        return x

    def forward(self, ids: Tensor, mask: Optional[Tensor], state: Optional[list]) -> tuple:
        """(each layer's output [batch, seq, width], before the dropout between layers;
        each layer's last (h, c))."""
        x = self.input_dp(self.embed(ids))
        outputs, states = [], []
        for i, rnn in enumerate(self.rnns):
            x, last = rnn(x, mask, None if state is None else state[i])
            outputs.append(x)
            states.append(last)
            if i < len(self.hidden_dps):
                x = self.hidden_dps[i](x)
        return outputs, states


@dataclass
class Reading:
    """One direction's reading of a batch: its layers' outputs and last states in its own
    reading order, and how to put a tensor back in the text's order. ``mask`` (None
    without padding) is the same in both orders: a text reversed within its length keeps
    its padding at the end."""

    outputs: list
    state: list
    backwards: bool
    lengths: Tensor
    mask: Optional[Tensor]

    def in_text_order(self, x: Tensor) -> Tensor:
        return reverse_within(x, self.lengths) if self.backwards else x


def text_order_layers(readings: list) -> tuple:
    """Every layer's output in the text's order, the directions' side by side."""
    return tuple(torch.cat([r.in_text_order(r.outputs[i]) for r in readings], dim=-1)
                 for i in range(len(readings[0].outputs)))


# --- outputs -------------------------------------------------------------------------------------

@dataclass
class AWDLSTMModelOutput(ModelOutput):
    """last_hidden_state: the last layer's output [batch, seq, emb_size per direction]
    (forward first), zero at padding; hidden_states (with output_hidden_states): every
    layer's; state: per direction, per layer, the (h, c) after each text's last token,
    which ``state=`` continues from."""

    last_hidden_state: Optional[Tensor] = None
    hidden_states: Optional[tuple] = None
    state: Optional[tuple] = None


@dataclass
class AWDLSTMLMOutput(ModelOutput):
    """loss: the mean over directions of the next-token (backward: previous-token) loss,
    plus the activation regularisers in training. logits [batch, seq, vocab] of the
    first direction, backward_logits of the backward one with directions="both"; in
    training with labels, None unless return_logits=True."""

    loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    backward_logits: Optional[Tensor] = None
    hidden_states: Optional[tuple] = None
    state: Optional[tuple] = None


# --- models --------------------------------------------------------------------------------------

class AWDLSTMPreTrainedModel(PreTrainedModel):
    config_class = AWDLSTMConfig
    base_model_prefix = "awd_lstm"
    main_input_name = "input_ids"
    # Where fastai's layouts put the encoder: a language model's (SequentialRNN of the
    # AWD_LSTM and its decoder), a classifier's (its SentenceEncoder's module), its own.
    _fastai_encoder = ""

    def _init_weights(self, module: nn.Module) -> None:
        """fastai's init: torch's for the LSTMs and the linear layers, embeddings uniform in
        +-0.1, a decoder bias of zero, batch norms of weight 1 and bias 1e-3."""
        if isinstance(module, AWDLSTMLayer):
            bound = module.weight_hh.shape[1] ** -0.5
            for p in module.parameters():
                init.uniform_(p, -bound, bound)
        elif isinstance(module, nn.Embedding):
            init.uniform_(module.weight, -0.1, 0.1)
        elif isinstance(module, nn.Linear):
            module.reset_parameters()
        elif isinstance(module, nn.BatchNorm1d):
            init.ones_(module.weight)
            init.constant_(module.bias, 1e-3)
            init.zeros_(module.running_mean)
            init.ones_(module.running_var)
        elif isinstance(module, TiedDecoder):
            init.zeros_(module.bias)

    @classmethod
    def from_fastai(cls, state_dict: Union[dict, tuple], config: AWDLSTMConfig, *, strict: bool = True,
                    output_loading_info: bool = False):
        """The model of fastai state dicts: one per direction (a tuple of the forward and
        the backward one with directions="both"), each a language model's, a classifier's or
        an AWD_LSTM's own (fastai's ``save_encoder``); a ``{"model": ...}`` checkpoint too.
        The parts of the model a state dict lacks keep their initial values; strict=True
        raises on any missing or unexpected key. With output_loading_info, returns (model,
        {"missing_keys": [...], "unexpected_keys": [...]}) in fastai's names."""
        model = cls(config)
        report = _fastai.load(model, state_dict, strict, DIRECTIONS[config.directions])
        return (model, report) if output_loading_info else model

    def resize_token_embeddings(self, new_num_tokens: int) -> nn.Embedding:
        """The vocabulary grown (or cut) to new_num_tokens, as fastai adapts a pretrained
        model to a new vocabulary (match_embeds): every direction's embedding row of a new
        token is the mean of the old rows, its decoder bias the mean of the old biases.
        Returns the first direction's embedding."""
        if new_num_tokens < 1:
            raise ValueError(f"new_num_tokens must be at least 1, got {new_num_tokens}")
        encoder = self if isinstance(self, AWDLSTMModel) else self.awd_lstm
        kept = min(new_num_tokens, self.config.vocab_size)
        with torch.no_grad():
            for lstm in encoder.lstms:
                old = lstm.encoder.weight
                weight = old.new_empty(new_num_tokens, old.shape[1])
                weight[:kept] = old[:kept]
                weight[kept:] = old.mean(dim=0)
                lstm.encoder.weight = nn.Parameter(weight)
                lstm.encoder.num_embeddings = new_num_tokens
            for decoder in getattr(self, "decoders", ()):
                old = decoder.bias
                bias = old.new_empty(new_num_tokens)
                bias[:kept] = old[:kept]
                bias[kept:] = old.mean()
                decoder.bias = nn.Parameter(bias)
        self.config.vocab_size = encoder.config.vocab_size = new_num_tokens
        return encoder.lstms[0].encoder

    def to_fastai(self) -> Union[dict, tuple]:
        """The state dict(s) of fastai's model of this one: one per direction (a tuple of
        the forward and the backward one with directions="both")."""
        return _fastai.save(self, DIRECTIONS[self.config.directions])


class AWDLSTMModel(AWDLSTMPreTrainedModel):
    """The encoder: one AWD-LSTM per direction of ``config.directions``."""

    def __init__(self, config: AWDLSTMConfig):
        super().__init__(config)
        self.lstms = nn.ModuleList(AWDLSTM(config) for _ in DIRECTIONS[config.directions])
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.lstms[0].encoder

    def read(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
             state: Optional[tuple] = None) -> list:
        """Each direction's :class:`Reading` of the batch."""
        mask, lengths = self._check(input_ids, attention_mask, state)
        readings = []
        for d, (name, lstm) in enumerate(zip(DIRECTIONS[self.config.directions], self.lstms)):
            backwards = name == "backward"
            ids = reverse_within(input_ids, lengths) if backwards else input_ids
            outputs, last = lstm(ids, mask, None if state is None else state[d])
            readings.append(Reading(outputs, last, backwards, lengths, mask))
        return readings

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                state: Optional[tuple] = None, output_hidden_states: bool = False,
                return_dict: Optional[bool] = None) -> AWDLSTMModelOutput:
        readings = self.read(input_ids, attention_mask, state)
        layers = text_order_layers(readings)
        return AWDLSTMModelOutput(last_hidden_state=layers[-1],
                                  hidden_states=layers if output_hidden_states else None,
                                  state=tuple(tuple(r.state) for r in readings))

    def _check(self, input_ids, attention_mask, state) -> tuple:
        """(the mask, or None without padding; each text's length)."""
        if not isinstance(input_ids, Tensor) or input_ids.dtype != torch.long or input_ids.dim() != 2:
            got = (f"{input_ids.dtype} of shape {tuple(input_ids.shape)}"
                   if isinstance(input_ids, Tensor) else type(input_ids).__name__)
            raise ValueError(f"input_ids must be an int64 tensor [batch, seq], got {got}")
        if input_ids.numel() and not 0 <= int(input_ids.min()) <= int(input_ids.max()) < self.config.vocab_size:
            raise ValueError(f"input_ids must be in [0, {self.config.vocab_size}), got values in "
                             f"[{int(input_ids.min())}, {int(input_ids.max())}]")
        batch, seq = input_ids.shape
        if seq == 0:
            raise ValueError("input_ids must have at least one position")
        if state is not None and len(state) != len(self.lstms):
            raise ValueError(f"state must hold one entry per direction ({len(self.lstms)}), got "
                             f"{len(state)}")
        if attention_mask is None:
            return None, torch.full((batch,), seq, device=input_ids.device)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask must have the shape of input_ids {(batch, seq)}, got "
                             f"{tuple(attention_mask.shape)}")
        mask = attention_mask.bool()
        lengths = mask.sum(dim=1)
        if not torch.equal(mask, torch.arange(seq, device=mask.device) < lengths[:, None]):
            raise ValueError("attention_mask must pad on the right (each row ones, then zeros)")
        if bool((lengths == 0).any()):
            raise ValueError("attention_mask: every text needs at least one token")
        return (None if bool(mask.all()) else mask), lengths


def _real(mask: Optional[Tensor], x: Tensor) -> Tensor:
    """mask [batch, seq] as a float multiplier of x [batch, seq, ...] (ones without one)."""
    if mask is None:
        return x.new_ones(x.shape[:2])
    return mask.to(x.dtype)


def activation_regularisation(dropped: Tensor, raw: Tensor, mask: Optional[Tensor],
                              alpha: float, beta: float) -> Tensor:
    """alpha * mean(dropped^2) + beta * mean((raw_t - raw_{t-1})^2) over the real tokens
    (fastai's RNNRegularizer, which averages over every position)."""
    width = raw.shape[-1]
    real = _real(mask, raw)
    total = raw.new_zeros((), dtype=torch.float32)
    if alpha:
        total = total + alpha * (dropped.float().pow(2).sum(-1) * real).sum() / (real.sum() * width)
    if beta and raw.shape[1] > 1:
        pairs = real[:, 1:] * real[:, :-1]
        change = (raw[:, 1:] - raw[:, :-1]).float().pow(2).sum(-1)
        total = total + beta * (change * pairs).sum() / (pairs.sum().clamp(min=1) * width)
    return total


class TiedDecoder(nn.Module):
    """fastai's LinearDecoder on the embedding's weights: locked dropout on the output,
    then a product with the embedding and this bias."""

    def __init__(self, config: AWDLSTMConfig):
        super().__init__()
        self.output_dp = LockedDropout(config.output_p)
        self.bias = nn.Parameter(torch.empty(config.vocab_size))


class AWDLSTMForLanguageModeling(AWDLSTMPreTrainedModel):
    """The encoder and, per direction, a decoder tied to that direction's embedding."""

    _fastai_encoder = "0."

    def __init__(self, config: AWDLSTMConfig):
        super().__init__(config)
        self.awd_lstm = AWDLSTMModel(config)
        self.decoders = nn.ModuleList(TiedDecoder(config) for _ in DIRECTIONS[config.directions])
        self.post_init()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, state: Optional[tuple] = None,
                output_hidden_states: bool = False, return_logits: bool = False,
                return_dict: Optional[bool] = None) -> AWDLSTMLMOutput:
        """labels [batch, seq]: the tokens, as input_ids (the shift is done here: the
        forward direction predicts labels[t + 1] at t, the backward one labels[t - 1];
        -100 and padding are ignored)."""
        readings = self.awd_lstm.read(input_ids, attention_mask, state)
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, "
                             f"got {tuple(labels.shape)}")
        losses, logits = [], []
        for reading, lstm, decoder in zip(readings, self.awd_lstm.lstms, self.decoders):
            raw = reading.outputs[-1]
            dropped = decoder.output_dp(raw)
            # The decoder's product in the autocast dtype, as F.linear's.
            hidden, weight, bias = lower(dropped, lstm.encoder.weight, decoder.bias)
            weight, bias = weight.to(hidden.dtype), bias.to(hidden.dtype)
            if labels is not None:
                targets = reading.in_text_order(labels)
                if reading.mask is not None:
                    targets = targets.masked_fill(~reading.mask, -100)
                targets = F.pad(targets[:, 1:], (0, 1), value=-100)
                loss = ops.masked_lm_loss(hidden, weight, bias, targets)
                if self.training:
                    loss = loss + activation_regularisation(
                        dropped, raw, reading.mask, self.config.ar_alpha, self.config.tar_beta)
                losses.append(loss)
            if labels is None or not self.training or return_logits:
                logits.append(reading.in_text_order(F.linear(hidden, weight, bias)))
            else:
                logits.append(None)
        layers = text_order_layers(readings) if output_hidden_states else None
        return AWDLSTMLMOutput(
            loss=sum(losses) / len(losses) if losses else None, logits=logits[0],
            backward_logits=logits[1] if len(logits) > 1 else None, hidden_states=layers,
            state=tuple(tuple(r.state) for r in readings))

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int = 20, do_sample: bool = False,
                 temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 eos_token_id: Optional[int] = None, attention_mask: Optional[Tensor] = None,
                 pad_token_id: Optional[int] = None) -> Tensor:
        """Continues each prompt of input_ids [batch, seq] (right-padded with
        attention_mask) with the forward language model, greedily or sampled (temperature,
        top-k and top-p as transformers' generate). Returns [batch, seq + new] ids: each
        prompt, its new tokens, then pad_token_id (after eos_token_id, or prompts shorter
        than the longest)."""
        from transformers.generation.logits_process import (LogitsProcessorList,
                                                            TemperatureLogitsWarper,
                                                            TopKLogitsWarper, TopPLogitsWarper)

        if "forward" not in DIRECTIONS[self.config.directions]:
            raise ValueError("generate needs a forward language model (directions 'forward' "
                             "or 'both')")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        warpers = LogitsProcessorList()
        if do_sample:
            if not temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
            warpers.append(TemperatureLogitsWarper(temperature))
            if top_k:
                warpers.append(TopKLogitsWarper(top_k))
            if top_p is not None and top_p < 1.0:
                warpers.append(TopPLogitsWarper(top_p))
        pad = self.config.pad_token_id if pad_token_id is None else pad_token_id
        was_training = self.training
        self.eval()
        try:
            out = self._generate(input_ids, attention_mask, max_new_tokens, do_sample, warpers,
                                 eos_token_id, 0 if pad is None else pad)
        finally:
            self.train(was_training)
        return out

    def _generate(self, input_ids, attention_mask, max_new_tokens, do_sample, warpers, eos, pad):
        forward = DIRECTIONS[self.config.directions].index("forward")
        lstm, decoder = self.awd_lstm.lstms[forward], self.decoders[forward]
        batch = input_ids.shape[0]
        reading = self.awd_lstm.read(input_ids, attention_mask)[forward]
        lengths = reading.lengths
        last = reading.outputs[-1][torch.arange(batch, device=input_ids.device), lengths - 1]
        state = reading.state
        new = input_ids.new_full((batch, max_new_tokens), pad)
        done = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
        for t in range(max_new_tokens):
            scores = F.linear(last, lstm.encoder.weight.to(last.dtype), decoder.bias.to(last.dtype))
            scores = warpers(torch.cat([input_ids, new[:, :t]], dim=1), scores.float())
            token = (torch.multinomial(scores.softmax(-1), 1)[:, 0] if do_sample
                     else scores.argmax(-1))
            token = torch.where(done, pad, token)
            new[:, t] = token
            if eos is not None:
                done = done | (token == eos)
                if bool(done.all()):
                    break
            outputs, state = lstm(token[:, None], None, state)
            last = outputs[-1][:, 0]
        # Each prompt's new tokens right after its own last token, then the padding.
        rows = [torch.cat([input_ids[b, :n], new[b], new.new_full((input_ids.shape[1] - n,), pad)])
                for b, n in enumerate(lengths.tolist())]
        return torch.stack(rows)


def concat_pool(output: Tensor, lengths: Tensor) -> Tensor:
    """ULMFiT's concat pooling of output [batch, seq, width] in reading order, over each
    text's first lengths[b] positions: [the last token's output, the max, the mean]."""
    batch, seq, _ = output.shape
    real = torch.arange(seq, device=output.device)[None, :] < lengths[:, None]
    last = output[torch.arange(batch, device=output.device), lengths - 1]
    biggest = output.masked_fill(~real[..., None], float("-inf")).amax(dim=1)
    mean = (output * real[..., None]).sum(dim=1) / lengths[:, None].to(output.dtype)
    return torch.cat([last, biggest, mean], dim=-1)


class LinBnDrop(nn.Module):
    """fastai's LinBnDrop: batch norm, dropout, a linear layer without bias, maybe ReLU."""

    def __init__(self, n_in: int, n_out: int, p: float, relu: bool):
        super().__init__()
        self.batch_norm = nn.BatchNorm1d(n_in)
        self.dropout = nn.Dropout(p)
        self.linear = nn.Linear(n_in, n_out, bias=False)
        self.relu = relu

    def forward(self, x: Tensor) -> Tensor:
        x = self.linear(self.dropout(self.batch_norm(x)))
        return torch.relu(x) if self.relu else x


class PoolingClassifier(nn.Module):
    """fastai's PoolingLinearClassifier on concat pooling: blocks of widths
    3 * emb_size, *classifier_hidden, num_labels."""

    def __init__(self, config: AWDLSTMConfig):
        super().__init__()
        dims = [3 * config.emb_size, *config.classifier_hidden, config.num_labels]
        ps = [config.output_p] + [config.classifier_p] * len(config.classifier_hidden)
        self.layers = nn.ModuleList(LinBnDrop(n_in, n_out, p, relu=i < len(ps) - 1)
                                    for i, (n_in, n_out, p) in enumerate(zip(dims, dims[1:], ps)))

    def forward(self, pooled: Tensor) -> Tensor:
        for layer in self.layers:
            pooled = layer(pooled)
        return pooled


class AWDLSTMForSequenceClassification(AWDLSTMPreTrainedModel):
    """The encoder and, per direction, concat pooling and a classifier head; with
    directions="both" the logits are the log of the mean of the two heads' probabilities
    (their mean, for a regression with num_labels=1) and the loss the mean of theirs."""

    _fastai_encoder = "0.module."

    def __init__(self, config: AWDLSTMConfig):
        super().__init__(config)
        self.awd_lstm = AWDLSTMModel(config)
        self.classifiers = nn.ModuleList(PoolingClassifier(config)
                                         for _ in DIRECTIONS[config.directions])
        self.post_init()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, output_hidden_states: bool = False,
                return_dict: Optional[bool] = None) -> SequenceClassifierOutput:
        readings = self.awd_lstm.read(input_ids, attention_mask)
        regression = self.config.num_labels == 1
        if labels is not None and labels.shape != input_ids.shape[:1]:
            raise ValueError(f"labels must have shape ({input_ids.shape[0]},), got "
                             f"{tuple(labels.shape)}")
        heads, losses = [], []
        for reading, classifier in zip(readings, self.classifiers):
            raw = reading.outputs[-1]
            logits = classifier(concat_pool(raw, reading.lengths))
            heads.append(logits)
            if labels is None:
                continue
            loss = (F.mse_loss(logits[:, 0].float(), labels.float()) if regression
                    else ops.cross_entropy(logits, labels))
            if self.training:
                loss = loss + activation_regularisation(raw, raw, reading.mask, self.config.ar_alpha,
                                                        self.config.tar_beta)
            losses.append(loss)
        if len(heads) == 1:
            logits = heads[0]
        elif regression:
            logits = (heads[0] + heads[1]) / 2
        else:
            probabilities = (heads[0].float().softmax(-1) + heads[1].float().softmax(-1)) / 2
            logits = probabilities.log()
        layers = text_order_layers(readings) if output_hidden_states else None
        return SequenceClassifierOutput(loss=sum(losses) / len(losses) if losses else None,
                                        logits=logits, hidden_states=layers)
