"""GPU benchmarks of the triton backend against torch, with the device's measured ceilings.

    python3 benchmarks/gpu.py [--out DIR] [--dry-run]

Each op and pass is timed for fusedlm's triton kernel and for torch's baselines: the
eager composition of the same computation and torch.compile of it (and, for the FFN,
the two bare matrix products). The ceilings are a large device-to-device copy (GB/s,
reads plus writes) and a large bf16 matrix product (TFLOP/s). The results go to
benchmarks/results/<device>-<date>.json (and DIR, when given) with the commit, the
versions and the ceilings; a short table is printed last.

Times are medians from triton.testing.do_bench (CUDA events). --dry-run runs every
section end to end on CPU tensors with tiny shapes and wall-clock timing (the kernels
in Triton's interpreter, torch.compile without code generation): it checks the script,
not the speed, and writes its JSON to DIR only.
"""
import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

import fusedlm
from fusedlm.backends import _REGISTRY

ROOT = Path(__file__).resolve().parents[1]

# Shapes: BERT-base (32 x 128 tokens, hidden 768, FFN 3072, vocab 30522, 15% of tokens
# labelled for the masked-LM loss), GPT-2 small (8 x 1024 tokens, vocab 50257), and the
# add+LayerNorm bandwidth target (65536 tokens x hidden 1024).
REAL = dict(tokens=32 * 128, gpt_tokens=8 * 1024, hidden=768, ffn=3072, vocab=30522,
            gpt_vocab=50257, ln_tokens=65536, ln_hidden=1024, heads=12, seq=128,
            attn_bert_seqs=(128, 256, 512), attn_long_seqs=(2048, 4096, 8192),
            attn_long_dims=(64, 128), attn_long_hidden=2048, attn_long_tokens=8192,
            copy_bytes=2 << 30, matmul=8192)
DRY = dict(tokens=16, gpt_tokens=24, hidden=32, ffn=64, vocab=300, gpt_vocab=500, ln_tokens=16,
           ln_hidden=48, heads=2, seq=8, attn_bert_seqs=(8,), attn_long_seqs=(24,),
           attn_long_dims=(16,), attn_long_hidden=32, attn_long_tokens=24, copy_bytes=1 << 20,
           matmul=64)


@dataclass
class Result:
    name: str  # op and pass
    shape: str
    times_ms: dict  # impl -> median ms; "fusedlm" is the triton kernel
    notes: dict = field(default_factory=dict)

    def ratio(self, baseline: str) -> float:
        return self.times_ms[baseline] / self.times_ms["fusedlm"]


class Bench:
    def __init__(self, dry_run: bool):
        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.shapes = DRY if dry_run else REAL
        self.dtype = torch.float32 if dry_run else torch.bfloat16

    def time(self, fn) -> float:
        """Median milliseconds of fn()."""
        if self.dry_run:  # one call: the interpreter is slow, and these times mean nothing
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def compile(self, fn):
        # Without a GPU, inductor's C++ code generation would dominate a dry run.
        return torch.compile(fn, backend="eager" if self.dry_run else "inductor")

    def tensor(self, *shape, dtype=None, scale=1.0, grad=False):
        t = torch.randn(*shape, device=self.device, dtype=dtype or self.dtype) * scale
        return t.requires_grad_(grad)


def forward_backward(fn, inputs):
    """fn(*inputs) then its backward with a fixed upstream gradient, as one step."""
    out = fn(*inputs)
    upstream = torch.ones_like(out)

    def step():
        for t in inputs:
            if isinstance(t, torch.Tensor):
                t.grad = None
        fn(*inputs).backward(upstream)

    return step


def _compare(bench, name, shape, fns, inputs, passes=("forward", "forward+backward")):
    """Times every impl in fns ({impl: fn}) on inputs for each pass."""
    results = []
    for pass_ in passes:
        times = {}
        for impl, fn in fns.items():
            if pass_ == "forward":
                def step(fn=fn):
                    with torch.no_grad():
                        fn(*inputs)
            else:
                step = forward_backward(fn, inputs)
            times[impl] = bench.time(step)
        results.append(Result(f"{name} {pass_}", shape, times))
    return results


# --- ceilings ------------------------------------------------------------------------------------

