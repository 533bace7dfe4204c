"""What the command line knows about each model: one :class:`ModelSpec` per model.

A spec says how to build the model at a ``--size``, which tokenizer it uses, how token
blocks become a training batch and a loss, and which classes serve each command. The
commands read specs only; adding a model is adding an entry here.
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable, Dict, Optional

import torch
from torch import Tensor

from . import loading
from . import tokenizer as tok
from .errors import UsageError


@dataclasses.dataclass(frozen=True)
class Size:
    layers: int
    hidden: int
    heads: int
    vocab: int  # the tokenizer trained on the corpus has at most this many tokens
    lr: float


SIZES = {
    "tiny": Size(layers=2, hidden=128, heads=2, vocab=8000, lr=1e-3),
    "small": Size(layers=12, hidden=256, heads=4, vocab=16000, lr=5e-4),  # ELECTRA-Small
    "base": Size(layers=12, hidden=768, heads=12, vocab=32000, lr=1e-4),  # BERT-base, GPT-2 small
}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """``build(size, tokenizer, dropout, embedding_size)``: a fresh model to pretrain
    (``embedding_size``: None, or the width of factorized embeddings: ``factorized``).
    ``blocks(documents, tokenizer, seq_len)``: the corpus (a list of texts) as a
    [blocks, seq_len, ...] tensor.
    ``batch(blocks, tokenizer, generator)``: the inputs of a global micro-batch (dict of
    tensors whose first dimension is the batch; rows are split between processes).
    ``loss(model, inputs, generator)``: the training loss of one process's rows.
    ``heads``: how each command (``pretrain`` to resume, ``generate``, ``embed``, ...)
    loads a folder: the class, and the parts that may start new or go unused.
    ``positions(config)``: the longest sequence the model takes.
    ``export(model)``: what pretraining leaves in the output folder for the other
    commands (the model itself, or the part of it that is used afterwards).
    ``resume(folder)``: the model a pretraining checkpoint holds (default: the
    ``pretrain`` head's).
    ``hidden(model, tokenizer, texts, device, length=None)``: the ``embed`` head's token
    vectors of a batch of texts, each cut to ``length`` tokens (None: the model's
    positions): (float [batch, seq, width], bool mask [batch, seq] True = token, number
    of texts cut).
    ``layers(model)``: the submodules ``--fsdp`` shards one by one (transformer blocks,
    LSTM layers); parameters shared between submodules (tied embeddings) must stay
    outside them, in the root. None: the model cannot be sharded."""

    name: str
    model_type: str
    tokenizer: str
    build: Callable
    blocks: Callable
    batch: Callable
    loss: Callable
    heads: Dict[str, loading.Head]
    positions: Callable
    export: Callable = lambda model: model
    resume: Optional[Callable] = None
    hidden: Optional[Callable] = None
    layers: Optional[Callable] = None
    factorized: bool = False

    def load_checkpoint(self, folder):
        """The model a pretraining checkpoint holds, every tensor of it from the files."""
        if self.resume is not None:
            return self.resume(folder)
        return loading.load(folder, self.heads["pretrain"], flag="--resume").model


def token_ids(tokenizer, documents) -> list:
    return [e.ids for e in tokenizer.encode_batch(list(documents), add_special_tokens=False)]


def pack(documents, length: int, separator: Optional[int], prefix=(), suffix=()) -> Tensor:
    """The documents' tokens (lists of ids) as one stream (``separator`` between
    documents) cut into [n, length] blocks, each framed by ``prefix`` and ``suffix``; the
    last partial block is dropped."""
    stream = []
    for ids in documents:
        stream.extend(ids)
        if separator is not None:
            stream.append(separator)
    body = length - len(prefix) - len(suffix)
    if body < 1:
        raise UsageError(f"--seq-len {length} leaves no room for text besides the "
                         f"{len(prefix) + len(suffix)} special tokens")
    n = len(stream) // body
    blocks = torch.tensor(stream[:n * body], dtype=torch.long).view(n, body)
    frame = [torch.tensor(list(t), dtype=torch.long).expand(n, len(t)) for t in (prefix, suffix)]
    return torch.cat([frame[0], blocks, frame[1]], dim=1)


# GPT: byte-level BPE, documents separated by <|endoftext|>, every position a target.

def _gpt_build(size: Size, tokenizer, dropout: Optional[float], embedding_size=None):
    from transformers import GPT2Config

    from ..models.gpt import GPT2LMHeadModel

    eos = tok.special_id(tokenizer, tok.ENDOFTEXT)
    extra = {} if dropout is None else dict(resid_pdrop=dropout, embd_pdrop=dropout,
                                            attn_pdrop=dropout)
    config = GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=1024,
                        n_embd=size.hidden, n_layer=size.layers, n_head=size.heads,
                        bos_token_id=eos, eos_token_id=eos, **extra)
    return GPT2LMHeadModel(config)


def _gpt_blocks(documents, tokenizer, seq_len: int) -> Tensor:
    return pack(token_ids(tokenizer, documents), seq_len, tok.special_id(tokenizer, tok.ENDOFTEXT))


def _gpt_batch(blocks: Tensor, tokenizer, generator: torch.Generator) -> dict:
    return {"input_ids": blocks}


def _lm_loss(model, inputs: dict, generator: torch.Generator) -> Tensor:
    return model(inputs["input_ids"], labels=inputs.get("labels", inputs["input_ids"])).loss


GPT = ModelSpec(
    name="gpt", model_type="gpt2", tokenizer="bpe", build=_gpt_build, blocks=_gpt_blocks,
    batch=_gpt_batch, loss=_lm_loss,
    # The head is tied to the token embedding: a GPT2Model folder serves as well.
    heads={"pretrain": loading.Head("gpt.GPT2LMHeadModel"),
           "generate": loading.Head("gpt.GPT2LMHeadModel")},
    positions=lambda config: config.n_positions, layers=lambda model: list(model.transformer.h))


# BERT and ELECTRA: WordPiece, [CLS] block [SEP] (documents separated by [SEP]), BERT's
# dynamic masking drawn for each global batch.

def _bert_config(config_class, size: Size, tokenizer, dropout: Optional[float], **extra):
    if dropout is not None:
        extra.update(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    extra.setdefault("max_position_embeddings", 512)
    return config_class(vocab_size=tokenizer.get_vocab_size(), hidden_size=size.hidden,
                        num_hidden_layers=size.layers, num_attention_heads=size.heads,
                        intermediate_size=4 * size.hidden,
                        pad_token_id=tok.role_id(tokenizer, "pad"), **extra)


def _bert_blocks(documents, tokenizer, seq_len: int) -> Tensor:
    """[CLS] text [SEP] blocks (RoBERTa: <s> text </s>), documents separated by [SEP]:
    full sentences packed across document ends, as RoBERTa's FULL-SENTENCES."""
    cls, sep = tok.role_id(tokenizer, "cls"), tok.role_id(tokenizer, "sep")
    return pack(token_ids(tokenizer, documents), seq_len, sep, prefix=(cls,), suffix=(sep,))


