"""The cuda backend: fusedlm's hand-written CUDA kernels (kernels/cuda/), compiled into fusedlm._C.

It has add_layer_norm, bias_gelu, cross_entropy and masked_lm_loss, for float32, bfloat16
and float16. gelu_ffn (a tensor-core matrix product with the bias, GELU and dropout in its
epilogue) takes bfloat16 and float16 with feature sizes that are multiples of 8; other
calls fall through to triton.

attention and attention_varlen (FlashAttention-2 on the tensor cores) take bfloat16 and
float16 with a head_dim of 64 or 128 and no attn_bias; other calls fall through to
triton. Their backward is deterministic: no atomics, each gradient element is written
once, so equal inputs give equal gradients bit for bit.

A FUSEDLM_CUDA=emulate build compiles the same kernels as C++ against a CPU emulator
of CUDA, which acts as the GPU FUSEDLM_EMULATE_ARCH names (sm_80, the default, or
sm_90a) and runs one CPU thread per CUDA thread. There the backend needs no GPU and
runs on CPU tensors (not on CUDA ones: that build has no CUDA), slowly, to test the
kernels; it runs only when asked for by name, never by automatic choice.
"""
from typing import Optional

import torch

from .._extension import _C, _build_info
from . import Backend, Kernel, register

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def emulated() -> bool:
    """Whether the kernels run on the CPU emulator of CUDA (a FUSEDLM_CUDA=emulate build).
    An extension compiled before it had the `cuda_emulated` attribute is not."""
    return bool(getattr(_C, "cuda_emulated", False))


def emulated_arch() -> Optional[str]:
    """The GPU the emulator acts as ("sm_80" or "sm_90a", from FUSEDLM_EMULATE_ARCH), or
    None outside an emulated build."""
    return _C.cuda.emulated_arch() if emulated() else None


def _emulation() -> Optional[str]:
    return f"emulated on the CPU as {emulated_arch()}" if emulated() else None


def _unavailable():
    if not _C.with_cuda:
        return "fusedlm was built without CUDA (rebuild with FUSEDLM_CUDA=1 and a CUDA PyTorch)"
    if not emulated() and not torch.cuda.is_available():
        return "no CUDA device"
    return None


def _devices():
    return ("cpu",) if emulated() else ("cuda",)


def arches() -> str:
    """The CUDA architectures the extension was compiled for (TORCH_CUDA_ARCH_LIST)."""
    return _build_info.cuda_arches


def _dtype_limits(dtype=None, **_features):
    if dtype is not None and dtype not in _FLOAT_DTYPES:
        return f"the cuda kernels take float32, bfloat16 or float16, not {str(dtype)[6:]}"
    return None


def _attention_limits(dtype=None, head_dim=None, head_dim_v=None, bias=False, **_features):
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return f"the cuda attention takes bfloat16 or float16, not {str(dtype)[6:]}"
    if head_dim is not None and head_dim not in (64, 128):
        return f"the cuda attention takes a head_dim of 64 or 128, not {head_dim}"
    if head_dim_v is not None and head_dim_v != head_dim:
        return f"the cuda attention takes v with q's head_dim ({head_dim}), not {head_dim_v}"
    if bias:
        return "the cuda attention takes no attn_bias"
    return None


def _ffn_limits(dtype=None, sizes=(), **_features):
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16):
        return f"the cuda gelu_ffn takes bfloat16 or float16, not {str(dtype)[6:]}"
    if any(size % 8 for size in sizes):
        return f"the cuda gelu_ffn takes d_in, d_ff and d_out that are multiples of 8, not {sizes}"
    return None


def keep_mask(seed, shape, p: float, device=None) -> torch.Tensor:
    """The dropout keep mask (bool, True = keep) the CUDA kernels draw for stream ``seed``,
    element order row-major over ``shape``, on CUDA device ``device`` (default: the
    current one). In an emulated build it is drawn by the emulator, on the CPU (the
    default there, and the only device it takes)."""
    if emulated():
        device = torch.device("cpu" if device is None else device)
        if device.type != "cpu":
            raise ValueError(f"the emulated cuda backend draws its masks on the CPU, not {device}")
        return _C.cuda.dropout_mask(seed, 0, list(shape), p, 0)
    device = torch.device("cuda" if device is None else device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _C.cuda.dropout_mask(seed, 0, list(shape), p, index)


def _kernels() -> dict:
    if not _C.with_cuda:
        return {}
    ops = _C.cuda
    limits = {"attention": _attention_limits, "attention_varlen": _attention_limits,
              "gelu_ffn": _ffn_limits}
    return {name: Kernel(getattr(ops, f"{name}_forward"), getattr(ops, f"{name}_backward"),
                         limits.get(name, _dtype_limits))
            for name in ("add_layer_norm", "bias_gelu", "gelu_ffn", "cross_entropy",
                         "masked_lm_loss", "attention", "attention_varlen")}


BACKEND = register(Backend("cuda", _devices, _unavailable, _kernels(), emulated=_emulation))
