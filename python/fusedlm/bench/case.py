"""A benchmark case, the context that builds cases, and timing a case into rows.

A case is one op or model step and pass at one shape, with a step (a callable of no
arguments) per implementation. fusedlm's implementations are named ``fusedlm[backend]``
(one per kernel backend that takes the call on this device) or ``fusedlm`` (a model,
with automatic dispatch); every other implementation is a baseline, and each fusedlm
row's speed-up over a baseline is the baseline's time over its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from .. import ops
from ..backends import _REGISTRY, KERNEL_BACKENDS, explain
from . import ceilings as ceilings_module
from .timing import Timer

PASSES = ("forward", "forward+backward")
_PER_MS = {"GB/s": 1e6, "TFLOP/s": 1e9, "tokens/s": 1e-3}  # a unit's amount per millisecond


def is_fused(impl: str) -> bool:
    return impl.startswith("fusedlm")


@dataclass
class Case:
    benchmark: str  # op or model step, and pass: "bias_gelu forward"
    shape: str
    steps: dict  # impl -> step()
    unit: Optional[str] = None  # GB/s (work in bytes), TFLOP/s (FLOPs) or tokens/s (tokens)
    work: Optional[float] = None  # the least a fused implementation must move or compute
    skipped: dict = field(default_factory=dict)  # impl -> why it has no row
    slow: bool = False  # a model's step: seconds on a CPU, so fewer rounds


@dataclass
class Bench:
    """What cases are built for: the device, --quick (tiny shapes, and torch.compile
    without code generation, whose compile time would dominate) and --shapes bert (the
    ops at BERT-base's shapes alone)."""

    device: torch.device
    quick: bool
    bert_shapes: bool = False

    def tensor(self, *shape, dtype, scale: float = 1.0) -> torch.Tensor:
        """A random leaf that takes a gradient."""
        return (torch.randn(*shape, device=self.device, dtype=dtype) * scale).requires_grad_()

    def compile(self, fn: Callable) -> Callable:
        return torch.compile(fn, backend="eager" if self.quick else "inductor")

    def fused(self, op: str, inputs: list, **kwargs) -> tuple[dict, dict]:
        """({"fusedlm[backend]": (fn, inputs)} for every kernel backend that takes this call
        here, {"fusedlm[backend]": why not} for those that run on this device but refuse
        the call (a dtype, a head dim, no kernel for the op))."""
        impls, skipped = {}, {}
        for name in KERNEL_BACKENDS:
            backend = _REGISTRY[name]
            # An emulated backend (the cuda one of a FUSEDLM_CUDA=emulate build) times the
            # emulator, not its kernels.
            if (backend.unavailable or backend.emulated()
                    or self.device.type not in backend.devices):
                continue
            try:
                explain(op, *inputs, backend=name, **kwargs)
            except RuntimeError as refused:
                skipped[f"fusedlm[{name}]"] = str(refused)
                continue

            def fn(*args, name=name):
                return getattr(ops, op)(*args, backend=name, **kwargs)

            impls[f"fusedlm[{name}]"] = (fn, inputs)
        return impls, skipped


def first(out):
    return out[0] if isinstance(out, tuple) else out


def forward_backward(fn: Callable, inputs: list) -> Callable[[], None]:
    """fn(*inputs) then its backward with a fixed upstream gradient, as one step: the
    gradients of the inputs that require them, returned (torch.autograd.grad) rather than
    accumulated into their .grad. Accumulation would add a copy wherever one gradient goes
    to two inputs (x + residual hands both the same tensor), the engine's work in every
    implementation alike and never an op's inside a model. The gradient is made on the
    first call, so that a baseline that cannot run (torch.compile without a compiler, say)
    fails while it is timed, where the failure is reported. An input a baseline leaves out
    (the bare matrix products take no biases) gets no gradient."""
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    upstream = []

    def step():
        out = first(fn(*inputs))
        if not upstream:
            upstream.append(torch.ones_like(out))
        torch.autograd.grad(out, leaves, upstream[0], allow_unused=True)

    return step


def forward(fn: Callable, inputs: list) -> Callable[[], None]:
    def step():
        with torch.no_grad():
            fn(*inputs)

    return step


def passes(benchmark: str, shape: str, impls: dict, *, unit: Optional[str] = None,
           work: Optional[dict] = None, skipped: Optional[dict] = None) -> Iterator[Case]:
    """The forward and the forward+backward case of impls ({impl: (fn, inputs)});
    work: {pass: bytes or FLOPs}."""
    for pass_, make in zip(PASSES, (forward, forward_backward)):
        yield Case(f"{benchmark} {pass_}", shape,
                   {impl: make(fn, inputs) for impl, (fn, inputs) in impls.items()},
                   unit=unit, work=(work or {}).get(pass_), skipped=dict(skipped or {}))


def measure(case: Case, timer: Timer, ceilings: dict) -> list[dict]:
    """One row per implementation: time, rate and share of the ceiling, and for fusedlm's
    rows the speed-up over each baseline; on a GPU also the peak memory of one step. The
    implementations are timed together (Timer.each), those that run at all."""
    steps = {}
    for impl, step in case.steps.items():
        try:
            timer.warm_up(step, case.slow)
        except Exception as failed:  # noqa: BLE001  (a baseline torch cannot run: say why)
            if is_fused(impl):
                raise
            why = (str(failed).strip().splitlines() or [""])[0]
            case.skipped[impl] = f"{type(failed).__name__}: {why}"
            continue
        steps[impl] = step
    rows = []
    for impl, time_ms in timer.each(steps, case.slow).items():
        row = {"benchmark": case.benchmark, "shape": case.shape, "impl": impl, "time_ms": time_ms}
        if timer.device.type == "cuda":
            row["peak_MiB"] = _cuda_peak_mib(steps[impl])
        if case.work:
            rate = case.work / row["time_ms"] / _PER_MS[case.unit]
            row.update(unit=case.unit, rate=rate)
            if case.unit in ceilings_module.CEILING_OF:
                row["of_peak"] = rate / ceilings[ceilings_module.CEILING_OF[case.unit]]
        rows.append(row)
    baselines = {r["impl"]: r["time_ms"] for r in rows if not is_fused(r["impl"])}
    for row in rows:
        if is_fused(row["impl"]):
            row["speedups"] = {name: t / row["time_ms"] for name, t in baselines.items()}
    return rows


def _cuda_peak_mib(step) -> float:
    """Memory one step allocates at its peak above what was held before it."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2 ** 20