def _masked_batch(blocks: Tensor, tokenizer, generator: torch.Generator) -> dict:
    from ..models import mask_tokens

    input_ids, labels = mask_tokens(
        blocks, mask_token_id=tok.role_id(tokenizer, "mask"),
        vocab_size=tokenizer.get_vocab_size(), special_token_ids=tok.special_ids(tokenizer),
        generator=generator)
    return {"input_ids": input_ids, "labels": labels}


def _electra_loss(model, inputs: dict, generator: torch.Generator) -> Tensor:
    # The generator's samples at the masked positions come from ``generator``.
    return model(inputs["input_ids"], labels=inputs["labels"], generator=generator).loss


def _max_positions(config) -> int:
    return config.max_position_embeddings


def _encoder_hidden(model, tokenizer, texts, device, length=None) -> tuple:
    """``hidden`` of a transformer encoder (BertModel, ElectraModel): WordPiece, padded."""
    positions = SPECS_BY_TYPE[model.config.model_type].positions(model.config)
    tokenizer.enable_truncation(positions if length is None else min(length, positions))
    pad = tok.role(tokenizer, "pad")
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id(pad), pad_token=pad)
    batch = tokenizer.encode_batch(texts)
    ids = torch.tensor([e.ids for e in batch], device=device)
    mask = torch.tensor([e.attention_mask for e in batch], device=device)
    out = model(ids, attention_mask=mask).last_hidden_state.float()
    return out, mask.bool(), sum(bool(e.overflowing) for e in batch)


