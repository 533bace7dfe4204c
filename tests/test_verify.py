"""Verification at first use (fusedlm.verify): a kernel that gives wrong numbers is
caught before it runs a user's data, reported once, and its calls go to the next backend;
the result is kept on disk; strict and off modes; never while something traces the call."""
import dataclasses
import json
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlm
import fusedlm.ops as F
from fusedlm import verify
from fusedlm.backends import _REGISTRY
from fusedlm.verify import probes
from fusedlm.backends import cuda as cuda_backend
from fusedlm.ops import reference
from cli_helpers import run_cli


class PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def checks(tmp_path, monkeypatch):
    """Checks on, with an empty cache of their own; forgotten afterwards."""
    monkeypatch.setattr(verify, "_MODE", "1")
    monkeypatch.setattr(verify, "_CACHE_DIR", tmp_path)
    verify.forget()
    yield tmp_path
    verify.forget()


def _broken(backend: str, op: str, monkeypatch, corrupt):
    """Replaces backend's forward kernel of op by one whose first output goes through corrupt
    (the ops' routing then calls it); returns the list of its calls."""
    calls = []
    kernels = _REGISTRY[backend].kernels
    good = kernels[op]

    def corrupted(run):
        def call(*args):
            outputs = run(*args)
            calls.append(1)
            if isinstance(outputs, tuple):
                return (corrupt(outputs[0]), *outputs[1:])
            return corrupt(outputs)
        return call

    monkeypatch.setitem(kernels, op, dataclasses.replace(good, forward=corrupted(good.forward)))
    return calls


def _inputs():
    return torch.randn(4, 9, 64), torch.randn(64)


def test_every_probe_passes_on_the_cpu_backend():
    for probe in probes.probes():
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            outcome = probes.run(probe, "cpu", torch.device("cpu"), dtype, seed=3)
            assert outcome.within(dtype), (probe.op, probe.name, dtype, outcome)


def test_a_probe_measures_a_wrong_kernel(monkeypatch):
    # 1% off in the output alone (the gradient flows around the detached part).
    _broken("cpu", "bias_gelu", monkeypatch, lambda out: out + 0.01 * out.detach())
    outcome = probes.run(probes.probes("bias_gelu")[0], "cpu", torch.device("cpu"), torch.float32)
    assert 5e-3 < outcome.error < 2e-2 and outcome.worst == "output 0"
    assert not outcome.within(torch.float32)


def test_a_wrong_kernel_is_refused_once_with_a_warning_and_the_call_runs_elsewhere(checks, monkeypatch):
    _broken("cpu", "bias_gelu", monkeypatch,
            lambda out: out + 0.1 if out.dtype == torch.float32 else out)  # float32 alone
    x, b = _inputs()
    with pytest.warns(RuntimeWarning, match=r"cpu backend's bias_gelu in float32 failed its check .*"
                                            r"error [0-9.e-]+ in output 0"):
        out = F.bias_gelu(x, b)
    torch.testing.assert_close(out, reference.bias_gelu(x, b))  # on the reference backend
    assert "skipped cpu: failed its check on this device" in fusedlm.explain("bias_gelu", x, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.bias_gelu(x, b)  # one warning: the result is remembered
    # Another float type is checked on its own, and passes.
    assert fusedlm.explain("bias_gelu", x.double(), b.double()).startswith("bias_gelu -> cpu")


def test_the_result_is_kept_on_disk(checks, monkeypatch):
    calls = _broken("cpu", "bias_gelu", monkeypatch, lambda out: out + 0.1)
    x, b = _inputs()
    with pytest.warns(RuntimeWarning):
        F.bias_gelu(x, b)
    checked = len(calls)
    assert checked > 0
    verify.forget()  # as a new process would start
    with pytest.warns(RuntimeWarning, match="failed its check"):
        F.bias_gelu(x, b)
    assert len(calls) == checked  # read from the file, not checked again
    stored = list((checks / "verified").glob("cpu-*.json"))
    assert len(stored) == 1 and "bias_gelu/cpu/float32" in stored[0].read_text()


def test_nan_fails_the_check(checks, monkeypatch):
    _broken("cpu", "add_layer_norm", monkeypatch, lambda out: out.index_fill(-1, torch.tensor([3]), math.nan))
    x = torch.randn(2, 5, 256)
    with pytest.warns(RuntimeWarning, match=r"error inf in output 0"):
        out, _ = F.add_layer_norm(x, None, None, None)
    assert torch.isfinite(out).all()


def test_a_named_backend_that_fails_its_check_raises(checks, monkeypatch):
    _broken("cpu", "bias_gelu", monkeypatch, lambda out: out + 0.1)
    x, b = _inputs()
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match=r"bias_gelu on backend 'cpu' "
                                                                        r"\(asked for by backend= argument\) failed"):
        F.bias_gelu(x, b, backend="cpu")


