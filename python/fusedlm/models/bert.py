"""BERT (Devlin et al., 2018) on fusedlm's ops, with transformers' checkpoints both ways.

A post-LN encoder: embeddings -> LayerNorm, then per layer attention and a GELU FFN,
each a residual branch whose dropout, add and LayerNorm are one add_layer_norm. When
the batch has padding the tokens are packed once (fusedlm.ops.unpad) before the first
layer, every layer runs on the packed [tokens, hidden] rows with attention_varlen,
and the result is padded once after the last; outputs at padding positions are then
zeros. The masked-LM head in training with labels projects only the labelled rows
(masked_lm_loss) and never builds the vocabulary logits.

Parameter names are short; ``key_map`` renames them to and from transformers' (the
heads' ``bert.`` prefix included), so a directory written by ``BertForMaskedLM
.save_pretrained`` in either library loads in the other.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .. import ops
from ..nn import GeluFFN, LayerNorm, LinearCrossEntropyLoss
from ..nn._autocast import lower
from ._pretrained import Config, KeyMap, KeyRule, PreTrainedModel
from .outputs import ModelOutput, PreTrainingOutput, QuestionAnsweringOutput

IGNORE_INDEX = -100
# transformers' hidden_act names -> fusedlm's GELU ``approximate``
GELU_APPROXIMATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass
class BertConfig(Config):
    """transformers' BertConfig fields (same names and defaults: BERT-base).
    ``classifier_dropout`` None means hidden_dropout_prob; ``gradient_checkpointing``
    recomputes each layer in the backward instead of storing its activations."""

    model_type = "bert"
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    num_labels: int = 2
    classifier_dropout: Optional[float] = None
    problem_type: Optional[str] = None
    gradient_checkpointing: bool = False

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size", "num_labels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be a multiple of "
                             f"num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in GELU_APPROXIMATIONS:
            raise ValueError(f"hidden_act must be one of {tuple(GELU_APPROXIMATIONS)}, got "
                             f"{self.hidden_act!r}")
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and 0.0 <= value < 1.0):
                raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")
        if self.problem_type not in (None, "regression", "single_label_classification",
                                     "multi_label_classification"):
            raise ValueError(f"problem_type must be None, 'regression', 'single_label_classification' "
                             f"or 'multi_label_classification', got {self.problem_type!r}")

    @classmethod
    def from_dict(cls, values: dict) -> "BertConfig":
        # transformers writes the label count as its id2label table.
        if "num_labels" not in values and "id2label" in values:
            values = {**values, "num_labels": len(values["id2label"])}
        return super().from_dict(values)

    @property
    def gelu_approximate(self) -> str:
        return GELU_APPROXIMATIONS[self.hidden_act]


# --- the encoder -------------------------------------------------------------------------------

class BertEmbeddings(nn.Module):
    """word + token type + position embeddings -> LayerNorm -> dropout: [batch, seq, width].
    ``width`` is hidden_size for BERT, ELECTRA's embedding_size for ELECTRA."""

    def __init__(self, config: BertConfig, width: Optional[int] = None):
        super().__init__()
        width = width or config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, width, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, width)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, width)
        self.norm = LayerNorm(width, eps=config.layer_norm_eps)
        self.dropout = config.hidden_dropout_prob

    def forward(self, input_ids: Tensor, token_type_ids: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None) -> Tensor:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        x = x + self.position_embeddings(position_ids)
        return F.dropout(self.norm(x), self.dropout, self.training)


