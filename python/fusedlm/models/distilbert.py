"""DistilBERT (Sanh et al., 2019) as transformers models, on fusedlm's fused ops.

DistilBERT is BERT with half the layers, distilled from it: no token types, no pooler,
and its own names (``q_lin`` ... ``out_lin``, ``sa_layer_norm``, ``ffn.lin1``/``lin2``,
``output_layer_norm``). Each layer is post-LN like BERT's: the attention's add and norm
in one ``add_layer_norm`` (DistilBERT drops nothing there), then the GELU FFN's two
products in one ``gelu_ffn`` and its dropout, add and norm in one ``add_layer_norm``.
With padding the tokens are packed once for the whole stack.

Every class named as in transformers subclasses ``transformers.PreTrainedModel``, takes
transformers' ``DistilBertConfig``, has transformers' module and parameter names (so its
loader and saver move checkpoints both ways, base <-> task through the ``distilbert``
prefix) and returns its output classes.

Shapes: B batch, T tokens, H hidden (``dim``), V vocab.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DistilBertConfig, PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (BaseModelOutput, MaskedLMOutput, QuestionAnsweringModelOutput,
                                           SequenceClassifierOutput, TokenClassifierOutput)

from ..nn import LayerNorm, LinearCrossEntropyLoss, linear_gelu_linear
from .bert import (GELU_APPROXIMATIONS, IGNORE_INDEX, AnyAttnImplementation, BertEncoder, InputEmbeddings,
                   OutputEmbeddings, check_activation, check_inputs, check_unchunked, classification_loss,
                   config_flag, dense_gelu, dropout_p, finish, masked_lm, self_attention, span_logits, span_loss,
                   token_loss)


def check_config(config) -> None:
    """Settings the fused path cannot honour are refused, never ignored."""
    check_activation("activation", config.activation)
    check_unchunked(config)
    if config.dim % config.n_heads:
        raise ValueError(f"dim ({config.dim}) must be a multiple of n_heads ({config.n_heads})")


def sinusoidal_positions(count: int, width: int) -> Tensor:
    """The Transformer's fixed position table (Vaswani et al.), [count, width] float32:
    position p's columns 2i and 2i + 1 hold sin and cos of p / 10000^(2i / width)."""
    angles = torch.arange(count, dtype=torch.float64)[:, None] / 10000 ** (
        torch.arange(width, dtype=torch.float64) // 2 * 2 / width)
    return torch.where(torch.arange(width) % 2 == 0, angles.sin(), angles.cos()).float()


class Embeddings(nn.Module):
    """word + position embeddings -> LayerNorm -> dropout: [B, T, H]. With
    sinusoidal_pos_embds the position table starts as sines and cosines (and stays trainable,
    as transformers')."""

    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.dim, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.dim)
        self.LayerNorm = LayerNorm(config.dim, eps=1e-12)
        self.dropout = config.dropout
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings)[None],
                             persistent=False)

    def forward(self, input_ids: Optional[Tensor], inputs_embeds: Optional[Tensor] = None,
                position_ids: Optional[Tensor] = None) -> Tensor:
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        if position_ids is None:
            position_ids = self.position_ids[:, :inputs_embeds.shape[1]]
        x = inputs_embeds + self.position_embeddings(position_ids)
        return F.dropout(self.LayerNorm(x), dropout_p(self, self.dropout))

    def resize_positions(self, count: int, sinusoidal: bool) -> None:
        """A position table of ``count`` rows: sines and cosines, or the learned rows kept
        and any new ones drawn as a new nn.Embedding's (transformers' rule)."""
        old = self.position_embeddings.weight
        table = nn.Embedding(count, old.shape[1], device=old.device, dtype=old.dtype)
        with torch.no_grad():
            if sinusoidal:
                table.weight.copy_(sinusoidal_positions(count, old.shape[1]))
            else:
                kept = min(count, old.shape[0])
                table.weight[:kept] = old[:kept]
        self.position_embeddings = table
        self.position_ids = torch.arange(count, device=self.position_ids.device)[None]


class DistilBertSelfAttention(nn.Module):
    """The q, k, v projections, the fused attention and ``out_lin``, over [B, T, H] or
    packed [tokens, H]."""

    def __init__(self, config):
        super().__init__()
        self.q_lin, self.k_lin, self.v_lin, self.out_lin = (nn.Linear(config.dim, config.dim)
                                                            for _ in range(4))
        self.heads = config.n_heads
        self.dropout = config.attention_dropout

    def forward(self, x: Tensor, packing: Optional[tuple], padding: Optional[Tensor],
                attentions: Optional[list]) -> Tensor:
        return self.out_lin(self_attention(x, (self.q_lin, self.k_lin, self.v_lin), self.heads, packing,
                                           padding, attentions, dropout_p(self, self.dropout)))


