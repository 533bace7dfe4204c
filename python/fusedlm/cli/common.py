"""Pieces the commands share: their parsers, devices, dtypes, atomic writes, and loading a
model folder."""
from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from . import loading, registry
from . import tokenizer as tok
from .errors import UsageError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE_HELP = "cpu, cuda or cuda:N (default cuda if present)"


def add_command(commands, name: str, module) -> None:
    """Adds the command ``name`` to ``commands`` (argparse's subparsers): its parser has the
    module's HELP and DESCRIPTION and what its add_arguments(parser), if any, adds, and
    runs the module's run(args)."""
    p = commands.add_parser(name, help=module.HELP, description=module.DESCRIPTION)
    if hasattr(module, "add_arguments"):
        module.add_arguments(p)
    p.set_defaults(run=module.run)


def add_device_argument(p, help: str = DEVICE_HELP) -> None:
    """--device, which resolve_device reads."""
    p.add_argument("--device", help=help)


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


def atomic_write(path: Path, write) -> None:
    """Writes through a temporary file in the same folder (``write(file)``), then renames
    it over ``path``: a reader sees the old file or the new one, never a part."""
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


def read_config(directory) -> dict:
    """The config.json of a model folder, after checking the folder holds weights."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UsageError(f"--model {directory}: no such directory")
    config = directory / loading.CONFIG_NAME
    if not config.is_file():
        halves = [h for h in ("discriminator", "generator")
                  if (directory / h / loading.CONFIG_NAME).is_file()]
        if halves:  # an ELECTRA pretraining checkpoint holds the two models in folders
            raise UsageError(f"--model {directory}: holds two models; pass "
                             f"{' or '.join(str(directory / h) for h in halves)}")
        raise UsageError(f"--model {directory}: not a checkpoint (no {loading.CONFIG_NAME})")
    if not loading.holds_weights(directory):
        raise UsageError(f"--model {directory}: not a checkpoint (no {loading.WEIGHT_FILES[0]})")
    try:
        values = json.loads(config.read_text())
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {directory}: unreadable {loading.CONFIG_NAME} ({e})") from None
    return values if isinstance(values, dict) else {}


def load_model(directory, command: str, device: torch.device, **config_changes):
    """(spec, model, tokenizer) of a model folder (transformers' layout, sharded or not),
    the model being the class that serves ``command``, chosen by config.json's
    model_type, in eval mode on ``device``. What the command may leave out of the folder
    or start afresh is the spec's :class:`~fusedlm.cli.loading.Head`; anything else is a
    UsageError. ``config_changes`` go to the config (num_labels, ...)."""
    config = read_config(directory)
    model_type = config.get("model_type", "")
    spec = registry.by_model_type(model_type)
    if spec is None:
        raise UsageError(f"--model {directory}: holds a {model_type!r} model, which fusedlm "
                         "does not know")
    if command not in spec.heads:
        can = sorted(s.name for s in registry.SPECS.values() if command in s.heads)
        raise UsageError(f"--model {directory}: {command} needs a model of one of "
                         f"{', '.join(can)}, not {spec.name}")
    tokenizer = tok.load(_tokenizer_file(Path(directory)))
    architectures = config.get("architectures") or [""]
    loaded = loading.load(directory, spec.heads[command], holds=str(architectures[0]),
                          **config_changes)
    note = loaded.note()
    if note:
        print(f"fusedlm: {directory}: {note}", file=sys.stderr)
    return spec, loaded.model.to(device).eval(), tokenizer


def _tokenizer_file(directory: Path) -> Path:
    """The folder's tokenizer.json; for one half of an ELECTRA pretraining checkpoint
    (generator/, discriminator/), the checkpoint's."""
    own = directory / tok.FILE_NAME
    if not own.is_file() and directory.name in ("generator", "discriminator") \
            and (directory.parent / tok.FILE_NAME).is_file():
        return directory.parent / tok.FILE_NAME
    return own
