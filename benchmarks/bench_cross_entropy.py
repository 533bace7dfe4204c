"""masked_lm_loss and cross_entropy on the CPU at BERT-base's masked-LM head, against eager PyTorch.

The masked-LM head projects 8 x 128 hidden states (768 wide) onto a 30522-word
vocabulary, and only the ~15% masked positions carry a label. The baseline
("torch") is what BERT implementations run: full-vocabulary logits with F.linear,
then F.cross_entropy with ignore_index. "torch-gathered" selects the labelled rows
with a boolean mask first: the cheap half of masked_lm_loss's saving, in plain PyTorch.

Besides time, every variant's peak memory is measured in a fresh process (peak
resident set size during one call, above what the inputs already hold; the weight
gradient that a backward creates counts) and kept in the benchmark's
extra_info["peak_mib"]. So is the transient part of it, extra_info["transient_mib"]: the
peak above what the call leaves behind (its outputs and gradients), which is what the
fused op saves. `python benchmarks/bench_cross_entropy.py` prints that table alone.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import fusedlm
from conftest import BATCH, HIDDEN, SEQ, VOCAB, forward_backward, role

LABELLED = 0.15
ROWS = BATCH * SEQ
MLM_IMPLS = ("fusedlm", "torch", "torch-gathered")
CE_IMPLS = ("fusedlm", "torch")
PASSES = ("forward", "forward+backward")


def mlm_inputs():
    hidden = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN) * HIDDEN**-0.5).requires_grad_()
    bias = torch.randn(VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ))
    labels = labels.masked_fill(torch.rand(BATCH, SEQ) >= LABELLED, -100)
    return hidden, weight, bias, labels


def mlm_fn(impl):
    if impl == "fusedlm":
        return lambda h, w, b, y: fusedlm.ops.masked_lm_loss(h, w, b, y, backend="cpu")
    if impl == "torch":
        return lambda h, w, b, y: F.cross_entropy(F.linear(h, w, b).view(-1, VOCAB), y.view(-1))

    def gathered(h, w, b, y):
        keep = y != -100
        return F.cross_entropy(F.linear(h[keep], w, b), y[keep])

    return gathered


def ce_inputs():
    logits = torch.randn(ROWS, VOCAB, requires_grad=True)
    labels = torch.randint(0, VOCAB, (ROWS,))
    return logits, labels


def ce_fn(impl):
    if impl == "fusedlm":
        return lambda x, y: fusedlm.ops.cross_entropy(x, y, backend="cpu")
    return lambda x, y: F.cross_entropy(x, y)


def step(op, impl, pass_):
    """(a callable running one call of the variant, its inputs)."""
    inputs = mlm_inputs() if op == "masked_lm_loss" else ce_inputs()
    fn = (mlm_fn if op == "masked_lm_loss" else ce_fn)(impl)
    if pass_ == "forward":
        def run():
            with torch.no_grad():
                fn(*inputs)
        return run, inputs
    return forward_backward(fn, inputs), inputs


# --- peak memory, one fresh process per variant --------------------------------------------------

def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _measure_here(op, impl, pass_):
    """(peak, transient) MiB of one call: its peak RSS above the RSS before it, and above the
    RSS after it. A first call warms up threads and libraries; the gradients it left are
    dropped; then the peak is reset (Linux clear_refs)."""
    run, inputs = step(op, impl, pass_)
    run()
    for t in inputs:
        t.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kib("VmRSS")
    run()
    peak, after = _status_kib("VmHWM"), _status_kib("VmRSS")
    return (peak - before) / 1024, (peak - after) / 1024


def peak_mib(op, impl, pass_) -> tuple[float, float]:
    """(peak, transient) MiB of one call, measured in a fresh process."""
    # glibc would otherwise serve buffers below its (self-raising) mmap threshold from
    # memory freed earlier, hiding them from the RSS; mapping every block above 64 KiB
    # makes the resident set follow the live buffers.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, __file__, "--peak", op, impl, pass_], check=True,
                         capture_output=True, text=True, env=env)
    peak, transient = out.stdout.strip().splitlines()[-1].split()
    return float(peak), float(transient)


# --- benchmarks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", MLM_IMPLS)
@pytest.mark.parametrize("pass_", PASSES)
def test_masked_lm_loss(benchmark, impl, pass_):
    role(benchmark, f"masked_lm_loss {pass_} float32 [{ROWS}x{HIDDEN}->{VOCAB}, {LABELLED:.0%} labelled]", impl)
    benchmark.extra_info["peak_mib"], benchmark.extra_info["transient_mib"] = peak_mib(
        "masked_lm_loss", impl, pass_)
    run, _ = step("masked_lm_loss", impl, pass_)
    benchmark(run)


@pytest.mark.parametrize("impl", CE_IMPLS)
@pytest.mark.parametrize("pass_", PASSES)
def test_cross_entropy(benchmark, impl, pass_):
    role(benchmark, f"cross_entropy {pass_} float32 [{ROWS}x{VOCAB}]", impl)
    benchmark.extra_info["peak_mib"], benchmark.extra_info["transient_mib"] = peak_mib(
        "cross_entropy", impl, pass_)
    run, _ = step("cross_entropy", impl, pass_)
    benchmark(run)


def memory_table() -> str:
    lines = ["| op | pass | impl | peak MiB | transient MiB |", "|---|---|---|---:|---:|"]
    for op, impls in (("masked_lm_loss", MLM_IMPLS), ("cross_entropy", CE_IMPLS)):
        for pass_ in PASSES:
            for impl in impls:
                peak, transient = peak_mib(op, impl, pass_)
                lines.append(f"| {op} | {pass_} | {impl} | {peak:.1f} | {transient:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peak"]:
        torch.manual_seed(0)
        print(*_measure_here(*sys.argv[2:5]))
    else:
        print(memory_table())
