"""ALBERT (Lan et al., 2019) as transformers models, on fusedlm's fused ops.

ALBERT factorizes the embeddings (``embedding_size`` E, much narrower than the hidden
size, projected up by ``embedding_hidden_mapping_in``) and shares one set of layer
weights: ``num_hidden_layers`` calls run the layers of ``num_hidden_groups`` groups, each
group's ``inner_group_num`` layers one object. A layer is post-LN like BERT's: attention
then LayerNorm(h + dropout(dense(a))) in one ``add_layer_norm``, and the FFN's two
products in one ``gelu_ffn`` before LayerNorm(ffn + a) in another. With padding the
tokens are packed once for all the calls. Pretraining pairs the masked LM with
sentence-order prediction (``AlbertForPreTraining``).

Every class named as in transformers subclasses ``transformers.PreTrainedModel``, takes
transformers' ``AlbertConfig``, has transformers' module and parameter names (so its
loader and saver move checkpoints both ways, base <-> task through the ``albert``
prefix) and returns its output classes.

Shapes: B batch, T tokens, E embedding size, H hidden, V vocab.
"""
from typing import Optional

import torch
from torch import Tensor, nn
from transformers import AlbertConfig
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPooling
from transformers.models.albert.modeling_albert import AlbertForPreTrainingOutput

from ..nn import LayerNorm, LinearCrossEntropyLoss, linear_gelu_linear
from .bert import (GELU_APPROXIMATIONS, IGNORE_INDEX, BertEmbeddings, BertPreTrainedModel, EncoderModel,
                   EncoderTaskModel, LinearClassifierMixin, MaskedLMMixin, QuestionAnsweringMixin,
                   SequenceClassificationMixin, TokenClassificationMixin, dense_gelu, dropout_p,
                   masked_lm, pretraining_output, run_encoder, self_attention)


class AlbertAttention(nn.Module):
    """q, k, v -> fused attention -> ``dense`` -> LayerNorm(x + dropout(.)), the dropout,
    add and norm one op; over [B, T, H] or packed [tokens, H]."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.query, self.key, self.value, self.dense = (nn.Linear(hidden, hidden) for _ in range(4))
        self.LayerNorm = LayerNorm(hidden, eps=config.layer_norm_eps)
        self.heads = config.num_attention_heads
        self.attention_dropout = config.attention_probs_dropout_prob
        self.output_dropout = config.hidden_dropout_prob

    def forward(self, x: Tensor, packing: Optional[tuple], padding: Optional[Tensor],
                attentions: Optional[list]) -> Tensor:
        a = self_attention(x, (self.query, self.key, self.value), self.heads, packing, padding, attentions,
                           dropout_p(self, self.attention_dropout))
        out, _ = self.LayerNorm(self.dense(a), x, dropout_p=dropout_p(self, self.output_dropout))
        return out


class AlbertLayer(GradientCheckpointingLayer):
    """attention, then LayerNorm(ffn_output(GELU(ffn(a))) + a): the products one fused op,
    the add and norm another (ALBERT drops nothing there). Each call is checkpointed as
    transformers' layers are, when checkpointing is on."""

    def __init__(self, config):
        super().__init__()
        self.attention = AlbertAttention(config)
        self.ffn = nn.Linear(config.hidden_size, config.intermediate_size)
        self.ffn_output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.full_layer_layer_norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.approximate = GELU_APPROXIMATIONS[config.hidden_act]

    def forward(self, x: Tensor, packing: Optional[tuple] = None, padding: Optional[Tensor] = None,
                attentions: Optional[list] = None) -> Tensor:
        a = self.attention(x, packing, padding, attentions)
        out, _ = self.full_layer_layer_norm(
            linear_gelu_linear(a, self.ffn, self.ffn_output, approximate=self.approximate), a)
        return out


class AlbertLayerGroup(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.albert_layers = nn.ModuleList(AlbertLayer(config) for _ in range(config.inner_group_num))


class AlbertTransformer(nn.Module):
    """``embedding_hidden_mapping_in`` (E -> H), then every layer call in order."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding_hidden_mapping_in = nn.Linear(config.embedding_size, config.hidden_size)
        self.albert_layer_groups = nn.ModuleList(AlbertLayerGroup(config)
                                                 for _ in range(config.num_hidden_groups))

    def calls(self) -> list:
        """The layers in the order they run: layer i runs group i * groups // layers."""
        layers, groups = self.config.num_hidden_layers, self.config.num_hidden_groups
        return [layer for i in range(layers)
                for layer in self.albert_layer_groups[int(i / (layers / groups))].albert_layers]

    def forward(self, x: Tensor, attention_mask: Optional[Tensor], output_hidden_states: bool,
                output_attentions: bool) -> tuple:
        return run_encoder(self.calls(), self.embedding_hidden_mapping_in(x), attention_mask,
                           output_hidden_states, output_attentions)


class AlbertPreTrainedModel(BertPreTrainedModel):
    """transformers' base for ALBERT: its config class and checkpoint prefix; BERT's weight
    init and refused settings."""

    config_class = AlbertConfig
    base_model_prefix = "albert"
    _no_split_modules = ["BertEmbeddings", "AlbertLayer"]


class AlbertModel(EncoderModel, AlbertPreTrainedModel):
    """Embeddings [B, T, E], the shared layers, and (``add_pooling_layer``) ``pooler`` with
    tanh over the first token: transformers' AlbertModel."""

    def __init__(self, config: AlbertConfig, add_pooling_layer: bool = True):
        super().__init__(config)
        self.embeddings = BertEmbeddings(config, config.embedding_size)
        self.encoder = AlbertTransformer(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size) if add_pooling_layer else None
        self.pooler_activation = nn.Tanh() if add_pooling_layer else None
        self.post_init()

    def output(self, hidden: Tensor, hidden_states, attentions) -> BaseModelOutputWithPooling:
        pooled = None if self.pooler is None else self.pooler_activation(self.pooler(hidden[:, 0]))
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooled,
                                          hidden_states=hidden_states, attentions=attentions)


