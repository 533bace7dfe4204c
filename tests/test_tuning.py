"""Timing at first use (fusedlm.verify.tuning): an automatic choice goes to the backend
measured fastest for such calls. On a GPU by default; here on the CPU, with an injected
timer that says what each backend costs."""
import contextlib
import subprocess
import sys

import pytest
import torch

import fusedlm
from fusedlm.backends import _REGISTRY
from fusedlm.verify import tuning


class Timer:
    """Times each backend as ``costs`` says, running its step once (so the step is known
    to run), and counts the timings."""

    def __init__(self, **costs):
        self.costs, self.timed = costs, []

    def __call__(self, step, device, backend):
        step()
        self.timed.append(backend)
        return self.costs[backend]


def _inputs(rows=8):
    return torch.randn(rows, 16, requires_grad=True), torch.randn(16, requires_grad=True)


def test_the_automatic_choice_is_the_backend_measured_fastest():
    x, b = _inputs()
    timer = Timer(cpu=2.0, torch=1.0)
    with tuning.timing_on(("cpu",), timer):
        why = fusedlm.explain("bias_gelu", x, b)
        assert why.startswith("bias_gelu -> torch: measured fastest for such calls on cpu")
        assert "(torch 1 ms, cpu 2 ms)" in why
        out = fusedlm.ops.bias_gelu(x, b)
        # Measured once per shape class: the call above and explain's shared it.
        assert sorted(timer.timed) == ["cpu", "torch"]
        torch.testing.assert_close(out, fusedlm.ops.bias_gelu(x, b, backend="torch"))
        fusedlm.ops.bias_gelu(*_inputs(7))  # the same class: sizes up to 8
        assert len(timer.timed) == 2
        fusedlm.ops.bias_gelu(*_inputs(9))  # another
        assert len(timer.timed) == 4
    # Off again: the order decides.
    assert fusedlm.explain("bias_gelu", x, b).startswith("bias_gelu -> cpu: fastest backend")


def test_named_and_forced_backends_run_as_named():
    x, b = _inputs()
    timer = Timer(cpu=2.0, torch=1.0)
    with tuning.timing_on(("cpu",), timer):
        assert fusedlm.explain("bias_gelu", x, b, backend="cpu").startswith("bias_gelu -> cpu: asked")
        with fusedlm.use_backend("cpu"):
            assert fusedlm.explain("bias_gelu", x, b).startswith("bias_gelu -> cpu: asked")
    assert timer.timed == []


def test_a_backend_that_cannot_run_the_call_is_not_timed():
    x, b = _inputs()
    timer = Timer(cpu=2.0, torch=1.0)
    old = _REGISTRY["cpu"].change(unavailable="switched off")
    try:
        with tuning.timing_on(("cpu",), timer):
            # One backend left: nothing to compare.
            assert fusedlm.explain("bias_gelu", x, b).startswith("bias_gelu -> torch: fastest")
    finally:
        _REGISTRY["cpu"].change(**old)
    assert timer.timed == []


def test_timing_leaves_the_callers_generators_inputs_and_modes_alone():
    # Dropout draws its seed from torch's generator; the timed calls draw theirs from a
    # generator put back after. attention_with_kvcache writes its caches: the timed calls
    # write copies.
    q = torch.randn(2, 1, 2, 8)
    k_cache, v_cache = torch.zeros(2, 6, 2, 8), torch.zeros(2, 6, 2, 8)
    lengths = torch.tensor([2, 3], dtype=torch.int32)
    k_new, v_new = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8)
    timer = Timer(cpu=1.0, torch=2.0)
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    with tuning.timing_on(("cpu",), timer), torch.autocast("cpu", enabled=False):
        fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)
        assert sorted(timer.timed) == ["cpu", "torch"]
        assert torch.equal(torch.rand(3), expected_draw)
    # The caches hold the one call's new keys, at each sequence's length.
    assert torch.equal(k_cache[0, 2], k_new[0, 0]) and torch.equal(k_cache[1, 3], k_new[1, 0])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 2


def test_winners_are_kept_on_disk_and_read_back(tmp_path, monkeypatch):
    from fusedlm import verify

    monkeypatch.setattr(verify, "_CACHE_DIR", tmp_path)
    x, b = _inputs()
    first = Timer(cpu=2.0, torch=1.0)
    with tuning.timing_on(("cpu",), first, on_disk=True):
        fusedlm.ops.bias_gelu(x, b)
    assert len(first.timed) == 2 and list((tmp_path / "verified").glob("timed-cpu-*.json"))
    again = Timer(cpu=2.0, torch=1.0)
    with tuning.timing_on(("cpu",), again, on_disk=True):
        assert fusedlm.explain("bias_gelu", x, b).startswith("bias_gelu -> torch: measured")
    assert again.timed == []


@pytest.mark.parametrize("value, works", [("0", True), ("2", False)])
def test_fusedlm_tune_turns_the_timing_off_or_is_refused(value, works):
    code = "import fusedlm; print(fusedlm.verify.tuning.enabled())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**__import__("os").environ, "FUSEDLM_TUNE": value})
    if works:
        assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr
    else:
        assert done.returncode != 0 and "FUSEDLM_TUNE must be 0 or 1, got '2'" in done.stderr


def test_the_timing_applies_to_gpus_by_default():
    # (On this machine's CPU tensors, then, the order decides without timing.)
    x, b = _inputs()
    with contextlib.nullcontext():
        assert fusedlm.explain("bias_gelu", x, b).startswith("bias_gelu -> cpu: fastest backend")
    assert tuning._TUNER.device_types == ("cuda",)


def test_a_winner_that_cannot_run_a_call_of_its_class_leaves_it_to_the_order():
    x, b = _inputs()
    timer = Timer(cpu=1.0, torch=2.0)
    with tuning.timing_on(("cpu",), timer):
        assert fusedlm.explain("bias_gelu", x, b).startswith("bias_gelu -> cpu: measured")
        old = _REGISTRY["cpu"].change(unavailable="switched off")
        try:
            assert fusedlm.explain("bias_gelu", x, b).startswith("bias_gelu -> torch: fastest")
            torch.testing.assert_close(fusedlm.ops.bias_gelu(x, b),
                                       torch.nn.functional.gelu(x + b))
        finally:
            _REGISTRY["cpu"].change(**old)