def _bert_build(size: Size, tokenizer, dropout: Optional[float], embedding_size=None):
    from transformers import BertConfig

    from ..models.bert import BertForMaskedLM

    return BertForMaskedLM(_bert_config(BertConfig, size, tokenizer, dropout))


def _encoder_heads(module: str, family: str, unused: tuple, *, pretrain: Optional[str] = None,
                   classifier_new: tuple = ("classifier.",), embed_kwargs: Optional[dict] = None,
                   masked_lm_hint: Optional[str] = None) -> Dict[str, loading.Head]:
    """The heads an encoder family's folders serve: ``<module>.<family>ForMaskedLM`` fills
    masks, ``<family>Model`` embeds, its sequence and token classifiers fine-tune (their
    ``classifier_new`` parts start new) and ``pretrain`` (a class name) trains. ``unused``:
    the parts of its folders besides the encoder, which a command may leave unread."""
    masked_lm = f"{family}ForMaskedLM"
    if masked_lm_hint is None:
        folders = masked_lm if pretrain in (None, masked_lm) else f"{masked_lm} or {pretrain}"
        masked_lm_hint = f"fill-mask needs {'an' if family[0] in 'AEIOU' else 'a'} {folders} folder"
    heads = {
        "fill-mask": loading.Head(f"{module}.{masked_lm}", unused=unused,
                                  what="masked-LM head", hint=masked_lm_hint),
        "embed": loading.Head(f"{module}.{family}Model", unused=unused, kwargs=embed_kwargs or {}),
        "classify": loading.Head(f"{module}.{family}ForSequenceClassification", unused=unused,
                                 new=classifier_new),
        "tag": loading.Head(f"{module}.{family}ForTokenClassification", unused=unused,
                            new=("classifier.",)),
    }
    if pretrain is not None:
        heads["pretrain"] = loading.Head(f"{module}.{pretrain}")
    return heads


# Embeddings need no pooler; a classifier that reads it starts it new where a folder has none.
NO_POOLER = {"add_pooling_layer": False}
POOLED_CLASSIFIER = ("classifier.", "pooler.")

# The parts of BERT's and ELECTRA's folders besides the encoder: the pretraining heads,
# BERT's pooler and the fine-tuning heads. A command reads the ones it uses and may leave
# the others unread; which of its own may start new is the Head's ``new``.
BERT_HEADS = ("cls.", "pooler.", "classifier.", "qa_outputs.")
ELECTRA_HEADS = ("discriminator_predictions.", "generator_predictions.", "generator_lm_head.",
                 "classifier.", "qa_outputs.")

BERT = ModelSpec(
    name="bert", model_type="bert", tokenizer="wordpiece",
    build=_bert_build,
    blocks=_bert_blocks, batch=_masked_batch, loss=_lm_loss,
    # The classifier reads the pooler, which a masked-LM folder has none of: then it is new
    # too, part of the head being fine-tuned.
    heads=_encoder_heads("bert", "Bert", BERT_HEADS, pretrain="BertForMaskedLM",
                         embed_kwargs=NO_POOLER, classifier_new=POOLED_CLASSIFIER,
                         masked_lm_hint="fill-mask needs a BertForMaskedLM or "
                                        "BertForPreTraining folder"),
    positions=_max_positions, hidden=_encoder_hidden,
    layers=lambda model: list(model.bert.encoder.layer))


# RoBERTa: byte-level BPE, <s> block </s>, no next-sentence task, BERT's dynamic masking
# drawn for each global batch.

