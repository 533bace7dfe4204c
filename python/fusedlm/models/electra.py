"""ELECTRA (Clark et al., 2020) as transformers models, on BERT's fused layers.

A small masked-LM generator fills the masked positions with samples, and the
discriminator learns which tokens were replaced. Both are BERT encoders
(fusedlm.models.bert's embeddings, layers and packing) whose embeddings may be
narrower than the hidden size (``embedding_size``, projected up by
``embeddings_project``).

Every class named as in transformers subclasses ``transformers.PreTrainedModel``,
takes transformers' ``ElectraConfig``, has transformers' module and parameter names
(so its loader and saver move checkpoints both ways, base <-> task through the
``electra`` prefix) and returns its output classes: ``ElectraForPreTraining`` is the
discriminator with its replaced-token-detection head, ``ElectraForMaskedLM`` the
generator. ``ElectraForJointPreTraining`` (a name transformers does not use) trains
the two together on shared embeddings and saves them as those two checkpoints.

Shapes: B batch, T tokens, E embedding size, H hidden, V vocab, M masked tokens.
"""
import copy
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import ElectraConfig
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions
from transformers.models.electra.modeling_electra import ElectraForPreTrainingOutput
from transformers.utils import ModelOutput

from .. import ops
from ..nn import LinearCrossEntropyLoss, is_plain_linear
from .bert import (GELU_APPROXIMATIONS, IGNORE_INDEX, BertEmbeddings, BertEncoder,
                   BertPredictionHeadTransform, BertPreTrainedModel, EncoderModel,
                   FirstTokenClassifierMixin, LabelledHeadMixin, MaskedLMMixin, OutputEmbeddings,
                   QuestionAnsweringMixin, TokenClassificationMixin, dense_gelu, masked_lm)

GENERATOR_SIZE = 0.25  # the paper's generator: 1/4 of the discriminator's width
DISCRIMINATOR_WEIGHT = 50.0  # the paper's weight of the discriminator's loss


class ElectraPreTrainedModel(BertPreTrainedModel):
    """transformers' base for ELECTRA: its config class and checkpoint prefix; BERT's
    weight init and refused settings."""

    config_class = ElectraConfig
    base_model_prefix = "electra"


class ElectraModel(EncoderModel, ElectraPreTrainedModel):
    """Embeddings [B, T, E] -> ``embeddings_project`` to [B, T, H] (when E != H) -> BERT's
    encoder: transformers' ElectraModel (no pooler)."""

    def __init__(self, config: ElectraConfig):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config, config.embedding_size)
        if config.embedding_size != config.hidden_size:
            self.embeddings_project = nn.Linear(config.embedding_size, config.hidden_size)
        self.encoder = BertEncoder(config)
        self.post_init()

    def embed(self, input_ids, token_type_ids, position_ids, inputs_embeds) -> Tensor:
        x = super().embed(input_ids, token_type_ids, position_ids, inputs_embeds)  # [B, T, E]
        if hasattr(self, "embeddings_project"):
            x = self.embeddings_project(x)  # [B, T, H]
        return x

    def output(self, hidden: Tensor, hidden_states, attentions) -> BaseModelOutputWithPastAndCrossAttentions:
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden, hidden_states=hidden_states,
                                                         attentions=attentions)


class ElectraTaskModel(ElectraPreTrainedModel):
    """An ElectraModel under ``electra``, for the heads."""

    def __init__(self, config: ElectraConfig):
        super().__init__(config)
        self.electra = ElectraModel(config)


# --- the heads ---------------------------------------------------------------------------------

