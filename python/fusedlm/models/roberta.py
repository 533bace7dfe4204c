"""RoBERTa (Liu et al., 2019) as transformers models, on BERT's fused layers.

RoBERTa is BERT's architecture trained longer on more data, with dynamic masking, no
next-sentence task and a byte-level BPE vocabulary. What differs in the model is small:
positions count from ``pad_token_id + 1`` and skip padding (fairseq's numbering), the
masked-LM head is ``lm_head`` (dense -> erf GELU -> LayerNorm -> decoder), and sequence
classification reads the first token through its own dense -> tanh -> ``out_proj``
head instead of a pooler.

Every class named as in transformers subclasses ``transformers.PreTrainedModel``, takes
transformers' ``RobertaConfig``, has transformers' module and parameter names (so its
loader and saver move checkpoints both ways, base <-> task through the ``roberta``
prefix) and returns its output classes.

Shapes: B batch, T tokens, H hidden, V vocab.
"""
from typing import Optional

import torch
from torch import Tensor, nn
from transformers import RobertaConfig

from ..nn import LayerNorm, LinearCrossEntropyLoss
from .bert import (IGNORE_INDEX, BertEmbeddings, BertPreTrainedModel, FirstTokenClassifierMixin,
                   MaskedLMMixin, PooledEncoderModel, QuestionAnsweringMixin,
                   TokenClassificationMixin, dense_gelu, masked_lm)


class RobertaEmbeddings(BertEmbeddings):
    """BERT's embeddings with RoBERTa's positions: each real token's is its index among the
    sequence's real tokens plus ``pad_token_id + 1``, padding's is ``pad_token_id`` (whose
    position embedding is the padding row); from ``inputs_embeds`` they count from
    ``pad_token_id + 1`` without gaps, as transformers'."""

    def __init__(self, config):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=self.padding_idx)

    def forward(self, input_ids: Optional[Tensor], token_type_ids: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None, inputs_embeds: Optional[Tensor] = None) -> Tensor:
        if position_ids is None:
            position_ids = self.positions(input_ids, inputs_embeds)
        return super().forward(input_ids, token_type_ids, position_ids, inputs_embeds)

    def positions(self, input_ids: Optional[Tensor], inputs_embeds: Optional[Tensor]) -> Tensor:
        if input_ids is not None:
            real = input_ids.ne(self.padding_idx).long()
            return torch.cumsum(real, dim=1) * real + self.padding_idx
        seq = inputs_embeds.shape[1]
        first = self.padding_idx + 1
        return torch.arange(first, first + seq, device=inputs_embeds.device)[None].expand(
            inputs_embeds.shape[:2])


class RobertaPreTrainedModel(BertPreTrainedModel):
    """transformers' base for RoBERTa: its config class and checkpoint prefix; BERT's
    weight init and refused settings."""

    config_class = RobertaConfig
    base_model_prefix = "roberta"
    _no_split_modules = ["RobertaEmbeddings", "BertLayer"]


class RobertaModel(PooledEncoderModel, RobertaPreTrainedModel):
    """Embeddings, BERT's encoder and (``add_pooling_layer``) pooler: transformers'
    RobertaModel."""

    embeddings_class = RobertaEmbeddings

    def embed(self, input_ids, token_type_ids, position_ids, inputs_embeds) -> Tensor:
        if position_ids is None:  # positions start past pad_token_id: the table must reach
            last = self.embeddings.padding_idx + (input_ids if input_ids is not None else inputs_embeds).shape[1]
            if last >= self.config.max_position_embeddings:
                raise ValueError(f"the input has {last - self.embeddings.padding_idx} positions; "
                                 f"RoBERTa's start at pad_token_id + 1 = {self.embeddings.padding_idx + 1}, "
                                 f"so max_position_embeddings ({self.config.max_position_embeddings}) "
                                 f"holds at most {self.config.max_position_embeddings - self.embeddings.padding_idx - 1}")
        return super().embed(input_ids, token_type_ids, position_ids, inputs_embeds)


class RobertaTaskModel(RobertaPreTrainedModel):
    """A RobertaModel without pooler under ``roberta``, for the heads."""

    def __init__(self, config: RobertaConfig):
        super().__init__(config)
        self.roberta = RobertaModel(config, add_pooling_layer=False)


# --- the heads ---------------------------------------------------------------------------------

class RobertaLMHead(nn.Module):
    """dense -> GELU -> ``layer_norm`` -> ``decoder`` (its weight tied to the word
    embeddings, its bias to ``bias``, unless the config unties them)."""

    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.loss = LinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, hidden: Tensor, labels: Optional[Tensor] = None, logits_wanted: bool = True) -> tuple:
        return masked_lm(self.transform, self.decoder, hidden, labels, self.loss, logits_wanted)

    def transform(self, hidden: Tensor) -> Tensor:
        """dense -> erf GELU (whatever hidden_act says, as transformers) -> layer_norm."""
        return self.layer_norm(dense_gelu(self.dense, hidden, "none"))


# --- the models --------------------------------------------------------------------------------

class RobertaForMaskedLM(MaskedLMMixin, RobertaTaskModel):
    """The masked-LM head: transformers' RobertaForMaskedLM. In training with labels the
    loss comes from the labelled rows only and ``logits`` is None unless
    ``return_logits=True``; in eval, or without labels, the [B, T, V] logits are built."""

    _tied_weights_keys = {"lm_head.decoder.weight": "roberta.embeddings.word_embeddings.weight",
                          "lm_head.decoder.bias": "lm_head.bias"}

    def __init__(self, config: RobertaConfig):
        super().__init__(config)
        self.lm_head = RobertaLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value
        self.lm_head.bias = value.bias

    def predict_masked(self, hidden: Tensor, labels: Optional[Tensor], logits_wanted: bool) -> tuple:
        return self.lm_head(hidden, labels, logits_wanted)


class RobertaForSequenceClassification(FirstTokenClassifierMixin, RobertaTaskModel):
    """First token -> dropout -> dense -> tanh -> dropout -> ``out_proj``: logits
    [B, num_labels]."""

    classifier_activation = "tanh"


class RobertaForTokenClassification(TokenClassificationMixin, RobertaTaskModel):
    """dropout -> linear per token: logits [B, T, num_labels]; labels -100 are ignored."""


class RobertaForQuestionAnswering(QuestionAnsweringMixin, RobertaTaskModel):
    """Span extraction: start and end logits per token; the loss needs both positions."""
