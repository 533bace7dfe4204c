"""The results of a run as a table, a JSON report and a bar chart of the speed-ups."""
from __future__ import annotations

import datetime
import functools
import platform
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .case import is_fused

@dataclass(frozen=True)
class Target:
    """A speed or memory target of the project's, for the rows whose benchmark starts with
    `benchmark` and whose shape matches the regex `shape`, of every fused implementation
    or only `impl`, measured on a `device` ("cuda" or "cpu"). measure: "of_peak" (the row's share of the device's ceiling), "speedup"
    (the baseline's time / ours) or "memory" (the baseline's peak memory / ours)."""
    benchmark: str
    measure: str
    least: float
    baseline: str = ""
    shape: str = ""
    impl: str = ""
    device: str = "cuda"


CUDA = "fusedlm[cuda]"
TARGETS = (
    # Every GPU backend.
    Target("add_layer_norm forward", "of_peak", 0.80, shape=r"^65536x1024 "),
    Target("gelu_ffn", "speedup", 1 / 1.10, "matmuls"),
    Target("masked_lm_loss", "speedup", 5.0, "eager"),
    # The hand-written CUDA kernels, held to more.
    Target("add_layer_norm forward", "of_peak", 0.85, shape=r"^65536x1024 ", impl=CUDA),
    Target("gelu_ffn", "speedup", 1 / 1.05, "matmuls", impl=CUDA),
    Target("masked_lm_loss", "memory", 5.0, "eager", impl=CUDA),
    Target("attention padded forward+backward", "speedup", 1.3, "sdpa", shape=r"x64 ", impl=CUDA),
    Target("attention causal forward+backward", "speedup", 1.0, "sdpa", impl=CUDA),
    Target("attention causal forward", "of_peak", 0.75, shape=r"x128 ", impl=CUDA),
    # The model steps a GPU user decides on (fusedlm.bench.models: bert-base, gpt2-small).
    *(Target(f"BERT-base MLM training step, bf16 autocast{flops}", "speedup", least, baseline)
      for flops in ("", ", model FLOPs")
      for baseline, least in (("transformers", 1.6), ("transformers-compiled", 1.2))),
    Target("BERT-base MLM training step, bf16 autocast, model FLOPs", "of_peak", 0.45),
    Target("BERT-base MLM inference, bf16 autocast", "speedup", 1.5, "transformers"),
    Target("GPT-2 small LM training step, bf16 autocast", "speedup", 1.2, "transformers"),
    # What CPU users serve (fusedlm.bench.models: minilm), in float32.
    *(Target("all-MiniLM-L6-v2 sentence embeddings", "speedup", least, baseline, shape=shape,
             impl="fusedlm", device="cpu")
      for baseline in ("onnxruntime", "onnxruntime-bert")
      for shape, least in ((r"^32x128", 1.3), (r"^1x128", 1.0))),
    Target("all-MiniLM-L6-v2 sentence embeddings", "speedup", 1.2, "transformers", impl="fusedlm",
           device="cpu"),
)


def _applies(target: Target, row: dict, device: str) -> bool:
    name = row["benchmark"]  # "<case> <pass>": the target names a case, or a case and pass
    return (target.device == device and (name == target.benchmark or name.startswith(target.benchmark + " "))
            and (not target.impl or row["impl"] == target.impl)
            and re.search(target.shape, row["shape"]) is not None)


def _value(target: Target, row: dict, rows: list) -> float | None:
    if target.measure == "of_peak":
        return row.get("of_peak")
    if target.measure == "speedup":
        return row.get("speedups", {}).get(target.baseline)
    baseline = next((r for r in rows if r["impl"] == target.baseline
                     and (r["benchmark"], r["shape"]) == (row["benchmark"], row["shape"])), None)
    if baseline is None or not row.get("peak_MiB") or "peak_MiB" not in baseline:
        return None
    return baseline["peak_MiB"] / row["peak_MiB"]


def targets(rows: list, device: str = "cuda") -> list:
    verdicts = []
    for row in rows:
        if not is_fused(row["impl"]):
            continue
        for target in TARGETS:
            if not _applies(target, row, device):
                continue
            value = _value(target, row, rows)
            if value is None:
                continue
            against = {"of_peak": "the ceiling", "speedup": target.baseline,
                       "memory": f"{target.baseline} peak memory"}[target.measure]
            verdicts.append({"benchmark": f"{row['benchmark']} [{row['shape']}] {row['impl']}",
                             "against": against, "value": value, "target": target.least,
                             "met": value >= target.least})
    return verdicts


