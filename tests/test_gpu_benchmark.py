"""benchmarks/gpu.py end to end in its dry mode: tiny shapes on the CPU, the kernels in
Triton's interpreter. It checks the script runs and writes its report, not the speed."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import fusedlm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_gpu_benchmark_dry_run(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(Path(fusedlm.__file__).parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--dry-run",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    (path,) = tmp_path.glob("cpu-dry-run-*.json")
    report = json.loads(path.read_text())
    assert {"device", "date", "commit", "versions", "ceilings", "targets"} <= set(report)
    names = {b["name"] for b in report["benchmarks"]}
    for op in ("add_layer_norm", "bias_gelu", "gelu_ffn", "cross_entropy", "masked_lm_loss",
               "attention_varlen", "attention causal"):
        assert {f"{op} forward", f"{op} forward+backward"} <= names
    for b in report["benchmarks"]:
        assert b["times_ms"]["fusedlm"] > 0 and set(b["speedups"]) == set(b["times_ms"]) - {"fusedlm"}
    # The table is printed last: its header, then one row per benchmark.
    lines = run.stdout.strip().splitlines()
    assert lines[-1 - len(report["benchmarks"])].startswith("benchmark")
