"""ELECTRA (Clark et al., 2020) on BERT's layers: a small masked-LM generator fills the
masked positions with samples, and the discriminator learns which tokens were replaced.

Both are BERT encoders (fusedlm.models.bert's embeddings, layers and packing) whose
embeddings may be narrower than the hidden size (``embedding_size``, projected up by
``embeddings_project``). In ElectraForPreTraining the two share one embeddings module
(token, position and type embeddings and their LayerNorm); each keeps its own
projection. The parts read and write transformers' checkpoints: ElectraDiscriminator
is its ElectraForPreTraining, ElectraGenerator its ElectraForMaskedLM.
"""
import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ..nn._autocast import lower
from ._pretrained import KeyMap, KeyRule
from .bert import (IGNORE_INDEX, BertConfig, BertEmbeddings, BertEncoder, BertLMHead,
                   BertPreTrainedModel, MaskedLMMixin, QuestionAnsweringMixin,
                   SequenceClassificationMixin, TokenClassificationMixin, check_inputs,
                   classifier_dropout, encoder_rules)
from .outputs import ElectraPreTrainingOutput, ModelOutput


@dataclass
class ElectraConfig(BertConfig):
    """transformers' ElectraConfig fields (defaults: ELECTRA-small's discriminator), plus
    the joint pretraining's: ``generator_size`` scales the discriminator's hidden size,
    intermediate size and heads down to the generator's (the paper's 1/4), and
    ``discriminator_weight`` weighs its loss (the paper's 50)."""

    model_type = "electra"
    embedding_size: int = 128
    hidden_size: int = 256
    num_attention_heads: int = 4
    intermediate_size: int = 1024
    generator_size: float = 0.25
    discriminator_weight: float = 50.0

    def __post_init__(self):
        super().__post_init__()
        size = self.embedding_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"embedding_size must be a positive int, got {self.embedding_size!r}")
        if not isinstance(self.generator_size, (int, float)) or not 0.0 < self.generator_size <= 1.0:
            raise ValueError(f"generator_size must be in (0, 1], got {self.generator_size!r}")
        if not isinstance(self.discriminator_weight, (int, float)) or self.discriminator_weight < 0:
            raise ValueError(f"discriminator_weight must be a non-negative number, got "
                             f"{self.discriminator_weight!r}")

    def generator_config(self) -> "ElectraConfig":
        """The generator's config: the same embeddings, a narrower encoder."""
        heads = max(1, round(self.num_attention_heads * self.generator_size))
        head_dim = self.hidden_size // self.num_attention_heads
        intermediate = max(1, round(self.intermediate_size * self.generator_size))
        return dataclasses.replace(self, hidden_size=heads * head_dim, num_attention_heads=heads,
                                   intermediate_size=intermediate, generator_size=1.0)


class ElectraPreTrainedModel(BertPreTrainedModel):
    config_class = ElectraConfig
    key_map = KeyMap(encoder_rules("electra.", "electra.")
                     + [KeyRule("electra.project.*", "electra.embeddings_project.*")])
    ignored_keys = BertPreTrainedModel.ignored_keys + (r"generator_lm_head\.weight",)


class ElectraModel(ElectraPreTrainedModel):
    """Embeddings [batch, seq, embedding_size] -> project to hidden_size (when they
    differ) -> BERT's encoder. ``embeddings`` shares another model's embeddings."""

    key_map = KeyMap(encoder_rules("", "") + [KeyRule("project.*", "embeddings_project.*")])

    def __init__(self, config: ElectraConfig, embeddings: Optional[BertEmbeddings] = None):
        super().__init__()
        self.config = config
        self.embeddings = embeddings or BertEmbeddings(config, config.embedding_size)
        self.project = (nn.Linear(config.embedding_size, config.hidden_size)
                        if config.embedding_size != config.hidden_size else None)
        self.encoder = BertEncoder(config)
        self.init_weights()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                output_hidden_states: bool = False) -> ModelOutput:
        check_inputs(input_ids, attention_mask, token_type_ids, self.config.max_position_embeddings)
        x = self.embeddings(input_ids, token_type_ids, position_ids)  # [batch, seq, embedding_size]
        if self.project is not None:
            x = self.project(x)  # [batch, seq, hidden]
        hidden, states = self.encoder(x, attention_mask, output_hidden_states)
        return ModelOutput(last_hidden_state=hidden, hidden_states=states)


