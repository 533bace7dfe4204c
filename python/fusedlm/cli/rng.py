"""The random generators a run draws from: torch's (the CPU's and the device's), Python's
``random`` and NumPy's global one. ``--seed`` seeds them all, a checkpoint saves their
states and ``--resume`` restores them, so a resumed run draws what the run it continues
would have drawn (dropout masks above all; models and user code may draw from any)."""
from __future__ import annotations

import contextlib
import random

import numpy as np
import torch


def seed(value: int) -> None:
    """Seeds every generator from ``value``, as transformers' ``set_seed`` does."""
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)  # the CPU's and every CUDA device's


def state(device: torch.device) -> dict:
    """Every generator's state, in types ``torch.load(weights_only=True)`` reads back."""
    kind, key, position, has_gauss, gauss = np.random.get_state()
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
            "python": random.getstate(),
            "numpy": (kind, key.tolist(), position, has_gauss, gauss)}


def restore(saved: dict, device: torch.device) -> None:
    """Sets the generators ``saved`` holds (a checkpoint written before Python's and NumPy's
    were saved holds torch's alone)."""
    torch.set_rng_state(saved["cpu"])
    if device.type == "cuda" and saved["cuda"] is not None:
        torch.cuda.set_rng_state(saved["cuda"], device)
    if "python" in saved:
        random.setstate(saved["python"])
    if "numpy" in saved:
        kind, key, position, has_gauss, gauss = saved["numpy"]
        np.random.set_state((kind, np.array(key, dtype=np.uint32), position, has_gauss, gauss))


@contextlib.contextmanager
def untouched(device: torch.device):
    """Whatever runs inside draws nothing from the run's streams: the generators are put
    back as they were on the way out."""
    before = state(device)
    try:
        yield
    finally:
        restore(before, device)