def _roberta_build(size: Size, tokenizer, dropout: Optional[float], embedding_size=None):
    from transformers import RobertaConfig

    from ..models.roberta import RobertaForMaskedLM

    bos, eos = tok.role_id(tokenizer, "cls"), tok.role_id(tokenizer, "sep")
    # 512 positions after pad_token_id's (RoBERTa's table of 514 for <pad> = 1).
    pad = tok.role_id(tokenizer, "pad")
    return RobertaForMaskedLM(_bert_config(RobertaConfig, size, tokenizer, dropout, type_vocab_size=1,
                                           max_position_embeddings=pad + 513, bos_token_id=bos,
                                           eos_token_id=eos))


def _roberta_positions(config) -> int:
    """RoBERTa's positions start at pad_token_id + 1."""
    return config.max_position_embeddings - config.pad_token_id - 1


ROBERTA_HEADS = ("lm_head.", "pooler.", "classifier.", "qa_outputs.")

ROBERTA = ModelSpec(
    name="roberta", model_type="roberta", tokenizer="roberta-bpe", build=_roberta_build,
    blocks=_bert_blocks, batch=_masked_batch, loss=_lm_loss,
    heads=_encoder_heads("roberta", "Roberta", ROBERTA_HEADS, pretrain="RobertaForMaskedLM",
                         embed_kwargs=NO_POOLER),
    positions=_roberta_positions, hidden=_encoder_hidden,
    layers=lambda model: list(model.roberta.encoder.layer))


# ALBERT: WordPiece, one layer's weights shared by every layer, embeddings of
# --embedding-size projected up, and sentence-order prediction: each row is two
# consecutive segments of a block, [CLS] A [SEP] B [SEP], swapped in half the rows.

def _albert_build(size: Size, tokenizer, dropout: Optional[float], embedding_size=None):
    from transformers import AlbertConfig

    from ..models.albert import AlbertForPreTraining

    # The sentence-order head's dropout too.
    extra = {} if dropout is None else {"classifier_dropout_prob": dropout}
    return AlbertForPreTraining(_bert_config(
        AlbertConfig, size, tokenizer, dropout, **extra, embedding_size=embedding_size or 128,
        num_hidden_groups=1, inner_group_num=1, hidden_act="gelu_new",
        bos_token_id=tok.role_id(tokenizer, "cls"), eos_token_id=tok.role_id(tokenizer, "sep")))


def _albert_blocks(documents, tokenizer, seq_len: int) -> Tensor:
    """The text of each row without its [CLS] and two [SEP]s, which the batch places."""
    if seq_len < 5:
        raise UsageError(f"--seq-len {seq_len}: sentence-order prediction needs at least 5 "
                         "tokens, two segments of text and [CLS] [SEP] [SEP]")
    return pack(token_ids(tokenizer, documents), seq_len - 3, tok.role_id(tokenizer, "sep"))


def _sentence_order_batch(blocks: Tensor, tokenizer, generator: torch.Generator) -> dict:
    """Each block cut in two consecutive segments at a random point, A B in order
    (sentence_order_label 0) or B A (1), then masked as BERT's."""
    n, body = blocks.shape
    cut = torch.randint(1, body, (n, 1), generator=generator)
    swapped = torch.rand(n, 1, generator=generator) < 0.5
    # Swapped rows read the block from the cut on, around: B then A.
    start = torch.where(swapped, cut, 0)
    text = blocks.gather(1, (torch.arange(body) + start) % body)
    first = torch.where(swapped, body - cut, cut)  # the first segment's length
    seq = torch.arange(body + 3)
    after_first = seq > first + 1  # past [CLS] first [SEP]
    at = (seq - 1 - after_first.long()).clamp(0, body - 1).expand(n, -1)
    ids = text.gather(1, at)
    ids[:, 0] = tok.role_id(tokenizer, "cls")
    sep = tok.role_id(tokenizer, "sep")
    ids = torch.where(seq == first + 1, sep, ids)
    ids[:, -1] = sep
    batch = _masked_batch(ids, tokenizer, generator)
    return {**batch, "token_type_ids": after_first.long(),
            "sentence_order_label": swapped.long().view(n)}


