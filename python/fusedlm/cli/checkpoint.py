"""Training checkpoints: ``OUT/checkpoint-<step>/`` holds the model in the
``save_pretrained`` layout, its ``tokenizer.json`` and ``trainer_state.pt`` (optimizer,
schedule, loss scaler, random generators, data position, settings).

A checkpoint is written into a hidden temporary folder and renamed into place, so a
kill leaves either the old checkpoint or the new one, never half of one. The model and
tokenizer are also exported to OUT itself (saved into a temporary folder, then each
file renamed over its old one), so that ``--model OUT`` reads the latest weights.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from . import tokenizer as tok
from .common import atomic_write
from .loading import CONFIG_NAME, quiet

STATE_NAME = "trainer_state.pt"
_NAME = re.compile(r"checkpoint-(\d+)")


def checkpoints(out) -> list:
    """The complete checkpoints in ``out``, oldest first."""
    out = Path(out)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir()
             if (m := _NAME.fullmatch(p.name)) and (p / STATE_NAME).is_file()]
    return [p for _, p in sorted(found)]


def latest(out) -> Optional[Path]:
    found = checkpoints(out)
    return found[-1] if found else None


def holds_model(out) -> bool:
    """Whether ``out`` already holds a checkpoint or an exported model."""
    return latest(out) is not None or (Path(out) / CONFIG_NAME).is_file()


def save(out, step: int, model, export, tokenizer, state: dict, keep: int = 1) -> Path:
    """Writes checkpoint-<step> (then deletes all but the newest ``keep``) and exports
    ``export`` (the model, or the part of it that is used after pretraining) and the
    tokenizer to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(out)
    final = out / f"checkpoint-{step}"
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=f".{final.name}."))
    try:
        tmp.chmod(0o777 & ~_umask())  # mkdtemp's folder is private; the checkpoint need not be
        with quiet():
            model.save_pretrained(tmp)
        _write_tokenizer(tmp, tokenizer)
        atomic_write(tmp / STATE_NAME, lambda f: torch.save(state, f))
        if final.exists():  # saved at this step before (a re-run of the last step)
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for old in checkpoints(out)[:-keep]:
        shutil.rmtree(old)
    _export(out, export)
    _write_tokenizer(out, tokenizer)
    return final


def _export(out: Path, model) -> None:
    """``model.save_pretrained(out)``, each file renamed into place."""
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".export."))
    try:
        with quiet():
            model.save_pretrained(tmp)
        for file in sorted(tmp.iterdir()):
            os.replace(file, out / file.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _remove_leftovers(out: Path) -> None:
    """Deletes the temporaries of a save that was killed (as large as a checkpoint)."""
    for left in out.iterdir():
        if left.name.startswith((".checkpoint-", ".export.", f".{tok.FILE_NAME}.")):
            if left.is_dir():
                shutil.rmtree(left, ignore_errors=True)
            else:
                left.unlink(missing_ok=True)


def load_state(directory) -> dict:
    return torch.load(Path(directory) / STATE_NAME, map_location="cpu", weights_only=True)


def _write_tokenizer(directory: Path, tokenizer) -> None:
    atomic_write(directory / tok.FILE_NAME, lambda f: f.write(tokenizer.to_str().encode()))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
