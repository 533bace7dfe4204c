"""BERT (Devlin et al., 2018) as a transformers model, on fusedlm's fused ops.

Every class here subclasses ``transformers.PreTrainedModel``, takes transformers'
``BertConfig``, and has transformers' module and parameter names, so transformers'
loader and saver move checkpoints both ways with no renaming (a task model from a
``BertModel`` folder, a ``BertModel`` from a task folder, tied or untied decoders,
sharded folders), and its output classes come back from ``forward``.

Inside, a post-LN encoder: embeddings -> LayerNorm, then per layer attention and a
GELU FFN, each a residual branch whose dropout, add and LayerNorm are one
``add_layer_norm``. With padding, the tokens are packed once before the first layer
(``fusedlm.nn.run_stack``) and every layer runs on the packed [tokens, hidden] rows.
The masked-LM head in training with labels projects only the labelled rows
(``masked_lm_loss``) and never builds the vocabulary logits.

Shapes: B batch, T tokens, H hidden, nh heads, hs head size, V vocab.
"""
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import BertConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (BaseModelOutputWithPoolingAndCrossAttentions,
                                           MaskedLMOutput, QuestionAnsweringModelOutput,
                                           SequenceClassifierOutput, TokenClassifierOutput)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.bert.modeling_bert import BertForPreTrainingOutput

from .. import ops
from ..nn import (LayerNorm, LinearCrossEntropyLoss, is_plain_linear, linear_gelu_linear, padding_of,
                  run_layers, run_stack)
from ..nn._autocast import lower
from ..nn.attention import attention_with_weights

IGNORE_INDEX = -100
# transformers' hidden_act names of GELU -> fusedlm's GELU ``approximate`` (the tanh forms
# differ only in how their constants are rounded)
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_python": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
                       "gelu_python_tanh": "tanh", "gelu_fast": "tanh", "gelu_accurate": "tanh"}


def check_config(config) -> None:
    """Settings the fused path cannot honour are refused, never ignored (BERT's, RoBERTa's,
    ALBERT's and ELECTRA's)."""
    check_activation("hidden_act", config.hidden_act)
    check_unchunked(config)
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError("is_decoder / add_cross_attention: fusedlm's BERT and ELECTRA are encoders; "
                         "use transformers' BertLMHeadModel or ElectraForCausalLM for a decoder")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type must be 'absolute', got {config.position_embedding_type!r}")
    if config.hidden_size % config.num_attention_heads:
        raise ValueError(f"hidden_size ({config.hidden_size}) must be a multiple of "
                         f"num_attention_heads ({config.num_attention_heads})")


def check_activation(setting: str, name) -> None:
    """The config's activation ``setting`` must name a GELU: the fused FFN computes no other."""
    if name not in GELU_APPROXIMATIONS:
        raise ValueError(f"{setting} must be one of {tuple(GELU_APPROXIMATIONS)}, got {name!r}")


def check_unchunked(config) -> None:
    if config.chunk_size_feed_forward:
        raise ValueError("chunk_size_feed_forward must be 0: the fused FFN runs in one piece")


def check_attn_implementation(name: Optional[str]) -> None:
    """Refuses what transformers refuses: a name of none of its attention functions (nor of
    a kernel repository on the Hub, "org/name")."""
    known = ("eager", *ALL_ATTENTION_FUNCTIONS.valid_keys())
    if name is None or name in known or name.removeprefix("paged|") in known or "/" in name:
        return
    raise ValueError(f"attn_implementation={name!r} is none of transformers' attention functions "
                     f"{known}, nor a kernel repository on the Hub ('org/name')")


class AnyAttnImplementation:
    """What a fusedlm model (a transformers PreTrainedModel) does with transformers'
    ``attn_implementation``: every name transformers takes ("eager", "sdpa",
    "flash_attention_2", ...) asks for the same attention, and fusedlm's is one whatever
    the name: the fused kernels, or plain PyTorch where a call asks for the weights
    (output_attentions=True). So each is accepted as it is, and the config object keeps
    what its caller set (None included): a transformers model built from it later chooses
    as it would have. A function registered with transformers' AttentionInterface is
    accepted by name but not called."""

    def _check_and_adjust_attn_implementation(self, attn_implementation: Optional[str], *args, **kwargs):
        check_attn_implementation(attn_implementation)
        return attn_implementation

    def _check_and_adjust_experts_implementation(self, experts_implementation: Optional[str]):
        return experts_implementation  # no mixture of experts here to implement

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True  # set_attn_implementation only checks and records the name