def _albert_loss(model, inputs: dict, generator: torch.Generator) -> tuple:
    out = model(inputs["input_ids"], token_type_ids=inputs["token_type_ids"],
                labels=inputs["labels"], sentence_order_label=inputs["sentence_order_label"])
    right = out.sop_logits.detach().argmax(-1) == inputs["sentence_order_label"]
    return out.loss, {"sop_accuracy": right.float().mean()}


ALBERT_HEADS = ("predictions.", "sop_classifier.", "pooler.", "classifier.", "qa_outputs.")

ALBERT = ModelSpec(
    name="albert", model_type="albert", tokenizer="wordpiece", build=_albert_build,
    blocks=_albert_blocks, batch=_sentence_order_batch, loss=_albert_loss,
    heads=_encoder_heads("albert", "Albert", ALBERT_HEADS, pretrain="AlbertForPreTraining",
                         embed_kwargs=NO_POOLER, classifier_new=POOLED_CLASSIFIER),
    positions=_max_positions, hidden=_encoder_hidden, factorized=True,
    # One layer's weights serve every layer: the encoder is sharded as one unit.
    layers=lambda model: [model.albert.encoder])


# DistilBERT: BERT's data without token types, 6 layers in its own layout.

def _distilbert_build(size: Size, tokenizer, dropout: Optional[float], embedding_size=None):
    from transformers import DistilBertConfig

    from ..models.distilbert import DistilBertForMaskedLM

    extra = {} if dropout is None else dict(dropout=dropout, attention_dropout=dropout)
    return DistilBertForMaskedLM(DistilBertConfig(
        vocab_size=tokenizer.get_vocab_size(), dim=size.hidden, n_layers=size.layers,
        n_heads=size.heads, hidden_dim=4 * size.hidden, max_position_embeddings=512,
        pad_token_id=tok.role_id(tokenizer, "pad"), **extra))


DISTILBERT_HEADS = ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.",
                    "pre_classifier.", "classifier.", "qa_outputs.")

DISTILBERT = ModelSpec(
    name="distilbert", model_type="distilbert", tokenizer="wordpiece", build=_distilbert_build,
    blocks=_bert_blocks, batch=_masked_batch, loss=_lm_loss,
    heads=_encoder_heads("distilbert", "DistilBert", DISTILBERT_HEADS,
                         pretrain="DistilBertForMaskedLM",
                         classifier_new=("pre_classifier.", "classifier.")),
    positions=_max_positions, hidden=_encoder_hidden,
    layers=lambda model: list(model.distilbert.transformer.layer))


def _electra_build(size: Size, tokenizer, dropout: Optional[float], embedding_size=None):
    from transformers import ElectraConfig

    from ..models.electra import ElectraForJointPreTraining

    # ELECTRA-Small's 128-wide embeddings, projected up, below base size.
    if embedding_size is None:
        embedding_size = 128 if size.hidden <= 256 else size.hidden
    return ElectraForJointPreTraining(_bert_config(
        ElectraConfig, size, tokenizer, dropout, embedding_size=embedding_size))


def _electra_resume(folder):
    """A checkpoint's generator/ and discriminator/, joined again on the discriminator's
    embeddings."""
    from ..models.electra import ElectraForJointPreTraining

    halves = [loading.load(Path(folder) / part, loading.Head(f"electra.{model}"),
                           flag="--resume").model
              for part, model in (("generator", "ElectraForMaskedLM"),
                                  ("discriminator", "ElectraForPreTraining"))]
    return ElectraForJointPreTraining.from_parts(*halves)


ELECTRA = ModelSpec(
    name="electra", model_type="electra", tokenizer="wordpiece", build=_electra_build,
    blocks=_bert_blocks, batch=_masked_batch, loss=_electra_loss,
    heads=_encoder_heads("electra", "Electra", ELECTRA_HEADS,
                         masked_lm_hint="fill-mask needs ELECTRA's generator (an "
                                        "ElectraForMaskedLM folder), not its discriminator"),
    positions=_max_positions, factorized=True,
    # The discriminator is the model ELECTRA's pretraining is for (transformers'
    # ElectraForPreTraining); the checkpoints keep both halves.
    export=lambda model: model.discriminator, resume=_electra_resume, hidden=_encoder_hidden,
    # The embeddings both halves share stay in the root.
    layers=lambda model: [*model.generator.electra.encoder.layer,
                          *model.discriminator.electra.encoder.layer])


