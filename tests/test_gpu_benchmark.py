"""fusedlm bench through the triton backend: every op at --quick's tiny shapes, on a GPU or,
without one, on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1). It checks that
every case runs on every backend and is reported, not the speed."""
import json

import pytest
import torch

import fusedlm
from cli_helpers import run_cli
from fusedlm.bench import OPS


@pytest.mark.slow
@pytest.mark.triton
def test_quick_run_times_every_op_on_every_backend(capsys, tmp_path):
    available = fusedlm.backends()["triton"]
    if available is not True:
        pytest.skip(f"triton: {available}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    code, out, err = run_cli(capsys, "bench", "--quick", "--device", device, "--ops", *OPS,
                             "--json", tmp_path / "bench.json")
    assert code == 0, err[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    cases = {(r["benchmark"], r["shape"]) for r in report["rows"]}
    benchmarks = {benchmark for benchmark, _ in cases}
    for op in ("add_layer_norm", "bias_gelu", "gelu_ffn", "cross_entropy", "masked_lm_loss",
               "attention", "attention padded", "attention causal"):
        assert {f"{op} forward", f"{op} forward+backward"} <= benchmarks
    impls = {}
    for row in report["rows"]:
        impls.setdefault((row["benchmark"], row["shape"]), set()).add(row["impl"])
        assert row["time_ms"] > 0
    refused = {(s["benchmark"], s["shape"], s["impl"]) for s in report["skipped"]}
    for (benchmark, shape), names in impls.items():
        assert "fusedlm[triton]" in names and {"eager", "compiled"} <= names, (benchmark, names)
        if benchmark.startswith("attention"):
            assert "sdpa" in names
        # The cuda backend, where it runs, has a row or says why it refused the call.
        if fusedlm.backends()["cuda"] is True:
            assert "fusedlm[cuda]" in names or (benchmark, shape, "fusedlm[cuda]") in refused
    assert all(s["reason"] for s in report["skipped"])
    assert out.splitlines()[1].startswith("benchmark")