class BertSelfAttention(nn.Module):
    """Multi-head self-attention over [batch, seq, hidden], or over packed [tokens, hidden]
    when given ``packing`` = (cu_seqlens, max_seqlen) from fusedlm.ops.unpad."""

    def __init__(self, config: BertConfig):
        super().__init__()
        hidden = config.hidden_size
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, hidden)
        self.heads = config.num_attention_heads
        self.dropout = config.attention_probs_dropout_prob

    def forward(self, x: Tensor, packing: Optional[tuple] = None) -> Tensor:
        # each [..., heads, head_dim]
        q, k, v = (proj(x).unflatten(-1, (self.heads, -1)) for proj in (self.query, self.key, self.value))
        p = self.dropout if self.training else 0.0
        if packing is None:  # [batch, seq, heads, head_dim] viewed as [batch, heads, seq, head_dim]
            out = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p)
            out = out.transpose(1, 2)
        else:
            cu_seqlens, max_seqlen = packing
            out = ops.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                       dropout_p=p)
        return self.out(out.flatten(-2))


class BertLayer(nn.Module):
    """x -> LN(x + drop(attn(x))) -> LN(. + drop(ffn(.))): post-LN, each add fused into its norm."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.attn = BertSelfAttention(config)
        self.norm1 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.ffn = GeluFFN(config.hidden_size, config.intermediate_size,
                           approximate=config.gelu_approximate)
        self.norm2 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = config.hidden_dropout_prob

    def forward(self, x: Tensor, packing: Optional[tuple] = None) -> Tensor:
        p = self.dropout if self.training else 0.0
        x, _ = self.norm1(self.attn(x, packing), x, dropout_p=p)
        x, _ = self.norm2(self.ffn(x), x, dropout_p=p)
        return x


class BertEncoder(nn.Module):
    """The stack of layers. With padding in ``attention_mask`` (1 = token) it packs the
    tokens once, runs every layer on them, and pads once at the end."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.gradient_checkpointing = config.gradient_checkpointing

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None,
                output_hidden_states: bool = False) -> tuple:
        """x [batch, seq, hidden] -> (last hidden state, every layer's input and output or None)."""
        batch, seq = x.shape[:2]
        packing, unpack = None, (lambda h: h)
        # Whether the batch has padding is data: torch.compile would break the graph to
        # read it, so a compiled forward packs every masked batch (the same result).
        if attention_mask is not None and (torch.compiler.is_compiling()
                                           or not bool(attention_mask.all())):
            x, indices, cu_seqlens, max_seqlen = ops.unpad(x, attention_mask == 0)  # [tokens, hidden]
            packing = (cu_seqlens, max_seqlen)
            unpack = lambda h: ops.pad(h, indices, batch, seq)  # noqa: E731
        states = [unpack(x)] if output_hidden_states else None
        for layer in self.layers:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                # The recomputation restores torch's RNG state, and with it the dropout seeds
                # fusedlm drew in the forward: the same masks are replayed.
                x = checkpoint(layer, x, packing, use_reentrant=False, preserve_rng_state=True)
            else:
                x = layer(x, packing)
            if states is not None:
                states.append(unpack(x))
        return unpack(x), None if states is None else tuple(states)


