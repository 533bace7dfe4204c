"""rms_norm in Triton: out = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps) per row.

Forward: one program per row holds the whole row in registers, so each element of x is
read once and out written once; the row's rstd (float32) is its only other traffic.
Memory-bound, as add_layer_norm's: it should run near the device's copy bandwidth.

Backward: each program walks a contiguous range of rows, rebuilding xhat = x * rstd from
x and the saved rstd, writing dx row by row and keeping its share of dweight in float32
registers; the shares land in a [programs, hidden] buffer summed over programs
afterwards. The program count depends only on the shape and the device, so dweight is
the same bit for bit on every run (no atomics).
"""
import torch
import triton
import triton.language as tl

from ._common import (autotune, contiguous, load_row, program_rows, row_block, row_configs,
                      row_programs, rows_of)



@autotune(row_configs(), key=["N"])
@triton.jit
def _forward_kernel(X, W, OUT, RSTD, N, eps, HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    offsets = row * N + cols
    x = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    # Masked lanes load 0, which the sum of squares ignores. Unlike add_layer_norm's summed,
    # x is not rounded before the backward reads it back, so the rstd out was computed with
    # is the one to save: the backward's xhat is the forward's exactly.
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    out = x * rstd
    if HAS_WEIGHT:
        out *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(RSTD + row, rstd)


@autotune(row_configs(), key=["N"])
@triton.jit
def _backward_kernel(DY, X, RSTD, W, DX, DW_PART, rows, N, rows_per_program,
                     HAS_WEIGHT: tl.constexpr, BLOCK_N: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if HAS_WEIGHT:
        w = load_row(W, cols, mask)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first, last = program_rows(rows, rows_per_program)
    for row in range(first, last):
        dy, x = load_row(DY, row * N + cols, mask), load_row(X, row * N + cols, mask)
        rstd = tl.load(RSTD + row)
        # rstd * (g - x * rstd^2 * mean(g * x)) written with xhat = x * rstd: rstd^2 alone
        # would overflow float32 for rows of tiny x when eps is small.
        xhat = x * rstd
        g = dy
        if HAS_WEIGHT:
            g = dy * w
        c = tl.sum(xhat * g, axis=0) / N
        dx = (g - xhat * c) * rstd
        tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
    if HAS_WEIGHT:
        tl.store(DW_PART + tl.program_id(0) * N + cols, dw, mask=mask)


def rms_norm_forward(x, weight, eps):
    hidden = x.shape[-1]
    x2 = rows_of(x)
    rows = x2.shape[0]
    # A new contiguous tensor in x's shape, which the kernel fills as [rows, hidden]: not a
    # view of a flat one (FSDP2 cannot follow in-place changes to a view a module returns).
    out = x.new_empty(x.shape)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows:
        w = contiguous(weight)
        _forward_kernel[(rows,)](x2, w, out, rstd, hidden, eps,
                                 HAS_WEIGHT=w is not None, BLOCK_N=row_block(hidden))
    return out, rstd


def rms_norm_backward(grad_out, x, rstd, weight, eps):
    # eps is the op's (the reference backward recomputes rstd from it); the kernel reads
    # the rstd the forward saved.
    hidden = x.shape[-1]
    x2 = rows_of(x)
    rows = x2.shape[0]
    dy = rows_of(grad_out)
    dx = x.new_empty(x.shape)
    programs = row_programs(rows, x.device)
    dw_part = (torch.empty((programs, hidden), dtype=torch.float32, device=x.device)
               if weight is not None else None)
    if rows:
        w = contiguous(weight)
        _backward_kernel[(programs,)](
            dy, x2, rstd.contiguous(), w, dx, dw_part, rows, hidden, triton.cdiv(rows, programs),
            HAS_WEIGHT=w is not None, BLOCK_N=row_block(hidden))
    dweight = dw_part.sum(0).to(x.dtype) if weight is not None else None
    return dx, dweight
