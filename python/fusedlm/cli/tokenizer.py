"""Tokenizers from Hugging Face ``tokenizers`` (an optional dependency), trained on the
corpus and saved with the model as ``tokenizer.json``.

``wordpiece``: BERT's (lower-cased, [CLS] text [SEP]); ``bpe``: GPT-2's byte-level BPE,
whose <|endoftext|> separates documents; ``roberta-bpe``: RoBERTa's byte-level BPE
(case kept, <s> text </s>, <pad> and <mask>); ``words``: ELMo's softmax vocabulary, the
most frequent words (case kept) and [UNK] (ELMo reads each word's characters; the ids
only name the word to predict); ``ulmfit``: ULMFiT's word vocabulary, the most frequent
lower-cased words, with [UNK], [PAD] and [CLS] (fastai's xxunk, xxpad and xxbos: ids 0, 1
and 2), [CLS] beginning each text.

The encoders' special tokens are known by their role (:func:`role_id`): [PAD] or <pad>,
[CLS] or <s>, [SEP] or </s>, [MASK] or <mask>, [UNK] or <unk>.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .errors import UsageError

FILE_NAME = "tokenizer.json"
WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
ROBERTA_SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")
ULMFIT_SPECIALS = ("[UNK]", "[PAD]", "[CLS]")
ENDOFTEXT = "<|endoftext|>"
# Each role's token in a WordPiece vocabulary and in RoBERTa's.
ROLES = {"pad": ("[PAD]", "<pad>"), "cls": ("[CLS]", "<s>"), "sep": ("[SEP]", "</s>"),
         "mask": ("[MASK]", "<mask>"), "unk": ("[UNK]", "<unk>")}


def _tokenizers():
    try:
        import tokenizers
    except ImportError:
        raise UsageError("the Hugging Face `tokenizers` package is needed for this "
                         "(pip install tokenizers)") from None
    return tokenizers


def train(kind: str, documents: Sequence[str], vocab_size: int):
    """A ``kind`` tokenizer ("wordpiece", "bpe", "roberta-bpe", "words" or "ulmfit") of at
    most vocab_size tokens."""
    tk = _tokenizers()
    if kind == "wordpiece":
        tokenizer = _wordpiece(_trained_wordpiece_vocab(documents, vocab_size))
    elif kind == "bpe":
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT],
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False)
        tokenizer.train_from_iterator(documents, trainer)
    elif kind == "roberta-bpe":
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(ROBERTA_SPECIALS),
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False)
        tokenizer.train_from_iterator(documents, trainer)
        tokenizer.post_processor = tk.processors.RobertaProcessing(
            ("</s>", tokenizer.token_to_id("</s>")), ("<s>", tokenizer.token_to_id("<s>")),
            add_prefix_space=False)
    elif kind == "words":
        tokenizer = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
        tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
        trainer = tk.trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=["[UNK]"],
                                               show_progress=False)
        tokenizer.train_from_iterator(documents, trainer)
    elif kind == "ulmfit":
        tokenizer = tk.Tokenizer(tk.models.WordLevel(unk_token="[UNK]"))
        tokenizer.normalizer = tk.normalizers.Lowercase()
        tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
        trainer = tk.trainers.WordLevelTrainer(vocab_size=vocab_size, show_progress=False,
                                               special_tokens=list(ULMFIT_SPECIALS))
        tokenizer.train_from_iterator(documents, trainer)
        tokenizer.post_processor = tk.processors.TemplateProcessing(
            single="[CLS] $A", special_tokens=[("[CLS]", tokenizer.token_to_id("[CLS]"))])
    else:
        raise ValueError(f"no tokenizer of kind {kind!r}")
    return tokenizer


def add_words(tokenizer, documents: Sequence[str], min_count: int = 2) -> tuple:
    """A word-level tokenizer with the words of ``documents`` it lacks, seen at least
    ``min_count`` times (fastai's vocabulary of a target corpus), given the ids after its
    own (the most frequent first). Returns (the tokenizer, the words added)."""
    from collections import Counter

    tk = _tokenizers()
    data = json.loads(tokenizer.to_str())
    if data["model"]["type"] != "WordLevel":
        raise ValueError("add_words needs a word-level tokenizer")
    vocab = data["model"]["vocab"]
    counts = Counter()
    for text in documents:
        if tokenizer.normalizer is not None:
            text = tokenizer.normalizer.normalize_str(text)
        counts.update(word for word, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text))
    added = sorted((w for w, n in counts.items() if n >= min_count and w not in vocab),
                   key=lambda w: (-counts[w], w))
    first = max(vocab.values()) + 1
    vocab.update((word, first + i) for i, word in enumerate(added))
    return tk.Tokenizer.from_str(json.dumps(data)), added


def _wordpiece(vocab=None):
    """BERT's tokenizer (lower-cased, [CLS] text [SEP]) over ``vocab``, or untrained."""
    tk = _tokenizers()
    tokenizer = tk.Tokenizer(tk.models.WordPiece(vocab, unk_token="[UNK]") if vocab
                             else tk.models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = tk.normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = tk.pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = tk.decoders.WordPiece()
    if vocab:
        tokenizer.add_special_tokens(list(WORDPIECE_SPECIALS))
        tokenizer.post_processor = tk.processors.TemplateProcessing(
            single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
            special_tokens=[(t, vocab[t]) for t in ("[CLS]", "[SEP]")])
    return tokenizer


def _wordpiece_vocab(documents: Sequence[str], vocab_size: int, first: Sequence[str]) -> dict:
    """The vocabulary tokenizers' WordPiece trainer learns from ``documents``, the tokens
    ``first`` numbered first."""
    tk = _tokenizers()
    tokenizer = _wordpiece()
    tokenizer.train_from_iterator(documents, tk.trainers.WordPieceTrainer(
        vocab_size=vocab_size, special_tokens=list(first), show_progress=False))
    return tokenizer.get_vocab()


def _trained_wordpiece_vocab(documents: Sequence[str], vocab_size: int) -> dict:
    """The vocabulary WordPiece training keeps, numbered: the specials, then the rest sorted.

    tokenizers' trainer numbers the "##x" token of each character that continues a word in
    the order of a hash map, which changes from run to run, and breaks ties between equally
    frequent merges by those numbers: on its own it keeps different tokens on each run.
    A first pass without merges finds those tokens; the second training numbers them in
    sorted order, after the specials (passed as its special tokens, which fixes their
    numbers and nothing else: the tokenizer returned has only the real specials)."""
    alphabet = _wordpiece_vocab(documents, 0, WORDPIECE_SPECIALS)
    continuing = sorted(t for t in alphabet if t.startswith("##") and len(t) == 3)
    vocab = _wordpiece_vocab(documents, vocab_size, [*WORDPIECE_SPECIALS, *continuing])
    ordered = list(WORDPIECE_SPECIALS) + sorted(set(vocab) - set(WORDPIECE_SPECIALS))
    return {token: i for i, token in enumerate(ordered)}


def load(path):
    """The tokenizer of a file, or of a folder's tokenizer.json. The file's padding and
    truncation settings are dropped (a model folder's may pad every text to a fixed
    length): each command sets its own."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE_NAME
    if not path.is_file():
        raise UsageError(f"{path}: no tokenizer file")
    tk = _tokenizers()
    try:
        tokenizer = tk.Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a bare Exception on a malformed file
        raise UsageError(f"{path}: not a tokenizers file ({e})") from None
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def from_json(text: str):
    return _tokenizers().Tokenizer.from_str(text)


def special_id(tokenizer, token: str) -> int:
    index = tokenizer.token_to_id(token)
    if index is None:
        raise UsageError(f"the tokenizer has no {token} token")
    return index


def role(tokenizer, name: str) -> str:
    """The token of special role ``name`` (see ROLES) in this tokenizer's vocabulary."""
    token = next((t for t in ROLES[name] if tokenizer.token_to_id(t) is not None), None)
    if token is None:
        raise UsageError(f"the tokenizer has no {' or '.join(ROLES[name])} token")
    return token


def role_id(tokenizer, name: str) -> int:
    return tokenizer.token_to_id(role(tokenizer, name))


def special_ids(tokenizer) -> list:
    """The ids of every role's token the vocabulary has."""
    return [i for tokens in ROLES.values() for t in tokens
            if (i := tokenizer.token_to_id(t)) is not None]


def shown(tokenizer, token_id: int) -> str:
    """A token as a person reads it: byte-level BPE's decoded (its Ġ a space), others' as
    the vocabulary writes them (WordPiece's ##ing)."""
    if type(tokenizer.decoder).__name__ == "ByteLevel":
        return tokenizer.decode([token_id], skip_special_tokens=False)
    return tokenizer.id_to_token(token_id)