def test_strict_mode_raises(checks, monkeypatch):
    monkeypatch.setattr(verify, "_MODE", "strict")
    _broken("cpu", "bias_gelu", monkeypatch, lambda out: out + 0.1)
    with pytest.raises(verify.VerificationError, match="failed its check"):
        F.bias_gelu(*_inputs())


def test_checks_off_run_the_kernel_as_it_is(checks, monkeypatch):
    monkeypatch.setattr(verify, "_MODE", "0")
    _broken("cpu", "bias_gelu", monkeypatch, lambda out: out + 0.1)
    x, b = _inputs()
    torch.testing.assert_close(F.bias_gelu(x, b), reference.bias_gelu(x, b) + 0.1)


def test_no_check_while_a_dispatch_mode_watches_then_at_the_next_call(checks, monkeypatch):
    calls = _broken("cpu", "bias_gelu", monkeypatch, lambda out: out + 0.1)
    x, b = _inputs()
    with PassThrough():
        F.bias_gelu(x, b)
    assert len(calls) == 1  # the call itself: unchecked, as configured
    with pytest.warns(RuntimeWarning, match="failed its check"):
        F.bias_gelu(x, b)


def test_no_check_while_torch_compile_traces(checks, monkeypatch):
    calls = _broken("cpu", "bias_gelu", monkeypatch, lambda out: out + 0.1)
    x, b = _inputs()
    compiled = torch.compile(lambda x, b: F.bias_gelu(x, b), backend="eager", fullgraph=True)
    compiled(x, b)
    assert len(calls) == 1


# The checks called the op through fusedlm.ops, where a caller's wrapper (a test's
# recorder, a user's logger) took the probe's calls for its own. They call it as the
# module declaring it defines it.
def test_a_check_calls_the_op_itself_not_a_wrapper_in_its_place(checks, monkeypatch):
    seen = []
    bias_gelu = fusedlm.ops.bias_gelu
    monkeypatch.setattr(fusedlm.ops, "bias_gelu",
                        lambda *a, **k: seen.append(tuple(a[0].shape)) or bias_gelu(*a, **k))
    x, b = _inputs()
    fusedlm.ops.bias_gelu(x, b)
    assert "bias_gelu/cpu/float32" in verify._records["cpu"]["results"]  # the check ran
    assert seen == [tuple(x.shape)]


def test_a_check_leaves_torchs_generator_alone(checks):
    torch.manual_seed(5)
    before = torch.get_rng_state()
    assert verify.failure("cross_entropy", "cpu", torch.device("cpu"), torch.float32) is None
    assert "cross_entropy/cpu/float32" in verify._records["cpu"]["results"]  # it did run
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_backend.emulated(), reason="not a FUSEDLM_CUDA=emulate build")
def test_a_broken_cuda_path_is_turned_off_and_the_rest_kept(checks, monkeypatch):
    # The emulated cuda attention, wrong only while its resident path is on: the check
    # turns that path off, warns once, and the op stays on the cuda backend.
    monkeypatch.setattr(verify, "CHECK_IMITATIONS", True)
    was_on = cuda_backend.paths()["attention_resident"]
    try:
        _broken("cuda", "attention", monkeypatch,
                lambda out: out + 0.1 if cuda_backend.paths()["attention_resident"] else out)
        with pytest.warns(RuntimeWarning, match=r"path 'attention_resident' failed its check"):
            failed = verify.failure("attention", "cuda", torch.device("cpu"), torch.bfloat16)
        assert failed is None
        assert cuda_backend.paths()["attention_resident"] is False
    finally:
        cuda_backend.set_path("attention_resident", was_on)


