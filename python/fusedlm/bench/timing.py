"""How long one step takes: the median of CUDA-event timings on a GPU, the fastest of
several wall-clock rounds on the CPU.

On a GPU the device runs alone and its times are tight, so the median is the honest
figure. On a shared CPU other processes only ever add time, so the fastest round is the
least disturbed estimate; and the steps compared in one case take turns, so that a slow
spell of the machine (it has lasted seconds here) falls on all of them alike rather than
on whichever step was being timed. A turn is two calls, the second timed: a step run
right after another meets the allocator in the other's state (freed blocks returned to
the system, whose pages the next call faults in again), which cost fusedlm's BERT eval
forward 114 ms against 72 ms in its steady state, the state of a loop that repeats it.
"""
from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..verify.tuning import events_median_ms


@dataclass(frozen=True)
class Timer:
    device: torch.device
    min_rounds: int = 5  # on the CPU: at least this many rounds ...
    seconds: float = 1.0  # ... and at least this long in all

    @property
    def statistic(self) -> str:
        return "median" if self.device.type == "cuda" else "min"

    def __call__(self, step: Callable[[], object], slow: bool = False) -> float:
        """Milliseconds of one call of step (after warm-up: compilation, caches, autotuning).
        A slow step (a model's, seconds on a CPU) gets at most 3 rounds."""
        self.warm_up(step, slow)
        return self.each({"step": step}, slow)["step"]

    def warm_up(self, step: Callable[[], object], slow: bool = False) -> None:
        """Calls step until compilation and caches are done with: once, and on the CPU for
        0.1 s of a fast step. (On a GPU do_bench warms up again, after the compilation.)"""
        fast_cpu = not slow and self.device.type == "cpu"
        _run_for(step, calls=1, seconds=min(0.1, self.seconds) if fast_cpu else 0.0)

    def each(self, steps: dict, slow: bool = False) -> dict:
        """{name: milliseconds of one call} of steps ({name: step}), each warmed up
        already; on the CPU the steps' rounds interleave."""
        if self.device.type == "cuda":
            return {name: _cuda_median_ms(step) for name, step in steps.items()}
        rounds, seconds = (min(self.min_rounds, 3), 0.0) if slow else (self.min_rounds, self.seconds)
        times = {name: [] for name in steps}
        start = time.perf_counter()
        while (any(len(t) < rounds for t in times.values())
               or (time.perf_counter() - start < seconds * len(steps)
                   and all(len(t) < 1000 for t in times.values()))):
            for name, step in steps.items():
                if len(steps) > 1:
                    step()  # untimed: the step meets the memory its own last call left
                begin = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - begin)
        return {name: min(t) * 1e3 for name, t in times.items()}


def _run_for(step, calls: int, seconds: float) -> None:
    """Calls step at least `calls` times and for at least `seconds` (at most 1000 calls)."""
    count, start = 0, time.perf_counter()
    while count < calls or (time.perf_counter() - start < seconds and count < 1000):
        step()
        count += 1


def _cuda_median_ms(step) -> float:
    try:
        import triton.testing
    except ImportError:
        return _events_median_ms(step)
    return triton.testing.do_bench(step, warmup=25, rep=100, return_mode="median")


def _events_median_ms(step, rounds: int = 50) -> float:
    """triton's do_bench without triton: CUDA events around each call, after a warm-up."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return events_median_ms(step, rounds)


def keep_freed_memory() -> Optional[str]:
    """Has glibc keep the memory a CPU step frees (mallopt: trim and mmap thresholds of
    1 GiB, which README advises for CPU training) and says so; None where the C library
    is not glibc. With its defaults glibc hands freed blocks of a few MB back to the system
    by a heuristic, and the next step faults their pages in again, 4 KiB at a time: which
    of the steps compared in a case pays for that changed from run to run (fusedlm's
    bias_gelu forward+backward at 1024 x 3072 took 2.3 ms in one process and 5.5 ms in the
    next, every call faulting its 12 MB gradient in), so the ratios measured glibc."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return None
    m_trim_threshold, m_mmap_threshold, gib = -1, -3, 2**30
    if mallopt(m_trim_threshold, gib) and mallopt(m_mmap_threshold, gib):
        return "glibc keeps freed memory (trim and mmap thresholds 1 GiB)"
    return None
