"""fusedlm bench: the fused ops and the models' steps against PyTorch, as a table."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

from .common import add_device_argument, resolve_device
from .errors import UsageError


HELP = "benchmark the fused ops and models against PyTorch"
DESCRIPTION = """Times each fused op (on every fusedlm backend that takes it) and each model's
step against PyTorch eager, torch.compile and SDPA, and prints time, speed-up, GB/s or TFLOP/s
and the share of the device's measured peak. Without --ops or --models: all of both.
With --host: instead, what one call of each op costs the host against the native PyTorch
composition it replaces, on tiny tensors (microseconds per call, forward and
forward+backward, on one thread). With --efficiency (a FUSEDLM_CUDA=emulate build): instead,
the bytes each cuda kernel moves and the tensor-core products it issues against its op's
ideal, counted by the emulator, beside its registers and occupancy (--resources)."""


def add_arguments(p) -> None:
    from ..bench import MODELS, OPS, efficiency, host

    add_device_argument(p, "cpu or cuda (default cuda if present)")
    p.add_argument("--ops", nargs="+", metavar="OP", help=f"among {', '.join(OPS)}; with "
                   f"--host among {', '.join(host.CASES)}; with --efficiency among "
                   f"{', '.join(efficiency.CASES)}")
    p.add_argument("--models", nargs="+", metavar="MODEL", help=f"among {', '.join(MODELS)}")
    p.add_argument("--host", action="store_true",
                   help="only the host's cost of one call of each op (default all) against "
                   "its native PyTorch composition, on tiny tensors; ignores --models")
    p.add_argument("--efficiency", action="store_true",
                   help="only what each cuda kernel moves and computes against its op's "
                   "ideal, counted by the CUDA emulator (a FUSEDLM_CUDA=emulate build); "
                   "ignores --models")
    p.add_argument("--resources", type=Path, metavar="FILE.json",
                   help="with --efficiency: the kernels' registers and occupancy, as "
                   "scripts/cuda_compile_check.sh writes them (build/cuda-check/resources.json)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write every row, the device, "
                   "versions, commit and ceilings here (after every case: a run stopped "
                   "early keeps the rows it measured)")
    p.add_argument("--plot", type=Path, metavar="FILE.png",
                   help="a bar chart of the speed-ups (needs matplotlib)")
    p.add_argument("--shapes", choices=("all", "bert"), default="all",
                   help="the ops' shapes: all (default), or bert, BERT-base's alone (its "
                   "batch of 32 x 128 tokens on a GPU, 8 x 128 on the CPU, at width 768, "
                   "vocabulary 30522 and sequences of 128): the op rows a short GPU run records")
    p.add_argument("--quick", action="store_true",
                   help="tiny shapes and few rounds: checks the benchmarks, measures nothing")


def _names(option: str, given, known: dict) -> list:
    if given is None:
        return []
    unknown = [name for name in given if name not in known]
    if unknown:
        raise UsageError(f"{option}: unknown {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(known)})")
    return list(dict.fromkeys(given))


def _writable(option: str, path):
    if path is not None and not path.parent.is_dir():
        raise UsageError(f"{option} {path}: no such directory {path.parent}")


def run(args: argparse.Namespace) -> int:
    from .. import bench
    from ..bench import report

    if args.host:
        return _run_host(args)
    if args.efficiency:
        return _run_efficiency(args)
    if args.resources is not None:
        raise UsageError("--resources goes with --efficiency")
    ops = _names("--ops", args.ops, bench.OPS)
    models = _names("--models", args.models, bench.MODELS)
    if args.ops is None and args.models is None:
        ops, models = list(bench.OPS), list(bench.MODELS)
    device = resolve_device(args.device)
    _writable("--json", args.json)
    _writable("--plot", args.plot)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)")
    def save(result):
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=2) + "\n")

    # The JSON is rewritten after every case: a run stopped early keeps the rows it measured.
    result = bench.run(device, ops, models, quick=args.quick, bert_shapes=args.shapes == "bert",
                       progress=save)
    print(report.table(result))
    save(result)
    if args.plot is not None:
        report.plot(result, args.plot)
    return 0


def _run_host(args: argparse.Namespace) -> int:
    from ..bench import host

    ops = _names("--ops", args.ops, host.CASES) or list(host.CASES)
    device = resolve_device(args.device)
    _writable("--json", args.json)
    if args.plot is not None:
        raise UsageError("--plot: --host has no speed-ups to draw")
    result = host.run(device, ops, quick=args.quick)
    print(host.table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _run_efficiency(args: argparse.Namespace) -> int:
    from ..backends import cuda as cuda_backend
    from ..bench import efficiency

    ops = _names("--ops", args.ops, efficiency.CASES) or list(efficiency.CASES)
    _writable("--json", args.json)
    if args.plot is not None:
        raise UsageError("--plot: --efficiency has no speed-ups to draw")
    if args.resources is not None and not args.resources.is_file():
        raise UsageError(f"--resources {args.resources}: no such file")
    if not cuda_backend.emulated():
        raise UsageError("--efficiency needs the emulated build (FUSEDLM_CUDA=emulate): its "
                         "emulator counts what the cuda kernels do")
    result = efficiency.run(ops, None if args.resources is None else str(args.resources))
    print(efficiency.table(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0
