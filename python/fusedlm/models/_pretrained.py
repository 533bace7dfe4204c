"""Configs and checkpoints in the Hugging Face layout: ``config.json`` + ``model.safetensors``.

A model class names its config class and a :class:`KeyMap` from its own parameter
names to those ``transformers`` uses, so that a directory written by either library
loads in the other. Reading ``pytorch_model.bin`` is supported with
``weights_only=True`` only.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
from pathlib import Path
from typing import ClassVar, Iterable, Optional

import torch
from torch import Tensor, nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
TORCH_WEIGHTS_NAME = "pytorch_model.bin"


@dataclasses.dataclass
class Config:
    """Base of the model configs: dataclasses whose fields use ``transformers``' names
    where the two libraries share a setting. ``model_type`` is the ``transformers``
    model type written into ``config.json``."""

    model_type: ClassVar[str] = ""

    def to_dict(self) -> dict:
        return {"model_type": self.model_type, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: dict) -> "Config":
        """Reads the fields this config has; a ``transformers`` config.json carries many
        more (architectures, tokenizer ids, ...), which are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in names})

    def save(self, directory) -> None:
        _atomic_write(Path(directory) / CONFIG_NAME,
                      lambda f: f.write(json.dumps(self.to_dict(), indent=2).encode() + b"\n"))

    @classmethod
    def load(cls, directory) -> "Config":
        with open(Path(directory) / CONFIG_NAME) as f:
            values = json.load(f)
        found = values.get("model_type")
        if cls.model_type and found and found != cls.model_type:
            raise ValueError(f"{directory} holds a {found!r} model, not {cls.model_type!r}")
        return cls.from_dict(values)


@dataclasses.dataclass(frozen=True)
class KeyRule:
    """fusedlm parameter names matching ``ours`` are called ``theirs`` in ``transformers``.
    Patterns are dotted names in which each ``*`` stands for one piece (e.g. a layer
    index), filled in order on the other side: ``KeyRule("blocks.*.ln.weight",
    "h.*.ln_1.weight")``. ``transpose``: the weight is stored transposed there (GPT-2's
    Conv1D)."""

    ours: str
    theirs: str
    transpose: bool = False


class KeyMap:
    """Renames state_dict keys between fusedlm and ``transformers``; the first rule that
    matches a name wins, and names no rule matches keep their name."""

    def __init__(self, rules: Iterable[KeyRule] = ()):
        self.rules = list(rules)

    def to_theirs(self, state: dict) -> dict:
        return dict(self._rename(k, v, "ours", "theirs") for k, v in state.items())

    def to_ours(self, state: dict) -> dict:
        return dict(self._rename(k, v, "theirs", "ours") for k, v in state.items())

    def _rename(self, key: str, value: Tensor, src: str, dst: str):
        for rule in self.rules:
            pattern, template = getattr(rule, src), getattr(rule, dst)
            match = re.fullmatch(re.escape(pattern).replace(r"\*", r"([^.]+)"), key)
            if match:
                pieces = iter(match.groups())
                new = re.sub(r"\*", lambda _: next(pieces), template)
                return new, value.t() if rule.transpose else value
        return key, value


class PreTrainedModel(nn.Module):
    """Adds ``save_pretrained`` / ``from_pretrained`` in the Hugging Face layout.

    Subclasses set ``config_class`` and ``key_map``, take the config as their first
    constructor argument, and list in ``tied_keys`` the parameter names that share
    storage with another (written once, as ``transformers`` does)."""

    config_class: ClassVar[type] = Config
    key_map: ClassVar[KeyMap] = KeyMap()
    tied_keys: ClassVar[tuple] = ()
    # Names transformers may write that hold no parameter here (e.g. position_ids buffers).
    ignored_keys: ClassVar[tuple] = ()

    def save_pretrained(self, directory) -> None:
        """Writes config.json and model.safetensors (each through a temporary file and a
        rename: an interrupted save leaves the previous files whole)."""
        from safetensors.torch import save

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.config.save(directory)
        state = {k: v for k, v in self.state_dict().items() if k not in self.tied_keys}
        state = {k: v.detach().contiguous() for k, v in self.key_map.to_theirs(state).items()}
        _atomic_write(directory / WEIGHTS_NAME,
                      lambda f: f.write(save(state, metadata={"format": "pt"})))

    @classmethod
    def from_pretrained(cls, directory, *, config: Optional[Config] = None, strict: bool = True,
                        **model_kwargs):
        """Builds the model from ``directory`` (written by fusedlm or by ``transformers``).

        Raises ValueError naming every missing, unexpected or mis-shaped tensor when
        ``strict`` (the default)."""
        directory = Path(directory)
        config = config or cls.config_class.load(directory)
        model = cls(config, **model_kwargs)
        state = model.key_map.to_ours(read_weights(directory))
        model.load_checked(state, strict=strict)
        return model

    def load_checked(self, state: dict, strict: bool = True) -> None:
        """load_state_dict with an error that names every missing, unexpected and
        mis-shaped tensor at once. Tied names may be absent (they are re-tied)."""
        own = self.state_dict()
        ignored = [re.compile(p) for p in self.ignored_keys]
        state = {k: v for k, v in state.items() if not any(p.fullmatch(k) for p in ignored)}
        missing = [k for k in own if k not in state and k not in self.tied_keys]
        unexpected = [k for k in state if k not in own]
        shapes = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(own[k].shape)}"
                  for k, v in state.items() if k in own and v.shape != own[k].shape]
        problems = []
        if missing and strict:
            problems.append("missing: " + ", ".join(missing))
        if unexpected and strict:
            problems.append("unexpected: " + ", ".join(unexpected))
        if shapes:
            problems.append("mis-shaped: " + "; ".join(shapes))
        if problems:
            raise ValueError(f"checkpoint does not fit {type(self).__name__} ("
                             + " | ".join(problems) + ")")
        state = {k: v for k, v in state.items() if k in own}
        self.load_state_dict(state, strict=False)
        tie = getattr(self, "tie_weights", None)
        if tie is not None:
            tie()


def read_weights(directory) -> dict:
    """The tensors of model.safetensors, else of pytorch_model.bin (weights_only)."""
    directory = Path(directory)
    if (directory / WEIGHTS_NAME).exists():
        from safetensors.torch import load_file

        return load_file(str(directory / WEIGHTS_NAME))
    if (directory / TORCH_WEIGHTS_NAME).exists():
        return torch.load(directory / TORCH_WEIGHTS_NAME, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {TORCH_WEIGHTS_NAME}")


def _atomic_write(path: Path, write) -> None:
    """Writes through a temporary file in the same directory, then renames it over path."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