def dropout_p(module: nn.Module, p: float) -> float:
    return p if module.training else 0.0


# --- the encoder -------------------------------------------------------------------------------

class BertEmbeddings(nn.Module):
    """word + token type + position embeddings -> LayerNorm -> dropout: [B, T, width].
    ``width`` is hidden_size for BERT, ELECTRA's embedding_size for ELECTRA."""

    def __init__(self, config, width: Optional[int] = None):
        super().__init__()
        width = width or config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width)
        self.LayerNorm = LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = config.hidden_dropout_prob
        # As transformers' (not saved): older checkpoints that hold them load without a report.
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings)[None],
                             persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, config.max_position_embeddings,
                                                           dtype=torch.long), persistent=False)

    def forward(self, input_ids: Optional[Tensor], token_type_ids: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None) -> Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        seq = inputs_embeds.shape[1]
        if position_ids is None:
            position_ids = self.position_ids[:, :seq]
        if token_type_ids is None:
            token_type_ids = self.token_type_ids[:, :seq]
        x = inputs_embeds + self.token_type_embeddings(token_type_ids) + self.position_embeddings(position_ids)
        return F.dropout(self.LayerNorm(x), dropout_p(self, self.dropout))


class BertSelfAttention(nn.Module):
    """The q, k, v projections and the fused attention over [B, T, H], or over packed
    [tokens, H] when given ``packing`` = (cu_seqlens, max_seqlen)."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.heads = config.num_attention_heads
        self.dropout = config.attention_probs_dropout_prob

    def forward(self, x: Tensor, packing: Optional[tuple], padding: Optional[Tensor],
                attentions: Optional[list]) -> Tensor:
        return self_attention(x, (self.query, self.key, self.value), self.heads, packing, padding,
                              attentions, dropout_p(self, self.dropout))


def self_attention(x: Tensor, projections: tuple, heads: int, packing: Optional[tuple],
                   padding: Optional[Tensor], attentions: Optional[list], p: float) -> Tensor:
    """The fused attention of x's q, k and v ``projections`` over ``heads`` heads: x is
    [B, T, H] with ``padding`` (bool [B, T], True = padding, or None), or packed
    [tokens, H] with ``packing`` = (cu_seqlens, max_seqlen); the result has x's shape.
    With ``attentions`` (a list) the plain-PyTorch path runs and appends the weights."""
    q, k, v = (proj(x).unflatten(-1, (heads, -1)) for proj in projections)  # each [..., nh, hs]
    if packing is not None:
        cu_seqlens, max_seqlen = packing
        out = ops.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=p)
        return out.flatten(-2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, nh, T, hs]
    if attentions is not None:
        out, weights = attention_with_weights(q, k, v, key_padding_mask=padding, dropout_p=p)
        attentions.append(weights)
    else:
        out = ops.attention(q, k, v, key_padding_mask=padding, dropout_p=p)
    return out.transpose(1, 2).flatten(-2)


class BertSelfOutput(nn.Module):
    """LN(dropout(dense(h)) + residual): the dropout, add and norm fused in one op. Also
    BERT's FFN output (``BertOutput``), whose dense runs inside the fused FFN."""

    def __init__(self, config, width: Optional[int] = None):
        super().__init__()
        self.dense = nn.Linear(width or config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = config.hidden_dropout_prob

    def forward(self, h: Tensor, residual: Tensor) -> Tensor:
        return self.add_norm(self.dense(h), residual)

    def add_norm(self, branch: Tensor, residual: Tensor) -> Tensor:
        out, _ = self.LayerNorm(branch, residual, dropout_p=dropout_p(self, self.dropout))
        return out


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: Tensor, packing, padding, attentions) -> Tensor:
        return self.output(self.self(x, packing, padding, attentions), x)