class ElectraDiscriminatorPredictions(nn.Module):
    """dense -> GELU (hidden_act; bias fused in) -> ``dense_prediction``: one logit per
    token, [B, T, H] -> [B, T]."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dense_prediction = nn.Linear(config.hidden_size, 1)
        self.approximate = GELU_APPROXIMATIONS[config.hidden_act]

    def forward(self, hidden: Tensor) -> Tensor:
        h = dense_gelu(self.dense, hidden, self.approximate)
        if not is_plain_linear(self.dense_prediction):
            return self.dense_prediction(h).squeeze(-1)
        # [B, T] from the one-row weight, not a squeezed view of [B, T, 1]: FSDP2 cannot
        # follow in-place changes to a view that a module returns.
        return F.linear(h, self.dense_prediction.weight[0], self.dense_prediction.bias[0])


def replaced_token_loss(logits: Tensor, labels: Tensor, attention_mask: Optional[Tensor]) -> Tensor:
    """Binary cross-entropy of 'replaced' (labels 1) against 'original' (0), the mean over
    the real tokens (attention_mask 1) as transformers takes it."""
    per_token = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="none")
    if attention_mask is None:
        return per_token.mean()
    # A weighted mean rather than selecting the real tokens: no data-dependent size, so
    # torch.compile keeps it in the graph.
    real = (attention_mask == 1).float()
    return (per_token * real).sum() / real.sum()


# --- the models --------------------------------------------------------------------------------

class ElectraForPreTraining(LabelledHeadMixin, ElectraTaskModel):
    """The discriminator: replaced-token detection, logits [B, T] (> 0: replaced);
    transformers' ElectraForPreTraining. ``labels`` [B, T]: 1 = replaced, 0 = original;
    the loss is their binary cross-entropy over the real tokens."""

    output_class = ElectraForPreTrainingOutput
    labels_loss = staticmethod(replaced_token_loss)

    def __init__(self, config: ElectraConfig):
        super().__init__(config)
        self.discriminator_predictions = ElectraDiscriminatorPredictions(config)
        self.post_init()

    def classify(self, out) -> Tensor:
        return self.discriminator_predictions(out.last_hidden_state)


class ElectraForMaskedLM(OutputEmbeddings, MaskedLMMixin, ElectraTaskModel):
    """The generator: ``generator_predictions`` (dense to E -> erf GELU -> LayerNorm) and
    ``generator_lm_head`` (E -> V, its weight tied to the word embeddings);
    transformers' ElectraForMaskedLM. In training with labels the loss comes from the
    labelled rows only and ``logits`` is None unless ``return_logits=True``."""

    _tied_weights_keys = {"generator_lm_head.weight": "electra.embeddings.word_embeddings.weight"}
    output_embeddings_attribute = "generator_lm_head"

    def __init__(self, config: ElectraConfig):
        super().__init__(config)
        # transformers' generator head is erf GELU whatever hidden_act says
        self.generator_predictions = BertPredictionHeadTransform(config, config.embedding_size, "none")
        self.generator_lm_head = nn.Linear(config.embedding_size, config.vocab_size)
        self.masked_lm_loss = LinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        self.post_init()

    def predict_masked(self, hidden: Tensor, labels: Optional[Tensor], logits_wanted: bool) -> tuple:
        return masked_lm(self.generator_predictions, self.generator_lm_head, hidden, labels,
                         self.masked_lm_loss, logits_wanted)


class ElectraForSequenceClassification(FirstTokenClassifierMixin, ElectraTaskModel):
    """First token -> dropout -> dense -> erf GELU -> dropout -> ``out_proj``: logits
    [B, num_labels]."""

    classifier_activation = "gelu"


class ElectraForTokenClassification(TokenClassificationMixin, ElectraTaskModel):
    """dropout -> linear per token: logits [B, T, num_labels]; labels -100 are ignored."""


class ElectraForQuestionAnswering(QuestionAnsweringMixin, ElectraTaskModel):
    """Span extraction: start and end logits per token; the loss needs both positions."""


# --- generator and discriminator trained together ---------------------------------------------

@dataclass
class ElectraJointPreTrainingOutput(ModelOutput):
    """ELECTRA's joint step. ``loss`` = generator_loss + discriminator_weight *
    discriminator_loss; ``logits`` are the discriminator's [B, T] (> 0: replaced),
    ``prediction_logits`` the generator's at the masked positions [M, V];
    ``replaced_ids`` [B, T] is the discriminator's input (the generator's samples at the
    masked positions) and ``replaced_labels`` [B, T] its targets (1 where a sample
    differs from the original)."""

    loss: Optional[Tensor] = None
    generator_loss: Optional[Tensor] = None
    discriminator_loss: Optional[Tensor] = None
    logits: Optional[Tensor] = None
    prediction_logits: Optional[Tensor] = None
    replaced_ids: Optional[Tensor] = None
    replaced_labels: Optional[Tensor] = None


def gumbel_sample(logits: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """One draw per row of softmax(logits) [rows, V] (Gumbel-max), without gradient."""
    device = generator.device if generator is not None else logits.device
    # rand(shape, generator=None) cannot trace a data-dependent row count; uniform_ can.
    uniform = torch.empty(logits.shape, device=device).uniform_(generator=generator).to(logits.device)
    gumbel = -torch.log(-torch.log(uniform.clamp_min(torch.finfo(uniform.dtype).tiny)))
    return (logits.detach().float() + gumbel).argmax(-1)


# Settings the shared embeddings fix: the generator's must equal the discriminator's.
SHARED_SETTINGS = ("vocab_size", "embedding_size", "max_position_embeddings", "type_vocab_size",
                   "pad_token_id", "layer_norm_eps")


class ElectraForJointPreTraining(nn.Module):
    """Generator (``generator``, an ElectraForMaskedLM) and discriminator
    (``discriminator``, an ElectraForPreTraining) trained together on one embeddings
    module (word, position and token type embeddings and their LayerNorm): the
    discriminator's, which the generator uses too. Each keeps its own
    ``embeddings_project``.

    ``generator_config`` defaults to ``generator_config_for(config)``: the paper's
    generator, 1/4 the discriminator's width. ``forward`` takes masked input_ids and
    ``labels`` (original ids at masked positions, -100 elsewhere), as
    fusedlm.models.mask_tokens gives them.

    ``save_pretrained(folder)`` writes ``folder/generator`` (transformers'
    ElectraForMaskedLM) and ``folder/discriminator`` (its ElectraForPreTraining), each
    whole, embeddings included; ``from_pretrained(folder)`` reads both and shares the
    discriminator's embeddings again. ``discriminator_weight`` is a training setting,
    not saved.
    """

    def __init__(self, config: ElectraConfig, generator_config: Optional[ElectraConfig] = None,
                 discriminator_weight: float = DISCRIMINATOR_WEIGHT):
        super().__init__()
        generator_config = generator_config or self.generator_config_for(config)
        self._join(ElectraForMaskedLM(generator_config), ElectraForPreTraining(config), discriminator_weight)

    @staticmethod
    def generator_config_for(config: ElectraConfig, size: float = GENERATOR_SIZE) -> ElectraConfig:
        """The discriminator's config with the encoder narrowed by ``size``: heads
        round(heads * size) (at least 1) of the same head size, intermediate
        round(intermediate * size); the embeddings and everything else unchanged."""
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0.0 < size <= 1.0:
            raise ValueError(f"size must be in (0, 1], got {size!r}")
        heads = max(1, round(config.num_attention_heads * size))
        generator = copy.deepcopy(config)
        generator.hidden_size = heads * (config.hidden_size // config.num_attention_heads)
        generator.num_attention_heads = heads
        generator.intermediate_size = max(1, round(config.intermediate_size * size))
        return generator

    @classmethod
    def from_parts(cls, generator: ElectraForMaskedLM, discriminator: ElectraForPreTraining,
                   discriminator_weight: float = DISCRIMINATOR_WEIGHT) -> "ElectraForJointPreTraining":
        """Joins a generator and a discriminator as they are; the generator's embeddings
        are replaced by the discriminator's."""
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._join(generator, discriminator, discriminator_weight)
        return model

    def _join(self, generator: ElectraForMaskedLM, discriminator: ElectraForPreTraining,
              discriminator_weight: float) -> None:
        differ = [f"{name} (generator {getattr(generator.config, name)!r}, discriminator "
                  f"{getattr(discriminator.config, name)!r})" for name in SHARED_SETTINGS
                  if getattr(generator.config, name) != getattr(discriminator.config, name)]
        if differ:
            raise ValueError("the generator's config must match the discriminator's in what the shared "
                             "embeddings fix: " + ", ".join(differ))
        if (isinstance(discriminator_weight, bool) or not isinstance(discriminator_weight, (int, float))
                or discriminator_weight < 0):
            raise ValueError(f"discriminator_weight must be a non-negative number, got "
                             f"{discriminator_weight!r}")
        self.generator, self.discriminator = generator, discriminator
        self.discriminator_weight = float(discriminator_weight)
        generator.electra.embeddings = discriminator.electra.embeddings
        generator.tie_weights()  # the generator's head onto the shared word embeddings

    @property
    def config(self) -> ElectraConfig:
        """The discriminator's config (the model ELECTRA's pretraining is for)."""
        return self.discriminator.config

    @property
    def generator_config(self) -> ElectraConfig:
        return self.generator.config

    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                token_type_ids: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                labels: Optional[Tensor] = None,
                generator: Optional[torch.Generator] = None) -> ElectraJointPreTrainingOutput:
        """``generator``: the random generator of the samples (default: torch's)."""
        if labels is None or tuple(labels.shape) != tuple(input_ids.shape):
            raise ValueError(f"labels must be given with input_ids' shape {tuple(input_ids.shape)} "
                             f"(original ids at masked positions, -100 elsewhere)")
        gen = self.generator
        hidden = gen.electra(input_ids, attention_mask, token_type_ids, position_ids).last_hidden_state
        masked = labels != IGNORE_INDEX  # [B, T]
        # The generator's logits at the masked positions only: [M, V]
        logits = gen.generator_lm_head(gen.generator_predictions(hidden[masked]))
        generator_loss = ops.cross_entropy(logits, labels[masked])

        originals = torch.where(masked, labels, input_ids)
        replaced_ids = originals.masked_scatter(masked, gumbel_sample(logits, generator))
        replaced = (replaced_ids != originals).long()
        disc = self.discriminator(replaced_ids, attention_mask, token_type_ids, position_ids, labels=replaced)
        loss = generator_loss + self.discriminator_weight * disc.loss
        return ElectraJointPreTrainingOutput(loss=loss, generator_loss=generator_loss,
                                             discriminator_loss=disc.loss, logits=disc.logits,
                                             prediction_logits=logits, replaced_ids=replaced_ids,
                                             replaced_labels=replaced)

    def save_pretrained(self, folder, **kwargs) -> None:
        """``folder/generator`` and ``folder/discriminator``, each through transformers'
        save_pretrained (``kwargs`` go to both)."""
        self.generator.save_pretrained(os.path.join(folder, "generator"), **kwargs)
        self.discriminator.save_pretrained(os.path.join(folder, "discriminator"), **kwargs)

    @classmethod
    def from_pretrained(cls, folder, discriminator_weight: float = DISCRIMINATOR_WEIGHT,
                        **kwargs) -> "ElectraForJointPreTraining":
        """The two folders save_pretrained writes, each through transformers'
        from_pretrained (``kwargs`` go to both). The discriminator's embeddings are the
        shared ones; the generator's copy is dropped."""
        generator = ElectraForMaskedLM.from_pretrained(os.path.join(folder, "generator"), **kwargs)
        discriminator = ElectraForPreTraining.from_pretrained(os.path.join(folder, "discriminator"), **kwargs)
        return cls.from_parts(generator, discriminator, discriminator_weight)
