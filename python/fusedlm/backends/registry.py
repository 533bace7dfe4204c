"""The registry: the backends, the declared ops, and what each backend's kernels take.

A backend finds an op's kernels by name (``<op>_forward`` and ``<op>_backward``, see each
backend's module); what each backend's kernel of an op takes is data (:class:`Supports`),
the backend's default or what the op's file declares for it. The automatic choice
(fusedlm.backends.dispatch), ``explain``, the tests and the benchmarks all read that one
statement.

What the registry holds decides the planners' memoised answers: a change to it (an op
declared, a backend registered, changed or given another kernel) calls every function
passed to :func:`on_change`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .._extension import _C
from ..dtypes import FLOATS, GPU_FLOATS, HALVES  # noqa: F401  (what Supports take)
from ..dtypes import name as dtype_name

BACKEND_NAMES = ("reference", "torch", "cpu", "triton", "cuda")
# Those with kernels of their own: the reference is the yardstick, and the torch backend
# runs PyTorch's own composition of each op, what users have without fusedlm.
KERNEL_BACKENDS = BACKEND_NAMES[2:]
# Automatic choice, fastest first, by device type. CPU tensors never go to
# interpreted Triton or emulated CUDA: `triton` and `cuda` on CPU tensors run only when
# asked for by name. Where no fusedlm kernel can take a call (or one is measured slower),
# PyTorch's own composition runs it, and the reference only for an op that has none.
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch", "reference"),
               "cpu": ("cpu", "torch", "reference")}


def _one_of(values) -> str:
    values = [str(v) for v in values]
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]


_LISTENERS: list = []


def on_change(listener: Callable[[], None]) -> None:
    """Calls ``listener()`` whenever what the registry holds changes."""
    _LISTENERS.append(listener)


def _changed() -> None:
    for listener in _LISTENERS:
        listener()


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
    grouped: bool = True  # fewer key/value heads than query heads (attention)
    window: bool = True  # a sliding window (attention)
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
                return ", ".join(f"{name}={dtype_name(value) if isinstance(value, torch.dtype) else value}"
                                 for name, value in entry.items())
        return None

    def refuses(self, kernel: str, dtype=None, head_dim=None, head_dim_v=None, bias=False,
                sizes=(), width=None, **features) -> Optional[str]:
        if dtype is not None and dtype not in self.dtypes:
            return (f"the {kernel} takes {_one_of(dtype_name(d) for d in self.dtypes)}, "
                    f"not {dtype_name(dtype)}")
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
        if features.get("grouped") and not self.grouped:
            return f"the {kernel} takes no grouped key/value heads"
        if features.get("window") and not self.window:
            return f"the {kernel} takes no window"
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
    backward or None), its probes (fusedlm.ops._probe) and its composition of PyTorch's
    own ops in the inputs' dtype, the torch backend's (or None)."""

    name: str
    module: str
    supports: dict
    reference: Callable
    reference_kernels: tuple
    probes: tuple = ()
    composition: Optional[Callable] = None


_OPS: dict[str, OpInfo] = {}


def declare(op: OpInfo) -> None:
    """Makes an op known to every backend (fusedlm.ops._op.Op does, once per op)."""
    _OPS[op.name] = op
    _changed()


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

    def __init__(self, backend: str, found: dict, compiled: dict, routed: bool):
        super().__init__(found)
        self._backend, self._compiled = backend, compiled  # {op: the Kernel compiled in}
        self._routed = routed
        for op, kernel in found.items():
            self._route(op, kernel)

    def _route(self, op: str, kernel: Optional[Kernel]) -> None:
        if not self._routed:
            return
        compiled = self._compiled.get(op)
        for part in ("forward", "backward"):
            function = getattr(kernel, part, None)
            if function is None or (compiled is not None and function is getattr(compiled, part)):
                function = None
            _C.set_python_kernel(f"{op}_{part}", self._backend, function and _filling(function))

    def __setitem__(self, op, found):
        super().__setitem__(op, found)
        self._route(op, found)
        _changed()

    def __delitem__(self, op):
        super().__delitem__(op)
        self._route(op, None)
        _changed()


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
    # Whether its forward "kernel" is the op's whole computation in PyTorch ops, which
    # autograd records itself: the op runs it in place of the registered op (fusedlm.ops._op),
    # not through the routing, and it has no backward kernel.
    composed: bool = False
    _kernels: dict = field(default_factory=dict, repr=False)
    _ops_seen: int = field(default=0, repr=False)

    def change(self, **fields) -> dict:
        """Sets these fields (``unavailable="why"`` switches the backend off) and tells those
        who keep answers that rest on them (the planners' memo); returns the fields' old
        values, which a later ``change(**old)`` restores."""
        old = {name: getattr(self, name) for name in fields}
        for name, value in fields.items():
            setattr(self, name, value)
        _changed()
        return old

    @property
    def kernels(self) -> dict:
        """{op name: Kernel} of every declared op the backend has kernels for."""
        if self._ops_seen != len(_OPS):  # found once, after the ops are declared
            found = {name: self._kernel(op) for name, op in _OPS.items()}
            found = {name: k for name, k in found.items() if k is not None}
            self._kernels = _Kernels(self.name, found, found if self.compiled else {},
                                     routed=not self.composed)
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


def register(backend: Backend) -> Backend:
    _REGISTRY[backend.name] = backend
    _changed()
    return backend


def find_kernels() -> None:
    """Has every backend find its kernels of the ops declared so far, as ``import fusedlm``
    does once it has declared them: finding them hands the Python kernels to the ops'
    routing (fusedlm._C), which torch.compile cannot trace, and an op's first call may be
    traced."""
    for backend in _REGISTRY.values():
        backend.kernels  # noqa: B018  (found on first access)


def kernel(backend: str, op: str) -> Kernel:
    return _REGISTRY[backend].kernels[op]


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
