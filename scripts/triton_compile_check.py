"""Compiles, for real GPUs and with no GPU, every Triton kernel specialization that the
test suite launches: what the interpreter cannot catch (a block shape tl.dot refuses, a
layout the backend cannot lower, a config that needs more shared memory than the chip has).

    python scripts/triton_compile_check.py [--arches 80,90] [--jobs N] [--keep FILE]
                                           [--only KERNELS] [pytest arguments]

1. record (a child process, TRITON_INTERPRET=1): runs `pytest -m triton` on the CPU and
   records every kernel launch: the kernel, and its arguments, each tensor reduced to its
   dtype and whether its address is 16-byte aligned (all Triton specializes a pointer on).
   Whether the tests pass is the test suite's business, not this check's. (Triton 3.6's
   interpreter stops on NumPy >= 2.4 in the attention tests: record with a newer Triton,
   then replay the recording under 3.6 with --keep.)
2. compile: replays each recorded launch through the kernel's own autotuner and heuristics
   (Triton's warmup path: every configuration that survives pruning), computes Triton's own
   specialization of it, and compiles each distinct one with triton.compile for each arch.

It fails when a compile fails, when a kernel that is not autotuned needs more shared memory
than the arch offers a block, or when no configuration of an autotuned one fits (the
autotuner skips the rest, as it does at run time). A table per kernel and arch is printed:
specializations compiled, the most registers, the most shared memory, spills.
"""
import argparse
import collections
import contextlib
import functools
import io
import os
import pickle
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Shared memory a block may opt into, in bytes: A100 (sm_80) and H100 (sm_90).
SHARED_LIMIT = {80: 163 * 1024, 90: 227 * 1024}


# --- step 1: record ----------------------------------------------------------------------------

class TensorArg:
    """A tensor argument as Triton's specialization sees it."""

    def __init__(self, dtype, aligned):
        self.dtype, self.aligned = dtype, aligned

    def key(self):
        return ("tensor", str(self.dtype), self.aligned)

    def rebuild(self):
        import torch
        t = torch.empty(32, dtype=self.dtype)  # fresh CPU storage is 64-byte aligned
        return t if self.aligned else t[1:]


def _encode(value):
    import torch
    if isinstance(value, torch.Tensor):
        return TensorArg(value.dtype, value.data_ptr() % 16 == 0)
    return value


def _key(value):
    return value.key() if isinstance(value, TensorArg) else (type(value).__name__, repr(value))


def _kernel_name(launched):
    """(module, name) of the Python function under a launched kernel's wrappers."""
    fn = launched
    while hasattr(fn, "fn"):  # autotuner, heuristics, interpreted function: each wraps .fn
        fn = fn.fn
    return fn.__module__, fn.__name__


class LaunchRecorder:
    """A pytest plugin that records the outermost kernel launch of each distinct call."""

    def __init__(self):
        self.launches, self._seen, self._depth = [], set(), 0

    def pytest_configure(self, config):
        from triton.runtime import autotuner, interpreter
        for cls in (autotuner.Autotuner, autotuner.Heuristics, interpreter.InterpretedFunction):
            cls.run = self._wrap(cls.run)

    def _wrap(self, run):
        def recording_run(kernel, *args, **kwargs):
            if self._depth == 0:
                self._record(kernel, args, kwargs)
            self._depth += 1
            try:
                return run(kernel, *args, **kwargs)
            finally:
                self._depth -= 1
        return recording_run

    def _record(self, kernel, args, kwargs):
        kwargs = {k: v for k, v in kwargs.items() if k not in ("grid", "warmup")}
        launch = (_kernel_name(kernel), [_encode(a) for a in args],
                  {k: _encode(v) for k, v in kwargs.items()})
        key = (launch[0], tuple(map(_key, launch[1])),
               tuple((k, _key(v)) for k, v in sorted(launch[2].items())))
        if key not in self._seen:
            self._seen.add(key)
            self.launches.append(launch)


def record(path, pytest_args):
    import pytest
    recorder = LaunchRecorder()
    status = pytest.main(["-q", "-p", "no:cacheprovider", "-m", "triton", *pytest_args],
                         plugins=[recorder])
    if status not in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
        raise SystemExit(f"the triton tests did not run (pytest exit {int(status)})")
    with open(path, "wb") as f:
        pickle.dump(recorder.launches, f)
    print(f"recorded {len(recorder.launches)} distinct launches", file=sys.stderr)


# --- step 2: compile ---------------------------------------------------------------------------

