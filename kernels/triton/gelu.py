"""bias_gelu and gelu_ffn in Triton.

bias_gelu: an elementwise kernel over [rows, cols] tiles (one read, one write per
element); its backward also sums each tile's column of dx into a [row tiles, cols]
float32 buffer, summed over tiles afterwards for dbias (no atomics).

gelu_ffn: the first linear is a Triton matrix product (fp32 accumulators, grouped tile
order for L2 reuse) whose epilogue writes both the pre-activation x @ w1^T (saved for
backward) and dropout(gelu(pre + b1)); the second linear is torch's. In the backward,
torch's products give dw2 and dact = grad @ w2 is a Triton product whose epilogue
multiplies by dropout's mask and gelu'(pre + b1) and sums the tile's columns for db1,
so the activation's gradient is never stored. The activation itself is recomputed from
pre by the elementwise kernel instead of being kept from the forward.
"""
import torch
import triton
import triton.language as tl

from ._common import (autotune, dot_precision, gelu, gelu_grad, keep, rows_of, seed_of,
                      upcast_products)

# Rows per tile of the elementwise kernels, and so per partial sum of dbias.
ROWS_PER_TILE = 32
# Rows per tile of the products: every configuration shares it, since the db1 buffer
# has one row per row tile.
MATMUL_BLOCK_M = 128


def _approx_tanh(approximate: str) -> bool:
    """GELU's tanh form ("tanh") rather than erf ("none"; the op refuses other names)."""
    return approximate == "tanh"


# --- elementwise ---------------------------------------------------------------------------------

def _elementwise_configs():
    return [triton.Config({"BLOCK_N": n}, num_warps=w) for n, w in ((128, 4), (256, 8), (64, 4))]


