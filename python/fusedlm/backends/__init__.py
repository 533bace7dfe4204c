"""Backends and dispatch.

Every op has four backends: ``reference`` (plain PyTorch, the ground truth),
``cpu`` (the C++ kernels), ``triton`` and ``cuda``. A call runs on the backend
named by its ``backend=`` argument, else by :func:`set_backend`, else by the
``FUSEDLM_BACKEND`` environment variable, else on the fastest backend that can
run it on the tensors' device. A backend named explicitly that cannot run the
call raises; it never falls back silently. :func:`explain` tells which backend a
call would use and why.

Two backends can also run on CPU tensors, slowly, to test their kernels without a
GPU: ``triton`` under ``TRITON_INTERPRET=1`` (Triton's interpreter) and ``cuda`` in a
``FUSEDLM_CUDA=emulate`` build (the CUDA kernels compiled against a CPU emulator of
CUDA). Either runs only when named, never by automatic choice.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

BACKEND_NAMES = ("reference", "cpu", "triton", "cuda")
# Automatic choice, fastest first, by device type. CPU tensors never go to
# interpreted Triton or emulated CUDA: `triton` and `cuda` on CPU tensors run only when
# asked for by name.
_AUTO_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}


@dataclass(frozen=True)
class Kernel:
    """One backend's implementation of one op.

    ``limits(**features)`` returns why this kernel cannot run a call (e.g. an
    unsupported head dim), or None when it can.
    """

    forward: Callable
    backward: Optional[Callable] = None
    limits: Optional[Callable[..., Optional[str]]] = None


def _native() -> Optional[str]:
    """A backend that runs on its device itself: no emulation."""
    return None


@dataclass
class Backend:
    name: str
    devices: Callable[[], tuple]  # the device types whose tensors it runs on
    unavailable: Callable[[], Optional[str]]  # why it cannot run at all, or None
    kernels: dict = field(default_factory=dict)  # op name -> Kernel
    # How it runs where it only emulates its device on the CPU (then never chosen
    # automatically), e.g. "emulated on the CPU as sm_80"; None where it runs natively.
    emulated: Callable[[], Optional[str]] = _native

    def cannot_run(self, op: str, device: torch.device, features: dict) -> Optional[str]:
        reason = self.unavailable()
        if reason:
            return reason
        if device.type not in self.devices():
            how = self.emulated()
            return (f"runs on {'/'.join(self.devices())} tensors{f' ({how})' if how else ''}, "
                    f"not {device.type}")
        kernel = self.kernels.get(op)
        if kernel is None:
            return f"has no {op} kernel"
        return kernel.limits(**features) if kernel.limits else None


_REGISTRY: dict[str, Backend] = {}
_PLANNERS: dict[str, Callable] = {}
_selected: Optional[str] = None


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    return backend


def kernel(backend: str, op: str) -> Kernel:
    return _REGISTRY[backend].kernels[op]


def set_backend(name: Optional[str]) -> None:
    """Run every op on backend ``name`` (None: choose automatically again)."""
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES} or None, got {name!r}")
    global _selected
    _selected = name


def get_backend() -> Optional[str]:
    """The backend every op is forced to, or None when chosen automatically."""
    return _selected if _selected is not None else _env_backend()


def _env_backend() -> Optional[str]:
    name = os.environ.get("FUSEDLM_BACKEND") or None
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"FUSEDLM_BACKEND must be one of {BACKEND_NAMES}, got {name!r}")
    return name


class Emulated(str):
    """A backend's entry in :func:`backends` where it runs, but only on an emulation of its
    device on the CPU, and only when asked for by name: how it runs
    ("emulated on the CPU as sm_80")."""

    __slots__ = ()


def backends() -> dict:
    """{backend name: True where it runs on this machine; an :class:`Emulated` string
    where it runs only emulated on the CPU (the cuda backend of a FUSEDLM_CUDA=emulate
    build); else the reason it is unavailable}."""
    return {name: _status(_REGISTRY[name]) for name in BACKEND_NAMES}


def _status(backend: Backend):
    reason = backend.unavailable()
    if reason:
        return reason
    how = backend.emulated()
    return Emulated(how) if how else True


@dataclass(frozen=True)
class Choice:
    backend: str
    why: str

    def __str__(self) -> str:
        return f"{self.backend}: {self.why}"


def choose(op: str, device: torch.device, backend: Optional[str] = None, **features) -> Choice:
    """The backend that runs ``op`` on ``device`` for a call with these features."""
    if backend is not None and backend not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {backend!r}")
    forced, source = backend, "backend= argument"
    if forced is None and _selected is not None:
        forced, source = _selected, "fusedlm.set_backend()"
    if forced is None and _env_backend() is not None:
        forced, source = _env_backend(), "FUSEDLM_BACKEND"
    if forced is not None:
        reason = _REGISTRY[forced].cannot_run(op, device, features)
        if reason:
            raise RuntimeError(f"fusedlm: {op} cannot run on backend {forced!r} (asked for by {source}): {reason}")
        return Choice(forced, f"asked for by {source}")

    skipped = []
    for name in _AUTO_ORDER.get(device.type, ("reference",)):
        candidate = _REGISTRY[name]
        reason = candidate.cannot_run(op, device, features)
        if reason is None and candidate.emulated():
            reason = f"{candidate.emulated()}, so only when asked for by name"
        if reason is None:
            why = f"fastest backend for {device.type} tensors that can run this call"
            if skipped:
                why += " (skipped " + "; ".join(skipped) + ")"
            return Choice(name, why)
        skipped.append(f"{name}: {reason}")
    raise RuntimeError(f"fusedlm: no backend can run {op} here: " + "; ".join(skipped))


def planner(op: str):
    """Registers the function that validates a call to ``op`` and returns its Choice."""

    def decorate(fn):
        _PLANNERS[op] = fn
        return fn

    return decorate


def explain(op: str, *args, **kwargs) -> str:
    """Which backend ``fusedlm.ops.<op>(*args, **kwargs)`` would run on, and why."""
    if op not in _PLANNERS:
        raise ValueError(f"op must be one of {sorted(_PLANNERS)}, got {op!r}")
    return f"{op} -> {_PLANNERS[op](*args, **kwargs)}"


from . import cpu, cuda, reference, triton  # noqa: E402,F401  (each registers itself)