_REGISTERS = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores")


def _as_gpu_launch(kwargs):
    """The interpreter's workaround for its bfloat16 products (fusedlm.triton_kernels._common.
    upcast_products) is off on a GPU, where 16-bit products take the tensor cores' path."""
    if kwargs.get("UPCAST"):
        kwargs = dict(kwargs, UPCAST=False, PRECISION="tf32")
    return kwargs


def _kernel(module, name):
    """The launched kernel object (a JITFunction, or its autotuner or heuristics wrapper)."""
    import importlib

    from fusedlm.backends import triton as backend
    backend._kernels_module("_common")  # makes fusedlm.triton_kernels importable from a source tree
    return getattr(importlib.import_module(module), name)


def _jit_of(kernel):
    from triton.runtime.jit import JITFunction
    while not isinstance(kernel, JITFunction):
        kernel = kernel.fn
    return kernel


@functools.lru_cache(maxsize=None)
def _binder(jit, arch):
    """(target, backend, binder) of a kernel on ``arch``, as JITFunction.create_binder makes
    them for the current device."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    return target, backend, create_function_from_signature(jit.signature, jit.params, backend)


def _prepare(jit, arch, args, kwargs):
    """JITFunction.run's preparation of a launch: its specialization and compile inputs."""
    _, backend, binder = _binder(jit, arch)
    kwargs = dict(kwargs, debug=kwargs.get("debug", jit.debug))
    bound, specialization, options = binder(*args, **kwargs)
    key = repr((specialization, sorted(options.items())))
    return key, jit._pack_args(backend, kwargs, bound, specialization, options)


def specializations(launch, arch):
    """Every (key, config, args, kwargs) that ``launch`` compiles on ``arch``: one per
    configuration its autotuner keeps, with its heuristics applied, as Triton's warmup does."""
    (module, name), args, kwargs = launch
    kernel = _kernel(module, name)
    jit = _jit_of(kernel)
    found = []

    def collect(*args, grid, warmup, **kwargs):
        key, _ = _prepare(jit, arch, args, kwargs)
        dtype = next(str(a.dtype)[6:] for a in args if hasattr(a, "dtype"))
        config = ", ".join([dtype] + [f"{k}={v}" for k, v in kwargs.items()
                                      if k.isupper() or k.startswith("num_")])
        found.append((key, config, args, kwargs))

    jit.run = collect  # the kernel's wrappers call down to this instead of a launch
    try:
        kernel.warmup(*[a.rebuild() if isinstance(a, TensorArg) else a for a in args],
                      grid=(1,), **{k: v.rebuild() if isinstance(v, TensorArg) else v
                                    for k, v in _as_gpu_launch(kwargs).items()})
    finally:
        del jit.run
    return found


def compile_one(job):
    """Compiles one specialization; returns (shared bytes, registers, spill bytes, error)."""
    import triton
    from triton.compiler import ASTSource
    (module, name), arch, args, kwargs = job
    jit = _jit_of(_kernel(module, name))
    target = _binder(jit, arch)[0]
    _, (options, signature, constexprs, attrs) = _prepare(jit, arch, args, kwargs)
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v's report
            binary = triton.compile(ASTSource(jit, signature, constexprs, attrs),
                                    target=target, options=options.__dict__)
    except Exception as e:  # any failure to compile is the finding
        return 0, 0, 0, f"{type(e).__name__}: {str(e).strip()[:2000]}"
    report = log.getvalue()
    return (binary.metadata.shared, max(map(int, _REGISTERS.findall(report)), default=0),
            max(map(int, _SPILLS.findall(report)), default=0), None)