class BertIntermediate(nn.Module):
    """The FFN's first product; its GELU runs fused with both products (BertLayer)."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class BertLayer(GradientCheckpointingLayer):
    """x -> LN(x + drop(attn(x))) -> LN(. + drop(ffn(.))): post-LN, each add fused into its norm,
    the FFN (dense -> GELU -> dense) one fused op. Checkpointed as transformers' layers are
    (``gradient_checkpointing_enable``'s function, with its arguments)."""

    def __init__(self, config):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, width=config.intermediate_size)
        self.approximate = GELU_APPROXIMATIONS[config.hidden_act]

    def forward(self, x: Tensor, packing: Optional[tuple] = None, padding: Optional[Tensor] = None,
                attentions: Optional[list] = None) -> Tensor:
        h = self.attention(x, packing, padding, attentions)
        ffn = linear_gelu_linear(h, self.intermediate.dense, self.output.dense, approximate=self.approximate)
        return self.output.add_norm(ffn, h)


class BertEncoder(nn.Module):
    """The stack of layers (``layer_class``'s: BERT's, or DistilBERT's blocks), packed once
    when the batch has padding."""

    def __init__(self, config, layer_class: Optional[type] = None):
        super().__init__()
        self.layer = nn.ModuleList((layer_class or BertLayer)(config)
                                   for _ in range(config.num_hidden_layers))

    def forward(self, x: Tensor, attention_mask: Optional[Tensor], output_hidden_states: bool,
                output_attentions: bool) -> tuple:
        return run_encoder(self.layer, x, attention_mask, output_hidden_states, output_attentions)


def run_encoder(layers, x: Tensor, attention_mask: Optional[Tensor], output_hidden_states: bool,
                output_attentions: bool) -> tuple:
    """x [B, T, H] through ``layers`` (each called as layer(h, packing, padding, attentions),
    positionally, as a reentrant checkpoint needs), packed once when the batch has padding
    -> (last hidden state, hidden states or None, attentions or None)."""
    if not output_attentions:
        hidden, states = run_stack(layers, x, padding_of(attention_mask),
                                   output_hidden_states=output_hidden_states)
        return hidden, states, None
    # The weights exist only on the reference attention, over the padded batch.
    padding = None if attention_mask is None else attention_mask == 0
    states, attentions = ([] if output_hidden_states else None), []
    hidden = run_layers(layers, x, None, padding, attentions, states=states)
    return hidden, None if states is None else tuple(states), tuple(attentions)


