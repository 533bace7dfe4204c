"""The rules :func:`fusedlm.patch` applies, registered by the rule modules
(torch_modules.py for torch.nn, hf/ for Hugging Face's models)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from torch import nn


@dataclass(frozen=True)
class Rule:
    """Matches one exact class (a subclass may change what the module computes).

    ``replace(module)`` returns the module to put in its place (the same
    object when it patches it in place) or a string saying why it is left alone."""

    name: str
    matches: Callable[[nn.Module], bool]
    replace: Callable[[nn.Module], Union[nn.Module, str]]


_RULES: list[Rule] = []
# (model) -> None, each run once :func:`patch` has replaced the model's modules.
_FINISHERS: list[Callable[[nn.Module], None]] = []
# Marks a module fusedlm built or patched, so that patching twice changes nothing.
PATCHED = "_fusedlm_patched"


def register(*rules: Rule, finish: Optional[Callable[[nn.Module], None]] = None) -> None:
    _RULES.extend(rules)
    if finish is not None:
        _FINISHERS.append(finish)
