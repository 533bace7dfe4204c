"""Backends and dispatch.

Every op has four backends: ``reference`` (plain PyTorch, the ground truth),
``cpu`` (the C++ kernels), ``triton`` and ``cuda``. A call runs on the backend named
by its ``backend=`` argument, else by the innermost :func:`use_backend`, else by
:func:`set_backend`, else by the ``FUSEDLM_BACKEND`` environment variable, else on the
fastest backend that can run it on the tensors' device, passing over a kernel
measured slower than plain PyTorch for such a call (:attr:`Supports.slower`). A backend
named that cannot run the call raises; it never falls back silently. :func:`explain`
tells which backend a call would use and why.

A backend finds an op's kernels by name (``<op>_forward`` and ``<op>_backward``, see
each backend's module); what each backend's kernel of an op takes is data
(:class:`Supports`), the backend's default or what the op's file declares for it. The
automatic choice, :func:`explain`, the tests and the benchmarks all read that one
statement.

Two backends can also run on CPU tensors, slowly, to test their kernels without a
GPU: ``triton`` under ``TRITON_INTERPRET=1`` (Triton's interpreter) and ``cuda`` in a
``FUSEDLM_CUDA=emulate`` build (the CUDA kernels compiled against a CPU emulator of
CUDA). Either runs only when named, never by automatic choice.

Environment switches are read once, when fusedlm is imported.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
from torch._C import _is_tracing, _len_torch_dispatch_stack
from torch._C._functorch import peek_interpreter_stack
from torch.autograd import forward_ad

from .._extension import _C

BACKEND_NAMES = ("reference", "cpu", "triton", "cuda")
KERNEL_BACKENDS = BACKEND_NAMES[1:]  # those with kernels of their own (the reference is the yardstick)
# Automatic choice, fastest first, by device type. CPU tensors never go to
# interpreted Triton or emulated CUDA: `triton` and `cuda` on CPU tensors run only when
# asked for by name.
_AUTO_ORDER = {"cuda": ("cuda", "triton", "reference"), "cpu": ("cpu", "reference")}

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
GPU_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALVES = (torch.bfloat16, torch.float16)


def _checked_name(name: Optional[str], source: str) -> Optional[str]:
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"{source} must be one of {BACKEND_NAMES} or None, got {name!r}")
    return name


# Read once: FUSEDLM_BACKEND forces a backend; FUSEDLM_DEBUG=1 checks the data of index
# tensors on GPUs too (a device-to-host copy per call).
_ENV_BACKEND = _checked_name(os.environ.get("FUSEDLM_BACKEND") or None, "FUSEDLM_BACKEND")
DEBUG = os.environ.get("FUSEDLM_DEBUG") == "1"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _one_of(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


@dataclass(frozen=True)
class Supports:
    """What one backend's kernel of one op takes. A field left at its default takes
    anything; a planner passes the features it knows of a call (``dtype``, ``head_dim``,
    ``head_dim_v``, ``bias``, ``sizes``, ``width``, ``rows``, ``batch``, ``heads``, ``grad``:
    whether autograd records it) and
    :meth:`refuses` names the first one refused."""

    dtypes: tuple = FLOATS  # of the op's floating-point inputs
    head_dims: Optional[tuple] = None  # q's and v's head_dim: the values taken
    max_head_dim: Optional[int] = None  # ... or the largest
    same_head_dim_v: bool = False  # v's head_dim must be q's
    bias: bool = True  # an attn_bias
    multiple_of: int = 1  # every feature size (gelu_ffn's d_in, d_ff and d_out)
    max_width: Optional[int] = None  # the last dimension (add_layer_norm's hidden size)
    # ((feature, largest), ...): counts one launch's grid holds (gelu_ffn's rows;
    # attention's batch and heads)
    max_counts: tuple = ()
    # Calls the kernel takes but runs slower than plain PyTorch on the same device
    # (measured, benchmarks/README.md): each a {feature: value} that a call matches by
    # having all of them. Automatic choice passes the kernel over for such calls, to the
    # next backend (plain PyTorch's reference on the CPU); asked for by name, it runs.
    slower: tuple = ()

    def slower_for(self, **features) -> Optional[str]:
        """The first ``slower`` entry the call's features match ("dtype=float16"), or None."""
        for entry in self.slower:
            if all(features.get(name) == value for name, value in entry.items()):
                return ", ".join(f"{name}={_dtype_name(value) if isinstance(value, torch.dtype) else value}"
                                 for name, value in entry.items())
        return None

    def refuses(self, kernel: str, dtype=None, head_dim=None, head_dim_v=None, bias=False,
                sizes=(), width=None, **features) -> Optional[str]:
        if dtype is not None and dtype not in self.dtypes:
            return (f"the {kernel} takes {_one_of(_dtype_name(d) for d in self.dtypes)}, "
                    f"not {_dtype_name(dtype)}")
        for name, dim in (("head_dim", head_dim), ("v's head_dim", head_dim_v)):
            if dim is None:
                continue
            if self.head_dims is not None and dim not in self.head_dims:
                return f"the {kernel} takes a {name} of {_one_of(self.head_dims)}, not {dim}"
            if self.max_head_dim is not None and dim > self.max_head_dim:
                return f"the {kernel} takes a {name} up to {self.max_head_dim}, not {dim}"
        if self.same_head_dim_v and head_dim_v is not None and head_dim_v != head_dim:
            return f"the {kernel} takes v with q's head_dim ({head_dim}), not {head_dim_v}"
        if bias and not self.bias:
            return f"the {kernel} takes no attn_bias"
        if any(size % self.multiple_of for size in sizes):
            return f"the {kernel} takes sizes that are multiples of {self.multiple_of}, not {sizes}"
        if self.max_width is not None and width is not None and width > self.max_width:
            return f"the {kernel} takes a last dimension up to {self.max_width}, not {width}"
        for name, largest in self.max_counts:
            if features.get(name) is not None and features[name] > largest:
                return f"the {kernel} takes up to {largest} {name}, not {features[name]}"
        return None