class BertPooler(nn.Module):
    """tanh(dense(first token)): [B, T, H] -> [B, H]."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertPredictionHeadTransform(nn.Module):
    """dense -> GELU (bias fused in) -> LayerNorm; ``width`` the output width (ELECTRA's
    generator projects down to its embedding size)."""

    def __init__(self, config, width: Optional[int] = None, approximate: Optional[str] = None):
        super().__init__()
        width = width or config.hidden_size
        self.dense = nn.Linear(config.hidden_size, width)
        self.LayerNorm = LayerNorm(width, eps=config.layer_norm_eps)
        self.approximate = approximate or GELU_APPROXIMATIONS[config.hidden_act]

    def forward(self, hidden: Tensor) -> Tensor:
        return self.LayerNorm(dense_gelu(self.dense, hidden, self.approximate))


def dense_gelu(dense: nn.Linear, x: Tensor, approximate: str) -> Tensor:
    """GELU(dense(x)), the bias added inside the GELU kernel."""
    if not is_plain_linear(dense):  # an adapter's or a hook's product must run
        return F.gelu(dense(x), approximate=approximate)
    pre, bias = lower(F.linear(x, dense.weight), dense.bias)
    return ops.bias_gelu(pre, bias, approximate)


def masked_lm(transform: Callable[[Tensor], Tensor], decoder: nn.Linear, hidden: Tensor, labels: Optional[Tensor],
              fused_loss: nn.Module, logits_wanted: bool) -> tuple:
    """(loss or None, logits [B, T, V] or None) of a masked-LM head: ``transform`` (a
    callable) then the ``decoder`` projection. In training with labels, unless ``logits_wanted``, only the
    labelled rows are transformed and projected, by one fused loss."""
    if labels is not None and decoder.training and not logits_wanted and is_plain_linear(decoder):
        rows = labels != IGNORE_INDEX
        return fused_loss(transform(hidden[rows]), decoder.weight, labels[rows], decoder.bias), None
    logits = decoder(transform(hidden))
    loss = None if labels is None else ops.cross_entropy(logits.flatten(0, -2), labels.flatten(),
                                                         ignore_index=IGNORE_INDEX)
    return loss, logits


class BertLMPredictionHead(nn.Module):
    """The transform, then the vocabulary projection ``decoder`` (its weight tied to the
    word embeddings, its bias to ``bias``, unless the config unties them)."""

    def __init__(self, config):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.loss = LinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, hidden: Tensor, labels: Optional[Tensor] = None, logits_wanted: bool = True) -> tuple:
        return masked_lm(self.transform, self.decoder, hidden, labels, self.loss, logits_wanted)


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)


# --- transformers' plumbing, shared with ELECTRA ---------------------------------------------------

def check_inputs(input_ids: Optional[Tensor], inputs_embeds: Optional[Tensor], attention_mask: Optional[Tensor],
                 token_type_ids: Optional[Tensor], max_positions: int) -> None:
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("give exactly one of input_ids and inputs_embeds")
    if input_ids is not None and (input_ids.dim() != 2 or input_ids.is_floating_point()):
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {input_ids.dtype} "
                         f"of shape {tuple(input_ids.shape)}")
    if inputs_embeds is not None and inputs_embeds.dim() != 3:
        raise ValueError(f"inputs_embeds must be [batch, seq, width], got shape {tuple(inputs_embeds.shape)}")
    shape = tuple((input_ids if input_ids is not None else inputs_embeds).shape[:2])
    if shape[1] > max_positions:
        raise ValueError(f"the input has {shape[1]} positions, more than max_position_embeddings "
                         f"({max_positions})")
    for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must be [batch, seq] = {shape}, got {tuple(t.shape)} (fusedlm "
                             f"takes 2-D padding masks only)")


def config_flag(config, name: str, value: Optional[bool], default: bool) -> bool:
    """A flag as given, else the config's (transformers' rule)."""
    return bool(getattr(config, name, default) if value is None else value)


def finish(output, config, return_dict: Optional[bool]):
    """transformers' output object, or (return_dict False, as given or by the config) its
    tuple of the fields that are set."""
    return output if config_flag(config, "return_dict", return_dict, True) else output.to_tuple()


class BertPreTrainedModel(AnyAttnImplementation, PreTrainedModel):
    """transformers' base for BERT: its config class, checkpoint prefix and weight init."""

    config_class = BertConfig
    base_model_prefix = "bert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BertEmbeddings", "BertLayer"]

    def __init__(self, config, *args, **kwargs):
        check_config(config)
        super().__init__(config, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if hasattr(module, "decoder") and isinstance(getattr(module, "bias", None), nn.Parameter):
            init.zeros_(module.bias)  # a masked-LM head's bias, which its decoder's is tied to
        elif isinstance(module, BertEmbeddings):  # buffers too: a load builds the model empty
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1])[None])
            init.zeros_(module.token_type_ids)


class InputEmbeddings:
    """transformers' input embeddings of a base model: its ``embeddings.word_embeddings``."""

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value


class OutputEmbeddings:
    """transformers' output embeddings of a masked-LM head whose decoder is a plain
    nn.Linear, the attribute named by ``output_embeddings_attribute``."""

    output_embeddings_attribute: str

    def get_output_embeddings(self) -> nn.Linear:
        return getattr(self, self.output_embeddings_attribute)

    def set_output_embeddings(self, value: nn.Linear) -> None:
        setattr(self, self.output_embeddings_attribute, value)


