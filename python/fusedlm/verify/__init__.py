"""Verification at first use: a backend's kernels are checked on a device before they run a
user's data there.

The first time a call would run op X in dtype D on a device on backend B (cpu, triton or
cuda; the reference and the torch backend, plain PyTorch, are yardsticks), fusedlm runs X's
small probes (fusedlm.verify.probes) on B against the float64 reference. A NaN, an error
past the dtype's tolerance or an exception fails the check: the backend is then skipped
for X in D on that device, with one warning naming it and the error measured, and the call
runs on the next backend. A failing probe that passes with one of the cuda backend's
kernel paths turned off (``attention_fused_backward``, ``attention_resident``,
``attention_wgmma``, ``ffn_cublas``, ``ffn_wgmma``) disables only that path (for the whole
process: the paths are switches of the extension, not of one device).

Results are kept on disk, one file per device name, driver, torch, triton and fusedlm
version and build (with the kernel paths a check turned off), so that a machine pays for
a check once:
``$FUSEDLM_CACHE_DIR/verified/`` (default ``~/.cache/fusedlm``). ``FUSEDLM_VERIFY=0``
turns the checks off; ``FUSEDLM_VERIFY=strict`` raises where a check fails. A call made
while torch.compile traces, under a dispatch mode (fake tensors, say), inside a torch.func
transform or during CUDA graph capture is not checked then: its kernel runs as configured,
and the check happens at the next call that can run it (a graph torch.compile captured
keeps the backend it was traced with).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import platform
import threading
import warnings
from pathlib import Path
from typing import Optional

import torch

from .. import switches
from ..dtypes import name as dtype_name
from ..backends import KERNEL_BACKENDS, forget_choices, install_checks, unobserved
from . import probes

# Read once, at import (fusedlm.switches).
_MODE = (switches.value("FUSEDLM_VERIFY") or "1").strip().lower()
if _MODE not in ("0", "1", "strict"):
    raise ValueError(f"FUSEDLM_VERIFY must be 0, 1 or strict, got {switches.value('FUSEDLM_VERIFY')!r}")
_CACHE_DIR = Path(switches.value("FUSEDLM_CACHE_DIR")
                  or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fusedlm")

# Backends that imitate their GPU on the CPU (the cuda backend of an emulated build, triton
# in its interpreter) are test vehicles, checked by the test suite rather than at first use.
CHECK_IMITATIONS = False

_lock = threading.RLock()
_checking = threading.local()  # set while a check runs its probes (they are calls too)
# {device key: {"results": {"op/backend/dtype": None (passed) or the failure},
#               "paths_off": [cuda kernel paths turned off by a check]}}
_records: dict = {}
_warned: set = set()  # (device key, "op/backend/dtype") of the failures reported
_outcomes: dict = {}  # {(op, backend, device, dtype): outcome}: the calls' fast path
_UNCHECKED = object()


class VerificationError(RuntimeError):
    """A kernel failed its check at first use under FUSEDLM_VERIFY=strict."""


def enabled() -> bool:
    """Whether kernels are checked at first use (FUSEDLM_VERIFY is not 0)."""
    return _MODE != "0"


def cache_folder() -> Path:
    """Where the checks' results are kept, one file per device and software."""
    return _CACHE_DIR / "verified"


def failure(op: str, backend: str, device: torch.device, dtype: Optional[torch.dtype]) -> Optional[str]:
    """Why ``backend``'s kernels of ``op`` in ``dtype`` must not run on ``device`` (they
    failed their check), or None: passed, not checked (off, no probe, or not now), or
    a backend of plain PyTorch (not one of KERNEL_BACKENDS). Checks on first use; never
    asked while torch.compile traces (fusedlm.backends.choose)."""
    if _MODE == "0" or backend not in KERNEL_BACKENDS or getattr(_checking, "active", False):
        return None
    decided = _outcomes.get((op, backend, device, dtype), _UNCHECKED)
    if decided is None or (decided is not _UNCHECKED and _MODE != "strict"):
        return decided
    if not probes.probes(op):
        return None
    device_key = _device_key(device)
    name = f"{op}/{backend}/{dtype_name(dtype)}"
    if device.type == "cpu" and backend != "cpu" and not CHECK_IMITATIONS:
        return None
    with _lock:
        record = _loaded(device_key, device)
        if name not in record["results"]:
            if not _may_check(device):
                return None
            record["results"][name] = _check(op, backend, device, dtype or torch.float32, record)
            _save(record)
        outcome = _outcomes[(op, backend, device, dtype)] = record["results"][name]
        if outcome is None:
            return None
        message = (f"fusedlm: the {backend} backend's {op} in {dtype_name(dtype)} failed its check "
                   f"on {device_name(device)} ({outcome})")
        if _MODE == "strict":
            raise VerificationError(message)
        if (device_key, name) not in _warned:  # once per process
            _warned.add((device_key, name))
            warnings.warn(f"{message}; its calls go to the next backend. Please report this with "
                          f"the output of `fusedlm selftest --json FILE`.", RuntimeWarning, stacklevel=4)
    return outcome


def passed_for_good(op: str, backend: str, device: torch.device,
                    dtype: Optional[torch.dtype]) -> bool:
    """Whether failure() answers None for such calls until forget(): checks off, the
    backends of plain PyTorch, a check passed, or no probe to check with."""
    return (_MODE == "0" or backend not in KERNEL_BACKENDS
            or _outcomes.get((op, backend, device, dtype), _UNCHECKED) is None
            or not probes.probes(op))


