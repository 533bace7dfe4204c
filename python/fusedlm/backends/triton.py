"""The triton backend: kernels in fusedlm.triton_kernels (kernels/triton/).

Runs on CUDA tensors; with TRITON_INTERPRET=1 it also runs on CPU tensors when
asked for by name (how the kernels are tested without a GPU). Every op but unpad and
pad, for float32, bfloat16 and float16; attention and attention_varlen take head dims
up to 256.
"""
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import torch

from . import GPU_FLOATS, Backend, Kernel, Supports, register

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # read once, as Triton does


def _unavailable():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not INTERPRETED and not torch.cuda.is_available():
        return "no CUDA device (set TRITON_INTERPRET=1 to interpret the kernels on the CPU)"
    return None


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


_FLOATS = Supports(dtypes=GPU_FLOATS)
# The attention kernels hold a row block of q and of the output in registers: BLOCK_D and
# BLOCK_DV, the head dims rounded up to a power of two, at most 256 (MAX_HEAD_DIM there).
_ATTENTION = Supports(dtypes=GPU_FLOATS, max_head_dim=256)


def _kernel(op: str, module: str, supports: Supports = _FLOATS, backward: bool = True) -> Kernel:
    return Kernel(_lazy(module, f"{op}_forward"),
                  _lazy(module, f"{op}_backward") if backward else None, supports)


BACKEND = register(Backend("triton", ("cuda", "cpu") if INTERPRETED else ("cuda",), _unavailable(), {
    "add_layer_norm": _kernel("add_layer_norm", "layer_norm"),
    "bias_gelu": _kernel("bias_gelu", "gelu"),
    "gelu_ffn": _kernel("gelu_ffn", "gelu"),
    "cross_entropy": _kernel("cross_entropy", "cross_entropy"),
    "masked_lm_loss": _kernel("masked_lm_loss", "cross_entropy"),
    "attention": _kernel("attention", "attention", _ATTENTION),
    "attention_varlen": _kernel("attention_varlen", "attention", _ATTENTION),
    "attention_with_kvcache": _kernel("attention_with_kvcache", "attention_kvcache", backward=False),
    "lstm_cell": _kernel("lstm_cell", "lstm"),
}))