def ceilings(bench):
    n = bench.shapes["copy_bytes"]
    src = torch.empty(n, dtype=torch.uint8, device=bench.device).random_()
    dst = torch.empty_like(src)
    copy_ms = bench.time(lambda: dst.copy_(src))
    size = bench.shapes["matmul"]
    a = bench.tensor(size, size)
    b = bench.tensor(size, size)
    matmul_ms = bench.time(lambda: a @ b)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "matmul_TFLOPs": 2 * size ** 3 / matmul_ms / 1e9,
            "copy_bytes": n, "matmul_size": size, "matmul_dtype": str(bench.dtype)[6:]}


# --- ops -----------------------------------------------------------------------------------------

def add_layer_norm(bench, ceiling):
    results = []
    s = bench.shapes
    target_shape = (s["ln_tokens"], s["ln_hidden"])
    for tokens, hidden in (target_shape, (s["tokens"], s["hidden"])):
        inputs = [bench.tensor(tokens, hidden, grad=True), bench.tensor(tokens, hidden, grad=True),
                  bench.tensor(hidden, grad=True), bench.tensor(hidden, grad=True)]

        def eager(x, r, w, b):
            return F.layer_norm(x + r, (hidden,), w, b)

        def fused(x, r, w, b):
            return fusedlm.ops.add_layer_norm(x, r, w, b, backend="triton")[0]

        fns = {"fusedlm": fused, "eager": eager, "compiled": bench.compile(eager)}
        for r in _compare(bench, "add_layer_norm", f"{tokens}x{hidden}", fns, inputs):
            if r.name.endswith("forward"):
                # x and residual read, out and summed written, once each.
                moved = 4 * tokens * hidden * inputs[0].element_size()
                r.notes["GBps"] = moved / r.times_ms["fusedlm"] / 1e6
                r.notes["of_copy_bandwidth"] = r.notes["GBps"] / ceiling["copy_GBps"]
                r.notes["bandwidth_target"] = (tokens, hidden) == target_shape
            results.append(r)
    return results


def bias_gelu(bench, ceiling):
    s = bench.shapes
    inputs = [bench.tensor(s["tokens"], s["ffn"], grad=True), bench.tensor(s["ffn"], grad=True)]
    fns = {"fusedlm": lambda x, b: fusedlm.ops.bias_gelu(x, b, backend="triton"),
           "eager": lambda x, b: F.gelu(x + b)}
    fns["compiled"] = bench.compile(fns["eager"])
    return _compare(bench, "bias_gelu", f"{s['tokens']}x{s['ffn']}", fns, inputs)


def gelu_ffn(bench, ceiling):
    results = []
    s = bench.shapes
    d, f = s["hidden"], s["ffn"]
    for tokens in (s["tokens"], s["gpt_tokens"]):
        inputs = [bench.tensor(tokens, d, grad=True), bench.tensor(f, d, scale=d ** -0.5, grad=True),
                  bench.tensor(f, grad=True), bench.tensor(d, f, scale=f ** -0.5, grad=True),
                  bench.tensor(d, grad=True)]

        def eager(x, w1, b1, w2, b2):
            return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

        def bare(x, w1, b1, w2, b2):
            return (x @ w1.t()) @ w2.t()

        fns = {"fusedlm": lambda *a: fusedlm.ops.gelu_ffn(*a, backend="triton"), "eager": eager,
               "compiled": bench.compile(eager), "matmuls": bare}
        for r in _compare(bench, "gelu_ffn", f"{tokens}x{d}->{f}->{d}", fns, inputs):
            flops = (2 if r.name.endswith("forward") else 6) * 2 * tokens * d * f
            r.notes["TFLOPs"] = flops / r.times_ms["fusedlm"] / 1e9
            results.append(r)
    return results


def cross_entropy(bench, ceiling):
    results = []
    s = bench.shapes
    for tokens, vocab in ((s["tokens"], s["vocab"]), (s["gpt_tokens"], s["gpt_vocab"])):
        logits = bench.tensor(tokens, vocab, grad=True)
        labels = torch.randint(0, vocab, (tokens,), device=bench.device)

        def eager(x, y):
            return F.cross_entropy(x.float(), y)

        fns = {"fusedlm": lambda x, y: fusedlm.ops.cross_entropy(x, y, backend="triton"),
               "eager": eager, "compiled": bench.compile(eager)}
        results += _compare(bench, "cross_entropy", f"{tokens}x{vocab}", fns, [logits, labels])
    return results