class AlbertTaskModel(AlbertPreTrainedModel):
    """An AlbertModel under ``albert``, for the heads; with its pooler when ``pooled``."""

    pooled = False

    def __init__(self, config: AlbertConfig):
        super().__init__(config)
        self.albert = AlbertModel(config, add_pooling_layer=self.pooled)


# --- the heads ---------------------------------------------------------------------------------

class AlbertMLMHead(nn.Module):
    """dense (H -> E) -> GELU -> LayerNorm -> ``decoder`` (E -> V, its weight tied to the
    word embeddings, its bias to ``bias``)."""

    def __init__(self, config):
        super().__init__()
        self.LayerNorm = LayerNorm(config.embedding_size, eps=config.layer_norm_eps)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.dense = nn.Linear(config.hidden_size, config.embedding_size)
        self.decoder = nn.Linear(config.embedding_size, config.vocab_size)
        self.approximate = GELU_APPROXIMATIONS[config.hidden_act]
        self.loss = LinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, hidden: Tensor, labels: Optional[Tensor] = None, logits_wanted: bool = True) -> tuple:
        return masked_lm(self.transform, self.decoder, hidden, labels, self.loss, logits_wanted)

    def transform(self, hidden: Tensor) -> Tensor:
        return self.LayerNorm(dense_gelu(self.dense, hidden, self.approximate))


class AlbertSOPHead(nn.Module):
    """dropout -> ``classifier``: sentence-order logits [B, 2] from the pooled first token."""

    def __init__(self, config):
        super().__init__()
        self.dropout = nn.Dropout(config.classifier_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, pooled: Tensor) -> Tensor:
        return self.classifier(self.dropout(pooled))


class _WithMaskedLMHead:
    """``predictions``, the masked-LM head, as the output embeddings (its decoder's weight
    tied to the word embeddings, its bias to the head's)."""

    _tied_weights_keys = {"predictions.decoder.weight": "albert.embeddings.word_embeddings.weight",
                          "predictions.decoder.bias": "predictions.bias"}

    def get_output_embeddings(self) -> nn.Linear:
        return self.predictions.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.predictions.decoder = value
        self.predictions.bias = value.bias


# --- the models --------------------------------------------------------------------------------

class AlbertForPreTraining(_WithMaskedLMHead, EncoderTaskModel, AlbertTaskModel):
    """Masked LM + sentence-order prediction: transformers' AlbertForPreTraining. The loss
    is the sum of the two (both labels given; ``labels`` token ids, -100 = not predicted;
    ``sentence_order_label`` 0 = in order, 1 = swapped). In training with labels the
    masked-LM head projects only the labelled rows and ``prediction_logits`` is None
    unless ``return_logits=True``."""

    pooled = True

    def __init__(self, config: AlbertConfig):
        super().__init__(config)
        self.predictions = AlbertMLMHead(config)
        self.sop_classifier = AlbertSOPHead(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None, sentence_order_label=None, output_attentions=None,
                output_hidden_states=None, return_dict=None, return_logits: bool = False):
        out = self.encode(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds,
                          output_attentions, output_hidden_states)
        return pretraining_output(self, out, self.predictions, labels, self.sop_classifier,
                                  sentence_order_label, AlbertForPreTrainingOutput, "sop_logits",
                                  return_logits, return_dict)


class AlbertForMaskedLM(_WithMaskedLMHead, MaskedLMMixin, AlbertTaskModel):
    """The masked-LM head alone: transformers' AlbertForMaskedLM."""

    def __init__(self, config: AlbertConfig):
        super().__init__(config)
        self.predictions = AlbertMLMHead(config)
        self.post_init()

    def predict_masked(self, hidden: Tensor, labels: Optional[Tensor], logits_wanted: bool) -> tuple:
        return self.predictions(hidden, labels, logits_wanted)


class AlbertForSequenceClassification(LinearClassifierMixin, SequenceClassificationMixin, AlbertTaskModel):
    """dropout (classifier_dropout_prob) -> linear over the pooled first token."""

    pooled = True

    def __init__(self, config: AlbertConfig):
        super().__init__(config)
        self.dropout = nn.Dropout(config.classifier_dropout_prob)

    @staticmethod
    def classified(out) -> Tensor:
        return out.pooler_output


class AlbertForTokenClassification(TokenClassificationMixin, AlbertTaskModel):
    """dropout -> linear per token: logits [B, T, num_labels]; labels -100 are ignored."""

    def __init__(self, config: AlbertConfig):
        super().__init__(config)
        p = config.classifier_dropout_prob
        self.dropout = nn.Dropout(config.hidden_dropout_prob if p is None else p)


class AlbertForQuestionAnswering(QuestionAnsweringMixin, AlbertTaskModel):
    """Span extraction: start and end logits per token; the loss needs both positions."""
