"""Timing at first use: on a GPU, an automatic choice of backend goes to the backend
measured fastest for such calls, never to a kernel slower than PyTorch's own composition.

The first time a call of op X in a shape class (each tensor's dtype and its sizes rounded
up to powers of two; the other arguments as they are) would run on a GPU by automatic
choice, fusedlm times X on every backend that can run the call there: the cuda and triton
kernels, and the torch backend, PyTorch's own composition in the inputs' dtype (SDPA,
cuBLAS products and eager elementwise passes), what users run without fusedlm (the
reference, in float32 or wider, is the yardstick of correctness, not a candidate). Each
runs the forward, and the
backward where the call takes gradients, on copies of the call's arguments, in a thread of
its own (the caller's autocast, grad mode and saved-tensor hooks stay out), with the random
generators put back after. The fastest wins for that class; ``fusedlm.explain`` quotes the
times.
Winners are kept on disk beside the verification record (``$FUSEDLM_CACHE_DIR/verified/``),
so a machine measures once. ``FUSEDLM_TUNE=0`` turns the timing off: the
fastest-in-principle order of fusedlm.backends then decides. Named and forced backends run
as named; calls torch.compile traces take the order; calls under CUDA graph capture, a
dispatch mode or a torch.func transform are not timed (they take a winner already
measured, or the order).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import inspect
import json
import math
import os
import statistics
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from .. import switches
from ..backends import Choice, install_tuner, unobserved
from ..backends.dispatch import _PLANNERS
from ..backends.registry import _AUTO_ORDER, _REGISTRY
from . import _device_key, identity  # (fusedlm imports this module after fusedlm.verify)
from . import _file as verified_file
from .probes import op_function

_MODE = (switches.value("FUSEDLM_TUNE") or "1").strip()
if _MODE not in ("0", "1"):
    raise ValueError(f"FUSEDLM_TUNE must be 0 or 1, got {switches.value('FUSEDLM_TUNE')!r}")

WARM_UP, ROUNDS = 2, 5  # calls before timing, and timed calls (the median counts)


def events_median_ms(step: Callable[[], None], rounds: int) -> float:
    """The median of ``rounds`` calls of ``step``, each timed by CUDA events on the current
    stream, in ms (the caller warms the step up)."""
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


class _Tuner:
    """The timing's state: the device types it times on, its timer, and the winners by
    device and shape class (in memory, and on disk per device and software)."""

    def __init__(self):
        self.device_types = ("cuda",)
        # timer(step, device, backend): ms of one call of step, which runs the backend's call
        self.timer: Callable = lambda step, device, backend: events_median_ms(step, ROUNDS)
        self.winners: dict = {}  # {device key: {class key: {"backend": b, "ms": {b: t}}}}
        self.on_disk = True  # winners read from and written to the cache folder
        self.enabled = _MODE != "0"
        self.lock = threading.RLock()


_TUNER = _Tuner()


def enabled() -> bool:
    """Whether automatic choices are timed (FUSEDLM_TUNE is not 0)."""
    return _TUNER.enabled


@contextlib.contextmanager
def timing_on(device_types: tuple, timer: Callable, on_disk: bool = False):
    """Times automatic choices on ``device_types`` with ``timer(step, device, backend)``
    (ms of one call of step, which runs the call on the backend), the winners kept in
    memory (and on disk with ``on_disk``), whatever FUSEDLM_TUNE says: for tests, on the
    CPU."""
    from ..backends import forget_choices

    fields = ("device_types", "timer", "winners", "on_disk", "enabled")
    saved = {name: getattr(_TUNER, name) for name in fields}
    _TUNER.__dict__.update(device_types=device_types, timer=timer, winners={}, on_disk=on_disk,
                           enabled=True)
    forget_choices()
    try:
        yield
    finally:
        _TUNER.__dict__.update(saved)
        forget_choices()


def tune(op: str, choice: Choice, args: tuple, kwargs: dict) -> Choice:
    """``choice``, an automatic one, or the backend measured fastest for such calls
    (fusedlm.backends.dispatch)."""
    device = _device_of(args, kwargs)
    if not _TUNER.enabled or device is None or device.type not in _TUNER.device_types:
        return choice
    if torch.compiler.is_compiling():
        return choice
    key = _class_key(op, args, kwargs)
    with _TUNER.lock:
        winners = _loaded(device)
        found = winners.get(key)
        if found is None:
            if not _may_time(device):
                return choice
            times = _measured(op, args, kwargs, device)
            if not times:
                return choice
            found = winners[key] = {"backend": min(times, key=times.get), "ms": times}
            _save(device, winners)
    # A winner holds for its class; this call of the class it must still be able to run.
    if found["backend"] != choice.backend and not _can_run(op, found["backend"], args, kwargs):
        return choice
    quoted = ", ".join(f"{name} {ms:.3g} ms" for name, ms in sorted(found["ms"].items(),
                                                                    key=lambda item: item[1]))
    return Choice(found["backend"], f"measured fastest for such calls on {device.type} ({quoted})",
                  choice.copies)


def _device_of(args: tuple, kwargs: dict) -> Optional[torch.device]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def _rounded(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _class_of(value) -> str:
    if isinstance(value, torch.Tensor):
        sizes = "x".join(str(_rounded(n)) for n in value.shape)
        grad = "g" if value.requires_grad else ""
        return f"{str(value.dtype).removeprefix('torch.')}[{sizes}]{grad}"
    if isinstance(value, bool) or not isinstance(value, int):
        return repr(value)
    return f"~{_rounded(value)}"


def _class_key(op: str, args: tuple, kwargs: dict) -> str:
    """The call's shape class, what its timing holds for: every argument of the op's
    planner (its defaults filled in, the backend left out) and the grad mode."""
    bound = inspect.signature(_PLANNERS[op]).bind(*args, **kwargs)
    bound.apply_defaults()
    parts = [f"{name}={_class_of(value)}" for name, value in bound.arguments.items()
             if name != "backend"]
    grad = "grad" if torch.is_grad_enabled() else "no_grad"
    return f"{op}/{grad}/" + ",".join(parts)


def _may_time(device: torch.device) -> bool:
    if not unobserved():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _can_run(op: str, backend: str, args: tuple, kwargs: dict) -> bool:
    """Whether the op's planner accepts the call with ``backend`` named (the backend can
    take it and passed its checks on the device), an emulation (a test vehicle) aside."""
    if backend not in _REGISTRY or _REGISTRY[backend].emulated():
        return False
    try:
        _PLANNERS[op](*args, **{**kwargs, "backend": backend})
    except (RuntimeError, ValueError, TypeError):
        return False
    return True


def _runnable(op: str, args: tuple, kwargs: dict, device: torch.device) -> list:
    """The backends but the reference that can run the call on ``device``, in the automatic
    order."""
    return [name for name in _AUTO_ORDER.get(device.type, ())
            if name != "reference" and _can_run(op, name, args, kwargs)]


def _measured(op: str, args: tuple, kwargs: dict, device: torch.device) -> dict:
    """{backend: ms of one call} for the backends that can run the call, timed in a
    thread of their own on the caller's device."""
    names = _runnable(op, args, kwargs, device)
    if len(names) < 2:
        return {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_timed_here, op, args, kwargs, device, names).result()


