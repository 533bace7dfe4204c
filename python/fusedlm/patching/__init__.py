"""fusedlm.patch: swap fusedlm's modules into an existing model, keeping its weights.

A :class:`Rule` recognises one kind of module (``torch.nn.LayerNorm``, Hugging Face's
``BertSelfAttention``, ...) and builds its replacement. :func:`patch` walks the model,
replaces every module a rule matches, and records what it did, or why it left a
recognised module alone, in a :class:`PatchReport` (``patch_report(model)``). A rule
module may also register a step that runs on the whole model once its modules are
replaced (Hugging Face models: the switch to fusedlm's attention, see hf/__init__.py).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from ..backends import use_backend
from .rules import _FINISHERS, _RULES, PATCHED, Rule, register  # noqa: F401


def _modules(count: int, kind: str = "") -> str:
    return f"{count} {kind}module{'' if count == 1 else 's'}"


@dataclass
class PatchReport:
    replaced: dict = field(default_factory=dict)  # module path -> rule name
    left_alone: dict = field(default_factory=dict)  # module path -> why

    def __str__(self) -> str:
        lines = [f"replaced {_modules(len(self.replaced))}"]
        lines += [f"  {path or '<model>'}: {rule}" for path, rule in self.replaced.items()]
        if self.left_alone:
            lines.append(f"left {_modules(len(self.left_alone), 'recognised ')} alone")
            lines += [f"  {path or '<model>'}: {why}" for path, why in self.left_alone.items()]
        return "\n".join(lines)


def _load_rules() -> None:
    from . import torch_modules  # noqa: F401  (each registers its rules)
    if importlib.util.find_spec("transformers") is not None:  # an optional dependency
        from . import hf  # noqa: F401


def patch(model: nn.Module, *, backend: Optional[str] = None) -> nn.Module:
    """Replaces the modules of ``model`` that fusedlm has a faster version of.

    Only ``model`` changes: weights, buffers and train/eval state are kept, modules no
    rule recognises are left untouched, and other models sharing its submodules' config
    objects keep theirs (patch ``copy.deepcopy(model)`` to keep the original as it is).
    ``backend`` pins every replaced module's ops to one backend (default: chosen per
    call): each such module runs its forward inside ``fusedlm.use_backend(backend)``. Returns the model, a new object when a rule replaces the model itself (a bare
    TransformerEncoder, say); ``patch_report(model)`` tells what was replaced.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    pinned = use_backend(backend)  # checks the name
    _load_rules()
    report = getattr(model, "_fusedlm_patch_report", None) or PatchReport()
    # Parents before children: a replaced parent brings its own children along.
    for path, module in list(model.named_modules(remove_duplicate=False)):
        if getattr(module, PATCHED, False) or not _still_attached(model, path, module):
            continue
        rule = next((r for r in _RULES if r.matches(module)), None)
        if rule is None:
            continue
        outcome = rule.replace(module)
        if isinstance(outcome, str):
            report.left_alone[path] = outcome
            continue
        outcome.train(module.training)
        if pinned.name is not None:
            _pin(outcome, pinned)
        setattr(outcome, PATCHED, True)
        if outcome is not module:
            if path == "":
                model = outcome
            else:
                _set_submodule(model, path, outcome)
        report.replaced[path] = rule.name
    for finish in _FINISHERS:
        finish(model)
    model._fusedlm_patch_report = report
    return model


def patch_report(model: nn.Module) -> PatchReport:
    """What :func:`patch` replaced in ``model`` and what it left alone, and why."""
    report = getattr(model, "_fusedlm_patch_report", None)
    if report is None:
        raise ValueError("model has not been patched by fusedlm.patch")
    return report


class _Enter:
    """A forward pre-hook that enters a use_backend block (a class, so that a pinned model
    still pickles and deep-copies)."""

    def __init__(self, block: use_backend):
        self.block = block

    def __call__(self, module, args):
        self.block.__enter__()


class _Exit(_Enter):
    """The forward hook that leaves it, also when the forward raises."""

    def __call__(self, module, args, output):
        self.block.__exit__(None, None, None)


def _pin(module: nn.Module, block: use_backend) -> None:
    """Runs ``module``'s forward inside ``block``."""
    module.register_forward_pre_hook(_Enter(block))
    module.register_forward_hook(_Exit(block), always_call=True)


def _still_attached(model: nn.Module, path: str, module: nn.Module) -> bool:
    try:
        return model.get_submodule(path) is module
    except AttributeError:
        return False


def _set_submodule(model: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent_path), name, module)