class EncoderModel(InputEmbeddings):
    """What BertModel and ElectraModel share: the word embeddings as transformers' input
    embeddings, and transformers' forward: the inputs checked, the model's ``embed``, the
    encoder, and the model's ``output`` object (or its tuple)."""

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                inputs_embeds: Optional[Tensor] = None, output_attentions: Optional[bool] = None,
                output_hidden_states: Optional[bool] = None, return_dict: Optional[bool] = None):
        check_inputs(input_ids, inputs_embeds, attention_mask, token_type_ids,
                     self.config.max_position_embeddings)
        attend = config_flag(self.config, "output_attentions", output_attentions, False)
        states = config_flag(self.config, "output_hidden_states", output_hidden_states, False)
        x = self.embed(input_ids, token_type_ids, position_ids, inputs_embeds)  # [B, T, H]
        hidden, hidden_states, attentions = self.encoder(x, attention_mask, states, attend)
        return finish(self.output(hidden, hidden_states, attentions), self.config, return_dict)

    def embed(self, input_ids, token_type_ids, position_ids, inputs_embeds) -> Tensor:
        return self.embeddings(input_ids, token_type_ids, position_ids, inputs_embeds)


class PooledEncoderModel(EncoderModel):
    """What BertModel and RobertaModel share: the model's ``embeddings_class``, BERT's
    encoder and (``add_pooling_layer``) pooler."""

    embeddings_class: type

    def __init__(self, config, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = self.embeddings_class(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()

    def output(self, hidden: Tensor, hidden_states, attentions) -> BaseModelOutputWithPoolingAndCrossAttentions:
        pooled = None if self.pooler is None else self.pooler(hidden)
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden, pooler_output=pooled, hidden_states=hidden_states,
            attentions=attentions)


class BertModel(PooledEncoderModel, BertPreTrainedModel):
    """Embeddings, encoder and (``add_pooling_layer``) pooler: transformers' BertModel.

    ``output_attentions=True`` runs attention on the plain-PyTorch path, which computes
    the weights (the fused kernels never materialise them)."""

    embeddings_class = BertEmbeddings


# --- the task heads, BERT's and ELECTRA's ------------------------------------------------------

class FirstTokenClassificationHead(nn.Module):
    """First token -> dropout -> dense -> activation -> dropout -> ``out_proj``:
    [B, T, H] -> [B, num_labels]. ELECTRA's activation is erf GELU (whatever hidden_act
    says, as transformers), RoBERTa's tanh."""

    def __init__(self, config, activation: str):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.out_proj = nn.Linear(config.hidden_size, config.num_labels)
        self.activation = activation

    def forward(self, hidden: Tensor) -> Tensor:
        x = self.dropout(hidden[:, 0])  # [B, H]
        x = dense_gelu(self.dense, x, "none") if self.activation == "gelu" else torch.tanh(self.dense(x))
        return self.out_proj(self.dropout(x))


def classifier_dropout(config) -> float:
    p = getattr(config, "classifier_dropout", None)  # ALBERT's config names it otherwise
    return config.hidden_dropout_prob if p is None else p


def classification_loss(logits: Tensor, labels: Tensor, config) -> Tensor:
    """transformers' rule: regression for one label, single-label for integer labels,
    multi-label (independent sigmoids) otherwise, unless config.problem_type says."""
    problem = config.problem_type
    if problem is None:
        if config.num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.int64, torch.int32):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        if config.num_labels == 1:
            return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
        return F.mse_loss(logits, labels.to(logits.dtype))
    if problem == "single_label_classification":
        return ops.cross_entropy(logits.view(-1, config.num_labels), labels.view(-1).long(),
                                 ignore_index=IGNORE_INDEX)
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))


