"""Dispatch: which backend runs a call, and why.

A call runs on the backend named by its ``backend=`` argument, else by the forcing
(fusedlm.backends.forcing), else on the fastest backend that can run it on the tensors'
device, passing over a kernel measured slower than plain PyTorch for such a call
(``Supports.slower``). A backend named that cannot run the call raises; it never falls back
silently. :func:`explain` tells which backend a call would use and why.

A backend may also have to pass a check on the device before it runs there: verification
at first use (fusedlm.verify), which sits above the ops it runs and installs its checks here
(:func:`install_checks`). Without it, no call is checked.

An automatic choice may also be timed against the other backends that can run the call
(fusedlm.verify.tuning, which installs itself with :func:`install_tuner`). Each op's planner
(its argument checks and its choice) is memoised by call (:func:`planner`);
:func:`check_index_data` is the policy on reading index tensors' values.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
from torch._C import _is_tracing, _len_torch_dispatch_stack
from torch._C._functorch import peek_interpreter_stack
from torch.autograd import forward_ad

from .. import switches
from .._extension import _C
from . import registry
from .forcing import _FORCING, _forced
from .registry import _AUTO_ORDER, _REGISTRY

DEBUG = switches.value("FUSEDLM_DEBUG") == "1"

_PLANNERS: dict[str, Callable] = {}
# The planners' answers, memoised by call (planner): {op: {fusedlm._C.call_key of the call and
# the forcing: Choice}}. An answer depends on the call's key, the forcing,
# the declared ops, the backends and the device checks (install_checks), so a change to the
# registry and the checks' own forgetting empty it (forget_choices).
_PLANS: dict[str, dict] = {}
_PLANS_SIZE = 4096  # calls per op (the key holds sizes, which vary from call to call)
# How many plannings so far read more than their call's key: the values of index tensors
# (check_index_data) or a device check not yet passed for good (choose). Such an answer is
# not memoised.
_not_memoisable = 0


def forget_choices() -> None:
    """Drops the planners' memoised answers."""
    for plans in _PLANS.values():
        plans.clear()


registry.on_change(forget_choices)


def _no_failure(op, backend, device, dtype) -> Optional[str]:
    return None


def _always(op, backend, device, dtype) -> bool:
    return True


# The device checks: failure(op, backend, device, dtype), why that backend failed its check
# on the device (None: it passed, or runs unchecked), and passed_for_good(...), whether that
# answer is final. None until verification installs its own.
_failure, _passed_for_good = _no_failure, _always


def install_checks(failure: Callable, passed_for_good: Callable) -> None:
    """Makes the device checks ``failure`` and ``passed_for_good`` decide which backends a
    call may run on (fusedlm.verify)."""
    global _failure, _passed_for_good
    _failure, _passed_for_good = failure, passed_for_good
    forget_choices()


# The timing of automatic choices: tune(op, choice, args, kwargs), the Choice of the
# backend measured fastest for such a call among those that can run it (or ``choice``),
# given an automatic choice and the public function's arguments. None until
# fusedlm.verify.tuning installs it.
_tune: Optional[Callable] = None


def install_tuner(tune: Callable) -> None:
    """Makes ``tune`` time the automatic choices (fusedlm.verify.tuning)."""
    global _tune
    _tune = tune
    forget_choices()


@dataclass(frozen=True)
class Choice:
    backend: str
    why: str
    # Index tensors the op passes on as contiguous copies: every kernel reads index tensors
    # (sequence offsets, lengths, positions) with stride 1.
    copies: tuple = ()

    def __str__(self) -> str:
        copies = f"; copies {', '.join(self.copies)} to contiguous memory" if self.copies else ""
        return f"{self.backend}: {self.why}{copies}"

    def copying(self, **index_tensors: Optional[torch.Tensor]) -> "Choice":
        """This choice, noting which of ``index_tensors`` the op will copy."""
        copies = tuple(n for n, t in index_tensors.items() if t is not None and not t.is_contiguous())
        return replace(self, copies=copies) if copies else self


def choose(op: str, device: torch.device, backend: Optional[str] = None, **features) -> Choice:
    """The backend that runs ``op`` on ``device`` for a call with these features."""
    global _not_memoisable
    forced, source = _forced(backend)
    candidates = _candidates(op, device, forced, source, features)
    # While torch.compile traces, nothing is checked: the graph it captures runs the kernels
    # as configured (the eager calls before it are checked).
    if torch.compiler.is_compiling():
        return _first_passing(op, device, forced, source, features.get("dtype"), candidates,
                              _no_failure)[0]
    choice, final = _first_passing(op, device, forced, source, features.get("dtype"), candidates,
                                   _failure)
    if not final:
        _not_memoisable += 1
    return choice


def _first_passing(op: str, device: torch.device, forced: Optional[str], source: Optional[str],
                   dtype: Optional[torch.dtype], candidates: tuple, failure: Callable) -> tuple:
    """(the Choice, whether it is final): the first of the ``candidates`` (:func:`_candidates`)
    that can take the call and passes the device checks of calls in ``dtype`` (``failure``:
    the installed checks', or none); raises where no backend can run the call."""
    if forced is not None:
        (_, reason, choice), = candidates
        if reason:
            raise RuntimeError(f"fusedlm: {op} cannot run on backend {forced!r} (asked for by {source}): {reason}")
        failed = failure(op, forced, device, dtype)
        if failed:
            raise RuntimeError(f"fusedlm: {op} on backend {forced!r} (asked for by {source}) failed "
                               f"its check on this device: {failed} (FUSEDLM_VERIFY=0 runs it unchecked)")
        return choice, _passed_for_good(op, forced, device, dtype)

    skipped, checks_failed = [], False
    for name, reason, choice in candidates:
        if reason is None:
            failed = failure(op, name, device, dtype)
            if not failed:  # (a candidate's Choice names only the backends skipped before it)
                if checks_failed:
                    return _automatic_choice(name, device.type, skipped), False
                return choice, _passed_for_good(op, name, device, dtype)
            reason, checks_failed = f"failed its check on this device: {failed}", True
        skipped.append(f"{name}: {reason}")
    raise RuntimeError(f"fusedlm: no backend can run {op} here: " + "; ".join(skipped))