def _timed_here(op: str, args: tuple, kwargs: dict, device: torch.device, names: list) -> dict:
    function = op_function(op)
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    devices = [device] if device.type == "cuda" else []
    grad = torch.is_grad_enabled()
    times = {}
    with on_device, torch.random.fork_rng(devices=devices), torch.set_grad_enabled(grad):
        for name in names:
            copies, copied_kwargs = _copies(args), {k: _copies((v,))[0] for k, v in kwargs.items()}
            copied_kwargs["backend"] = name
            leaves = [t for t in (*copies, *copied_kwargs.values())
                      if isinstance(t, torch.Tensor) and t.requires_grad]

            def step(copies=copies, copied_kwargs=copied_kwargs, leaves=leaves):
                out = function(*copies, **copied_kwargs)
                outputs = [o for o in (out if isinstance(out, tuple) else (out,))
                           if isinstance(o, torch.Tensor) and o.requires_grad]
                if leaves and outputs:
                    torch.autograd.grad(outputs, leaves, [torch.ones_like(o) for o in outputs],
                                        allow_unused=True)

            try:
                for _ in range(WARM_UP):
                    step()
                ms = _TUNER.timer(step, device, name)
            except RuntimeError:  # a backend that cannot take the call after all
                continue
            if math.isfinite(ms):
                times[name] = ms
    return times


def _copies(values: tuple) -> list:
    """The values, with each tensor a copy of its own (a kernel may write its inputs, as
    attention_with_kvcache writes its caches) that takes gradients as the original does."""
    return [v.detach().clone().requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) else v
            for v in values]


def _file(device: torch.device) -> Path:
    """Beside the device's verification record, named as it is."""
    checked = verified_file(device, identity(device))
    return checked.with_name(f"timed-{checked.name}")


def _loaded(device: torch.device) -> dict:
    key = _device_key(device)
    if key not in _TUNER.winners:
        winners = {}
        if _TUNER.on_disk:
            try:
                winners = dict(json.loads(_file(device).read_text())["winners"])
            except (OSError, ValueError, KeyError, TypeError):
                pass
        _TUNER.winners[key] = winners
    return _TUNER.winners[key]


def _save(device: torch.device, winners: dict) -> None:
    """Writes the device's winners; a cache that cannot be written only means timing
    again next time."""
    if not _TUNER.on_disk:
        return
    path = _file(device)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        record = {"identity": identity(device), "winners": winners}
        temporary.write_text(json.dumps(record, indent=1))
        os.replace(temporary, path)
    except OSError:
        pass


install_tuner(tune)