def forget() -> None:
    """Drops the results held in memory (the files stay): the next calls check again, or
    read the files again."""
    with _lock:
        _records.clear()
        _warned.clear()
        _outcomes.clear()
        forget_choices()  # choose()'s answers that rest on them


@contextlib.contextmanager
def suspended():
    """No checks inside: for code that measures the kernels itself (fusedlm selftest)."""
    was = getattr(_checking, "active", False)
    _checking.active = True
    try:
        yield
    finally:
        _checking.active = was


def _may_check(device: torch.device) -> bool:
    if device.type not in ("cpu", "cuda") or not unobserved():
        return False
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def _check(op: str, backend: str, device: torch.device, dtype: torch.dtype,
           record: dict) -> Optional[str]:
    """None where every probe of op passes on backend (after turning off a broken kernel
    path, if that is what it takes), else what failed.

    The probes run in a thread of their own, on the caller's device: the caller's
    thread-local state (autograd's saved-tensor hooks, which activation checkpointing
    counts on; autocast; grad and inference modes) neither reaches them nor is changed."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(_check_in_this_thread, op, backend, device, dtype, record).result()


def _check_in_this_thread(op: str, backend: str, device: torch.device, dtype: torch.dtype,
                          record: dict) -> Optional[str]:
    on_device = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with suspended(), on_device:
        for probe in probes.probes(op):
            failed = _run(probe, backend, device, dtype)
            if failed and backend == "cuda":
                failed = _without_broken_path(probe, device, dtype, failed, record)
            if failed:
                return failed
        return None


def _run(probe, backend, device, dtype) -> Optional[str]:
    try:
        outcome = probes.run(probe, backend, device, dtype)
    except RuntimeError as error:
        if "cannot run on backend" in str(error):  # a shape this backend refuses: not its path
            return None
        return f"{probe.name}: raised {type(error).__name__}: {error}"
    if outcome.within(dtype):
        return None
    return (f"{probe.name}: error {outcome.error:.3g} in {outcome.worst}, "
            f"tolerance {probes.TOLERANCE.get(dtype, 5e-2):.3g}")


def _without_broken_path(probe, device, dtype, failed: str, record: dict) -> Optional[str]:
    """Turns off each cuda path the probe takes in turn; keeps off the first whose absence
    makes the probe pass, with a warning, and returns None then; else ``failed``."""
    from ..backends import cuda

    for path in probe.paths:
        if not cuda.paths().get(path):
            continue
        cuda.set_path(path, False)
        if _run(probe, "cuda", device, dtype) is None:
            record["paths_off"].append(path)
            warnings.warn(f"fusedlm: the cuda kernel path {path!r} failed its check on "
                          f"{device_name(device)} ({failed}) and is turned off.",
                          RuntimeWarning, stacklevel=6)
            return None
        cuda.set_path(path, True)
    return failed


def device_name(device: torch.device) -> str:
    """The device as a report names it: cuda:0 (NVIDIA H100 80GB HBM3), cpu (x86_64)."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()})"


def identity(device: torch.device) -> dict:
    """What a check's result holds for: the device and the software that ran it."""
    from importlib import metadata

    from .._version import __version__
    from .._extension import _C, _build_info

    def version(module):
        try:
            return metadata.version(module)
        except metadata.PackageNotFoundError:
            return None

    ident = {"fusedlm": __version__, "torch": torch.__version__, "triton": version("triton"),
             "cuda_arches": _build_info.cuda_arches, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        # The driver's version from fusedlm's own binding (torch has no public one); None in
        # a build without the CUDA runtime, the emulated one included.
        runtime = _C.with_cuda and not _C.cuda_emulated
        ident.update(device=torch.cuda.get_device_name(index),
                     capability=".".join(map(str, torch.cuda.get_device_capability(index))),
                     driver=_C.cuda.driver_version() if runtime else None, cuda=torch.version.cuda)
    else:
        ident.update(device=platform.processor() or platform.machine())
    return ident


def _device_key(device: torch.device) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def _file(device: torch.device, ident: dict) -> Path:
    digest = hashlib.sha1(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    return cache_folder() / f"{device.type}-{digest}.json"


def _loaded(device_key: str, device: torch.device) -> dict:
    """The record of a device: the one in memory, else its file's (whose broken kernel
    paths are turned off again), else an empty one."""
    if device_key not in _records:
        ident = identity(device)
        record = {"identity": ident, "file": _file(device, ident), "results": {}, "paths_off": []}
        try:
            stored = json.loads(record["file"].read_text())
            record.update(results=dict(stored["results"]), paths_off=list(stored["paths_off"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if record["paths_off"]:
            from ..backends import cuda

            for path in record["paths_off"]:
                cuda.set_path(path, False)
        _records[device_key] = record
    return _records[device_key]


def _save(record: dict) -> None:
    """Writes the device's record (merged with what another process wrote meanwhile);
    a cache that cannot be written only means checking again next time."""
    path = record["file"]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            stored = json.loads(path.read_text())
            results, paths_off = dict(stored["results"]), list(stored["paths_off"])
        except (OSError, ValueError, KeyError, TypeError):
            results, paths_off = {}, []
        results.update(record["results"])
        paths_off += [p for p in record["paths_off"] if p not in paths_off]
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"identity": record["identity"], "results": results,
                                         "paths_off": paths_off}, indent=1))
        os.replace(temporary, path)
    except OSError:
        pass


# Every choice of backend from now on asks these checks (fusedlm.backends.dispatch).
install_checks(failure, passed_for_good)
