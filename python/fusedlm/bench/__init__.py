"""Benchmarks of fusedlm's fused ops and models against PyTorch (``fusedlm bench``).

Each case is defined once, in :mod:`.ops` (the fused ops) and :mod:`.models` (the models'
steps); :func:`run` times them on one device next to the device's ceilings
(:mod:`.ceilings`) and :mod:`.report` prints, saves and plots the result.
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

import torch

from . import ceilings, report
from .case import Bench, measure
from .models import MODELS
from .ops import OPS, shapes_for
from .timing import Timer, keep_freed_memory


def run(device: torch.device, ops: Sequence[str], models: Sequence[str], quick: bool = False,
        bert_shapes: bool = False, log=None,
        progress: Optional[Callable[[dict], None]] = None) -> dict:
    """The report (see :func:`.report.report`) of `ops` and `models` (names in OPS and
    MODELS) timed on `device`, the ops at BERT-base's shapes alone with `bert_shapes`
    (.ops.shapes_for); one line per case goes to `log` (default: sys.stderr as it is at
    the call) as it is measured, and
    `progress`, where given, gets the report of the cases measured so far after each (its
    "complete" false until the last): a run cut off keeps what it measured. On the CPU
    it has glibc keep freed memory for the rest of the process (.timing.keep_freed_memory):
    call it from a process of its own, as the command line does."""
    log = sys.stderr if log is None else log
    torch.manual_seed(0)
    allocator = keep_freed_memory() if device.type == "cpu" else None
    bench = Bench(device, quick, bert_shapes)
    timer = Timer(device, min_rounds=1, seconds=0.0) if quick else Timer(device)
    shapes = shapes_for(bench)
    peak = ceilings.measure(timer, shapes.copy_bytes, shapes.matmul)
    rows, skipped = [], []
    for cases in [OPS[name](bench) for name in ops] + [MODELS[name](bench) for name in models]:
        for case in cases:
            print(f"bench: {case.benchmark} [{case.shape}]", file=log, flush=True)
            rows += measure(case, timer, peak)
            # Cases compile their baselines from shared functions (every attention case's
            # eager composition is one function): across cases dynamo's cache for a
            # function fills up, and past its limit torch.compile runs it eagerly, quietly.
            torch.compiler.reset()
            skipped += [{"benchmark": case.benchmark, "shape": case.shape, "impl": impl,
                         "reason": reason} for impl, reason in case.skipped.items()]
            if progress is not None:
                progress(report.report(device, quick, timer.statistic, peak, rows, skipped,
                                       allocator, complete=False))
    return report.report(device, quick, timer.statistic, peak, rows, skipped, allocator)


__all__ = ["MODELS", "OPS", "run"]