def _candidates(op: str, device: torch.device, forced: Optional[str], source: Optional[str],
                features: dict) -> tuple:
    """((backend, why it cannot take this call or None, its Choice), ...): the backend
    forced, else every backend in the automatic order."""
    if forced is not None:
        return ((forced, _REGISTRY[forced].cannot_run(op, device, features),
                 Choice(forced, f"asked for by {source}")),)
    candidates, skipped = [], []
    for name in _AUTO_ORDER.get(device.type, ("reference",)):
        candidate = _REGISTRY[name]
        reason = candidate.cannot_run(op, device, features)
        if reason is None and candidate.emulated():
            reason = f"{candidate.emulated()}, so only when asked for by name"
        if reason is None:
            slower = candidate.kernels[op].supports.slower_for(**features)
            if slower:
                reason = (f"measured slower than plain PyTorch for {slower} on {device.type}, "
                          "so only when asked for by name")
        candidates.append((name, reason, _automatic_choice(name, device.type, skipped)))
        if reason is not None:
            skipped.append(f"{name}: {reason}")
    return tuple(candidates)


def _automatic_choice(backend: str, device_type: str, skipped: list) -> Choice:
    why = f"fastest backend for {device_type} tensors that can run this call"
    if skipped:
        why += " (skipped " + "; ".join(skipped) + ")"
    return Choice(backend, why)


def planner(op: str):
    """Registers the function that validates a call to ``op`` and returns its Choice, and
    returns it memoised: a call whose arguments have the key of an earlier one
    (fusedlm._C.call_key: their types and values, the tensors' metadata, the grad mode) under
    the same forcing gets the earlier answer, unless its planning read more than that
    (``_not_memoisable``). Not while torch.compile traces, which must see the planner run."""

    def decorate(plan):
        _PLANNERS[op] = plan
        plans = _PLANS[op] = {}
        is_compiling = torch.compiler.is_compiling

        @functools.wraps(plan)
        def planned(*args, **kwargs):
            if is_compiling():
                return plan(*args, **kwargs)
            key = _C.call_key(args, kwargs, _FORCING.key)
            if key is not None:
                memoised = plans.get(key)
                if memoised is not None:
                    return memoised
            before = _not_memoisable
            choice = _decided(op, plan, args, kwargs)
            if key is not None and _not_memoisable == before:
                if len(plans) >= _PLANS_SIZE:
                    plans.clear()
                plans[key] = choice
            return choice

        return planned

    return decorate


def _decided(op: str, plan: Callable, args: tuple, kwargs: dict) -> Choice:
    """The planner's Choice for a call, timed against the other backends that can run it
    where the choice is automatic (neither asked for by name nor forced) and a tuner is
    installed."""
    choice = plan(*args, **kwargs)
    if _tune is None or kwargs.get("backend") is not None or _FORCING.backend is not None:
        return choice
    return _tune(op, choice, args, kwargs)


def explain(op: str, *args, **kwargs) -> str:
    """Which backend ``fusedlm.ops.<op>(*args, **kwargs)`` would run on, and why."""
    if op not in _PLANNERS:
        raise ValueError(f"op must be one of {sorted(_PLANNERS)}, got {op!r}")
    return f"{op} -> {_decided(op, _PLANNERS[op], args, kwargs)}"


def unobserved() -> bool:
    """Nothing but autograd's reverse mode watches the call: no torch.compile, jit tracing,
    dispatch mode (fake tensors), torch.func transform or forward-mode AD. Such calls may
    run checks (fusedlm.verify) and share constants (fusedlm.ops._dropout) that
    traced code must not see."""
    # (The C functions behind torch.jit.is_tracing and the dispatch mode stack's: this runs
    # on every eager call, where each Python frame saved is a microsecond.)
    return (not torch.compiler.is_compiling() and not _len_torch_dispatch_stack()
            and not _is_tracing() and peek_interpreter_stack() is None
            and forward_ad._current_level < 0)


def check_index_data(device: torch.device, backend: str, *, once_a_step: bool = False) -> bool:
    """Whether a planner checks the values of index tensors (cu_seqlens, labels, indices,
    cache lengths) before a call to ``backend``: never for the cpu backend, whose kernels
    check them as they read them (with the planners' messages); always for other calls on
    CPU tensors. On a GPU the check copies to
    the host, a synchronisation, so a check there runs only under FUSEDLM_DEBUG=1; an op
    called ``once_a_step`` (the losses' labels) checks always, as a bad label would
    otherwise cost a NaN loss, but without reading the result at once
    (fusedlm.ops.cross_entropy: a later call reads it). Never while torch.compile traces
    (the values are not known then), while a CUDA graph captures (it cannot synchronise)
    nor for meta tensors."""
    global _not_memoisable
    if backend == "cpu":
        return False
    if torch.compiler.is_compiling() or device.type == "meta":
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _not_memoisable += 1  # (the next call, outside the capture, checks)
        return False
    checks = device.type == "cpu" or once_a_step or DEBUG
    if checks:  # (the call's answer then rests on the values: not memoised)
        _not_memoisable += 1
    return checks