class BertPooler(nn.Module):
    """tanh(dense(first token)): [batch, seq, hidden] -> [batch, hidden]."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: Tensor) -> Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertLMHead(nn.Module):
    """dense -> GELU -> LayerNorm, then the vocabulary projection through the (tied) word
    embeddings plus a bias of its own. ``width``: the width of that projection (ELECTRA's
    generator projects down to its embedding size)."""

    def __init__(self, config: BertConfig, width: Optional[int] = None, approximate: Optional[str] = None):
        super().__init__()
        width = width or config.hidden_size
        self.dense = nn.Linear(config.hidden_size, width)
        self.norm = LayerNorm(width, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.approximate = approximate or config.gelu_approximate
        self.loss = LinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def transform(self, hidden: Tensor) -> Tensor:
        pre, bias = lower(F.linear(hidden, self.dense.weight), self.dense.bias)
        return self.norm(ops.bias_gelu(pre, bias, self.approximate))

    def forward(self, hidden: Tensor, decoder_weight: Tensor, labels: Optional[Tensor] = None,
                return_logits: bool = False) -> tuple:
        """(loss or None, logits [..., vocab] or None). In training with labels, unless
        return_logits, only the labelled rows are transformed and projected."""
        if labels is not None and self.training and not return_logits:
            rows = labels != IGNORE_INDEX
            return self.loss(self.transform(hidden[rows]), decoder_weight, labels[rows], self.bias), None
        logits = F.linear(self.transform(hidden), decoder_weight, self.bias)
        loss = None if labels is None else ops.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
        return loss, logits


# --- checkpoints -------------------------------------------------------------------------------

def encoder_rules(ours: str, theirs: str) -> list:
    """Our encoder and embedding names under prefix ``ours`` -> transformers' under ``theirs``."""
    pairs = [
        ("embeddings.norm.*", "embeddings.LayerNorm.*"),
        ("encoder.layers.*.attn.query.*", "encoder.layer.*.attention.self.query.*"),
        ("encoder.layers.*.attn.key.*", "encoder.layer.*.attention.self.key.*"),
        ("encoder.layers.*.attn.value.*", "encoder.layer.*.attention.self.value.*"),
        ("encoder.layers.*.attn.out.*", "encoder.layer.*.attention.output.dense.*"),
        ("encoder.layers.*.norm1.*", "encoder.layer.*.attention.output.LayerNorm.*"),
        ("encoder.layers.*.ffn.fc1.*", "encoder.layer.*.intermediate.dense.*"),
        ("encoder.layers.*.ffn.fc2.*", "encoder.layer.*.output.dense.*"),
        ("encoder.layers.*.norm2.*", "encoder.layer.*.output.LayerNorm.*"),
    ]
    return [KeyRule(ours + a, theirs + b) for a, b in pairs]


LM_HEAD_RULES = [
    KeyRule("head.dense.*", "cls.predictions.transform.dense.*"),
    KeyRule("head.norm.*", "cls.predictions.transform.LayerNorm.*"),
    KeyRule("head.bias", "cls.predictions.bias"),
]


class BertPreTrainedModel(PreTrainedModel):
    """Weight init as transformers' (normal(0, initializer_range), zero biases) and the
    gradient-checkpointing switch."""

    config_class = BertConfig
    key_map = KeyMap(encoder_rules("bert.", "bert."))
    # Buffers and the tied decoder that transformers' files may hold: nothing to load here.
    ignored_keys = (r"(\w+\.)?embeddings\.(position_ids|token_type_ids)",
                    r"cls\.predictions\.decoder\.(weight|bias)")

    def init_weights(self) -> None:
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, nn.Embedding) and module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()

    def gradient_checkpointing_enable(self) -> None:
        self._set_checkpointing(True)

    def gradient_checkpointing_disable(self) -> None:
        self._set_checkpointing(False)

    def _set_checkpointing(self, on: bool) -> None:
        for module in self.modules():
            if isinstance(module, BertEncoder):
                module.gradient_checkpointing = on


def check_inputs(input_ids: Tensor, attention_mask: Optional[Tensor], token_type_ids: Optional[Tensor],
                 max_positions: int) -> None:
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        found = (f"{input_ids.dtype} of shape {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor)
                 else type(input_ids).__name__)
        raise ValueError(f"input_ids must be an integer tensor [batch, seq], got {found}")
    if input_ids.shape[1] > max_positions:
        raise ValueError(f"input_ids has {input_ids.shape[1]} positions, more than "
                         f"max_position_embeddings ({max_positions})")
    for name, t in (("attention_mask", attention_mask), ("token_type_ids", token_type_ids)):
        if t is not None and tuple(t.shape) != tuple(input_ids.shape):
            raise ValueError(f"{name} must have input_ids' shape {tuple(input_ids.shape)}, got "
                             f"{tuple(t.shape)}")


# --- the task heads, BERT's and ELECTRA's ------------------------------------------------------
#
# Each mixin goes before a task model base (BertTaskModel, ElectraTaskModel) whose
# ``base_model`` is the encoder, and gives the head's forward (and, where the head's
# modules are the same in both families, its __init__).

def classifier_dropout(config: BertConfig) -> float:
    return config.hidden_dropout_prob if config.classifier_dropout is None else config.classifier_dropout


