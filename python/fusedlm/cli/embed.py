"""fusedlm embed: one vector per line of a text file, from a BERT or ELECTRA encoder
(any of their transformers folders: the encoder is read, the heads left) or ELMo,
written as .npy or .safetensors. A sentence-transformers folder's vectors are
sentence-transformers': its pooling, normalization and length, each of which --pool and
--normalize may override."""
from __future__ import annotations

import argparse
import dataclasses
import io
import re
import sys
from pathlib import Path

import torch

from ..dtypes import native_bf16
from .common import (DTYPES, add_device_argument, atomic_write, load_model, positive_int,
                     resolve_device)
from .corpus import decode
from .errors import UsageError

WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors")  # a model folder's (or shard's)
POOLS = {"mean": "mean", "first": "cls", "max": "max"}  # --pool: SentencePooling's mode


HELP = "vectors of the lines of a text file"
DESCRIPTION = """Encodes each non-empty line of FILE and writes one vector per line ([lines,
hidden] float32) to --out. On a sentence-transformers folder (one with modules.json) the
vectors are the ones sentence-transformers gives: its pooling, its Normalize module and
its max_seq_length."""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a BERT, ELECTRA or ELMo folder")
    p.add_argument("file", metavar="FILE", help="text, one sentence or passage per line")
    p.add_argument("--out", help="FILE.npy or FILE.safetensors (default: FILE with .npy)")
    p.add_argument("--pool", choices=tuple(POOLS),
                   help="mean of the token vectors, the first token's ([CLS] for BERT), or "
                        "their maximum (default: a sentence-transformers folder's pooling, "
                        "else mean)")
    p.add_argument("--normalize", action=argparse.BooleanOptionalAction,
                   help="scale each vector to unit length (default: if a sentence-transformers "
                        "folder has a Normalize module)")
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the model's weights and activations: fp32 (default), or bf16, faster "
                        "where the device multiplies bfloat16 natively (a GPU, a CPU with AMX "
                        "or AVX512-BF16); the vectors then differ from fp32's by a cosine of "
                        "about 1e-4 (the vectors themselves are written in float32)")
    add_device_argument(p)


def run(args: argparse.Namespace) -> int:
    source = Path(args.file)
    out = Path(args.out) if args.out else source.with_suffix(".npy")
    if out.suffix not in (".npy", ".safetensors"):
        raise UsageError(f"--out {out}: the name must end in .npy or .safetensors")
    if WEIGHTS.fullmatch(out.name):
        raise UsageError(f"--out {out}: that is a checkpoint's weights file; choose another name")
    if not source.is_file():
        raise UsageError(f"{source}: no such file")
    text, replaced = decode(source.read_bytes())
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"{source}: the file has no text")
    if replaced:
        print(f"fusedlm embed: warning: {replaced} undecodable bytes in {source} were replaced "
              "by U+FFFD", file=sys.stderr)
    device = resolve_device(args.device)
    pooling, described = _pooling(args)
    spec, model, tokenizer = load_model(args.model, "embed", device)
    if args.dtype == "bf16":
        if not native_bf16(device):
            print(f"fusedlm embed: warning: {device} has no native bfloat16 products (AMX or "
                  "AVX512-BF16 on a CPU): --dtype bf16 runs slower than fp32 here", file=sys.stderr)
        model = model.to(DTYPES["bf16"])
    print(described)
    vectors, truncated = [], 0
    with torch.inference_mode():
        for start in range(0, len(lines), args.batch_size):
            hidden, mask, cut = spec.hidden(model, tokenizer, lines[start:start + args.batch_size],
                                            device, pooling.max_seq_length)  # [B, T, H], [B, T]
            truncated += cut
            vectors.append(pooling(hidden, mask))
    vectors = torch.cat(vectors).cpu().contiguous()
    _write(out, vectors)
    length = pooling.max_seq_length
    limit = f"{length} tokens" if length is not None and length < spec.positions(model.config) \
        else "the model's positions"
    note = f" ({truncated} lines cut to {limit})" if truncated else ""
    print(f"{tuple(vectors.shape)} vectors of {len(lines)} lines -> {out}{note}")
    return 0


def _pooling(args: argparse.Namespace) -> tuple:
    """(SentencePooling, a line saying what it does and where each setting came from):
    --pool and --normalize where given, else the folder's sentence-transformers modules
    where it has them, else a plain mean."""
    from ..models.pooling import MODULES, SETTINGS, SentencePooling

    try:
        found = SentencePooling.from_folder(args.model)
    except ValueError as e:
        raise UsageError(str(e)) from None
    pooling = found or SentencePooling()
    if args.pool is not None:
        pooling = dataclasses.replace(pooling, mode=POOLS[args.pool])
    if args.normalize is not None:
        pooling = dataclasses.replace(pooling, normalize=args.normalize)

    name = {mode: pool for pool, mode in POOLS.items()}.get(pooling.mode, pooling.mode)
    parts = [(name, "--pool" if args.pool else found and found.source),
             ("normalized" if pooling.normalize else "not normalized",
              ("--normalize" if args.normalize else "--no-normalize")
              if args.normalize is not None else found and MODULES)]
    if pooling.max_seq_length is not None:
        parts.append((f"texts cut at {pooling.max_seq_length} tokens", SETTINGS))
    return pooling, "pooling: " + ", ".join(f"{what} ({source})" if source else what
                                            for what, source in parts)


def _write(path: Path, vectors: torch.Tensor) -> None:
    if path.suffix == ".npy":
        import numpy as np

        buffer = io.BytesIO()
        np.save(buffer, vectors.numpy())
        data = buffer.getvalue()
    else:
        from safetensors.torch import save

        data = save({"embeddings": vectors})
    atomic_write(path, lambda f: f.write(data))