def report(device: torch.device, quick: bool, statistic: str, ceilings: dict, rows: list,
           skipped: list, allocator: Optional[str] = None, complete: bool = True) -> dict:
    """allocator: how the run set the host's allocator (fusedlm.bench.timing.keep_freed_memory),
    or None; complete: false for the cases measured so far of a run still going."""
    return {"device": device_name(device), "date": datetime.date.today().isoformat(),
            "commit": git_commit(), "versions": versions(), "quick": quick, "complete": complete,
            "statistic": statistic, "ceilings": ceilings, "allocator": allocator,
            "targets": targets(rows, device.type) if not quick else [],
            "rows": list(rows), "skipped": list(skipped)}


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def slug(name: str) -> str:
    """A device name as a file name: "NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3"."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


@functools.lru_cache(maxsize=None)  # one run's reports, written after every case, ask often
def git_commit():
    """The commit of the source tree fusedlm runs from (with -dirty for uncommitted changes),
    or None when it is not in a git checkout (an installed package)."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return commit + ("-dirty" if dirty else "")


def versions() -> dict:
    import fusedlm

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"fusedlm": fusedlm.__version__, "torch": torch.__version__, "triton": triton_version,
            "cuda": torch.version.cuda, "python": platform.python_version(),
            "cpu_capability": fusedlm._C.cpu_capability()}


def _rate(row: dict) -> tuple[str, str]:
    if "rate" not in row:
        return "", ""
    unit = row["unit"]
    rate = f"{row['rate']:.3g} {unit}" if unit != "tokens/s" else f"{row['rate']:.0f} {unit}"
    return rate, (f"{row['of_peak']:.0%}" if "of_peak" in row else "")


def table(result: dict) -> str:
    """One line per implementation, the benchmark named on its first; fusedlm's lines carry
    the speed-up over each baseline (baseline time / fusedlm time: above 1, fusedlm is faster)."""
    c = result["ceilings"]
    lines = [f"device: {result['device']}; ceilings: copy {c['copy_GBps']:.1f} GB/s, "
             f"{c['matmul_dtype']} matmul {c['matmul_TFLOPs']:.2f} TFLOP/s; "
             f"times: {result['statistic']} of rounds"
             + (f"; {result['allocator']}" if result.get("allocator") else "")]
    cells, previous = [], None
    for row in result["rows"]:
        name = f"{row['benchmark']} [{row['shape']}]"
        speedups = "  ".join(f"{b} {s:.2f}x" for b, s in row.get("speedups", {}).items())
        cells.append([name if name != previous else "", row["impl"], f"{row['time_ms']:.3f}",
                      speedups, *_rate(row)])
        previous = name
    header = ["benchmark", "impl", "ms", "speed-up", "rate", "of peak"]
    widths = [max(len(r[i]) for r in cells + [header]) for i in range(len(header))]
    right = {2, 5}
    for r in [header] + cells:
        lines.append("  ".join(v.rjust(w) if i in right else v.ljust(w)
                               for i, (v, w) in enumerate(zip(r, widths))).rstrip())
    for s in result["skipped"]:
        lines.append(f"no row: {s['benchmark']} [{s['shape']}] {s['impl']}: {s['reason']}")
    for t in result["targets"]:
        lines.append(f"target: {t['benchmark']} vs {t['against']}: {t['value']:.2f} "
                     f"(>= {t['target']:.2f}) {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """A horizontal bar per fusedlm row and baseline: its speed-up, on a log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fused = [r for r in result["rows"] if r.get("speedups")]
    baselines = sorted({b for r in fused for b in r["speedups"]})
    height = 0.8 / max(1, len(baselines))
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.35 * len(fused) * max(1, len(baselines)) ** 0.5))
    for i, baseline in enumerate(baselines):
        ys = [j + i * height for j, r in enumerate(fused) if baseline in r["speedups"]]
        xs = [r["speedups"][baseline] for r in fused if baseline in r["speedups"]]
        ax.barh(ys, xs, height=height, label=baseline)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(fused))])
    ax.set_yticklabels([f"{r['benchmark']} [{r['shape']}] {r['impl']}" for r in fused], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("speed-up of fusedlm (baseline time / fusedlm time)")
    ax.set_title(f"fusedlm bench: {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