def classification_loss(logits: Tensor, labels: Tensor, config: BertConfig) -> Tensor:
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
        return F.mse_loss(logits.squeeze(-1).float(), labels.view(logits.shape[:-1]).float())
    if problem == "single_label_classification":
        return ops.cross_entropy(logits, labels.long(), ignore_index=IGNORE_INDEX)
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


def span_logits(logits: Tensor, attention_mask: Optional[Tensor]) -> tuple:
    """[batch, seq, 2] -> start and end logits [batch, seq]; padding can never be an answer
    (its logits are the dtype's lowest value)."""
    start, end = logits.float().unbind(-1)
    if attention_mask is not None:
        padding = attention_mask == 0
        lowest = torch.finfo(start.dtype).min
        start, end = start.masked_fill(padding, lowest), end.masked_fill(padding, lowest)
    return start, end


def span_loss(start: Tensor, end: Tensor, start_positions: Tensor, end_positions: Tensor) -> Tensor:
    """transformers' QA loss: the mean of the start and end cross-entropies; positions
    outside the sequence are clamped to seq and ignored."""
    seq = start.shape[1]
    start_positions, end_positions = start_positions.clamp(0, seq), end_positions.clamp(0, seq)
    return (ops.cross_entropy(start, start_positions, ignore_index=seq)
            + ops.cross_entropy(end, end_positions, ignore_index=seq)) / 2


class MaskedLMMixin:
    """The masked LM through the model's ``head`` (a BertLMHead), tied to the encoder's
    word embeddings."""

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, output_hidden_states: bool = False,
                return_logits: bool = False) -> ModelOutput:
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids,
                              output_hidden_states)
        loss, logits = self.head(out.last_hidden_state,
                                 self.base_model.embeddings.word_embeddings.weight,
                                 labels, return_logits)
        return ModelOutput(loss=loss, logits=logits, last_hidden_state=out.last_hidden_state,
                           hidden_states=out.hidden_states)


class SequenceClassificationMixin:
    """One label per sequence: the model's ``classify`` turns the encoder's output into
    logits [batch, num_labels]; the loss follows classification_loss."""

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, output_hidden_states: bool = False) -> ModelOutput:
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids,
                              output_hidden_states)
        logits = self.classify(out)
        loss = None if labels is None else classification_loss(logits, labels, self.config)
        return ModelOutput(loss=loss, logits=logits, last_hidden_state=out.last_hidden_state,
                           pooler_output=out.pooler_output, hidden_states=out.hidden_states)


class TokenClassificationMixin:
    """A label per token: ``classifier`` over the dropped-out hidden states."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.dropout = classifier_dropout(config)
        self.init_weights()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, output_hidden_states: bool = False) -> ModelOutput:
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids,
                              output_hidden_states)
        logits = self.classifier(F.dropout(out.last_hidden_state, self.dropout, self.training))
        loss = None if labels is None else ops.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
        return ModelOutput(loss=loss, logits=logits, last_hidden_state=out.last_hidden_state,
                           hidden_states=out.hidden_states)


class QuestionAnsweringMixin:
    """Answer spans: ``qa_outputs`` gives each token a start and an end logit."""

    def __init__(self, config: BertConfig):
        # transformers sizes qa_outputs by num_labels and reads it as (start, end).
        if config.num_labels != 2:
            raise ValueError(f"question answering needs num_labels == 2 (start and end), got "
                             f"{config.num_labels}")
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                start_positions: Optional[Tensor] = None, end_positions: Optional[Tensor] = None,
                output_hidden_states: bool = False) -> QuestionAnsweringOutput:
        out = self.base_model(input_ids, attention_mask, token_type_ids, position_ids,
                              output_hidden_states)
        start, end = span_logits(self.qa_outputs(out.last_hidden_state), attention_mask)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = span_loss(start, end, start_positions, end_positions)
        return QuestionAnsweringOutput(loss=loss, start_logits=start, end_logits=end,
                                       last_hidden_state=out.last_hidden_state,
                                       hidden_states=out.hidden_states)


# --- the models --------------------------------------------------------------------------------

class BertModel(BertPreTrainedModel):
    """Embeddings, encoder and (``add_pooling_layer``) pooler; transformers' BertModel,
    whose checkpoints have no ``bert.`` prefix."""

    key_map = KeyMap(encoder_rules("", ""))

    def __init__(self, config: BertConfig, add_pooling_layer: bool = True):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.init_weights()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                output_hidden_states: bool = False) -> ModelOutput:
        check_inputs(input_ids, attention_mask, token_type_ids, self.config.max_position_embeddings)
        x = self.embeddings(input_ids, token_type_ids, position_ids)  # [batch, seq, hidden]
        hidden, states = self.encoder(x, attention_mask, output_hidden_states)
        pooled = None if self.pooler is None else self.pooler(hidden)
        return ModelOutput(last_hidden_state=hidden, pooler_output=pooled, hidden_states=states)


class BertTaskModel(BertPreTrainedModel):
    """Base of the models that put a task head on a BertModel, kept as ``bert`` (their
    checkpoints' prefix); ``pooled``: whether it has the pooler."""

    def __init__(self, config: BertConfig, pooled: bool = False):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, add_pooling_layer=pooled)

    @property
    def base_model(self) -> BertModel:
        return self.bert