@dataclass(frozen=True)
class Kernel:
    """One backend's implementation of one op: the forward and backward kernels of the op's
    schemas (csrc/ops; without the trailing backend), and what they take."""

    forward: Callable
    backward: Optional[Callable] = None
    supports: Supports = Supports()


@dataclass(frozen=True)
class OpInfo:
    """What the backends need to know of a declared op: its name, the module of fusedlm.ops
    that declares it (a kernel module of the same name holds its Triton kernels), what it
    takes on each backend where that differs from the backend's default, its plain-PyTorch
    reference (fusedlm.ops.reference.<name>), the reference backend's kernels (forward,
    backward or None) and its probes (fusedlm.backends.probes)."""

    name: str
    module: str
    supports: dict
    reference: Callable
    reference_kernels: tuple
    probes: tuple = ()


_OPS: dict[str, OpInfo] = {}


def declare(op: OpInfo) -> None:
    """Makes an op known to every backend (fusedlm.ops._op.Op does, once per op)."""
    _OPS[op.name] = op
    forget_choices()


def declared() -> dict[str, OpInfo]:
    """{name: OpInfo} of every declared op, in the order of declaration."""
    return dict(_OPS)


def _native() -> Optional[str]:
    """A backend that runs on its device itself: no emulation."""
    return None


def _any_device(device: torch.device) -> Optional[str]:
    """A backend whose code runs on every device of the types it takes."""
    return None


def filled(outputs, args):
    """A kernel's outputs with each None (an output not asked for) replaced by an empty tensor
    like the first tensor argument: an op cannot return None."""
    if not isinstance(outputs, tuple):
        return outputs
    for o in outputs:  # (a plain loop, which costs least when none is None)
        if o is None:
            break
    else:
        return outputs
    like = next(a for a in args if isinstance(a, torch.Tensor))
    return tuple(like.new_empty(0) if o is None else o for o in outputs)


def _filling(kernel: Callable) -> Callable:
    """A Python kernel as the ops' routing calls it: its absent outputs as empty tensors."""
    def run(*args):
        return filled(kernel(*args), args)

    return run


class _Kernels(dict):
    """A backend's {op name: Kernel}, which the ops' routing (csrc/ops/route.h) follows: a
    Python kernel is handed to it, a compiled one it calls itself. Replacing one at run time
    (a kernel swapped, as the tests swap in broken ones) hands the new one over, and forgets
    the choices made with the old one."""

    def __init__(self, backend: str, found: dict, compiled: dict):
        super().__init__(found)
        self._backend, self._compiled = backend, compiled  # {op: the Kernel compiled in}
        for op, kernel in found.items():
            self._route(op, kernel)

    def _route(self, op: str, kernel: Optional[Kernel]) -> None:
        compiled = self._compiled.get(op)
        for part in ("forward", "backward"):
            function = getattr(kernel, part, None)
            if function is None or (compiled is not None and function is getattr(compiled, part)):
                function = None
            _C.set_python_kernel(f"{op}_{part}", self._backend, function and _filling(function))

    def __setitem__(self, op, found):
        super().__setitem__(op, found)
        self._route(op, found)
        forget_choices()

    def __delitem__(self, op):
        super().__delitem__(op)
        self._route(op, None)
        forget_choices()


