"""The triton backend: kernels in fusedlm.triton_kernels (kernels/triton/).

Runs on CUDA tensors; with TRITON_INTERPRET=1 it also runs on CPU tensors when
asked for by name (how the kernels are tested without a GPU).
"""
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from . import Backend, Kernel, register

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _unavailable():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to interpret the kernels on the CPU)"
    return None


def _devices():
    return ("cuda", "cpu") if os.environ.get("TRITON_INTERPRET") == "1" else ("cuda",)


def _kernels_module(name: str):
    """fusedlm.triton_kernels.<name>, imported on first use (importing triton is slow, and
    triton may be absent). In a source tree that was not installed, kernels/triton is
    loaded as that package."""
    package = "fusedlm.triton_kernels"
    if importlib.util.find_spec(package) is None:
        source = Path(__file__).resolve().parents[3] / "kernels" / "triton" / "__init__.py"
        spec = importlib.util.spec_from_file_location(
            package, source, submodule_search_locations=[str(source.parent)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[package] = module
        spec.loader.exec_module(module)
    return importlib.import_module(f"{package}.{name}")


def _lazy(module: str, function: str):
    def call(*args):
        return getattr(_kernels_module(module), function)(*args)

    call.__name__ = f"{module}.{function}"
    return call


def keep_mask(seed, shape, p: float, device="cpu"):
    """The dropout keep mask (bool, True = keep) the Triton kernels draw for stream ``seed``."""
    return _kernels_module("_common").keep_mask(seed, shape, p, device)


def _dtype_limits(dtype=None, **_features):
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        return f"the triton kernels take float32, bfloat16 or float16, not {str(dtype)[6:]}"
    return None


def _attention_limits(dtype=None, **features):
    return _dtype_limits(dtype) or _kernels_module("attention").limits(**features)


def _kernel(op: str, module: str, limits=_dtype_limits) -> Kernel:
    return Kernel(_lazy(module, f"{op}_forward"), _lazy(module, f"{op}_backward"), limits)


BACKEND = register(Backend("triton", _devices, _unavailable, {
    "add_layer_norm": _kernel("add_layer_norm", "layer_norm"),
    "bias_gelu": _kernel("bias_gelu", "gelu"),
    "gelu_ffn": _kernel("gelu_ffn", "gelu"),
    "cross_entropy": _kernel("cross_entropy", "cross_entropy"),
    "masked_lm_loss": _kernel("masked_lm_loss", "cross_entropy"),
    "attention": _kernel("attention", "attention", _attention_limits),
    "attention_varlen": _kernel("attention_varlen", "attention", _attention_limits),
    "attention_with_kvcache": _kernel("attention_with_kvcache", "attention_kvcache"),
    "lstm_cell": _kernel("lstm_cell", "lstm"),
}))