class ElectraTaskModel(ElectraPreTrainedModel):
    """Base of the models that put a task head on an ElectraModel, kept as ``electra``
    (their checkpoints' prefix); ``embeddings`` as ElectraModel's."""

    def __init__(self, config: ElectraConfig, embeddings: Optional[BertEmbeddings] = None):
        super().__init__()
        self.config = config
        self.electra = ElectraModel(config, embeddings)

    @property
    def base_model(self) -> ElectraModel:
        return self.electra


def replaced_token_loss(logits: Tensor, labels: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
    """Binary cross-entropy of 'replaced' over the real tokens (mean)."""
    if attention_mask is None:
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
    # A weighted mean rather than selecting the real tokens: no data-dependent size, so
    # torch.compile keeps it in the graph.
    per_token = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    real = (attention_mask == 1).float()
    return (per_token * real).sum() / real.sum()


class ElectraDiscriminator(ElectraTaskModel):
    """Replaced-token detection: dense -> GELU -> one logit per token [batch, seq];
    ``labels`` 1 = replaced. transformers' ElectraForPreTraining."""

    key_map = KeyMap(ElectraPreTrainedModel.key_map.rules + [
        KeyRule("dense.*", "discriminator_predictions.dense.*"),
        KeyRule("prediction.*", "discriminator_predictions.dense_prediction.*")])

    def __init__(self, config: ElectraConfig, embeddings: Optional[BertEmbeddings] = None):
        super().__init__(config, embeddings)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.prediction = nn.Linear(config.hidden_size, 1)
        self.init_weights()

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                labels: Optional[Tensor] = None, output_hidden_states: bool = False) -> ModelOutput:
        out = self.electra(input_ids, attention_mask, token_type_ids, position_ids, output_hidden_states)
        pre, bias = lower(F.linear(out.last_hidden_state, self.dense.weight), self.dense.bias)
        # [batch, seq] from the one-row weight, not a squeezed view of [batch, seq, 1]:
        # FSDP2 cannot follow in-place changes to a view that a module returns.
        h = ops.bias_gelu(pre, bias, self.config.gelu_approximate)
        logits = F.linear(h, self.prediction.weight[0], self.prediction.bias[0])
        loss = None if labels is None else replaced_token_loss(logits, labels, attention_mask)
        return ModelOutput(loss=loss, logits=logits, last_hidden_state=out.last_hidden_state,
                           hidden_states=out.hidden_states)


class ElectraGenerator(MaskedLMMixin, ElectraTaskModel):
    """The masked-LM generator: BERT's LM head (GELU, projecting to embedding_size) with
    the decoder tied to the word embeddings. transformers' ElectraForMaskedLM."""

    key_map = KeyMap(ElectraPreTrainedModel.key_map.rules + [
        KeyRule("head.dense.*", "generator_predictions.dense.*"),
        KeyRule("head.norm.*", "generator_predictions.LayerNorm.*"),
        KeyRule("head.bias", "generator_lm_head.bias")])

    def __init__(self, config: ElectraConfig, embeddings: Optional[BertEmbeddings] = None):
        super().__init__(config, embeddings)
        # transformers' generator head is erf GELU whatever hidden_act says
        self.head = BertLMHead(config, width=config.embedding_size, approximate="none")
        self.init_weights()


def gumbel_sample(logits: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """One draw per row of softmax(logits) [rows, vocab] (Gumbel-max), without gradient."""
    device = generator.device if generator is not None else logits.device
    # rand(shape, generator=None) cannot trace a data-dependent row count; uniform_ can.
    uniform = torch.empty(logits.shape, device=device).uniform_(generator=generator).to(logits.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny)))
    return (logits.detach().float() + gumbel).argmax(-1)


