"""Model folders read through transformers' loader, every tensor accounted for.

``from_pretrained`` loads what fits and reports the rest: tensors of the file the model
has no place for, tensors of the model the file lacks (which it initialises at random)
and tensors whose shapes differ. The commands take nothing silently. A :class:`Head`
says, for one command, which parts of the model may start new (the task head being
fine-tuned) and which parts of a file may go unused (a pretraining head, when
fine-tuning); any other tensor left out on either side is a :class:`UsageError` that
names it. The only tensors not read are the buffers a model computes itself (position
ids, the causal masks of older GPT-2 files), which transformers' loader skips by design.

Key prefixes are matched after the base model's prefix (``bert.``, ``electra.``,
``transformer.``) is removed, so one rule serves a base-model folder and a task folder.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
from pathlib import Path
from typing import Dict, Tuple

import torch

from .errors import UsageError

CONFIG_NAME = "config.json"
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


@dataclasses.dataclass(frozen=True)
class Head:
    """``model``: the class, as "module.Class" under fusedlm.models. ``new``: key prefixes
    of the model that may be missing from the file (initialised afresh). ``unused``: key
    prefixes of a file that the command leaves unread. ``what``: the part of the model
    a file lacking tensors outside ``new`` most likely lacks (e.g. "masked-LM head"), and
    ``hint`` what to pass instead, for the error. ``kwargs``: passed to the class
    (e.g. ``add_pooling_layer=False``)."""

    model: str
    new: Tuple[str, ...] = ()
    unused: Tuple[str, ...] = ()
    what: str = ""
    hint: str = ""
    kwargs: Dict[str, object] = dataclasses.field(default_factory=dict)

    @property
    def model_class(self) -> type:
        module, name = self.model.rsplit(".", 1)
        return getattr(importlib.import_module(f"fusedlm.models.{module}"), name)


@dataclasses.dataclass
class Loaded:
    """A model and what of it, or of its file, the load left out: ``new`` (the model's
    keys initialised afresh) and ``unused`` (the file's keys not read)."""

    model: torch.nn.Module
    new: list
    unused: list

    def note(self) -> str:
        """One line for the user ('' when the file and the model matched exactly)."""
        prefix = getattr(self.model, "base_model_prefix", "") or ""
        parts = [f"{label} {_grouped(keys, prefix)}" for label, keys in
                 (("new:", self.new), ("not used:", self.unused)) if keys]
        return "; ".join(parts)


def load(folder, head: Head, flag: str = "--model", holds: str = "", **changes) -> Loaded:
    """``head``'s model from ``folder`` in float32, ``changes`` applied to its config
    (num_labels, id2label, ...). Raises UsageError when a tensor of either side is left
    out beyond what ``head`` allows, or when the folder cannot be read. ``holds``: the
    class the folder's config.json names (its ``architectures``), for the errors."""
    model_class = head.model_class
    try:
        with quiet():
            model, info = model_class.from_pretrained(
                str(folder), output_loading_info=True, dtype=torch.float32,
                ignore_mismatched_sizes=True, **head.kwargs, **changes)
    except (OSError, ValueError, TypeError, RuntimeError, KeyError) as e:
        raise UsageError(f"{flag} {folder}: cannot be loaded as {model_class.__name__} "
                         f"({_first_line(e)})") from None
    prefix = getattr(model, "base_model_prefix", "") or ""
    name = model_class.__name__

    def under(key: str, prefixes) -> bool:
        if prefix and key.startswith(prefix + "."):
            key = key[len(prefix) + 1:]
        return key.startswith(tuple(prefixes))

    errors = [e for e in info.get("error_msgs", []) if e]
    if errors:
        raise UsageError(f"{flag} {folder}: {name} could not load it ({_first_line(errors[0])})")
    # A task head of another shape (a classifier of other labels) is another task's: new.
    mismatched = sorted(info.get("mismatched_keys", []))
    wrong = [m for m in mismatched if not under(m[0], head.new)]
    if wrong:
        shapes = ", ".join(f"{k} (file {list(a)}, model {list(b)})" for k, a, b in wrong[:4])
        raise UsageError(f"{flag} {folder}: {len(wrong)} tensors of the file differ in shape from "
                         f"{name}'s as its config.json describes it: {shapes}{_more(wrong, 4)}")
    unexpected = sorted(info.get("unexpected_keys", []))
    missing = sorted(info.get("missing_keys", []))
    # A renamed tensor is both: the two lists are given together.
    stray = [k for k in unexpected if not under(k, head.unused)]
    lacking = [k for k in missing if not under(k, head.new)]
    said = []
    if stray:
        said.append(f"{len(stray)} tensors of the file fit no part of {name}: {_names(stray)}")
    if lacking and head.what and not stray:
        said.append(f"{f'its {holds}' if holds else 'the model'} has no {head.what} (the file "
                    f"lacks {len(lacking)} tensors of {name}: {_names(lacking, 3)})")
    elif lacking:
        said.append(f"the file lacks {len(lacking)} tensors of {name}: {_names(lacking)}")
    if said:
        hint = f"; {head.hint}" if head.hint and lacking else ""
        raise UsageError(f"{flag} {folder}: " + "; ".join(said) + hint)
    return Loaded(model, missing + [k for k, _, _ in mismatched], unexpected)


@contextlib.contextmanager
def quiet():
    """transformers' warnings and progress bars off (its loading report is replaced by the
    checks here)."""
    from transformers.utils import logging

    verbosity, bar = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bar:
            logging.enable_progress_bar()


def holds_weights(folder: Path) -> bool:
    return any((folder / name).is_file() for name in WEIGHT_FILES)


def _names(keys: list, shown: int = 6) -> str:
    return ", ".join(keys[:shown]) + _more(keys, shown)


def _more(items: list, shown: int) -> str:
    return f" and {len(items) - shown} more" if len(items) > shown else ""


def _grouped(keys: list, prefix: str) -> str:
    """'cls.predictions (5), classifier (2)': the keys by module, without the base
    model's prefix, to two levels."""
    groups: Dict[str, int] = {}
    for key in keys:
        if prefix and key.startswith(prefix + "."):
            key = key[len(prefix) + 1:]
        parts = key.split(".")
        module = ".".join(parts[:2] if len(parts) > 2 else parts[:1])
        groups[module] = groups.get(module, 0) + 1
    return ", ".join(f"{module} ({count})" for module, count in groups.items())


def _first_line(error) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
