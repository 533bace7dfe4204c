"""Probes: small problems that check a backend's kernels against the plain-PyTorch reference.

A probe is one call of an op (``fusedlm.ops.<op>``) on inputs drawn from its own
generator: the backend's forward and backward run in the call's dtype on the call's
device, the reference (fusedlm.ops.reference) in float64 on the CPU from the same
inputs after their rounding to that dtype, and the result is the largest norm-wise
relative error ‖out − ref‖ / ‖ref‖ over the outputs and the gradients. Probes draw
nothing from torch's global generator and use no dropout (whose seed would), so running
one does not change what a user's program computes.

Each op declares its probes beside itself (fusedlm/ops/<op>.py, with fusedlm.ops._probe). ``small`` probes take
each kernel path a backend has for the op (the cuda attention's resident and streamed
K/V, head dims 64 and 128, the layer norm's vector and one-element rows, ...) and run in
milliseconds; ``real`` ones have the shapes of BERT-base, GPT-2 small and ELMo. First-use verification
(fusedlm.verify) runs the small ones;
``fusedlm selftest`` runs both.
"""
from __future__ import annotations

import contextlib
import importlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..backends import declared
from ..ops._probe import Probe, randn

# Norm-wise relative error a correct kernel stays under, by the dtype it computes in: a few
# roundings of that dtype over long reductions, with a wide margin (a wrong kernel is off
# by order 1).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass
class Outcome:
    error: float  # the largest norm-wise relative error (inf: a NaN or a wrong integer output)
    worst: str  # what it was measured on ("output 0", "gradient of input 1")

    def within(self, dtype: torch.dtype) -> bool:
        return self.error <= TOLERANCE.get(dtype, 5e-2)


def probes(op: Optional[str] = None, size: str = "small") -> list:
    """The probes at ``size`` ("small" or "real") of ``op`` (None: of every op), as the ops
    declare them (fusedlm/ops/<op>.py)."""
    return [p for info in declared().values() if op is None or info.name == op
            for p in info.probes if p.size == size]


def op_function(name: str) -> Callable:
    """fusedlm.ops.<name> as the module declaring the op defines it: the checks call the op
    itself, never what someone put in its place in fusedlm.ops (a test's recorder, a
    user's logging wrapper), which would see calls its caller never made."""
    return getattr(importlib.import_module(f"fusedlm.ops.{declared()[name].module}"), name)


def probed() -> list:
    """The ops that have small probes."""
    return sorted({p.op for p in probes()})


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _leaves(outputs) -> list:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not got.is_floating_point():
        return 0.0 if torch.equal(got.cpu(), ref) else math.inf
    got = got.detach().to("cpu", torch.float64)
    if not torch.isfinite(got).all():
        return math.inf
    scale = ref.norm().item()
    return (got - ref).norm().item() / (scale if scale > 0 else 1.0)


@contextlib.contextmanager
def _no_autocast():
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


class _Call:
    """A probe's inputs on ``device`` in ``dtype`` (floating tensors rounded to it, those
    taking gradients as leaves), and one forward and backward of ``fn`` over them."""

    def __init__(self, probe: Probe, device, dtype, generator: torch.Generator):
        args, kwargs = probe.make(generator)
        self.args = [a.to(device, dtype) if _floating(a)
                     else a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        self.kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}
        self.grad_of = [i for i, a in enumerate(args) if _floating(a) and i not in probe.constant] \
            if probe.differentiable else []
        for i in self.grad_of:
            self.args[i].requires_grad_()

    def __call__(self, fn: Callable, upstream=None) -> tuple:
        """(outputs, gradients of the floating inputs), in the inputs' dtype whatever autocast
        or inference mode the caller is in. ``upstream``: the outputs' gradients, a function
        of the outputs that gives them, or None (ones)."""
        with torch.inference_mode(False), torch.enable_grad(), _no_autocast():
            out = _leaves(fn(*self.args, **self.kwargs))
            if callable(upstream):
                upstream = upstream(out)
            elif upstream is None:
                upstream = [torch.ones_like(o) if _floating(o) else None for o in out]
            pairs = [(o, u) for o, u in zip(out, upstream) if u is not None and o.requires_grad]
            grads = []
            if self.grad_of and pairs:
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], [self.args[i] for i in self.grad_of],
                    [u.to(o.device, o.dtype) for o, u in pairs], allow_unused=True)
        return out, list(grads)


def run(probe: Probe, backend: str, device: torch.device, dtype: torch.dtype,
        seed: int = 0) -> Outcome:
    """The probe on ``backend`` in ``dtype`` on ``device``, against the float64 reference
    computed on the CPU from the same inputs."""
    from fusedlm.ops import reference

    call = _Call(probe, device, dtype, torch.Generator().manual_seed(seed))
    ref_call = _Call(probe, "cpu", dtype, torch.Generator().manual_seed(seed))
    ref_call.args = [a.detach().double().requires_grad_(a.requires_grad) if _floating(a) else a
                     for a in ref_call.args]
    generator, upstream = torch.Generator().manual_seed(seed + 1), []

    def draw(outputs):  # random output gradients, the same for the backend's call
        upstream.extend(randn(generator, *o.shape) if _floating(o) else None for o in outputs)
        return upstream

    ref_out, ref_grads = ref_call(getattr(reference, probe.op), draw)
    op = op_function(probe.op)
    out, grads = call(lambda *a, **k: op(*a, backend=backend, **k), upstream)

    measured = [(f"output {i}", _relative_error(o, r)) for i, (o, r) in enumerate(zip(out, ref_out))
                if isinstance(r, torch.Tensor)]
    measured += [(f"gradient of input {i}", _relative_error(g, r))
                 for i, g, r in zip(call.grad_of, grads, ref_grads) if r is not None and g is not None]
    measured += [(f"gradient of input {i}", math.inf)
                 for i, g, r in zip(call.grad_of, grads, ref_grads) if r is not None and g is None]
    worst, error = max(measured, key=lambda m: m[1])
    return Outcome(error, worst)


def time_ms(probe: Probe, device: torch.device, dtype: torch.dtype,
            backend: Optional[str] = None, rounds: int = 5) -> Optional[float]:
    """The median time of the probe's forward and backward on ``backend`` (None: in plain
    PyTorch, the torch backend's composition) after one call to warm up; None where plain
    PyTorch has no kernel for this dtype here."""
    plain = backend is None
    backend = backend or "torch"
    op = op_function(probe.op)

    def fn(*args, **kwargs):
        return op(*args, backend=backend, **kwargs)

    call = _Call(probe, device, dtype, torch.Generator().manual_seed(0))
    times = []
    try:
        for _ in range(rounds + 1):
            start = time.perf_counter()
            call(fn)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
    except (RuntimeError, NotImplementedError):
        if not plain:
            raise
        return None
    return statistics.median(times[1:])
