"""How long one step takes: the median of CUDA-event timings on a GPU, the fastest of
several wall-clock rounds on the CPU.

On a GPU the device runs alone and its times are tight, so the median is the honest
figure. On a shared CPU other processes only ever add time, so the fastest round is the
least disturbed estimate.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


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
        if self.device.type == "cuda":
            return _cuda_median_ms(step)
        rounds, seconds = (min(self.min_rounds, 3), 0.0) if slow else (self.min_rounds, self.seconds)
        _run_for(step, calls=1, seconds=min(0.1, seconds))
        return min(_run_for(step, calls=rounds, seconds=seconds)) * 1e3


def _run_for(step, calls: int, seconds: float) -> list:
    """Wall-clock seconds of each call of step, until at least `calls` calls and `seconds`."""
    times, start = [], time.perf_counter()
    while len(times) < calls or (time.perf_counter() - start < seconds and len(times) < 1000):
        begin = time.perf_counter()
        step()
        times.append(time.perf_counter() - begin)
    return times


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
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
