"""fusedlm bench on the CPU at --quick's tiny shapes: the table, the JSON report, the bar
chart, and bad input (exit status 2, one line)."""
import importlib.util
import json

import pytest

from cli_helpers import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One run of two ops and BERT, shared by the tests that read its output."""
    import contextlib
    import io

    from fusedlm.cli import main

    out = tmp_path_factory.mktemp("bench")
    plot = ["--plot", str(out / "bench.png")] if importlib.util.find_spec("matplotlib") else []
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main(["bench", "--quick", "--device", "cpu", "--ops", "bias_gelu", "add_layer_norm",
                     "--models", "bert", "--json", str(out / "bench.json"), *plot])
    assert code == 0
    return out, stdout.getvalue(), json.loads((out / "bench.json").read_text())


def test_table_names_every_case_and_implementation(quick_run):
    _, table, report = quick_run
    lines = table.splitlines()
    assert lines[0].startswith("device: cpu") and "GB/s" in lines[0] and "TFLOP/s" in lines[0]
    assert lines[1].split()[:4] == ["benchmark", "impl", "ms", "speed-up"]
    for pass_ in ("forward", "forward+backward"):
        for op in ("bias_gelu", "add_layer_norm"):
            assert f"{op} {pass_} [" in table
    assert "BERT MLM training step [" in table and "BERT MLM eval forward [" in table
    assert len(lines) == 2 + len(report["rows"]) + len(report["skipped"]) + len(report["targets"])
    fused_lines = [line for line in lines if "fusedlm[cpu]" in line]
    assert len(fused_lines) == 4 and all("eager " in line and "compiled " in line for line in fused_lines)



def test_bert_inference_runs_against_onnx_runtime_or_says_why_not(quick_run):
    _, table, report = quick_run
    has_onnx = all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime"))
    rows = {(r["benchmark"], r["impl"]) for r in report["rows"]}
    assert (("BERT MLM eval forward", "onnxruntime") in rows) == has_onnx
    if not has_onnx:
        assert "onnxruntime" in table and "not installed" in table

def test_a_run_hands_over_the_cases_measured_so_far_after_each():
    import torch

    from fusedlm import bench

    partial = []
    final = bench.run(torch.device("cpu"), ["bias_gelu"], [], quick=True, progress=partial.append)
    assert len(partial) == 2  # forward, forward+backward
    assert [p["complete"] for p in partial] == [False, False] and final["complete"] is True
    assert 0 < len(partial[0]["rows"]) < len(partial[1]["rows"]) == len(final["rows"])
    assert partial[0]["rows"] == final["rows"][:len(partial[0]["rows"])]


def test_json_has_device_versions_ceilings_and_every_row(quick_run):
    _, _, report = quick_run
    assert report["device"].startswith("cpu") and report["quick"] is True and report["complete"]
    assert {"fusedlm", "torch", "triton", "python"} <= set(report["versions"])
    assert "commit" in report and report["statistic"] == "min"
    # On glibc the CPU run keeps freed memory, so page faults do not decide the ratios.
    assert report["allocator"] is None or "glibc keeps freed memory" in report["allocator"]
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_TFLOPs"] > 0
    rows = {(r["benchmark"], r["impl"]): r for r in report["rows"]}
    for op in ("bias_gelu", "add_layer_norm"):
        for pass_ in ("forward", "forward+backward"):
            for impl in ("fusedlm[cpu]", "eager", "compiled"):
                row = rows[(f"{op} {pass_}", impl)]
                assert row["time_ms"] > 0 and row["unit"] == "GB/s" and 0 < row["of_peak"]
            fused = rows[(f"{op} {pass_}", "fusedlm[cpu]")]
            assert set(fused["speedups"]) == {"eager", "compiled"}
            assert fused["speedups"]["eager"] == pytest.approx(
                rows[(f"{op} {pass_}", "eager")]["time_ms"] / fused["time_ms"])
    for step in ("BERT MLM training step", "BERT MLM eval forward"):
        impls = {impl for benchmark, impl in rows if benchmark == step}
        expected = {"fusedlm", "reference"}
        if importlib.util.find_spec("transformers"):
            expected |= {"transformers", "transformers-compiled"}
        assert impls - {"onnxruntime"} == expected  # (see test_bert_inference_runs_against_onnx...)
        assert all(rows[(step, impl)]["time_ms"] > 0 for impl in impls)
        assert rows[(step, "fusedlm")]["unit"] == "tokens/s"


def test_plot_is_a_png(quick_run):
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib is not installed")
    out, _, _ = quick_run
    data = (out / "bench.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


@pytest.mark.parametrize("argv, message", [
    (["--ops", "bias_gelu", "softmax"], "--ops: unknown 'softmax'"),
    (["--models", "t5"], "--models: unknown 't5'"),
    (["--ops", "bias_gelu", "--json", "/no/such/dir/out.json"], "--json /no/such/dir/out.json"),
])
def test_bad_names_and_paths_are_one_line_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, "bench", "--quick", "--device", "cpu", *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"fusedlm bench: error: {message}") and err.count("\n") == 1


def test_cuda_without_a_device_is_exit_2(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    code, _, err = run_cli(capsys, "bench", "--quick", "--device", "cuda", "--ops", "bias_gelu")
    assert code == 2 and err == "fusedlm bench: error: --device cuda: no CUDA device is available\n"


def test_plot_without_matplotlib_is_exit_2(capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    code, _, err = run_cli(capsys, "bench", "--quick", "--device", "cpu", "--ops", "bias_gelu",
                           "--plot", "chart.png")
    assert code == 2 and "--plot needs matplotlib" in err and err.count("\n") == 1


def test_a_baseline_that_fails_is_reported_and_fusedlm_still_timed():
    import torch

    from fusedlm.bench.case import Bench, measure, passes
    from fusedlm.bench.timing import Timer

    bench = Bench(torch.device("cpu"), quick=True)
    inputs = [bench.tensor(4, 8, dtype=torch.float32), bench.tensor(8, dtype=torch.float32)]
    impls, skipped = bench.fused("bias_gelu", inputs)

    def broken(x, b):
        raise RuntimeError("no C++ compiler\nsecond line")

    impls["compiled"] = (broken, inputs)
    for case in passes("bias_gelu", "4x8", impls, unit="GB/s", skipped=skipped,
                       work={"forward": 96, "forward+backward": 240}):
        rows = measure(case, Timer(bench.device, min_rounds=1, seconds=0.0),
                       {"copy_GBps": 1.0, "matmul_TFLOPs": 1.0})
        assert [r["impl"] for r in rows] == ["fusedlm[cpu]"] and rows[0]["time_ms"] > 0
        assert case.skipped == {"compiled": "RuntimeError: no C++ compiler"}


def test_targets_hold_each_row_to_its_backends_targets():
    """A GPU run's verdicts: every fused row against the targets of all GPU backends, the
    cuda rows also against the cuda kernels' stricter ones (memory from the baseline's row)."""
    from fusedlm.bench.report import targets

    def row(benchmark, shape, impl, **values):
        return {"benchmark": benchmark, "shape": shape, "impl": impl, "time_ms": 1.0, **values}

    norm = "65536x1024 bfloat16"
    rows = [row("add_layer_norm forward", norm, "fusedlm[triton]", of_peak=0.82),
            row("add_layer_norm forward", norm, "fusedlm[cuda]", of_peak=0.82),
            row("add_layer_norm forward+backward", norm, "fusedlm[cuda]", of_peak=0.1),
            row("masked_lm_loss forward", "m", "fusedlm[cuda]", speedups={"eager": 6.0}, peak_MiB=100),
            row("masked_lm_loss forward", "m", "eager", peak_MiB=600),
            row("attention causal forward", "1x16x2048x128 bfloat16", "fusedlm[cuda]", of_peak=0.5),
            row("attention causal forward", "1x32x2048x64 bfloat16", "fusedlm[cuda]", of_peak=0.5)]
    verdicts = {(v["benchmark"], v["against"], v["target"]): v["met"] for v in targets(rows)}
    assert verdicts == {
        (f"add_layer_norm forward [{norm}] fusedlm[triton]", "the ceiling", 0.80): True,
        (f"add_layer_norm forward [{norm}] fusedlm[cuda]", "the ceiling", 0.80): True,
        (f"add_layer_norm forward [{norm}] fusedlm[cuda]", "the ceiling", 0.85): False,
        ("masked_lm_loss forward [m] fusedlm[cuda]", "eager", 5.0): True,
        ("masked_lm_loss forward [m] fusedlm[cuda]", "eager peak memory", 5.0): True,
        ("attention causal forward [1x16x2048x128 bfloat16] fusedlm[cuda]", "the ceiling", 0.75): False,
    }


def test_bert_family_training_steps_run_against_transformers(capsys):
    code, table, err = run_cli(capsys, "bench", "--quick", "--device", "cpu",
                               "--models", "roberta", "albert", "distilbert")
    assert code == 0, err
    for family in ("RoBERTa", "ALBERT", "DistilBERT"):
        rows = [line for line in table.splitlines() if line.startswith(f"{family} MLM training step [")]
        assert any("transformers" in row for row in rows) and any("fusedlm" in row for row in rows), table


def test_the_cpu_timer_interleaves_the_steps_of_a_case():
    """A slow spell of a shared CPU must fall on every step compared, not on one: the steps
    take turns of two calls, the second timed, and each time is that step's fastest."""
    import time

    import torch

    from fusedlm.bench.timing import Timer

    calls = []

    def step(name, slow_calls):
        def run():
            calls.append(name)
            if calls.count(name) in slow_calls:
                time.sleep(0.02)
        return run

    # A warm-up call each, then turns of two calls, the second timed; "a" is slow in its
    # first timed call.
    timer = Timer(torch.device("cpu"), min_rounds=4, seconds=0.0)
    steps = {"a": step("a", {3}), "b": step("b", set())}
    for s in steps.values():
        timer.warm_up(s)
    times = timer.each(steps)
    assert calls == ["a", "b"] + ["a", "a", "b", "b"] * 4
    assert set(times) == {"a", "b"} and times["a"] < 10
