"""The dtype and layout rules, stated once: which floating dtypes the ops take and which of
them GPU kernels take, the dtype every kernel and reference accumulates in, how a message
names a dtype, whether a device multiplies bfloat16 natively, and how every backend lays out the outputs it allocates."""
from typing import Optional

import torch

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
GPU_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALVES = (torch.bfloat16, torch.float16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a kernel or a reference computes and keeps its statistics in for inputs of
    ``dtype``: float64 for float64, float32 otherwise (csrc/common.h's acc_t, in C++)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def native_bf16(device: torch.device) -> bool:
    """Whether ``device`` multiplies bfloat16 matrices natively: a GPU that takes bfloat16,
    a CPU with AMX or AVX512-BF16. Elsewhere bfloat16 products are emulated, slower than
    float32 ones."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    # torch's own probes (cpuinfo), private: a torch without them counts as without the units.
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def _stride_order(ref: torch.Tensor) -> list:
    """ref's dimensions from the outermost in memory to the innermost (ties in order)."""
    return sorted(range(ref.dim()), key=lambda d: -ref.stride(d))


def empty_like_layout(ref: torch.Tensor, shape,
                      dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """A new tensor of ``shape`` whose dimensions lie in memory in the order of ref's strides
    (an output of a [batch, seq, heads, dim] view is laid out the same way): the rule every
    backend allocates its outputs by (csrc/common.h's empty_like_layout, in C++)."""
    return torch.empty_permuted(shape, _stride_order(ref), dtype=dtype or ref.dtype,
                                device=ref.device)


def laid_out_like(ref: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """t laid out by the same rule, out of place (so that torch.func's transforms and
    autograd pass through it): what the reference backend returns."""
    order = _stride_order(ref)
    back = sorted(range(ref.dim()), key=order.__getitem__)
    return t.permute(order).contiguous().permute(back)


def name(dtype: Optional[torch.dtype]) -> str:
    """"float32", as messages name a dtype ("any" for None)."""
    return str(dtype).removeprefix("torch.") if dtype is not None else "any"
