"""fusedlm embed: one vector per line of a text file, from a BERT or ELECTRA encoder
(any of their transformers folders: the encoder is read, the heads left) or ELMo,
written as .npy or .safetensors."""
from __future__ import annotations

import argparse
import io
import re
import sys
from pathlib import Path

import torch

from .common import add_device_argument, atomic_write, load_model, positive_int, resolve_device
from .corpus import decode
from .errors import UsageError

WEIGHTS = re.compile(r"model(-\d+-of-\d+)?\.safetensors")  # a model folder's (or shard's)


HELP = "vectors of the lines of a text file"
DESCRIPTION = """Encodes each non-empty line of FILE and writes one vector per line ([lines,
hidden] float32) to --out."""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a BERT, ELECTRA or ELMo folder")
    p.add_argument("file", metavar="FILE", help="text, one sentence or passage per line")
    p.add_argument("--out", help="FILE.npy or FILE.safetensors (default: FILE with .npy)")
    p.add_argument("--pool", choices=("mean", "first"), default="mean",
                   help="mean of the token vectors, or the first token's ([CLS] for BERT) "
                        "(default mean)")
    p.add_argument("--batch-size", type=positive_int, default=32)
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
    spec, model, tokenizer = load_model(args.model, "embed", device)
    vectors, truncated = [], 0
    with torch.no_grad():
        for start in range(0, len(lines), args.batch_size):
            hidden, mask, cut = spec.hidden(model, tokenizer, lines[start:start + args.batch_size],
                                            device)  # [B, T, H], [B, T]
            truncated += cut
            if args.pool == "first":
                vectors.append(hidden[:, 0])
            else:
                weights = mask[..., None].float()
                vectors.append((hidden * weights).sum(1) / weights.sum(1))
    vectors = torch.cat(vectors).cpu().contiguous()
    _write(out, vectors)
    note = f" ({truncated} lines cut to the model's positions)" if truncated else ""
    print(f"{tuple(vectors.shape)} vectors of {len(lines)} lines -> {out}{note}")
    return 0


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
