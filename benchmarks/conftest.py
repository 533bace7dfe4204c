"""Benchmark conventions.

Each benchmark is a pytest-benchmark test whose group names one op and pass
(e.g. "bias_gelu forward"); `role(benchmark, name)` marks it as fusedlm's or a
named baseline's. benchmarks/report.py turns a run's JSON into the table of
speed-ups (baseline time / fusedlm time) for benchmarks/README.md. Inputs are
BERT-base shapes: batch 8, seq 128, hidden 768, 12 heads, FFN 3072, vocab 30522.
"""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

BATCH, SEQ, HIDDEN, HEADS, FFN, VOCAB = 8, 128, 768, 12, 3072, 30522


def role(benchmark, group: str, impl: str) -> None:
    """Files a benchmark under `group`; impl is "fusedlm" or the baseline's name."""
    benchmark.group = group
    benchmark.extra_info["impl"] = impl


def forward_backward(fn, inputs):
    """A step of fn(*inputs): forward, then backward with a fixed upstream gradient."""
    out = fn(*inputs)
    out = out[0] if isinstance(out, tuple) else out
    grad = torch.ones_like(out)

    def step():
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None
        fn_out = fn(*inputs)
        fn_out = fn_out[0] if isinstance(fn_out, tuple) else fn_out
        fn_out.backward(grad)

    return step


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