class FFN(nn.Module):
    """lin1 -> GELU -> lin2 (the dropout after lin2 runs fused with the add and norm)."""

    def __init__(self, config):
        super().__init__()
        self.lin1 = nn.Linear(config.dim, config.hidden_dim)
        self.lin2 = nn.Linear(config.hidden_dim, config.dim)
        self.dropout = config.dropout
        self.approximate = GELU_APPROXIMATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        return linear_gelu_linear(x, self.lin1, self.lin2, approximate=self.approximate)


class TransformerBlock(GradientCheckpointingLayer):
    """x -> LN(x + attn(x)) -> LN(. + drop(ffn(.))), each add fused into its norm;
    checkpointed as transformers' layers are."""

    def __init__(self, config):
        super().__init__()
        self.attention = DistilBertSelfAttention(config)
        self.sa_layer_norm = LayerNorm(config.dim, eps=1e-12)
        self.ffn = FFN(config)
        self.output_layer_norm = LayerNorm(config.dim, eps=1e-12)

    def forward(self, x: Tensor, packing: Optional[tuple] = None, padding: Optional[Tensor] = None,
                attentions: Optional[list] = None) -> Tensor:
        h, _ = self.sa_layer_norm(self.attention(x, packing, padding, attentions), x)
        out, _ = self.output_layer_norm(self.ffn(h), h, dropout_p=dropout_p(self, self.ffn.dropout))
        return out


class DistilBertPreTrainedModel(AnyAttnImplementation, PreTrainedModel):
    """transformers' base for DistilBERT: its config class, checkpoint prefix and init, and
    the position table's access and resizing."""

    config_class = DistilBertConfig
    base_model_prefix = "distilbert"
    supports_gradient_checkpointing = True
    _no_split_modules = ["TransformerBlock"]

    def __init__(self, config, *args, **kwargs):
        check_config(config)
        super().__init__(config, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, Embeddings):  # buffers too: a load builds the model empty
            if self.config.sinusoidal_pos_embds:  # (a loaded table is kept: init skips it)
                init.copy_(module.position_embeddings.weight,
                           sinusoidal_positions(*module.position_embeddings.weight.shape))
            init.copy_(module.position_ids, torch.arange(module.position_ids.shape[-1])[None])

    def get_position_embeddings(self) -> nn.Embedding:
        return self.base_model.embeddings.position_embeddings

    def resize_position_embeddings(self, new_num_position_embeddings: int) -> None:
        """transformers' resize: the table gets ``new_num_position_embeddings`` rows (see
        Embeddings.resize_positions) and config.max_position_embeddings says so."""
        count = new_num_position_embeddings
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"new_num_position_embeddings must be a positive int, got {count!r}")
        if count != self.config.max_position_embeddings:
            self.base_model.embeddings.resize_positions(count, self.config.sinusoidal_pos_embds)
            self.config.max_position_embeddings = count


class DistilBertModel(InputEmbeddings, DistilBertPreTrainedModel):
    """Embeddings and the transformer: transformers' DistilBertModel."""

    def __init__(self, config: DistilBertConfig):
        super().__init__(config)
        self.embeddings = Embeddings(config)
        self.transformer = BertEncoder(config, TransformerBlock)  # transformers' Transformer
        self.post_init()

    def forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                inputs_embeds: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                output_attentions: Optional[bool] = None, output_hidden_states: Optional[bool] = None,
                return_dict: Optional[bool] = None):
        check_inputs(input_ids, inputs_embeds, attention_mask, None, self.config.max_position_embeddings)
        attend = config_flag(self.config, "output_attentions", output_attentions, False)
        states = config_flag(self.config, "output_hidden_states", output_hidden_states, False)
        x = self.embeddings(input_ids, inputs_embeds, position_ids)
        hidden, hidden_states, attentions = self.transformer(x, attention_mask, states, attend)
        return finish(BaseModelOutput(last_hidden_state=hidden, hidden_states=hidden_states,
                                      attentions=attentions), self.config, return_dict)


class _TaskModel(DistilBertPreTrainedModel):
    """A DistilBertModel under ``distilbert``, and its call with transformers' arguments."""

    def __init__(self, config: DistilBertConfig):
        super().__init__(config)
        self.distilbert = DistilBertModel(config)

    def encode(self, input_ids, attention_mask, inputs_embeds, position_ids, output_attentions,
               output_hidden_states):
        return self.distilbert(input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                               position_ids=position_ids, output_attentions=output_attentions,
                               output_hidden_states=output_hidden_states, return_dict=True)

    def finished(self, output_class, out, return_dict, **fields):
        return finish(output_class(**fields, hidden_states=out.hidden_states, attentions=out.attentions),
                      self.config, return_dict)


