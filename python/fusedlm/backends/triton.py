"""The triton backend: kernels in fusedlm.triton_kernels (kernels/triton/).

Runs on CUDA tensors; with TRITON_INTERPRET=1 it also runs on CPU tensors when
asked for by name (how the kernels are tested without a GPU). An op has Triton kernels
where kernels/triton/<op file>.py exists, for float32, bfloat16 and float16.
"""
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

from .. import switches
from ..dtypes import GPU_FLOATS
from .registry import Backend, Supports, register

INTERPRETED = switches.value("TRITON_INTERPRET") == "1"
# The kernels in a source tree that was not installed (installed: fusedlm.triton_kernels).
_SOURCE = Path(__file__).resolve().parents[3] / "kernels" / "triton"


def _unavailable():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not INTERPRETED and not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to interpret the kernels on the CPU)"
    return None


def _kernels_folder() -> Path:
    installed = importlib.util.find_spec("fusedlm.triton_kernels")
    return Path(installed.submodule_search_locations[0]) if installed else _SOURCE


def _kernels_module(name: str):
    """fusedlm.triton_kernels.<name>, imported on first use (importing triton is slow, and
    triton may be absent). In a source tree that was not installed, kernels/triton is
    loaded as that package."""
    package = "fusedlm.triton_kernels"
    if importlib.util.find_spec(package) is None:
        source = _SOURCE / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            package, source, submodule_search_locations=[str(source.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.{name}")


def _lazy(module: str, function: str):
    """kernels/triton/<module>.<function>, imported at its first call, then called straight."""
    found = None

    def call(*args):
        nonlocal found
        if found is None:
            found = getattr(_kernels_module(module), function)
        return found(*args)

    call.__name__ = f"{module}.{function}"
    return call


def keep_mask(seed, shape, p: float, device="cpu"):
    """The dropout keep mask (bool, True = keep) the Triton kernels draw for stream ``seed``."""
    return _kernels_module("_common").keep_mask(seed, shape, p, device)


def _find(op):
    """The kernels of the ops declared in fusedlm/ops/<module>.py are <op>_forward and
    <op>_backward in kernels/triton/<module>.py, where that file exists."""
    if not (_kernels_folder() / f"{op.module}.py").exists():
        return None
    return _lazy(op.module, f"{op.name}_forward"), _lazy(op.module, f"{op.name}_backward")


BACKEND = register(Backend("triton", ("cuda", "cpu") if INTERPRETED else ("cuda",), _unavailable(),
                           _find, Supports(dtypes=GPU_FLOATS)))
