"""The dtype rules, stated once: which floating dtypes the ops take and which of them GPU
kernels take, the dtype every kernel and reference accumulates in, and how a message names
a dtype."""
from typing import Optional

import torch

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
GPU_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
HALVES = (torch.bfloat16, torch.float16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a kernel or a reference computes and keeps its statistics in for inputs of
    ``dtype``: float64 for float64, float32 otherwise (csrc/common.h's acc_t, in C++)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def name(dtype: Optional[torch.dtype]) -> str:
    """"float32", as messages name a dtype ("any" for None)."""
    return str(dtype).removeprefix("torch.") if dtype is not None else "any"
