"""add_layer_norm in Triton: summed = dropout(x) + residual and its LayerNorm.

Forward: one program per row holds the whole row in registers, so each element of x
and the residual is read once and out and summed written once; the row's mean and
rstd (float32) are its only other traffic. Memory-bound: it should run near the
device's copy bandwidth (4 bytes moved per element in bf16 with a residual, plus 4).

Backward: each program walks a contiguous range of rows, writing dsummed (and dx
under dropout) row by row and keeping its share of dweight and dbias in float32
registers; the shares land in a [programs, hidden] buffer summed over programs
afterwards. The program count depends only on the shape and the device, so the
parameter gradients are the same bit for bit on every run (no atomics).
"""
import torch
import triton
import triton.language as tl

from ._common import (autotune, contiguous, keep, load_row, program_rows, row_block, row_configs,
                      row_programs, rows_of, seed_of)


@triton.jit
def _row_stats(s, mask, N, eps):
    """The row's mean and 1/sqrt(variance + eps), in two passes over registers."""
    mean = tl.sum(s, axis=0) / N
    # The rounding of that sum, corrected from the centred values: rows of equal values
    # (variance 0, where rstd = 1/sqrt(eps) magnifies any error) centre to exact zeros.
    mean += tl.sum(tl.where(mask, s - mean, 0.0), axis=0) / N
    centred = tl.where(mask, s - mean, 0.0)
    return mean, tl.rsqrt(tl.sum(centred * centred, axis=0) / N + eps)


@autotune(row_configs(), key=["N", "HAS_RESIDUAL", "DROPOUT"])
@triton.jit(do_not_specialize=["seed"])
def _forward_kernel(X, R, W, B, OUT, SUMMED, MEAN, RSTD, N, eps, p, seed,
                    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DROPOUT: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    offsets = row * N + cols
    s = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if DROPOUT:
        s = tl.where(keep(seed, offsets, p), s / (1.0 - p), 0.0)
    if HAS_RESIDUAL:
        s += tl.load(R + offsets, mask=mask, other=0.0).to(tl.float32)
    stored = s.to(SUMMED.dtype.element_ty)
    tl.store(SUMMED + offsets, stored, mask=mask)
    # out normalises summed before rounding, as the reference does. The saved statistics
    # are those of summed as stored: the backward rebuilds xhat from it, and xhat must
    # have mean 0 and variance 1 exactly there, or rows of near-zero variance turn
    # bf16/fp16 rounding into gradients of 1/sqrt(eps) times it. In float32 the two agree.
    mean, rstd = _row_stats(s, mask, N, eps)
    out = tl.where(mask, s - mean, 0.0) * rstd
    if SUMMED.dtype.element_ty != tl.float32:
        mean, rstd = _row_stats(stored.to(tl.float32), mask, N, eps)
    if HAS_WEIGHT:
        out *= tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        out += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@autotune(row_configs(), key=["N", "HAS_GRAD_SUMMED", "DROPOUT"])
@triton.jit(do_not_specialize=["seed"])
def _backward_kernel(DY, DS_IN, SUMMED, MEAN, RSTD, W, DSUMMED, DX, DW_PART, DB_PART,
                     rows, N, rows_per_program, p, seed,
                     HAS_GRAD_SUMMED: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, WRITE_DSUMMED: tl.constexpr, DROPOUT: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    if HAS_WEIGHT:
        w = load_row(W, cols, mask)
    dw = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first, last = program_rows(rows, rows_per_program)
    for row in range(first, last):
        offsets = row * N + cols
        dy, s = load_row(DY, offsets, mask), load_row(SUMMED, offsets, mask)
        rstd = tl.load(RSTD + row)
        xhat = tl.where(mask, (s - tl.load(MEAN + row)) * rstd, 0.0)
        wdy = dy
        if HAS_WEIGHT:
            wdy = dy * w
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = tl.sum(wdy, axis=0) / N
        ds = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_GRAD_SUMMED:
            ds += tl.load(DS_IN + offsets, mask=mask, other=0.0).to(tl.float32)
        if WRITE_DSUMMED:
            tl.store(DSUMMED + offsets, ds.to(DSUMMED.dtype.element_ty), mask=mask)
        if DROPOUT:
            dx = tl.where(keep(seed, offsets, p), ds / (1.0 - p), 0.0)
            tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * xhat
        db += dy
    if HAS_WEIGHT:
        tl.store(DW_PART + program * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + program * N + cols, db, mask=mask)


def add_layer_norm_forward(x, residual, weight, bias, eps, dropout_p, seed):
    hidden = x.shape[-1]
    block = row_block(hidden)
    x2 = rows_of(x)
    r2 = rows_of(residual) if residual is not None else None
    rows = x2.shape[0]
    # New contiguous tensors in x's shape, which the kernel fills as [rows, hidden]: not
    # views of flat ones (FSDP2 cannot follow in-place changes to a view a module returns).
    out, summed = x.new_empty(x.shape), x.new_empty(x.shape)
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty_like(mean)
    if rows:
        w, b = contiguous(weight), contiguous(bias)
        _forward_kernel[(rows,)](
            x2, r2, w, b, out, summed, mean, rstd, hidden, eps, dropout_p, seed_of(seed, dropout_p),
            HAS_RESIDUAL=r2 is not None, HAS_WEIGHT=w is not None, HAS_BIAS=b is not None,
            DROPOUT=dropout_p > 0, BLOCK_N=block)
    return out, summed, mean, rstd


def add_layer_norm_backward(grad_out, grad_summed, summed, mean, rstd, weight, has_bias,
                            has_residual, dropout_p, seed):
    hidden = summed.shape[-1]
    block = row_block(hidden)
    s2 = rows_of(summed)
    rows = s2.shape[0]
    dy = rows_of(grad_out)
    ds_in = rows_of(grad_summed) if grad_summed is not None else None
    dropout = dropout_p > 0
    # Without dropout dx is dsummed itself (the op hands one tensor to x and residual);
    # with it, dsummed is written only for a residual. Both in summed's shape, as out.
    dsummed = summed.new_empty(summed.shape) if not dropout or has_residual else None
    dx = summed.new_empty(summed.shape) if dropout else None
    programs = row_programs(rows, summed.device)
    dw_part = torch.empty((programs, hidden), dtype=torch.float32, device=summed.device)
    db_part = torch.empty_like(dw_part) if has_bias else None
    if rows:
        w = contiguous(weight)
        _backward_kernel[(programs,)](
            dy, ds_in, s2, mean, rstd, w, dsummed, dx, dw_part, db_part, rows, hidden,
            triton.cdiv(rows, programs), dropout_p, seed_of(seed, dropout_p),
            HAS_GRAD_SUMMED=ds_in is not None, HAS_WEIGHT=w is not None, HAS_BIAS=has_bias,
            WRITE_DSUMMED=dsummed is not None, DROPOUT=dropout, BLOCK_N=block)
    dweight = dw_part.sum(0).to(summed.dtype) if weight is not None else None
    dbias = db_part.sum(0).to(summed.dtype) if has_bias else None
    return dsummed, dx, dweight, dbias
