"""The device's measured ceilings, against which each op's GB/s and TFLOP/s are judged:
a large device-to-device copy (bytes read plus written per second) and a large square
matrix product (in bfloat16 on a GPU, float32 on the CPU)."""
from __future__ import annotations

import torch

from .timing import Timer

CEILING_OF = {"GB/s": "copy_GBps", "TFLOP/s": "matmul_TFLOPs"}  # a rate's unit -> its ceiling


def measure(timer: Timer, copy_bytes: int, matmul_size: int) -> dict:
    device = timer.device
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    del src, dst
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
    b = torch.randn(matmul_size, matmul_size, device=device, dtype=dtype)
    matmul_ms = timer(lambda: a @ b)
    return {"copy_GBps": 2 * copy_bytes / copy_ms / 1e6,
            "matmul_TFLOPs": 2 * matmul_size ** 3 / matmul_ms / 1e9,
            "copy_bytes": copy_bytes, "matmul_size": matmul_size,
            "matmul_dtype": str(dtype).removeprefix("torch.")}