# ELMo: words read as characters; a block holds, per word, its id in the softmax
# vocabulary and its character ids ([blocks, seq_len, 1 + max characters]).

def _elmo_build(size: Size, tokenizer, dropout: Optional[float], embedding_size=None):
    from ..models.elmo import ElmoBiLM, ElmoConfig

    projection = min(size.hidden, 512)
    small = size.hidden <= 128
    config = ElmoConfig(
        filters=[[1, 32], [2, 32], [3, 64], [4, 128]] if small else ElmoConfig().filters,
        n_highway=1 if small else 2, projection_dim=projection,
        lstm_dim=4096 if projection == 512 else 4 * projection,
        vocab_size=tokenizer.get_vocab_size(), **({} if dropout is None else {"dropout": dropout}))
    return ElmoBiLM(config)


def _elmo_words(tokenizer, texts) -> list:
    """Each text's words as the tokenizer splits them (their surface form, which ELMo
    reads, and the vocabulary id it predicts)."""
    encoded = tokenizer.encode_batch(list(texts))
    return [[(text[a:b], i) for (a, b), i in zip(e.offsets, e.ids)]
            for text, e in zip(texts, encoded)]


def _elmo_blocks(documents, tokenizer, seq_len: int) -> Tensor:
    from ..models.elmo import word_to_char_ids

    # One row per distinct word ([id, characters...]), gathered into the word stream.
    rows, index, stream = [], {}, []
    for sentence in _elmo_words(tokenizer, documents):
        for word, i in sentence:
            if word not in index:
                index[word] = len(rows)
                rows.append([i, *word_to_char_ids(word)])
            stream.append(index[word])
    n = len(stream) // seq_len
    if not rows:
        return torch.zeros(0, seq_len, 1, dtype=torch.int32)
    table = torch.tensor(rows, dtype=torch.int32)
    return table[torch.tensor(stream[:n * seq_len], dtype=torch.long)].view(n, seq_len, -1)


def _elmo_batch(blocks: Tensor, tokenizer, generator: torch.Generator) -> dict:
    return {"char_ids": blocks[..., 1:].long(), "word_ids": blocks[..., 0].long()}


def _elmo_loss(model, inputs: dict, generator: torch.Generator) -> Tensor:
    return model(inputs["char_ids"], inputs["word_ids"]).loss


ELMO_NEW, ELMO_UNUSED = ("mixes.",), ("softmax_",)


def _elmo_export(model):
    """The ELMo (character encoder, biLSTM, fresh scalar mixes) of a trained biLM."""
    from ..models.elmo import ELMo

    elmo = ELMo(model.config)
    missing, unexpected = elmo.load_state_dict(model.state_dict(), strict=False)
    # All but the mixes come from the biLM; all of it but the word softmax is used.
    left = [k for k in missing if not k.startswith(ELMO_NEW)]
    left += [k for k in unexpected if not k.startswith(ELMO_UNUSED)]
    if left:
        raise RuntimeError(f"the biLM and ELMo differ in more than the mixes and the "
                           f"softmax: {', '.join(left)}")
    return elmo


def _elmo_hidden(model, tokenizer, texts, device, length=None) -> tuple:
    from ..models.elmo import batch_to_ids

    sentences = [[w for w, _ in sentence] for sentence in _elmo_words(tokenizer, texts)]
    words = [sentence[:length] for sentence in sentences]
    char_ids = batch_to_ids(words, model.config.max_characters_per_token)
    out = model(char_ids.to(device))
    cut = sum(len(kept) < len(sentence) for kept, sentence in zip(words, sentences))
    return out.last_hidden_state.float(), out.mask, cut


