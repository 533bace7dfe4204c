"""Sentence vectors from token vectors, as sentence-transformers pools them.

A sentence-transformers folder is a transformers folder plus ``modules.json``, which
lists the steps after the encoder: a ``Pooling`` module (its settings in
``<path>/config.json``) and, for most models, ``Normalize``. ``sentence_bert_config.json``
holds the length texts are cut to. :class:`SentencePooling` reads those files and
computes the same vectors; whatever else a folder asks for (a Dense layer, a pooling
fusedlm does not compute, a prompt) is refused by name rather than left out.
"""
import dataclasses
import json
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

MODES = ("mean", "cls", "max", "mean_sqrt_len")

# sentence-transformers' settings: the pooling_mode_* flags of its older configs, and the
# pooling_mode names of its newer ones.
FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
         "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len"}
NAMES = {"mean": "mean", "cls": "cls", "max": "max", "mean_sqrt_len_tokens": "mean_sqrt_len"}
NOT_COMPUTED = {"pooling_mode_weightedmean_tokens": "weightedmean",
                "pooling_mode_lasttoken": "lasttoken"}

LAYOUT = ("Transformer", "Pooling", "Normalize")  # modules.json's, the last optional
MODULES = "modules.json"
SETTINGS = "sentence_bert_config.json"
PROMPTS = "config_sentence_transformers.json"


@dataclasses.dataclass(frozen=True)
class SentencePooling:
    """``mode``: mean of the real tokens, the first token (``cls``), their maximum, or
    their sum over the square root of their count (``mean_sqrt_len``). ``normalize``: the
    vectors scaled to unit L2 norm. ``max_seq_length``: the most tokens a text keeps
    (None: the model's positions). ``source``: the Pooling module's config file in the
    folder it was read from (for messages)."""

    mode: str = "mean"
    normalize: bool = False
    max_seq_length: Optional[int] = None
    source: Optional[str] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    def __call__(self, hidden: Tensor, attention_mask: Tensor) -> Tensor:
        """[B, H] float32 vectors of hidden [B, T, H] over attention_mask [B, T] (nonzero =
        token, padding on the right). Plain tensor ops: it traces and compiles."""
        hidden = hidden.float()
        mask = attention_mask[..., None].to(hidden.dtype)  # [B, T, 1]
        if self.mode == "cls":
            pooled = hidden[:, 0]
        elif self.mode == "max":  # padding never wins
            pooled = hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(1)
        else:
            total = (hidden * mask).sum(1)
            count = mask.sum(1).clamp(min=1e-9)  # [B, 1], as sentence-transformers clamps it
            pooled = total / (count if self.mode == "mean" else count.sqrt())
        return F.normalize(pooled, p=2, dim=1) if self.normalize else pooled

    @classmethod
    def from_folder(cls, folder) -> Optional["SentencePooling"]:
        """The pooling of a sentence-transformers folder; None when the folder has no
        modules.json. A ValueError names the file and the setting fusedlm does not follow."""
        folder = Path(folder)
        modules_file = folder / MODULES
        if not modules_file.is_file():
            return None
        modules = _read(modules_file, list)
        for i, module in enumerate(modules):
            kind = str(module.get("type", "")).rsplit(".", 1)[-1]
            if i >= len(LAYOUT) or kind != LAYOUT[i]:
                raise ValueError(f"{modules_file}: module {module.get('name', i)!r} "
                                 f"({module.get('type')}) is not one fusedlm computes: it reads "
                                 f"{', '.join(LAYOUT)}, in that order")
        if len(modules) < 2:
            raise ValueError(f"{modules_file}: lists no Pooling module")
        if modules[0].get("path", ""):
            raise ValueError(f"{modules_file}: the Transformer module lies in "
                             f"{modules[0]['path']}/; fusedlm reads it from the folder itself")
        pooling_file = Path(modules[1].get("path", "")) / "config.json"
        mode = _mode(folder / pooling_file, _read(folder / pooling_file, dict))
        settings = _read(folder / SETTINGS, dict) if (folder / SETTINGS).is_file() else {}
        if settings.get("do_lower_case"):
            raise ValueError(f"{folder / SETTINGS}: do_lower_case is true; fusedlm embed reads "
                             "the text as the tokenizer normalizes it")
        prompts = _read(folder / PROMPTS, dict) if (folder / PROMPTS).is_file() else {}
        if prompts.get("default_prompt_name"):
            raise ValueError(f"{folder / PROMPTS}: default_prompt_name "
                             f"{prompts['default_prompt_name']!r}: sentence-transformers puts "
                             "that prompt before every text, which fusedlm embed does not")
        length = settings.get("max_seq_length")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int)
                                   or length < 1):
            raise ValueError(f"{folder / SETTINGS}: max_seq_length {length!r} is not a positive "
                             "int")
        return cls(mode=mode, normalize=len(modules) == 3, max_seq_length=length,
                   source=str(pooling_file))


def _mode(path: Path, config: dict) -> str:
    """The one pooling of a Pooling module's config: sentence-transformers' newer
    ``pooling_mode`` or its older pooling_mode_* flags."""
    refused = [key for key in NOT_COMPUTED if config.get(key)]
    if "pooling_mode" in config:
        named = config["pooling_mode"]
        named = list(named) if isinstance(named, (list, tuple)) else [named]
        refused += [f"pooling_mode {n!r}" for n in named if n in NOT_COMPUTED.values()]
        modes = [NAMES.get(n) for n in named]
        several = f"pooling_mode {named!r} names several poolings"
    else:
        modes = [mode for key, mode in FLAGS.items() if config.get(key)]
        several = f"{' and '.join(k for k in FLAGS if config.get(k))} are true"
    if refused:
        raise ValueError(f"{path}: {refused[0]} is a pooling fusedlm does not compute "
                         f"(it computes {', '.join(MODES)})")
    if None in modes:
        raise ValueError(f"{path}: pooling_mode {config['pooling_mode']!r} is a pooling fusedlm "
                         f"does not compute (it computes {', '.join(MODES)})")
    if not modes:
        raise ValueError(f"{path}: names no pooling (none of {', '.join(FLAGS)} is true)")
    if len(modes) > 1:
        raise ValueError(f"{path}: {several}, which sentence-transformers concatenates; "
                         "fusedlm computes one")
    return modes[0]


def _read(path: Path, kind: type):
    """The JSON ``kind`` (dict, list) of a file."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: unreadable ({e})") from None
    if not isinstance(value, kind) or kind is list and not all(isinstance(v, dict) for v in value):
        what = "list of modules" if kind is list else "config"
        raise ValueError(f"{path}: not a sentence-transformers {what}")
    return value