@dataclass
class Backend:
    name: str
    devices: tuple  # the device types whose tensors it runs on
    unavailable: Optional[str]  # why it cannot run at all, or None
    # (forward, backward or None) of an op, or None where the backend has no kernel for it.
    find: Callable[[OpInfo], Optional[tuple]]
    supports: Supports = Supports()  # what its kernels take, unless an op says otherwise
    # How it runs where it only emulates its device on the CPU (then never chosen
    # automatically), e.g. "emulated on the CPU as sm_80"; None where it runs natively.
    emulated: Callable[[], Optional[str]] = _native
    # Why it cannot run on this one device (a GPU too old for its compiled code, say), or
    # None; asked per call, so it must answer from a cache.
    refuses_device: Callable[[torch.device], Optional[str]] = _any_device
    # Whether the kernels it finds are compiled into fusedlm._C, which the ops' routing calls
    # without Python (csrc/ops/route.h); else they are Python functions handed to it.
    compiled: bool = False
    _kernels: dict = field(default_factory=dict, repr=False)
    _ops_seen: int = field(default=0, repr=False)

    def __setattr__(self, name, value):
        # What a backend takes and runs decides the planners' memoised answers: a change to it
        # (a backend switched off, say) forgets them.
        object.__setattr__(self, name, value)
        if not name.startswith("_"):
            forget_choices()

    @property
    def kernels(self) -> dict:
        """{op name: Kernel} of every declared op the backend has kernels for."""
        if self._ops_seen != len(_OPS):  # found once, after the ops are declared
            found = {name: self._kernel(op) for name, op in _OPS.items()}
            found = {name: k for name, k in found.items() if k is not None}
            self._kernels = _Kernels(self.name, found, found if self.compiled else {})
            self._ops_seen = len(_OPS)
        return self._kernels

    def _kernel(self, op: OpInfo) -> Optional[Kernel]:
        found = None if self.unavailable else self.find(op)
        if found is None:
            return None
        return Kernel(*found, supports=op.supports.get(self.name, self.supports))

    def cannot_run(self, op: str, device: torch.device, features: dict) -> Optional[str]:
        if self.unavailable:
            return self.unavailable
        if device.type not in self.devices and "any" not in self.devices:
            how = self.emulated()
            return (f"runs on {'/'.join(self.devices)} tensors{f' ({how})' if how else ''}, "
                    f"not {device.type}")
        kernel = self.kernels.get(op)
        if kernel is None:
            return f"has no {op} kernel"
        refused = self.refuses_device(device)
        if refused:
            return refused
        return kernel.supports.refuses(f"{self.name} {op}", **features)


_REGISTRY: dict[str, Backend] = {}
_PLANNERS: dict[str, Callable] = {}
# The planners' answers, memoised by call (planner): {op: {fusedlm._C.call_key of the call,
# forced backend, what forced it: Choice}}. An answer depends on the call's key, the forcing,
# the declared ops, the backends and the device checks of fusedlm.backends.verify, so
# declare(), register(), a change to a Backend and verify.forget() empty it (forget_choices).
_PLANS: dict[str, dict] = {}
_PLANS_SIZE = 4096  # calls per op (the key holds sizes, which vary from call to call)
# How many plannings so far read more than their call's key: the values of index tensors
# (check_index_data) or a device check not yet passed for good (choose). Such an answer is
# not memoised.
_unsettled = 0
_selected: Optional[str] = None
_pinned: list = []  # the use_backend() blocks being run, innermost last


def forget_choices() -> None:
    """Drops the planners' memoised answers."""
    for plans in _PLANS.values():
        plans.clear()


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    forget_choices()
    return backend


def kernel(backend: str, op: str) -> Kernel:
    return _REGISTRY[backend].kernels[op]


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

    __slots__ = ("backend", "source")

    def update(self) -> None:
        for pinned in reversed(_pinned):
            if pinned is not None:
                self.backend, self.source = pinned, "fusedlm.use_backend()"
                return
        if _selected is not None:
            self.backend, self.source = _selected, "fusedlm.set_backend()"
        elif _ENV_BACKEND is not None:
            self.backend, self.source = _ENV_BACKEND, "FUSEDLM_BACKEND"
        else:
            self.backend, self.source = None, None


_FORCING = _Forcing()
_FORCING.update()


