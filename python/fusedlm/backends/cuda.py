"""The cuda backend: fusedlm's hand-written CUDA kernels (kernels/cuda/), compiled into fusedlm._C.

It has add_layer_norm, bias_gelu, cross_entropy and masked_lm_loss, for float32, bfloat16
and float16. gelu_ffn is left to the triton backend, whose matrix product applies the
GELU in its epilogue: the automatic choice for CUDA tensors falls through to it.
"""
import torch

from .._extension import _C, _build_info
from . import Backend, Kernel, register

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _unavailable():
    if not _C.with_cuda:
        return "fusedlm was built without CUDA (rebuild with FUSEDLM_CUDA=1 and a CUDA PyTorch)"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def arches() -> str:
    """The CUDA architectures the extension was compiled for (TORCH_CUDA_ARCH_LIST)."""
    return _build_info.cuda_arches


def _dtype_limits(dtype=None, **_features):
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        return f"the cuda kernels take float32, bfloat16 or float16, not {str(dtype)[6:]}"
    return None


def keep_mask(seed, shape, p: float, device="cuda") -> torch.Tensor:
    """The dropout keep mask (bool, True = keep) the CUDA kernels draw for stream ``seed``,
    element order row-major over ``shape``, on CUDA device ``device``."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _C.cuda.dropout_mask(seed, 0, list(shape), p, index)


def _kernels() -> dict:
    if not _C.with_cuda:
        return {}
    ops = _C.cuda
    return {name: Kernel(getattr(ops, f"{name}_forward"), getattr(ops, f"{name}_backward"),
                         _dtype_limits)
            for name in ("add_layer_norm", "bias_gelu", "cross_entropy", "masked_lm_loss")}


BACKEND = register(Backend("cuda", lambda: ("cuda",), _unavailable, _kernels()))