def masked_lm_loss(bench, ceiling):
    s = bench.shapes
    tokens, d, vocab = s["tokens"], s["hidden"], s["vocab"]
    inputs = [bench.tensor(tokens, d, grad=True), bench.tensor(vocab, d, scale=d ** -0.5, grad=True),
              bench.tensor(vocab, grad=True)]
    labels = torch.randint(0, vocab, (tokens,), device=bench.device)
    labels = labels.masked_fill(torch.rand(tokens, device=bench.device) >= 0.15, -100)

    def eager(h, w, b, y):
        return F.cross_entropy(F.linear(h, w, b).float(), y)

    fns = {"fusedlm": lambda h, w, b, y: fusedlm.ops.masked_lm_loss(h, w, b, y, backend="triton"),
           "eager": eager, "compiled": bench.compile(eager)}
    return _compare(bench, "masked_lm_loss", f"{tokens}x{d}->{vocab}, 15% labelled", fns,
                    [*inputs, labels])


def _attention_flops(pairs, heads, head_dim, pass_):
    """Matrix-product FLOPs over `pairs` (query, key) pairs: QK^T and PV forward, and 2.5
    times that again backward (dV, dP, dS K, dS^T Q)."""
    forward = 4 * pairs * heads * head_dim
    return forward if pass_.endswith("forward") else 3.5 * forward


def _with_tflops(results, pairs, heads, head_dim):
    for r in results:
        flops = _attention_flops(pairs, heads, head_dim, r.name)
        r.notes["TFLOPs"] = flops / r.times_ms["fusedlm"] / 1e9
    return results


