"""Forcing: the backend calls without a ``backend=`` argument run on, when it is not chosen
automatically. The innermost :class:`use_backend`, else :func:`set_backend`, else the
``FUSEDLM_BACKEND`` environment variable (fusedlm.switches)."""
from __future__ import annotations

from typing import Optional

from .. import switches
from .registry import BACKEND_NAMES


def _checked_name(name: Optional[str], source: str) -> Optional[str]:
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"{source} must be one of {BACKEND_NAMES} or None, got {name!r}")
    return name


_ENV_BACKEND = _checked_name(switches.value("FUSEDLM_BACKEND"), "FUSEDLM_BACKEND")
_selected: Optional[str] = None
_pinned: list = []  # the use_backend() blocks being run, innermost last


def set_backend(name: Optional[str]) -> None:
    """Run every op on backend ``name`` (None: choose automatically again)."""
    global _selected
    _selected = _checked_name(name, "backend")
    _FORCING.update()


def get_backend() -> Optional[str]:
    """The backend every op is forced to (by use_backend, set_backend or FUSEDLM_BACKEND),
    or None when chosen automatically."""
    return _forced()[0]


class use_backend:
    """``with fusedlm.use_backend("cpu"): ...`` runs every op called inside on that backend
    (None: leaves the choice as it is). Blocks nest; the innermost wins; an op's
    ``backend=`` argument wins over all. torch.compile traces through it."""

    def __init__(self, name: Optional[str]):
        self.name = _checked_name(name, "backend")

    def __enter__(self):
        _pinned.append(self.name)
        _FORCING.update()
        return self

    def __exit__(self, *exc):
        _pinned.pop()
        _FORCING.update()
        return False


class _Forcing:
    """The backend that calls without a ``backend=`` argument are forced to, and what forced
    it (None, None: chosen automatically); brought up to date by set_backend and use_backend,
    so that a call reads it in one step."""

    __slots__ = ("backend", "source", "key")

    def update(self) -> None:
        self.backend, self.source = self._now()
        self.key = (self.backend, self.source)  # (part of a memoised choice's key)

    @staticmethod
    def _now() -> tuple:
        for pinned in reversed(_pinned):
            if pinned is not None:
                return pinned, "fusedlm.use_backend()"
        if _selected is not None:
            return _selected, "fusedlm.set_backend()"
        if _ENV_BACKEND is not None:
            return _ENV_BACKEND, "FUSEDLM_BACKEND"
        return None, None


_FORCING = _Forcing()
_FORCING.update()


def _forced(backend: Optional[str] = None) -> tuple:
    """(the backend a call is forced to, what forced it), or (None, None)."""
    if backend is not None:
        return _checked_name(backend, "backend"), "backend= argument"
    return _FORCING.backend, _FORCING.source