def compile_all(launches, arches, jobs):
    """Compiles every distinct specialization; returns the table's rows and the failures."""
    jobs_by_key, launch_keys = {}, []
    for launch in launches:
        for arch in arches:
            found = specializations(launch, arch)
            for key, config, args, kwargs in found:
                jobs_by_key.setdefault((key, arch), (launch[0], arch, config, args, kwargs))
            launch_keys.append((launch[0], arch, [(key, arch) for key, *_ in found]))
    keys = list(jobs_by_key)
    with tempfile.TemporaryDirectory() as cache, ProcessPoolExecutor(
            jobs, initializer=os.environ.update,
            initargs=({"TRITON_CACHE_DIR": cache, "TRITON_DUMP_PTXAS_LOG": "1"},)) as pool:
        work = [(kernel, arch, args, kwargs)
                for kernel, arch, _, args, kwargs in map(jobs_by_key.get, keys)]
        results = {}
        for key, result in zip(keys, pool.map(compile_one, work)):
            results[key] = result
            if result[3]:  # a failure, shown at once: the whole run takes a while
                print(f"FAILED {_label(jobs_by_key[key][0])} sm_{key[1]} "
                      f"[{jobs_by_key[key][2]}]: {result[3]}", file=sys.stderr, flush=True)
            if len(results) % 100 == 0:
                print(f"compiled {len(results)} of {len(keys)}", file=sys.stderr, flush=True)

    rows = collections.defaultdict(lambda: [0, 0, 0, 0])  # compiled, registers, shared, spills
    failures, spilling = [], []
    for key in keys:
        kernel, arch, config, *_ = jobs_by_key[key]
        shared, registers, spills, error = results[key]
        if error:
            failures.append(f"{_label(kernel)} sm_{arch} [{config}]: {error}")
            continue
        if spills:
            spilling.append((spills, f"{_label(kernel)} sm_{arch} [{config}]"))
        row = rows[(_label(kernel), arch)]
        row[0] += 1
        row[1:] = max(row[1], registers), max(row[2], shared), max(row[3], spills)
    always_spilling = set()  # launches the autotuner cannot keep off spilled registers
    for kernel, arch, keys_of_launch in launch_keys:
        compiled = [(results[k], k) for k in keys_of_launch if not results[k][3]]
        fitting = [(r, k) for r, k in compiled if r[0] <= SHARED_LIMIT[arch]]
        if compiled and not fitting:
            failures.append(f"{_label(kernel)} sm_{arch}: no configuration fits in "
                            f"{SHARED_LIMIT[arch]} bytes of shared memory (the least needs "
                            f"{min(r[0] for r, _ in compiled)})")
        elif fitting and all(r[2] for r, _ in fitting):
            (_, _, spills, _), key = min(fitting, key=lambda found: found[0][2])
            always_spilling.add((spills, f"{_label(kernel)} sm_{arch} [{jobs_by_key[key][2]}]"))
    return (rows, sorted(set(failures)), sorted(spilling, reverse=True),
            sorted(always_spilling, reverse=True))


def _label(kernel):
    module, name = kernel
    return f"{module.rsplit('.', 1)[-1]}.{name}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arches", default="80,90", help="compute capabilities, e.g. 80,90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count(), help="compile processes")
    parser.add_argument("--keep", metavar="FILE",
                        help="keep the recorded launches in FILE, or reuse them if it exists")
    parser.add_argument("--only", metavar="NAMES",
                        help="compile only these kernels (comma-separated function names)")
    parser.add_argument("--record-to", help=argparse.SUPPRESS)  # the child's step 1
    args, pytest_args = parser.parse_known_args()
    if args.record_to:
        return record(args.record_to, pytest_args)

    with tempfile.TemporaryDirectory() as scratch:
        launches_file = args.keep or os.path.join(scratch, "launches.pkl")
        if not os.path.exists(launches_file):
            env = dict(os.environ, TRITON_INTERPRET="1")
            subprocess.run([sys.executable, __file__, "--record-to", launches_file, *pytest_args],
                           env=env, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(launches_file, "rb") as f:
            launches = pickle.load(f)
    if args.only:
        launches = [launch for launch in launches if launch[0][1] in args.only.split(",")]
    arches = [int(a) for a in args.arches.split(",")]
    rows, failures, spilling, always_spilling = compile_all(launches, arches, args.jobs)
    print(f"{'kernel':40} {'arch':>5} {'compiled':>9} {'registers':>10} {'shared':>8} {'spills':>7}")
    for (name, arch), (n, registers, shared, spills) in sorted(rows.items()):
        print(f"{name:40} sm_{arch:<2} {n:>9} {registers:>10} {shared:>8} {spills:>7}")
    if spilling:  # slow, not wrong: the autotuner may pick another configuration
        print(f"\n{len(spilling)} specializations spill registers; the most:")
        for spills, where in spilling[:12]:
            print(f"  {spills:>7} bytes  {where}")
    if always_spilling:  # slow whatever the autotuner picks: their configurations need work
        print(f"\n{len(always_spilling)} launches spill in every configuration that fits; "
              "the least-spilling configuration of each, worst first:")
        for spills, where in always_spilling:
            print(f"  {spills:>7} bytes  {where}")
    for failure in failures:
        print("FAILED", failure)
    print(f"{sum(row[0] for row in rows.values())} specializations of {len(launches)} distinct "
          f"launches compiled; {len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