def _forced(backend: Optional[str] = None) -> tuple:
    """(the backend a call is forced to, what forced it), or (None, None)."""
    if backend is not None:
        return _checked_name(backend, "backend"), "backend= argument"
    return _FORCING.backend, _FORCING.source


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
    if backend.unavailable:
        return backend.unavailable
    how = backend.emulated()
    return Emulated(how) if how else True


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
    global _unsettled
    forced, source = _forced(backend)
    plan = _worked_out(op, device, forced, source, features)
    # While torch.compile traces, nothing is checked: the graph it captures runs the kernels
    # as configured (the eager calls before it are checked).
    if torch.compiler.is_compiling():
        return _decided(op, device, forced, source, features.get("dtype"), plan, _unchecked)[0]
    choice, final = _decided(op, device, forced, source, features.get("dtype"), plan,
                             verify.failure)
    if not final:
        _unsettled += 1
    return choice


def _decided(op: str, device: torch.device, forced: Optional[str], source: Optional[str],
             dtype: Optional[torch.dtype], plan: tuple, failure: Callable) -> tuple:
    """(the Choice, whether it is final) from _worked_out's plan and the device checks of
    calls in ``dtype`` (``failure``: fusedlm.backends.verify.failure); raises where no
    backend can run the call."""
    if forced is not None:
        (_, reason, choice), = plan
        if reason:
            raise RuntimeError(f"fusedlm: {op} cannot run on backend {forced!r} (asked for by {source}): {reason}")
        failed = failure(op, forced, device, dtype)
        if failed:
            raise RuntimeError(f"fusedlm: {op} on backend {forced!r} (asked for by {source}) failed "
                               f"its check on this device: {failed} (FUSEDLM_VERIFY=0 runs it unchecked)")
        return choice, verify.passed_for_good(op, forced, device, dtype)

    skipped, checks_failed = [], False
    for name, reason, choice in plan:
        if reason is None:
            failed = failure(op, name, device, dtype)
            if not failed:  # (the plan's Choice names only the backends it skipped)
                if checks_failed:
                    return _automatic_choice(name, device.type, skipped), False
                return choice, verify.passed_for_good(op, name, device, dtype)
            reason, checks_failed = f"failed its check on this device: {failed}", True
        skipped.append(f"{name}: {reason}")
    raise RuntimeError(f"fusedlm: no backend can run {op} here: " + "; ".join(skipped))


def _unchecked(*call) -> None:
    return None


def _worked_out(op: str, device: torch.device, forced: Optional[str], source: Optional[str],
                features: dict) -> tuple:
    """((backend, why it cannot take this call or None, its Choice), ...): the backend
    forced, else every backend in the automatic order."""
    if forced is not None:
        return ((forced, _REGISTRY[forced].cannot_run(op, device, features),
                 Choice(forced, f"asked for by {source}")),)
    plan, skipped = [], []
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
        plan.append((name, reason, _automatic_choice(name, device.type, skipped)))
        if reason is not None:
            skipped.append(f"{name}: {reason}")
    return tuple(plan)


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
    (``_unsettled``). Not while torch.compile traces, which must see the planner run."""

    def decorate(plan):
        _PLANNERS[op] = plan
        plans = _PLANS[op] = {}

        @functools.wraps(plan)
        def planned(*args, **kwargs):
            if torch.compiler.is_compiling():
                return plan(*args, **kwargs)
            key = _C.call_key(args, kwargs)
            if key is not None:
                key = (key, _FORCING.backend, _FORCING.source)
                known = plans.get(key)
                if known is not None:
                    return known
            unsettled = _unsettled
            choice = plan(*args, **kwargs)
            if key is not None and _unsettled == unsettled:
                if len(plans) >= _PLANS_SIZE:
                    plans.clear()
                plans[key] = choice
            return choice

        return planned

    return decorate


def explain(op: str, *args, **kwargs) -> str:
    """Which backend ``fusedlm.ops.<op>(*args, **kwargs)`` would run on, and why."""
    if op not in _PLANNERS:
        raise ValueError(f"op must be one of {sorted(_PLANNERS)}, got {op!r}")
    return f"{op} -> {_PLANNERS[op](*args, **kwargs)}"


def unobserved() -> bool:
    """Nothing but autograd's reverse mode watches the call: no torch.compile, jit tracing,
    dispatch mode (fake tensors), torch.func transform or forward-mode AD. Such calls may
    run checks (fusedlm.backends.verify) and share constants (fusedlm.ops._dropout) that
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
    global _unsettled
    if backend == "cpu":
        return False
    if torch.compiler.is_compiling() or device.type == "meta":
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        _unsettled += 1  # (the next call, outside the capture, checks)
        return False
    checks = device.type == "cpu" or once_a_step or DEBUG
    if checks:  # (the call's answer then rests on the values: not memoised)
        _unsettled += 1
    return checks


from . import cpu, cuda, reference, triton  # noqa: E402,F401  (each registers itself)
from . import verify  # noqa: E402