ELMO = ModelSpec(
    name="elmo", model_type="elmo", tokenizer="words", build=_elmo_build, blocks=_elmo_blocks,
    batch=_elmo_batch, loss=_elmo_loss,
    # ELMo's scalar mixes are its task head (a biLM folder has none); the word softmax
    # only trains the biLM.
    heads={"pretrain": loading.Head("elmo.ElmoBiLM"),
           "embed": loading.Head("elmo.ELMo", new=ELMO_NEW, unused=ELMO_UNUSED)},
    positions=lambda config: sys.maxsize,  # an LSTM takes any length
    export=_elmo_export, hidden=_elmo_hidden,
    layers=lambda model: [*model.lstm.forward_layers, *model.lstm.backward_layers])

# ULMFiT: fastai's AWD-LSTM language models, forward and backward, on lower-cased words;
# each text begins with [CLS] (fastai's xxbos) in one stream cut into blocks.

def _ulmfit_build(size: Size, tokenizer, dropout: Optional[float], embedding_size=None):
    from ..models.awd_lstm import AWDLSTMConfig, AWDLSTMForLanguageModeling

    base = size.hidden >= AWDLSTMConfig.emb_size
    rates = {} if dropout is None else {name: dropout for name in
                                        ("embed_p", "input_p", "hidden_p", "weight_p", "output_p")}
    return AWDLSTMForLanguageModeling(AWDLSTMConfig(
        vocab_size=tokenizer.get_vocab_size(), pad_token_id=tok.role_id(tokenizer, "pad"),
        emb_size=AWDLSTMConfig.emb_size if base else size.hidden,
        hidden_size=AWDLSTMConfig.hidden_size if base else 3 * size.hidden,
        directions="both", **rates))


def ulmfit_blocks(documents, tokenizer, seq_len: int) -> Tensor:
    cls = tok.role_id(tokenizer, "cls")
    return pack([[cls, *ids] for ids in token_ids(tokenizer, documents)], seq_len, None)


def _padded_batch(tokenizer, texts, device, length=None) -> tuple:
    """(ids, attention mask, number of texts cut) of texts, each begun with [CLS], cut to
    ``length`` tokens (None: whole) and padded on the right."""
    pad = tok.role(tokenizer, "pad")
    tokenizer.enable_padding(pad_id=tokenizer.token_to_id(pad), pad_token=pad)
    if length is not None:
        tokenizer.enable_truncation(length)
    try:
        batch = tokenizer.encode_batch(list(texts))
    finally:
        tokenizer.no_padding()
        if length is not None:
            tokenizer.no_truncation()
    ids = torch.tensor([e.ids for e in batch], device=device)
    mask = torch.tensor([e.attention_mask for e in batch], device=device)
    return ids, mask, sum(bool(e.overflowing) for e in batch)


def _ulmfit_hidden(model, tokenizer, texts, device, length=None) -> tuple:
    ids, mask, cut = _padded_batch(tokenizer, texts, device, length)
    out = model(ids, attention_mask=mask).last_hidden_state.float()
    return out, mask.bool(), cut


ULMFIT_LM = loading.Head("awd_lstm.AWDLSTMForLanguageModeling")

ULMFIT = ModelSpec(
    name="ulmfit", model_type="awd_lstm", tokenizer="ulmfit", build=_ulmfit_build,
    blocks=ulmfit_blocks, batch=_gpt_batch, loss=_lm_loss,
    # A language model's folder holds the decoders' biases, a classifier's its heads.
    heads={"pretrain": ULMFIT_LM, "generate": ULMFIT_LM, "lm-finetune": ULMFIT_LM,
           "embed": loading.Head("awd_lstm.AWDLSTMModel", unused=("decoders.", "classifiers."))},
    positions=lambda config: sys.maxsize, hidden=_ulmfit_hidden,
    # The embeddings, which the decoders read too, stay in the root.
    layers=lambda model: [rnn for lstm in model.awd_lstm.lstms for rnn in lstm.rnns])

SPECS = {spec.name: spec for spec in (BERT, ROBERTA, ALBERT, DISTILBERT, ELECTRA, ELMO, GPT, ULMFIT)}
SPECS_BY_TYPE = {spec.model_type: spec for spec in SPECS.values()}


def by_model_type(model_type: str) -> Optional[ModelSpec]:
    return SPECS_BY_TYPE.get(model_type)