class ElectraForPreTraining(ElectraPreTrainedModel):
    """Generator and discriminator trained together on shared embeddings.

    ``forward`` takes masked input_ids and their ``labels`` (original ids at masked
    positions, -100 elsewhere), as fusedlm.models.mask_tokens gives them. The generator
    predicts the masked positions (its logits built for those rows only); its samples
    replace them (no gradient flows through the sampling); the discriminator tells
    replaced tokens from originals over the real tokens. Checkpoints in transformers'
    layout: ``model.generator`` and ``model.discriminator``.
    """

    key_map = KeyMap()
    ignored_keys = ()
    tied_keys = tuple(f"generator.electra.embeddings.{name}" for name in (
        "word_embeddings.weight", "position_embeddings.weight", "token_type_embeddings.weight",
        "norm.weight", "norm.bias"))

    def __init__(self, config: ElectraConfig):
        super().__init__()
        self.config = config
        self.discriminator = ElectraDiscriminator(config)
        self.generator = ElectraGenerator(config.generator_config(),
                                          embeddings=self.discriminator.electra.embeddings)

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                labels: Optional[Tensor] = None,
                generator: Optional[torch.Generator] = None) -> ElectraPreTrainingOutput:
        if labels is None or tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(f"labels must be given with input_ids' shape {tuple(input_ids.shape)} "
                             f"(original ids at masked positions, -100 elsewhere)")
        generated = self.generator.electra(input_ids, attention_mask, token_type_ids, position_ids)
        masked = labels != IGNORE_INDEX
        word_embeddings = self.generator.electra.embeddings.word_embeddings.weight
        _, logits = self.generator.head(generated.last_hidden_state[masked], word_embeddings)
        generator_loss = ops.cross_entropy(logits, labels[masked])  # logits [masked, vocab]

        originals = torch.where(masked, labels, input_ids)
        replaced_ids = originals.masked_scatter(masked, gumbel_sample(logits, generator))
        replaced = (replaced_ids != originals).long()
        disc = self.discriminator(replaced_ids, attention_mask, token_type_ids, position_ids, labels=replaced)
        loss = generator_loss + self.config.discriminator_weight * disc.loss
        return ElectraPreTrainingOutput(loss=loss, generator_loss=generator_loss,
                                        discriminator_loss=disc.loss, logits=disc.logits,
                                        prediction_logits=logits, replaced_ids=replaced_ids,
                                        replaced_labels=replaced)


class ElectraForSequenceClassification(SequenceClassificationMixin, ElectraTaskModel):
    """First token -> dropout -> dense -> GELU -> dropout -> out_proj: [batch, num_labels]."""

    def __init__(self, config: ElectraConfig):
        super().__init__(config)
        self.classifier = nn.ModuleDict({"dense": nn.Linear(config.hidden_size, config.hidden_size),
                                         "out_proj": nn.Linear(config.hidden_size, config.num_labels)})
        self.dropout = classifier_dropout(config)
        self.init_weights()

    def classify(self, out: ModelOutput) -> Tensor:
        x = F.dropout(out.last_hidden_state[:, 0], self.dropout, self.training)  # [batch, hidden]
        pre, bias = lower(F.linear(x, self.classifier.dense.weight), self.classifier.dense.bias)
        x = F.dropout(ops.bias_gelu(pre, bias), self.dropout, self.training)
        return self.classifier.out_proj(x)


class ElectraForTokenClassification(TokenClassificationMixin, ElectraTaskModel):
    """dropout -> linear per token: logits [batch, seq, num_labels]; labels -100 are ignored."""


class ElectraForQuestionAnswering(QuestionAnsweringMixin, ElectraTaskModel):
    """Span extraction as BertForQuestionAnswering: start and end logits per token."""