def test_selftest_checks_every_kernel_here_and_writes_a_report(capsys, tmp_path):
    report = tmp_path / "selftest.json"
    code, out, _ = run_cli(capsys, "selftest", "--device", "cpu", "--json", report)
    assert code == 0, out
    record = json.loads(report.read_text())
    assert record["identity"]["torch"] == torch.__version__ and record["commit"]
    rows = record["rows"]
    assert {(r["op"], r["problem"]) for r in rows} == {(p.op, p.name) for p in probes.probes()}
    assert {r["dtype"] for r in rows} == {"float32", "float64", "bfloat16", "float16"}
    assert all(r["status"] == "ok" and r["error"] <= r["tolerance"] and r["ms"] > 0 for r in rows)
    assert f"{len(rows)} rows: {len(rows)} ok, 0 mismatch" in out


def test_selftest_reports_a_mismatch_and_fails(capsys, monkeypatch):
    _broken("cpu", "bias_gelu", monkeypatch, lambda out: out * 1.5)
    code, out, _ = run_cli(capsys, "selftest", "--device", "cpu", "--ops", "bias_gelu", "lstm_cell")
    assert code == 1
    assert "bias_gelu" in out and "MISMATCH" in out and "lstm_cell" in out
    summary = out.splitlines()[-1]
    # bias_gelu's two problems in four dtypes, lstm_cell's one
    assert summary == "12 rows: 4 ok, 8 mismatch, 0 unavailable"
    code, _, err = run_cli(capsys, "selftest", "--ops", "nonsense")
    assert code == 2 and "unknown 'nonsense'" in err


def test_a_check_under_autocast_measures_the_kernels_in_their_dtype(checks):
    # Inside the caller's autocast the float64 reference would drop to bfloat16 and fail
    # a correct kernel.
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert verify.failure("gelu_ffn", "cpu", torch.device("cpu"), torch.float32) is None


_BROKEN_PROCESS = """
import dataclasses, warnings
import torch, fusedlm, fusedlm.ops as F
from fusedlm.backends import _REGISTRY
kernels = _REGISTRY["cpu"].kernels
good = kernels["bias_gelu"]
calls = []
def broken(run):
    def call(*args):
        calls.append(1)
        return run(*args) + 0.1
    return call
kernels["bias_gelu"] = dataclasses.replace(good, forward=broken(good.forward))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    F.bias_gelu(torch.randn(3, 64), torch.randn(64))
print(len(calls), sum("failed its check" in str(w.message) for w in caught))
"""


def test_a_second_process_reads_the_result_from_disk(tmp_path):
    env = {**os.environ, "FUSEDLM_CACHE_DIR": str(tmp_path), "FUSEDLM_VERIFY": "1"}
    first = subprocess.run([sys.executable, "-c", _BROKEN_PROCESS], env=env, capture_output=True,
                           text=True, check=True).stdout.split()
    second = subprocess.run([sys.executable, "-c", _BROKEN_PROCESS], env=env, capture_output=True,
                            text=True, check=True).stdout.split()
    assert int(first[0]) > 0 and first[1] == "1"  # checked: the probes ran the broken kernel
    assert second == ["0", "1"]  # read from disk: the kernel never ran, one warning again


def test_a_check_inside_a_checkpointed_forward_leaves_the_checkpoint_intact(checks):
    # Non-reentrant activation checkpointing counts the tensors autograd saves in the
    # forward and again in the recomputation. A check at first use that ran its probes in
    # the forward's thread added its own saved tensors to the first count only, and the
    # backward raised a CheckpointError.
    x = torch.randn(4, 9, 64, requires_grad=True)
    b = torch.randn(64, requires_grad=True)

    def block(x, b):
        return F.bias_gelu(x, b).sum(-1)

    out = torch.utils.checkpoint.checkpoint(block, x, b, use_reentrant=False)
    out.sum().backward()
    assert list((checks / "verified").glob("cpu-*.json"))  # the check did run, in the forward
    x2, b2 = x.detach().requires_grad_(), b.detach().requires_grad_()
    block(x2, b2).sum().backward()
    torch.testing.assert_close((x.grad, b.grad), (x2.grad, b2.grad))


# The cuda branch of the record's identity and of the messages runs only on a GPU: without
# one, torch's functions it calls are stood in for (monkeypatch fails on a name torch lacks).
def test_a_cuda_devices_identity_and_name_use_functions_torch_has(monkeypatch):
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "GPU")
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    ident = verify.identity(torch.device("cuda"))
    assert ident["device"] and ident["capability"].count(".") == 1
    assert ident["driver"] is None or ident["driver"] > 0
    assert verify.device_name(torch.device("cuda", 0)).startswith("cuda:0 (")
