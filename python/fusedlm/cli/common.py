"""Pieces the commands share: devices, dtypes, and loading a model directory."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from ..models._pretrained import CONFIG_NAME, TORCH_WEIGHTS_NAME, WEIGHTS_NAME
from . import registry
from . import tokenizer as tok
from .errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "positive int"  # argparse names the type in its error


def resolve_device(name) -> torch.device:
    """--device (default: the first CUDA device if there is one, else the CPU)."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: no CUDA device is available")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: there are only {torch.cuda.device_count()} "
                             "CUDA devices")
    elif device.type != "cpu":
        raise UsageError(f"--device {name}: fusedlm runs on cpu or cuda")
    return device


def read_model_type(directory) -> str:
    """The model_type of a checkpoint directory, after checking it is one."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"--model {directory}: no such directory")
    config = directory / CONFIG_NAME
    if not config.is_file():
        raise UsageError(f"--model {directory}: not a checkpoint (no {CONFIG_NAME})")
    if not ((directory / WEIGHTS_NAME).is_file() or (directory / TORCH_WEIGHTS_NAME).is_file()):
        raise UsageError(f"--model {directory}: not a checkpoint (no {WEIGHTS_NAME})")
    try:
        values = json.loads(config.read_text())
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {directory}: unreadable {CONFIG_NAME} ({e})") from None
    return values.get("model_type", "") if isinstance(values, dict) else ""


def load_model(directory, command: str, device: torch.device, *, strict: bool = True,
               **config_changes):
    """(spec, model, tokenizer) of a checkpoint directory, the model being the class that
    serves ``command``, in eval mode on ``device``. ``strict=False`` lets a head the
    checkpoint lacks start from its initialisation (fine-tuning a pretrained encoder)."""
    model_type = read_model_type(directory)
    spec = registry.by_model_type(model_type)
    if spec is None:
        raise UsageError(f"--model {directory}: holds a {model_type!r} model, which fusedlm "
                         "does not know")
    if command not in spec.heads:
        can = sorted(s.name for s in registry.SPECS.values() if command in s.heads)
        raise UsageError(f"--model {directory}: {command} needs a {' or '.join(can)} model, "
                         f"not {spec.name}")
    tokenizer = tok.load(directory)
    model_class = spec.heads[command]
    try:
        config = dataclasses.replace(model_class.config_class.load(directory), **config_changes)
        model = model_class.from_pretrained(directory, config=config, strict=strict)
    except (ValueError, TypeError, OSError) as e:
        raise UsageError(f"--model {directory}: {e}") from None
    return spec, model.to(device).eval(), tokenizer