class DistilBertForMaskedLM(OutputEmbeddings, _TaskModel):
    """``vocab_transform`` -> GELU -> ``vocab_layer_norm`` -> ``vocab_projector`` (its weight
    tied to the word embeddings): transformers' DistilBertForMaskedLM. In training with
    labels the loss comes from the labelled rows only and ``logits`` is None unless
    ``return_logits=True``."""

    _tied_weights_keys = {"vocab_projector.weight": "distilbert.embeddings.word_embeddings.weight"}
    output_embeddings_attribute = "vocab_projector"

    def __init__(self, config: DistilBertConfig):
        super().__init__(config)
        self.vocab_transform = nn.Linear(config.dim, config.dim)
        self.vocab_layer_norm = LayerNorm(config.dim, eps=1e-12)
        self.vocab_projector = nn.Linear(config.dim, config.vocab_size)
        self.approximate = GELU_APPROXIMATIONS[config.activation]
        self.mlm_loss = LinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)
        self.post_init()

    def transform(self, hidden: Tensor) -> Tensor:
        return self.vocab_layer_norm(dense_gelu(self.vocab_transform, hidden, self.approximate))

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                position_ids=None, output_attentions=None, output_hidden_states=None, return_dict=None,
                return_logits: bool = False):
        out = self.encode(input_ids, attention_mask, inputs_embeds, position_ids, output_attentions,
                          output_hidden_states)
        loss, logits = masked_lm(self.transform, self.vocab_projector, out.last_hidden_state, labels,
                                 self.mlm_loss, return_logits)
        return self.finished(MaskedLMOutput, out, return_dict, loss=loss, logits=logits)


class DistilBertForSequenceClassification(_TaskModel):
    """First token -> ``pre_classifier`` -> ReLU -> dropout -> ``classifier``: logits
    [B, num_labels]; the loss follows transformers' problem_type rule."""

    def __init__(self, config: DistilBertConfig):
        super().__init__(config)
        self.pre_classifier = nn.Linear(config.dim, config.dim)
        self.classifier = nn.Linear(config.dim, config.num_labels)
        self.dropout = nn.Dropout(config.seq_classif_dropout)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                position_ids=None, output_attentions=None, output_hidden_states=None, return_dict=None):
        out = self.encode(input_ids, attention_mask, inputs_embeds, position_ids, output_attentions,
                          output_hidden_states)
        pooled = self.dropout(torch.relu(self.pre_classifier(out.last_hidden_state[:, 0])))
        logits = self.classifier(pooled)
        loss = None if labels is None else classification_loss(logits, labels, self.config)
        return self.finished(SequenceClassifierOutput, out, return_dict, loss=loss, logits=logits)


class DistilBertForTokenClassification(_TaskModel):
    """dropout -> ``classifier`` per token: logits [B, T, num_labels]; labels -100 and
    labels at padding are ignored."""

    def __init__(self, config: DistilBertConfig):
        super().__init__(config)
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.dim, config.num_labels)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, labels=None,
                position_ids=None, output_attentions=None, output_hidden_states=None, return_dict=None):
        out = self.encode(input_ids, attention_mask, inputs_embeds, position_ids, output_attentions,
                          output_hidden_states)
        logits = self.classifier(self.dropout(out.last_hidden_state))
        loss = None if labels is None else token_loss(logits, labels, attention_mask)
        return self.finished(TokenClassifierOutput, out, return_dict, loss=loss, logits=logits)


class DistilBertForQuestionAnswering(_TaskModel):
    """dropout (``qa_dropout``) -> ``qa_outputs``: start and end logits per token, padding
    never an answer; the loss needs both positions."""

    def __init__(self, config: DistilBertConfig):
        if config.num_labels != 2:
            raise ValueError(f"question answering needs num_labels == 2 (start and end), got "
                             f"{config.num_labels}")
        super().__init__(config)
        self.qa_outputs = nn.Linear(config.dim, 2)
        self.dropout = nn.Dropout(config.qa_dropout)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, start_positions=None,
                end_positions=None, position_ids=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        out = self.encode(input_ids, attention_mask, inputs_embeds, position_ids, output_attentions,
                          output_hidden_states)
        start, end = span_logits(self.qa_outputs(self.dropout(out.last_hidden_state)), attention_mask)
        loss = None
        if start_positions is not None and end_positions is not None:
            loss = span_loss(start, end, start_positions, end_positions)
        return self.finished(QuestionAnsweringModelOutput, out, return_dict, loss=loss,
                             start_logits=start, end_logits=end)