def token_loss(logits: Tensor, labels: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
    """Cross-entropy over the real tokens' labels (-100 ignored); a label at a padding
    position is ignored too, since that position's output is not the model's."""
    if attention_mask is not None:
        labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return ops.cross_entropy(logits.flatten(0, -2), labels.flatten().long(), ignore_index=IGNORE_INDEX)


def span_logits(logits: Tensor, attention_mask: Optional[Tensor]) -> tuple:
    """[B, T, 2] -> start and end logits [B, T]; padding can never be an answer (its
    logits are the dtype's lowest value)."""
    start, end = (t.squeeze(-1).contiguous() for t in logits.split(1, dim=-1))
    if attention_mask is not None:
        padding = attention_mask == 0
        lowest = torch.finfo(start.dtype).min
        start, end = start.masked_fill(padding, lowest), end.masked_fill(padding, lowest)
    return start, end


def span_loss(start: Tensor, end: Tensor, start_positions: Tensor, end_positions: Tensor) -> Tensor:
    """transformers' QA loss: the mean of the start and end cross-entropies; positions
    outside the sequence are clamped to T and ignored."""
    seq = start.shape[1]
    start_positions = start_positions.reshape(-1).clamp(0, seq)
    end_positions = end_positions.reshape(-1).clamp(0, seq)
    return (ops.cross_entropy(start, start_positions, ignore_index=seq)
            + ops.cross_entropy(end, end_positions, ignore_index=seq)) / 2


class EncoderTaskModel:
    """What BERT's and ELECTRA's task models share: the encoder call with transformers'
    arguments and flags. ``base_model`` (transformers' property) is the encoder."""

    def encode(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
               output_attentions, output_hidden_states):
        return self.base_model(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                               position_ids=position_ids, inputs_embeds=inputs_embeds,
                               output_attentions=output_attentions,
                               output_hidden_states=output_hidden_states, return_dict=True)


class LabelledHeadMixin(EncoderTaskModel):
    """A head of logits and their labels' loss: the model's ``classify`` turns the
    encoder's output into logits (by default its ``classifier`` over the last hidden
    state), ``labels_loss(logits, labels, attention_mask)`` gives the loss, and
    ``output_class`` (loss, logits, hidden_states, attentions) is the output."""

    def classify(self, out) -> Tensor:
        return self.classifier(out.last_hidden_state)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          output_attentions, output_hidden_states)
        logits = self.classify(out)
        loss = None if labels is None else self.labels_loss(logits, labels, attention_mask)
        return finish(self.output_class(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                        attentions=out.attentions), self.config, return_dict)


class SequenceClassificationMixin(LabelledHeadMixin):
    """One label per sequence: ``classify`` turns the encoder's output into logits
    [B, num_labels]; the loss follows classification_loss."""

    output_class = SequenceClassifierOutput

    def labels_loss(self, logits: Tensor, labels: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
        return classification_loss(logits, labels, self.config)


class FirstTokenClassifierMixin(SequenceClassificationMixin):
    """One label per sequence from a FirstTokenClassificationHead ``classifier`` with the
    model's ``classifier_activation``: logits [B, num_labels]."""

    classifier_activation: str

    def __init__(self, config):
        super().__init__(config)
        self.classifier = FirstTokenClassificationHead(config, self.classifier_activation)
        self.post_init()


class LinearClassifierMixin:
    """dropout -> ``classifier`` (hidden -> num_labels) over the model's ``classified(out)``
    of the encoder's output."""

    def __init__(self, config):
        super().__init__(config)
        self.dropout = nn.Dropout(classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def classify(self, out) -> Tensor:
        return self.classifier(self.dropout(self.classified(out)))


class TokenClassificationMixin(LinearClassifierMixin, LabelledHeadMixin):
    """dropout -> ``classifier`` per token: logits [B, T, num_labels]."""

    output_class = TokenClassifierOutput
    labels_loss = staticmethod(token_loss)

    @staticmethod
    def classified(out) -> Tensor:
        return out.last_hidden_state


class QuestionAnsweringMixin(EncoderTaskModel):
    """Answer spans: ``qa_outputs`` gives each token a start and an end logit."""

    def __init__(self, config):
        # transformers sizes qa_outputs by num_labels and reads it as (start, end).
        if config.num_labels != 2:
            raise ValueError(f"question answering needs num_labels == 2 (start and end), got "
                             f"{config.num_labels}")
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None, output_attentions=None,
                output_hidden_states=None, return_dict=None):
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          output_attentions, output_hidden_states)
        start, end = span_logits(self.qa_outputs(out.last_hidden_state), attention_mask)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = span_loss(start, end, start_positions, end_positions)
        return finish(QuestionAnsweringModelOutput(loss=loss, start_logits=start, end_logits=end,
                                                   hidden_states=out.hidden_states,
                                                   attentions=out.attentions), self.config, return_dict)


