"""The triton backend: kernels in fusedlm.triton_kernels (kernels/triton/).

Runs on CUDA tensors; with TRITON_INTERPRET=1 it also runs on CPU tensors when
asked for by name (how the kernels are tested without a GPU).
"""
import importlib.util
import os

import torch

from . import Backend, register


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


BACKEND = register(Backend("triton", _devices, _unavailable, {}))