@triton.jit
def _pre_activation(X, BIAS, M, N, tile, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """(columns, offsets, mask, x + bias in float32) of this program's tile of the [M, N]
    input: row tile ``tile``, column tile program_id(1)."""
    rows = tile.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    offsets = rows[:, None] * N + cols[None, :]
    z = tl.load(X + offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    return cols, offsets, mask, z


@autotune(_elementwise_configs(), key=["N"])
@triton.jit(do_not_specialize=["seed"])
def _bias_gelu_kernel(X, BIAS, OUT, M, N, p, seed, HAS_BIAS: tl.constexpr,
                      APPROX_TANH: tl.constexpr, DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    _, offsets, mask, z = _pre_activation(X, BIAS, M, N, tl.program_id(0), HAS_BIAS, BLOCK_M,
                                          BLOCK_N)
    out = gelu(z, APPROX_TANH)
    if DROPOUT:
        out = tl.where(keep(seed, offsets, p), out / (1.0 - p), 0.0)
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)


@autotune(_elementwise_configs(), key=["N"])
@triton.jit
def _bias_gelu_backward_kernel(DY, X, BIAS, DX, DB_PART, M, N, HAS_BIAS: tl.constexpr,
                               APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr,
                               BLOCK_N: tl.constexpr):
    tile = tl.program_id(0)
    cols, offsets, mask, z = _pre_activation(X, BIAS, M, N, tile, HAS_BIAS, BLOCK_M, BLOCK_N)
    dx = tl.load(DY + offsets, mask=mask, other=0.0).to(tl.float32) * gelu_grad(z, APPROX_TANH)
    tl.store(DX + offsets, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + tile * N + cols, tl.sum(dx, axis=0), mask=cols < N)


def _gelu_rows(pre, bias, shape, approx_tanh, p=0.0, seed=0):
    """dropout(gelu(pre + bias)) of a contiguous [rows, cols] matrix, as a new tensor of
    ``shape`` (the kernel fills its memory as [rows, cols])."""
    rows, cols = pre.shape
    out = pre.new_empty(shape)
    if pre.numel():
        grid = lambda meta: (triton.cdiv(rows, ROWS_PER_TILE), triton.cdiv(cols, meta["BLOCK_N"]))
        _bias_gelu_kernel[grid](pre, bias, out, rows, cols, p, seed, HAS_BIAS=bias is not None,
                                APPROX_TANH=approx_tanh, DROPOUT=p > 0, BLOCK_M=ROWS_PER_TILE)
    return out


def _sum_partials(partial, like):
    return partial.sum(0).to(like.dtype)


def bias_gelu_forward(x, bias, approximate):
    b = bias.contiguous() if bias is not None else None
    # In x's shape, not a view of a [rows, cols] result: FSDP2 cannot follow in-place
    # changes to a view a module returns.
    return _gelu_rows(rows_of(x), b, x.shape, _approx_tanh(approximate))


def bias_gelu_backward(grad, x, bias, approximate):
    approx_tanh = _approx_tanh(approximate)
    x2, dy = rows_of(x), rows_of(grad)
    rows, cols = x2.shape
    dx = x.new_empty(x.shape)
    b = bias.contiguous() if bias is not None else None
    tiles = triton.cdiv(rows, ROWS_PER_TILE)
    partial = torch.empty((tiles, cols), dtype=torch.float32, device=x.device) if b is not None else None
    if x2.numel():
        grid = lambda meta: (tiles, triton.cdiv(cols, meta["BLOCK_N"]))
        _bias_gelu_backward_kernel[grid](dy, x2, b, dx, partial, rows, cols, HAS_BIAS=b is not None,
                                         APPROX_TANH=approx_tanh, BLOCK_M=ROWS_PER_TILE)
    return dx, _sum_partials(partial, b) if b is not None else None


# --- matrix product with a GELU epilogue ---------------------------------------------------------

def _matmul_configs():
    # Valid on sm_80 and sm_90 alike (at most 4 stages of 128x128x64 bf16 tiles: 128 KiB
    # of shared memory, under the A100's 164 KiB). The 8-warp 128 x 64 tiles are the ones
    # whose GELU epilogues fit in registers at every dtype (the 4-warp ones spill on sm_90).
    shapes = ((128, 64, 4, 8), (256, 64, 3, 8), (128, 32, 4, 4), (64, 64, 4, 4), (64, 32, 5, 4),
              (256, 32, 3, 8), (64, 64, 4, 8), (64, 32, 5, 8))
    return [triton.Config({"BLOCK_N": n, "BLOCK_K": k, "GROUP_M": 8}, num_stages=s, num_warps=w)
            for n, k, s, w in shapes]


@autotune(_matmul_configs(), key=["M", "N", "K", "BACKWARD"])
@triton.jit(do_not_specialize=["seed"])
def _matmul_gelu_kernel(A, B, PRE, OUT, BIAS, DB_PART, M, N, K, stride_am, stride_ak,
                        stride_bk, stride_bn, p, seed, BACKWARD: tl.constexpr,
                        HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
                        DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
                        UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """acc = A[M, K] @ B[K, N], then
    forward:  PRE = acc; OUT = dropout(gelu(PRE + BIAS))
    backward: OUT = dropout_mask(acc) * gelu'(PRE + BIAS); DB_PART[tile_m] = column sums of OUT
    """
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    # Groups of GROUP_M row tiles sweep the columns together: their B tiles stay in L2.
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    tile_n = (pid % (GROUP_M * tiles_n)) // group_m

    rm = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + rm[:, None] * stride_am + rk[None, :] * stride_ak
    b_ptrs = B + rk[:, None] * stride_bk + rn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] < k_left) & (rn[None, :] < N), other=0.0)
        if UPCAST:
            a, b = a.to(tl.float32), b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = (rm[:, None] < M) & (rn[None, :] < N)
    offsets = rm[:, None] * N + rn[None, :]
    if BACKWARD:
        z = tl.load(PRE + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        pre = acc.to(PRE.dtype.element_ty)
        tl.store(PRE + offsets, pre, mask=mask)
        # The activation of pre as stored: what the backward recomputes from it.
        z = pre.to(tl.float32)
    if HAS_BIAS:
        z += tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:
        out = acc * gelu_grad(z, APPROX_TANH)
    else:
        out = gelu(z, APPROX_TANH)
    if DROPOUT:
        out = tl.where(keep(seed, offsets, p), out / (1.0 - p), 0.0)
    tl.store(OUT + offsets, out.to(OUT.dtype.element_ty), mask=mask)
    if BACKWARD and HAS_BIAS:
        out = tl.where(mask, out, 0.0)
        tl.store(DB_PART + tile_m * N + rn, tl.sum(out, axis=0), mask=rn < N)


def _matmul_gelu(a, b, pre, out, bias, db_part, approx_tanh, p, seed, backward):
    """a [M, K] @ b [K, N] (any strides) with the GELU epilogue into pre and out [M, N]."""
    (m, k), n = a.shape, b.shape[1]
    if m == 0 or n == 0:
        return
    grid = lambda meta: (triton.cdiv(m, MATMUL_BLOCK_M) * triton.cdiv(n, meta["BLOCK_N"]),)
    _matmul_gelu_kernel[grid](
        a, b, pre, out, bias, db_part, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        p, seed, BACKWARD=backward, HAS_BIAS=bias is not None, APPROX_TANH=approx_tanh,
        DROPOUT=p > 0, PRECISION=dot_precision(a.dtype), UPCAST=upcast_products(a.dtype),
        BLOCK_M=MATMUL_BLOCK_M)


def gelu_ffn_forward(x, w1, b1, w2, b2, approximate, dropout_p, seed):
    approx_tanh = _approx_tanh(approximate)
    x2 = rows_of(x)
    rows, d_ff = x2.shape[0], w1.shape[0]
    pre = x2.new_empty((rows, d_ff))
    act = torch.empty_like(pre)
    b1 = b1.contiguous() if b1 is not None else None
    _matmul_gelu(x2, w1.t(), pre, act, b1, None, approx_tanh, dropout_p, seed_of(seed, dropout_p),
                 backward=False)
    # As in bias_gelu_forward, y is made in its final shape: the product writes into it.
    y = x2.new_empty((*x.shape[:-1], w2.shape[0]))
    if b2 is not None:
        torch.addmm(b2, act, w2.t(), out=y.view(rows, w2.shape[0]))
    else:
        torch.mm(act, w2.t(), out=y.view(rows, w2.shape[0]))
    return y, pre


def gelu_ffn_backward(grad, x, pre, w1, b1, w2, b2, approximate, dropout_p, seed):
    approx_tanh = _approx_tanh(approximate)
    s = seed_of(seed, dropout_p)
    x2, g2 = rows_of(x), rows_of(grad)
    rows, d_ff = pre.shape
    b1 = b1.contiguous() if b1 is not None else None
    act = _gelu_rows(pre, b1, pre.shape, approx_tanh, dropout_p, s)
    dw2 = g2.t() @ act
    db2 = g2.sum(0, dtype=torch.float32).to(b2.dtype) if b2 is not None else None
    dpre = torch.empty_like(pre)
    tiles = triton.cdiv(rows, MATMUL_BLOCK_M)
    db_part = torch.empty((tiles, d_ff), dtype=torch.float32, device=pre.device) if b1 is not None else None
    _matmul_gelu(g2, w2, pre, dpre, b1, db_part, approx_tanh, dropout_p, s, backward=True)
    dx = x.new_empty(x.shape)
    torch.mm(dpre, w1, out=dx.view(x2.shape))
    dw1 = dpre.t() @ x2
    db1 = _sum_partials(db_part, b1) if b1 is not None else None
    return dx, dw1, db1, dw2, db2