class MaskedLMMixin(EncoderTaskModel):
    """A masked-LM head alone: the model's ``predict_masked(hidden, labels, logits_wanted)``
    gives (loss or None, logits or None) as masked_lm does."""

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, output_attentions=None, output_hidden_states=None,
                return_dict=None, return_logits: bool = False):
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          output_attentions, output_hidden_states)
        loss, logits = self.predict_masked(out.last_hidden_state, labels, return_logits)
        return finish(MaskedLMOutput(loss=loss, logits=logits, hidden_states=out.hidden_states,
                                     attentions=out.attentions), self.config, return_dict)


# --- the models --------------------------------------------------------------------------------

class BertForPreTraining(EncoderTaskModel, BertPreTrainedModel):
    """Masked LM + next-sentence prediction: transformers' BertForPreTraining. The loss
    is the sum of the two losses (both labels given; ``labels`` token ids, -100 = not
    predicted; ``next_sentence_label`` 0 = B follows A, 1 = random B). In training with
    labels the masked-LM head projects only the labelled rows and ``prediction_logits``
    is None unless ``return_logits=True``."""

    _tied_weights_keys = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
                          "cls.predictions.decoder.bias": "cls.predictions.bias"}

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.cls.predictions.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.cls.predictions.decoder = value
        self.cls.predictions.bias = value.bias

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, next_sentence_label=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, return_logits: bool = False):
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          output_attentions, output_hidden_states)
        return pretraining_output(self, out, self.cls.predictions, labels, self.cls.seq_relationship,
                                  next_sentence_label, BertForPreTrainingOutput,
                                  "seq_relationship_logits", return_logits, return_dict)


def pretraining_output(model, out, predictions, labels, pair_head, pair_labels, output_class,
                       pair_field: str, return_logits: bool, return_dict):
    """BERT's and ALBERT's pretraining heads over the encoder's ``out``: the masked-LM
    ``predictions`` and the two-way ``pair_head`` over the pooled first token (next sentence;
    sentence order), its logits the output's ``pair_field``. There is a loss only when both
    labels are given, as in transformers."""
    both = labels is not None and pair_labels is not None
    mlm_loss, logits = predictions(out.last_hidden_state, labels if both else None, return_logits)
    pair_logits = pair_head(out.pooler_output)  # [B, 2]
    loss = mlm_loss + ops.cross_entropy(pair_logits, pair_labels.view(-1)) if both else None
    return finish(output_class(loss=loss, prediction_logits=logits, **{pair_field: pair_logits},
                               hidden_states=out.hidden_states, attentions=out.attentions),
                  model.config, return_dict)


class BertForMaskedLM(MaskedLMMixin, BertPreTrainedModel):
    """The masked-LM head alone: transformers' BertForMaskedLM. In training with labels
    the loss comes from the labelled rows only and ``logits`` is None unless
    ``return_logits=True``; in eval, or without labels, the [B, T, V] logits are built."""

    _tied_weights_keys = BertForPreTraining._tied_weights_keys

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()

    get_output_embeddings = BertForPreTraining.get_output_embeddings
    set_output_embeddings = BertForPreTraining.set_output_embeddings

    def predict_masked(self, hidden: Tensor, labels: Optional[Tensor], logits_wanted: bool) -> tuple:
        return self.cls.predictions(hidden, labels, logits_wanted)


class BertTaskModel(BertPreTrainedModel):
    """A BertModel under ``bert``, for the heads; with its pooler when ``pooled``."""

    pooled = False

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=self.pooled)


class BertForSequenceClassification(LinearClassifierMixin, SequenceClassificationMixin, BertTaskModel):
    """dropout -> linear over the pooled first token: logits [B, num_labels]."""

    pooled = True

    @staticmethod
    def classified(out) -> Tensor:
        return out.pooler_output


class BertForTokenClassification(TokenClassificationMixin, BertTaskModel):
    """dropout -> linear per token: logits [B, T, num_labels]; labels -100 are ignored."""


class BertForQuestionAnswering(QuestionAnsweringMixin, BertTaskModel):
    """Span extraction: start and end logits per token; the loss needs both positions."""