class BertForPreTraining(BertTaskModel):
    """Masked LM + next-sentence prediction. The loss is the sum of the losses whose
    labels are given (``labels``: token ids, -100 = not predicted; ``next_sentence_label``:
    0 = B follows A, 1 = random B)."""

    key_map = KeyMap(encoder_rules("bert.", "bert.") + LM_HEAD_RULES
                     + [KeyRule("nsp.*", "cls.seq_relationship.*")])

    def __init__(self, config: BertConfig):
        super().__init__(config, pooled=True)
        self.head = BertLMHead(config)
        self.nsp = nn.Linear(config.hidden_size, 2)
        self.init_weights()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, next_sentence_label: Optional[Tensor] = None,
                output_hidden_states: bool = False, return_logits: bool = False) -> PreTrainingOutput:
        out = self.bert(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states)
        loss, logits = self.head(out.last_hidden_state, self.bert.embeddings.word_embeddings.weight,
                                 labels, return_logits)
        nsp_logits = self.nsp(out.pooler_output)  # [batch, 2]
        if next_sentence_label is not None:
            nsp_loss = ops.cross_entropy(nsp_logits, next_sentence_label)
            loss = nsp_loss if loss is None else loss + nsp_loss
        return PreTrainingOutput(loss=loss, prediction_logits=logits, seq_relationship_logits=nsp_logits,
                                 last_hidden_state=out.last_hidden_state, hidden_states=out.hidden_states)


class BertForMaskedLM(MaskedLMMixin, BertTaskModel):
    """The masked-LM head alone. In training with labels the loss comes from the
    labelled rows only and ``logits`` is None; ``return_logits=True`` (or eval mode)
    builds the [batch, seq, vocab] logits."""

    key_map = KeyMap(encoder_rules("bert.", "bert.") + LM_HEAD_RULES)

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.head = BertLMHead(config)
        self.init_weights()


class BertForSequenceClassification(SequenceClassificationMixin, BertTaskModel):
    """dropout -> linear over the pooled first token: logits [batch, num_labels]."""

    def __init__(self, config: BertConfig):
        super().__init__(config, pooled=True)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.dropout = classifier_dropout(config)
        self.init_weights()

    def classify(self, out: ModelOutput) -> Tensor:
        return self.classifier(F.dropout(out.pooler_output, self.dropout, self.training))


class BertForTokenClassification(TokenClassificationMixin, BertTaskModel):
    """dropout -> linear per token: logits [batch, seq, num_labels]; labels -100 are ignored."""


class BertForQuestionAnswering(QuestionAnsweringMixin, BertTaskModel):
    """Span extraction: start and end logits per token; the loss needs both positions."""
