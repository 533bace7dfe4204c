"""fusedlm selftest: every kernel on this device against the reference, one row each."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from .common import add_device_argument, atomic_write, resolve_device
from .errors import UsageError


HELP = "check every kernel on this device against the reference"
DESCRIPTION = """Runs every op on every fusedlm backend that runs on the device, in each
floating-point type, each cuda kernel path on and off, on small problems (and with --size
real, at BERT-base, GPT-2 small and ELMo shapes), forward and backward, against the plain
PyTorch reference in float64. Each row is ok (with the error measured and the time),
mismatch (with the error), or unavailable (with the reason), next to the time of the same
call in eager PyTorch. Exits 1 on any mismatch. Attach --json's file to a bug report."""


def add_arguments(p) -> None:
    add_device_argument(p, "cpu or cuda (default cuda if present)")
    p.add_argument("--size", choices=("small", "real", "all"), default="small",
                   help="the problems: small (seconds), real (model shapes), or all")
    p.add_argument("--ops", nargs="+", metavar="OP", help="only these ops (default: all)")
    p.add_argument("--json", type=Path, metavar="FILE",
                   help="write the device, versions and every row here")


def run(args: argparse.Namespace) -> int:
    import fusedlm
    from fusedlm import verify
    from fusedlm.backends import KERNEL_BACKENDS, _REGISTRY
    from fusedlm.backends import cuda as cuda_backend
    from fusedlm.bench.report import git_commit
    from fusedlm.verify import probes

    device = resolve_device(args.device)
    known = probes.probed()
    unknown = [op for op in args.ops or () if op not in known]
    if unknown:
        raise UsageError(f"--ops: unknown {', '.join(map(repr, unknown))} (known: {', '.join(known)})")
    sizes = ("small", "real") if args.size == "all" else (args.size,)
    rows = []
    with verify.suspended():  # measured here, not refused
        for size in sizes:
            for probe in probes.probes(size=size):
                if args.ops and probe.op not in args.ops:
                    continue
                for name in KERNEL_BACKENDS:
                    backend = _REGISTRY[name]
                    if device.type not in backend.devices or backend.emulated():
                        continue
                    for dtype in backend.supports.dtypes:
                        for path in _paths(name, probe, cuda_backend):
                            rows.append(_row(probe, size, name, dtype, path, device, cuda_backend))
                            _print(rows[-1])
    mismatches = sum(row["status"] == "mismatch" for row in rows)
    print(f"{len(rows)} rows: {sum(r['status'] == 'ok' for r in rows)} ok, {mismatches} mismatch, "
          f"{sum(r['status'] == 'unavailable' for r in rows)} unavailable")
    if args.json:
        record = {"device": verify.device_name(device), "identity": verify.identity(device),
                  "commit": git_commit(), "backends": {k: str(v) for k, v in fusedlm.backends().items()},
                  "rows": rows}
        atomic_write(args.json, lambda f: f.write((json.dumps(record, indent=1) + "\n").encode()))
        print(f"wrote {args.json}")
    return 1 if mismatches else 0


def _paths(backend: str, probe, cuda_backend) -> list:
    """None (the paths as configured), then each cuda path the probe takes turned off."""
    if backend != "cuda":
        return [None]
    on = cuda_backend.paths()
    return [None] + [path for path in probe.paths if on.get(path)]


def _row(probe, size, backend, dtype, path, device, cuda_backend) -> dict:
    from fusedlm.dtypes import name as dtype_name
    from fusedlm.verify import probes

    row = {"op": probe.op, "problem": probe.name, "size": size, "backend": backend,
           "dtype": dtype_name(dtype), "path": f"no {path}" if path else "default"}
    if path:
        cuda_backend.set_path(path, False)
    try:
        outcome = probes.run(probe, backend, device, dtype)
        ms = probes.time_ms(probe, device, dtype, backend)
    except RuntimeError as error:
        if "cannot run on backend" in str(error):
            return dict(row, status="unavailable", reason=str(error).split(": ", 2)[-1])
        return dict(row, status="mismatch", error=math.inf, reason=f"{type(error).__name__}: {error}")
    finally:
        if path:
            cuda_backend.set_path(path, True)
    baseline = probes.time_ms(probe, device, dtype)
    status = "ok" if outcome.within(dtype) else "mismatch"
    return dict(row, status=status, error=outcome.error, worst=outcome.worst,
                tolerance=probes.TOLERANCE.get(dtype), ms=ms, eager_ms=baseline)


def _print(row: dict) -> None:
    what = f"{row['op']:<23} {row['problem'][:30]:<30} {row['backend']:<7} {row['dtype']:<9} {row['path']:<23}"
    if row["status"] == "unavailable":
        print(f"{what} unavailable: {row['reason']}")
        return
    if "ms" not in row:
        print(f"{what} MISMATCH: {row['reason']}")
        return
    eager = f"{row['eager_ms']:.3f}" if row["eager_ms"] is not None else "-"
    flag = "ok" if row["status"] == "ok" else "MISMATCH"
    print(f"{what} {flag:<8} error {row['error']:.1e}  {row['ms']:.3f} ms (eager {eager} ms)")
