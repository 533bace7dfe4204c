"""Every environment variable that changes what fusedlm does, in one table.

The Python ones are read here, once, when fusedlm is imported (:func:`value`); the C++ ones
are read by the code named in ``read_by``, as the table says; the build's by setup.py and the
test suite's by its own files.
``fusedlm info`` prints the table with the values in effect.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Switch:
    name: str
    default: str  # in effect when the variable is unset or empty
    what: str
    read_by: str  # "python", or the C++ source or setup.py that reads it


SWITCHES = (
    Switch("FUSEDLM_BACKEND", "chosen per call",
           "runs every op on this backend: reference, torch, cpu, triton or cuda", "python"),
    Switch("FUSEDLM_DEBUG", "0",
           "1: checks the values of index tensors on GPUs too (a device-to-host copy per call)",
           "python"),
    Switch("FUSEDLM_VERIFY", "1",
           "the kernel checks at first use: 1 on, 0 off, strict raises where one fails", "python"),
    Switch("FUSEDLM_TUNE", "1",
           "the timing of automatic choices on a GPU at first use: 1 on, 0 off", "python"),
    Switch("FUSEDLM_CACHE_DIR", "$XDG_CACHE_HOME/fusedlm, else ~/.cache/fusedlm",
           "where the kernel checks and the timings keep their results", "python"),
    Switch("TRITON_INTERPRET", "0",
           "1: the triton backend runs in Triton's interpreter, on CPU tensors (as Triton reads it)",
           "python"),
    Switch("FUSEDLM_CPU_CAPABILITY", "the best this CPU has",
           "the cpu kernels' instruction set: baseline, avx2 or avx512", "csrc/cpu_dispatch.cpp"),
    Switch("FUSEDLM_ATTENTION_RESIDENT", "1",
           "0 turns off the cuda attention's path with K and V resident in shared memory",
           "csrc/cuda/paths.cu"),
    Switch("FUSEDLM_ATTENTION_WGMMA", "1",
           "0 turns off the cuda attention's Hopper (wgmma) path", "csrc/cuda/paths.cu"),
    Switch("FUSEDLM_ATTENTION_FUSED_BACKWARD", "1",
           "0: the cuda attention's backward runs as three kernels (delta, dQ, dK/dV) at every "
           "length, instead of one kernel up to 512 keys", "csrc/cuda/paths.cu"),
    Switch("FUSEDLM_FFN_CUBLAS", "1",
           "0: the cuda gelu_ffn runs its own fused products instead of cuBLAS's products and "
           "its GELU pass", "csrc/cuda/paths.cu"),
    Switch("FUSEDLM_FFN_WGMMA", "1",
           "0 turns off the cuda gelu_ffn's Hopper (wgmma) path", "csrc/cuda/paths.cu"),
    Switch("FUSEDLM_EMULATE_ARCH", "sm_80",
           "the GPU a FUSEDLM_CUDA=emulate build acts as: sm_80 or sm_90a",
           "csrc/emulator/runtime.cpp"),
    Switch("FUSEDLM_EMULATE_TRACE", "off",
           "set: a FUSEDLM_CUDA=emulate build prints each kernel launch to stderr",
           "csrc/emulator/runtime.cpp"),
    Switch("FUSEDLM_CUDA", "auto",
           "the build's CUDA kernels: auto (when nvcc and a CUDA torch are there), 1, 0, or "
           "emulate (against the CPU emulator)", "setup.py"),
    Switch("TORCH_CUDA_ARCH_LIST", "8.0+PTX;9.0a", "the build's CUDA architectures",
           "setup.py"),
    Switch("MAX_JOBS", "the CPU count", "the build's parallel compile jobs", "setup.py"),
    Switch("FUSEDLM_SEED", "a fresh one per test", "the test suite's random seed, which a failing "
           "test prints", "tests/conftest.py"),
    Switch("FUSEDLM_FUZZ_CASES", "200", "the fuzzers' cases per op and backend", "tests/fuzz.py"),
    Switch("FUSEDLM_FUZZ_CASE", "all", "replays one fuzz case, as a failure prints it",
           "tests/fuzz.py"),
)

_READ = {s.name: os.environ.get(s.name) or None for s in SWITCHES if s.read_by == "python"}


def value(name: str) -> Optional[str]:
    """A Python switch's value as it was when fusedlm was imported (None: unset or empty)."""
    return _READ[name]


def in_effect() -> list:
    """(switch, its value now, or None where unset) for every switch: the Python ones as
    read at import, the others as the environment has them."""
    return [(s, _READ[s.name] if s.name in _READ else os.environ.get(s.name) or None)
            for s in SWITCHES]
