"""lstm_cell in Triton: the pointwise part of an LSTM step with AllenNLP's cell clip.

One program takes a [rows, cell] tile and reads the four gate pre-activations of each unit
(input, forget, cell, output: columns k, cell + k, 2 cell + k, 3 cell + k of its row) and
c_prev, and writes h and c: 7 elements per unit, the least the step can move. The backward
recomputes the activations from the same inputs and writes dgates and dc_prev (12 per unit)
instead of having the forward store them.
"""
import torch
import triton
import triton.language as tl

from ._common import autotune, rows_of, tanh

ROWS_PER_TILE = 16


def _configs():
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in ((128, 4), (256, 8), (64, 4))]


@triton.jit
def _gates(G, offsets, mask, CELL):
    """The i, f, g, o pre-activations (float32) of the units at offsets (row * 4 cell + col)."""
    zi = tl.load(G + offsets, mask=mask, other=0.0).to(tl.float32)
    zf = tl.load(G + offsets + CELL, mask=mask, other=0.0).to(tl.float32)
    zg = tl.load(G + offsets + 2 * CELL, mask=mask, other=0.0).to(tl.float32)
    zo = tl.load(G + offsets + 3 * CELL, mask=mask, other=0.0).to(tl.float32)
    return zi, zf, zg, zo


@triton.jit
def _activations(G, offsets, mask, CELL):
    """sigmoid(i), sigmoid(f), tanh(g), sigmoid(o) of the units at offsets."""
    zi, zf, zg, zo = _gates(G, offsets, mask, CELL)
    return tl.sigmoid(zi), tl.sigmoid(zf), tanh(zg), tl.sigmoid(zo)


@triton.jit
def _tanh_grad(x, t):
    """1 - tanh(x)^2 (t = tanh(x)) without cancellation: 4e / (1 + e)^2 with e = exp(-2|x|)
    above |x| = 0.625, where 1 - t * t would lose the bits it needs (as the cpu kernel)."""
    e = tl.exp(-2.0 * tl.abs(x))
    return tl.where(tl.abs(x) < 0.625, 1.0 - t * t, 4.0 * e / ((1.0 + e) * (1.0 + e)))


@autotune(_configs(), key=["CELL"])
@triton.jit
def _lstm_cell_kernel(G, C_PREV, H, C, M, CELL, clip, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < CELL)
    units = rows[:, None] * CELL + cols[None, :]
    i, f, g, o = _activations(G, rows[:, None] * 4 * CELL + cols[None, :], mask, CELL)
    c = i * g + f * tl.load(C_PREV + units, mask=mask, other=0.0).to(tl.float32)
    c = tl.minimum(tl.maximum(c, -clip), clip)
    tl.store(C + units, c.to(C.dtype.element_ty), mask=mask)
    tl.store(H + units, (o * tanh(c)).to(H.dtype.element_ty), mask=mask)


@autotune(_configs(), key=["CELL"])
@triton.jit
def _lstm_cell_backward_kernel(DH, DC, G, C_PREV, DG, DC_PREV, M, CELL, clip,
                               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < CELL)
    units = rows[:, None] * CELL + cols[None, :]
    gate_at = rows[:, None] * 4 * CELL + cols[None, :]
    zi, zf, zg, zo = _gates(G, gate_at, mask, CELL)
    i, f, g, o = tl.sigmoid(zi), tl.sigmoid(zf), tanh(zg), tl.sigmoid(zo)
    prev = tl.load(C_PREV + units, mask=mask, other=0.0).to(tl.float32)
    raw = i * g + f * prev
    c = tl.minimum(tl.maximum(raw, -clip), clip)
    t = tanh(c)
    dh = tl.load(DH + units, mask=mask, other=0.0).to(tl.float32)
    dc = tl.load(DC + units, mask=mask, other=0.0).to(tl.float32) + dh * o * _tanh_grad(c, t)
    # As torch.clamp: the gradient passes where -clip <= raw <= clip (bounds included).
    dc = tl.where((raw >= -clip) & (raw <= clip), dc, 0.0)
    ty = DG.dtype.element_ty
    # 1 - sigmoid(z) as sigmoid(-z): no cancellation near saturation.
    tl.store(DG + gate_at, (dc * g * i * tl.sigmoid(-zi)).to(ty), mask=mask)
    tl.store(DG + gate_at + CELL, (dc * prev * f * tl.sigmoid(-zf)).to(ty), mask=mask)
    tl.store(DG + gate_at + 2 * CELL, (dc * i * _tanh_grad(zg, g)).to(ty), mask=mask)
    tl.store(DG + gate_at + 3 * CELL, (dh * t * o * tl.sigmoid(-zo)).to(ty), mask=mask)
    tl.store(DC_PREV + units, (dc * f).to(DC_PREV.dtype.element_ty), mask=mask)


def _grid(rows, cell):
    return lambda meta: (triton.cdiv(rows, ROWS_PER_TILE), triton.cdiv(cell, meta["BLOCK_N"]))


def lstm_cell_forward(gates, c_prev, cell_clip):
    g2, c2 = rows_of(gates), rows_of(c_prev)
    rows, cell = c2.shape
    # In c_prev's shape, not views of [rows, cell] results: FSDP2 cannot follow in-place
    # changes to a view a module returns.
    h, c = c_prev.new_empty(c_prev.shape), c_prev.new_empty(c_prev.shape)
    if c2.numel():
        _lstm_cell_kernel[_grid(rows, cell)](g2, c2, h, c, rows, cell, cell_clip,
                                             BLOCK_M=ROWS_PER_TILE)
    return h, c


def lstm_cell_backward(grad_h, grad_c, gates, c_prev, cell_clip):
    g2, c2 = rows_of(gates), rows_of(c_prev)
    dh, dc = rows_of(grad_h), rows_of(grad_c)
    rows, cell = c2.shape
    dgates, dc_prev = gates.new_empty(gates.shape), c_prev.new_empty(c_prev.shape)
    if c2.numel():
        _lstm_cell_backward_kernel[_grid(rows, cell)](dh, dc, g2, c2, dgates, dc_prev, rows, cell,
                                                      cell_clip, BLOCK_M=ROWS_PER_TILE)
    return dgates, dc_prev
