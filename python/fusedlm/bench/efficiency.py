"""What each cuda kernel moves and computes against its op's ideal (``fusedlm bench
--efficiency``), counted by the CUDA emulator of a FUSEDLM_CUDA=emulate build.

Each op runs once, forward and backward, at a small BERT-like shape in bfloat16 on the cuda
backend, under :func:`fusedlm.backends.cuda.count_launches`. For every launch:

- **moved**: the bytes the kernel loaded and stored, every access as issued (before any
  cache, so a tensor read twice counts twice);
- **ideal**: each tensor the launch touched moved once: its size once if read, once more
  if written;
- **products**: the multiply-adds its tensor-core instructions issued, in units of the op's
  one matrix product (B x H x Sq x Sk x D for attention, rows x d_in x d_ff for the FFN):
  the attention forward needs 2 and a FlashAttention-2 backward 5;
- with ``--resources`` (the JSON ``scripts/cuda_compile_check.sh`` writes), the kernel's
  registers and the occupancy they allow, per architecture.

Nothing is timed: the emulator runs a kernel's blocks one after another on one CPU thread.
The numbers change only when a kernel does, so a regression shows on any machine.
"""
from __future__ import annotations

import json
import re
from typing import Callable, Optional

import torch

from .. import ops
from ..backends import cuda as cuda_backend

DTYPE = torch.bfloat16
ROWS, HIDDEN, FFN, VOCAB = 64, 768, 1024, 1000
BATCH, HEADS, SEQ, HEAD_DIM = 2, 2, 128, 64


def _leaf(*shape, scale=1.0):
    return (torch.randn(shape) * scale).to(DTYPE).requires_grad_()


def _add_layer_norm():
    x, r, w, b = _leaf(ROWS, HIDDEN), _leaf(ROWS, HIDDEN), _leaf(HIDDEN), _leaf(HIDDEN)
    return lambda: ops.add_layer_norm(x, r, w, b, dropout_p=0.1, backend="cuda"), None


def _bias_gelu():
    x, b = _leaf(ROWS, FFN), _leaf(FFN)
    return lambda: ops.bias_gelu(x, b, backend="cuda"), None


def _gelu_ffn():
    x, w1, b1 = _leaf(ROWS, HIDDEN), _leaf(FFN, HIDDEN, scale=HIDDEN ** -0.5), _leaf(FFN)
    w2, b2 = _leaf(HIDDEN, FFN, scale=FFN ** -0.5), _leaf(HIDDEN)
    return (lambda: ops.gelu_ffn(x, w1, b1, w2, b2, dropout_p=0.1, backend="cuda"),
            ROWS * HIDDEN * FFN)


def _cross_entropy():
    logits, labels = _leaf(ROWS, VOCAB), torch.randint(0, VOCAB, (ROWS,))
    return lambda: ops.cross_entropy(logits, labels, backend="cuda"), None


def _attention():
    q, k, v = (_leaf(BATCH, HEADS, SEQ, HEAD_DIM) for _ in range(3))
    return (lambda: ops.attention(q, k, v, backend="cuda"), BATCH * HEADS * SEQ * SEQ * HEAD_DIM)


# op: () -> (a call of it on the cuda backend, the MACs of one of its matrix products or None)
CASES: dict[str, Callable] = {"add_layer_norm": _add_layer_norm, "bias_gelu": _bias_gelu,
                              "gelu_ffn": _gelu_ffn, "cross_entropy": _cross_entropy,
                              "attention": _attention}


def kernel_key(name: str) -> str:
    """A kernel's name without namespaces, return type and parameters, as both the emulator
    and the compile check's table spell it: ``add_layer_norm_forward_kernel<BFloat16, 8>``."""
    name = re.sub(r"\(.*\)$", "", name).removeprefix("void ")
    return re.sub(r"\b\w+::", "", name)


def _row(op: str, direction: str, launch, unit: Optional[int], resources: dict) -> dict:
    moved = sum(launch.read.values()) + sum(launch.written.values())
    ideal = (sum(launch.sizes[s] for s, n in launch.read.items() if n)
             + sum(launch.sizes[s] for s, n in launch.written.items() if n))
    key = kernel_key(launch.kernel)
    row = {"op": op, "pass": direction, "kernel": key, "grid": list(launch.grid),
           "block": list(launch.block), "moved_bytes": moved, "ideal_bytes": ideal,
           "tensor_core_macs": launch.tensor_core_macs,
           "products": launch.tensor_core_macs / unit if unit else None}
    for arch, entry in resources.get(key, {}).items():
        row[f"registers_{arch}"] = entry["registers"]
        row[f"occupancy_{arch}"] = entry["occupancy"]
    return row


def run(names, resources_path: Optional[str] = None) -> dict:
    """{"rows": one per launch, "arches": those of the resources} for the ops `names`."""
    if not cuda_backend.emulated():
        raise RuntimeError("--efficiency counts the emulated kernels: it needs a "
                           "FUSEDLM_CUDA=emulate build")
    resources: dict = {}
    if resources_path is not None:
        with open(resources_path) as f:
            for entry in json.load(f):
                resources.setdefault(kernel_key(entry["kernel"]), {})[entry["arch"]] = entry
    arches = sorted({arch for by_arch in resources.values() for arch in by_arch})
    rows = []
    for op in names:
        call, unit = CASES[op]()
        with cuda_backend.count_launches() as forward:
            out = call()
        outputs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
        with cuda_backend.count_launches() as backward:
            torch.autograd.backward(outputs, [torch.randn_like(t) for t in outputs])
        for direction, launches in (("forward", forward), ("backward", backward)):
            rows += [_row(op, direction, launch, unit, resources) for launch in launches]
    return {"arch": cuda_backend.emulated_arch(), "arches": arches, "rows": rows}


def table(result: dict) -> str:
    arches = result["arches"]
    head = (f"{'op':15} {'pass':8} {'kernel':52} {'moved':>9} {'ideal':>9} {'ratio':>6} "
            f"{'products':>8}" + "".join(f" {'regs ' + a:>12} {'occ':>4}" for a in arches))
    lines = [f"cuda kernels on the emulator ({result['arch']}), bfloat16: bytes moved against "
             "each touched tensor moved once, and tensor-core products", head]
    for r in result["rows"]:
        products = f"{r['products']:.2f}" if r["products"] is not None else "-"
        line = (f"{r['op']:15} {r['pass']:8} {r['kernel'][:52]:52} {r['moved_bytes']:9d} "
                f"{r['ideal_bytes']:9d} {r['moved_bytes'] / max(r['ideal_bytes'], 1):6.2f} "
                f"{products:>8}")
        for arch in arches:
            regs = r.get(f"registers_{arch}")
            line += (f" {regs:12d} {r[f'occupancy_{arch}']:4.0%}" if regs is not None
                     else f" {'-':>12} {'-':>4}")
        lines.append(line)
    return "\n".join(lines)