def _eager_attention(q, k, v, allowed=None, causal=False):
    """The unfused composition: scores, mask, softmax, product."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        scores = scores.masked_fill(
            torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(seq_k - seq_q + 1),
            float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def attention(bench, ceiling):
    """BERT lengths with mixed padding (fusedlm packs the tokens and runs attention_varlen;
    torch gets the padded batch and a mask), and long causal sequences."""
    results = []
    s = bench.shapes
    heads, head_dim = s["heads"], s["hidden"] // s["heads"]
    generator = torch.Generator().manual_seed(0)
    for seq in s["attn_bert_seqs"]:
        batch = s["tokens"] // seq
        lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=generator).tolist()
        lengths[0] = seq  # the longest fills the padded batch
        allowed = torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]
        allowed = allowed.to(bench.device)[:, None, None, :]
        inputs = [bench.tensor(batch, heads, seq, head_dim, grad=True) for _ in range(3)]
        cu = torch.tensor([0] + lengths, device=bench.device).cumsum(0).to(torch.int32)
        packed = [bench.tensor(sum(lengths), heads, head_dim, grad=True) for _ in range(3)]

        def varlen(q, k, v, cu=cu, seq=seq):
            return fusedlm.ops.attention_varlen(q, k, v, cu, cu, seq, seq, backend="triton")

        def sdpa(q, k, v, allowed=allowed):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)

        def eager(q, k, v, allowed=allowed):
            return _eager_attention(q, k, v, allowed)

        pairs = sum(n * n for n in lengths)
        shape = f"{batch}x{heads}x{seq}x{head_dim}, lengths {seq // 2}-{seq}"
        # fusedlm's inputs are the packed tokens; torch's the padded batch.
        fused = _compare(bench, "attention_varlen", shape, {"fusedlm": varlen}, packed)
        baselines = _compare(bench, "attention_varlen", shape,
                             {"sdpa": sdpa, "eager": eager, "compiled": bench.compile(eager)},
                             inputs)
        for r, other in zip(fused, baselines):
            r.times_ms.update(other.times_ms)
        results += _with_tflops(fused, pairs, heads, head_dim)
    for head_dim in s["attn_long_dims"]:
        heads = s["attn_long_hidden"] // head_dim
        for seq in s["attn_long_seqs"]:
            batch = max(1, s["attn_long_tokens"] // seq)
            inputs = [bench.tensor(batch, heads, seq, head_dim, grad=True) for _ in range(3)]

            def eager_causal(q, k, v):
                return _eager_attention(q, k, v, causal=True)

            fns = {"fusedlm": lambda q, k, v: fusedlm.ops.attention(q, k, v, causal=True,
                                                                    backend="triton"),
                   "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   "eager": eager_causal, "compiled": bench.compile(eager_causal)}
            # The hand-written CUDA kernels too, where their limits (dtype, head dim) allow.
            try:
                fusedlm.explain("attention", *inputs, causal=True, backend="cuda")
                fns["cuda"] = lambda q, k, v: fusedlm.ops.attention(q, k, v, causal=True,
                                                                    backend="cuda")
            except RuntimeError as refused:
                print(f"attention: no cuda timing, {refused}")
            timed = _compare(bench, "attention causal", f"{batch}x{heads}x{seq}x{head_dim}", fns,
                             inputs)
            results += _with_tflops(timed, batch * seq * (seq + 1) // 2, heads, head_dim)
    return results


SECTIONS = (add_layer_norm, bias_gelu, gelu_ffn, cross_entropy, masked_lm_loss, attention)

# (op and pass prefix, baseline, the least speed-up that meets the target)
TARGETS = (("gelu_ffn", "matmuls", 1 / 1.1), ("masked_lm_loss", "eager", 5.0))
LAYER_NORM_TARGET = 0.8  # of the copy bandwidth, forward, at 65536 x 1024


# --- report --------------------------------------------------------------------------------------

def _git_commit():
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions():
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
            "python": platform.python_version()}


def _device_name(bench):
    if bench.dry_run:
        return "cpu-dry-run"
    return torch.cuda.get_device_name(bench.device)


def _targets(results):
    verdicts = []
    for r in results:
        for prefix, baseline, least in TARGETS:
            if r.name.startswith(prefix) and baseline in r.times_ms:
                ratio = r.ratio(baseline)
                verdicts.append({"benchmark": f"{r.name} [{r.shape}]", "against": baseline,
                                 "speedup": ratio, "target": least, "met": ratio >= least})
        if r.notes.get("bandwidth_target"):
            fraction = r.notes["of_copy_bandwidth"]
            verdicts.append({"benchmark": f"{r.name} [{r.shape}]", "against": "copy bandwidth",
                             "fraction": fraction, "target": LAYER_NORM_TARGET,
                             "met": fraction >= LAYER_NORM_TARGET})
    return verdicts


def table(results):
    lines = [f"{'benchmark':<58} {'fusedlm ms':>10}  speed-up vs baselines"]
    for r in results:
        ratios = "  ".join(f"{impl} {r.ratio(impl):.2f}x" for impl in r.times_ms if impl != "fusedlm")
        extra = "  ".join(f"{k} {v:.3g}" for k, v in r.notes.items() if isinstance(v, float))
        lines.append(f"{r.name + ' [' + r.shape + ']':<58} {r.times_ms['fusedlm']:>10.3f}  {ratios}"
                     + (f"  ({extra})" if extra else ""))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="also write the JSON into this folder")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on CPU tensors (needs TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device (--dry-run checks the script on the CPU)")
    torch.manual_seed(0)
    bench = Bench(args.dry_run)
    ceiling = ceilings(bench)
    results = []
    for section in SECTIONS:
        results += section(bench, ceiling)
    device = _device_name(bench)
    date = datetime.date.today().isoformat()
    report = {
        "device": device, "date": date, "commit": _git_commit(), "versions": _versions(),
        "dtype": str(bench.dtype)[6:], "ceilings": ceiling, "targets": _targets(results),
        "benchmarks": [{"name": r.name, "shape": r.shape, "times_ms": r.times_ms,
                        "speedups": {i: r.ratio(i) for i in r.times_ms if i != "fusedlm"},
                        **r.notes} for r in results],
    }
    name = f"{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}-{date}.json"
    paths = [args.out / name] if args.out else []
    if not args.dry_run:
        paths.append(ROOT / "benchmarks" / "results" / name)
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"ceilings: copy {ceiling['copy_GBps']:.1f} GB/s, "
          f"{ceiling['matmul_dtype']} matmul {ceiling['matmul_TFLOPs']:.1f} TFLOP/s")
    for verdict in report["targets"]:
        value = verdict.get("speedup", verdict.get("fraction"))
        print(f"target {verdict['benchmark']} vs {verdict['against']}: {value:.2f} "
              f"(>= {verdict['target']:.2f}) {'met' if verdict['met'] else 'MISSED'}")
    print("results: " + ", ".join(str(p) for p in paths))
    print(table(results))
    return report


if __name__ == "__main__":
    main()
