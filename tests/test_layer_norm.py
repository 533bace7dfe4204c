"""add_layer_norm against the reference, on every backend that has it: small cases, and
BERT-base and GPT-2-small shapes on a GPU."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import fusedlm
import fuzz
from fusedlm.ops import reference
from fuzz import Case
from fusedlm.ops._dropout import next_seed
from fusedlm.backends import cuda as cuda_backend
from helpers import (as_reference, assert_close, assert_relative_error, backend_device, backends_for,
                     first_taken, fresh, grads, keep_mask, needs_emulator, poison_memory,
                     skip_if_refused, slow_backend)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GRAD_NAMES = ("dx", "dresidual", "dweight", "dbias")


def _inputs(shape, dtype, device="cpu", residual=True, weight=True, bias=True, scale=1.0):
    hidden = shape[-1]
    x = fresh(shape, dtype, device, scale=scale)
    r = fresh(shape, dtype, device, scale=scale) if residual else None
    w = fresh((hidden,), dtype, device) if weight else None
    b = fresh((hidden,), dtype, device) if bias else None
    return x, r, w, b


def _grads(outputs, inputs, upstream):
    """Gradients of the inputs present (None for absent ones) for upstream gradients of
    (out, summed); a None upstream gradient leaves that output out of the loss."""
    present = [t for t in inputs if t is not None]
    used = [(o, g) for o, g in zip(outputs, upstream) if g is not None]
    # Without out in the loss, weight and bias get zeros.
    grads = iter(torch.autograd.grad([o for o, _ in used], present, [g for _, g in used],
                                     materialize_grads=True))
    return [None if t is None else next(grads) for t in inputs]


def _upstream(like, which):
    """Fresh upstream gradients for (out, summed): "both", "out" (post-LN) or "summed"."""
    return tuple(torch.randn_like(like) if which in ("both", name) else None
                 for name in ("out", "summed"))


def _compare(inputs, backend="cpu", *, eps=1e-5, which="both", out_scale=1.0, grad_scale=1.0,
             dropout_p=0.0, keep=None):
    """Runs the op and the float64 reference on the same inputs and compares outputs and
    gradients; under dropout `keep` is the mask the op's seed gives."""
    out, summed = fusedlm.ops.add_layer_norm(*inputs, eps, dropout_p=dropout_p, backend=backend)
    upstream = _upstream(out, which)
    got = _grads((out, summed), inputs, upstream)
    ref_inputs = as_reference(*inputs)
    e_out, e_summed = reference.add_layer_norm(*ref_inputs, eps, dropout_p=dropout_p,
                                               dropout_mask=keep)
    expected = _grads((e_out, e_summed), ref_inputs,
                      [None if g is None else g.double() for g in upstream])
    dtype = inputs[0].dtype
    assert out.dtype == summed.dtype == dtype
    assert out.shape == summed.shape == inputs[0].shape
    assert_close(out, e_out, scale=out_scale, name="out")
    assert_close(summed, e_summed, name="summed")
    for name, g, e in zip(GRAD_NAMES, got, expected):
        if e is not None:
            assert g.dtype == dtype and g.shape == e.shape, name
            # The parameter gradients sum over every row: allow for that many roundings.
            scale = grad_scale * (10 if name in ("dweight", "dbias") else 1)
            assert_close(g, e, dtype=dtype, scale=scale, name=name)
    return out, summed, got


# The reference backend too: automatic choice falls back to it where a kernel is slower.
@pytest.mark.parametrize("backend", backends_for("add_layer_norm") + ["reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("absent", ["", "residual", "weight", "bias", "weight+bias"])
@pytest.mark.parametrize("hidden", [128, 130])  # the cuda kernels' 16-byte vectors; one at a time
def test_add_layer_norm_matches_reference(backend, dtype, absent, hidden):
    shape = (2, 5, hidden) if slow_backend(backend) else (3, 37, hidden)
    inputs = _inputs(shape, dtype, backend_device(backend), residual="residual" not in absent,
                     weight="weight" not in absent, bias="bias" not in absent)
    _compare(inputs, backend)


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [8203, 8200, 16400])
def test_add_layer_norm_long_rows(backend, dtype, hidden):
    # Rows longer than the cuda kernels' 1024 threads hold in registers, whose remaining
    # elements are read back from memory: 8203 one element at a time (past 8192 in the
    # forward and the backward), 8200 in 16-byte vectors (past the backward's 8192), 16400
    # (past the forward's 16384).
    inputs = _inputs((2, hidden), dtype, backend_device(backend))
    _compare(inputs, backend)


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
def test_add_layer_norm_parameter_gradients_outlive_the_next_call(backend):
    # The CPU kernels' partial sums of dweight and dbias sit in per-thread scratch that the
    # next call reuses: a returned gradient must not be that scratch. The calls in between
    # use it at other widths and numbers of row blocks.
    device = backend_device(backend)
    first = _inputs((130, 96), torch.float32, device)
    _, _, (_, _, dweight, dbias) = _compare(first, backend)
    kept = dweight.clone(), dbias.clone()
    for shape in ((70, 32), (600, 640), (3, 96)):
        _compare(_inputs(shape, torch.float32, device), backend)
    assert torch.equal(dweight, kept[0]) and torch.equal(dbias, kept[1])


def _misaligned(t):
    """A contiguous copy of `t` that starts one element past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    copy = flat[1:].view(t.shape)
    with torch.no_grad():
        copy.copy_(t)
    return copy.requires_grad_(t.requires_grad)


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_misaligned_inputs(backend, dtype):
    # Rows of 64 elements, a whole number of 16-byte vectors, in tensors that start off a
    # 16-byte boundary: the cuda kernels take them one element at a time, forward and
    # backward (the weight's alignment counts in both).
    x, r, w, b = (_misaligned(t) for t in _inputs((3, 7, 64), dtype, backend_device(backend)))
    _compare((x, r, w, b), backend)


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("which", ["out", "summed"])
def test_add_layer_norm_one_output_used(backend, which):
    # Post-LN stacks use only out, pre-LN ones sometimes only summed (the last
    # block's norm output unused): the other output has no upstream gradient.
    inputs = _inputs((2, 5 if slow_backend(backend) else 19, 96), torch.float32,
                     backend_device(backend))
    _compare(inputs, backend, which=which)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("absent", ["", "residual", "weight+bias"])
def test_add_layer_norm_gradcheck(dropout_p, absent):
    inputs = _inputs((3, 2, 7), torch.float64, residual="residual" not in absent,
                     weight="weight" not in absent, bias="bias" not in absent)
    present = [t for t in inputs if t is not None]

    def fn(*tensors):
        it = iter(tensors)
        args = [None if t is None else next(it) for t in inputs]
        torch.manual_seed(99)  # every evaluation draws the same dropout seed
        return fusedlm.ops.add_layer_norm(*args, 1e-5, dropout_p=dropout_p, backend="cpu")

    assert torch.autograd.gradcheck(fn, tuple(present))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_layer_norm_every_instruction_set(cpu_isa, dtype):
    # Odd widths exercise the vector loops' remainders; 1000 > 32 lanes with a tail.
    for hidden in (1, 7, 33, 768, 1000):
        inputs = _inputs((5, hidden), dtype, scale=2.0)
        # A row of one element has no spread: the norm's gradient is rstd = eps^-1/2 (316)
        # times a difference of two equal terms, exactly 0, and the vector kernels' fused
        # multiply-adds leave the rounding of upstream * weight in it, up to
        # 316 * 2^-23 * |g w| = 3.8e-5 |g w| (3.0e-5 |g w| seen in 3000 draws; float32's
        # tolerance is 2e-5, at |g w| up to about 15 here 6.4e-4).
        grad_scale = 32.0 if hidden == 1 else 1.0
        try:
            _compare(inputs, grad_scale=grad_scale)
        except AssertionError as e:
            raise AssertionError(f"{cpu_isa}, hidden {hidden}: {e}") from e


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_layer_norm_summed_rounds_like_torch(cpu_isa, dtype):
    # summed is x + residual in float32 rounded once to dtype: bit for bit what torch
    # gives, for every bit pattern of x (subnormals, infinities and NaNs included).
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(dtype).view(256, 256)
    exponents = torch.randint(-30, 16, (256, 256)).double()
    r = (torch.randn(256, 256, dtype=torch.float64) * 2.0 ** exponents).to(dtype)
    for residual, expected in ((None, x), (r, (x.float() + r.float()).to(dtype))):
        summed = fusedlm.ops.add_layer_norm(x, residual, None, None, backend="cpu")[1]
        nan = expected.isnan()
        assert torch.equal(summed.isnan(), nan), cpu_isa
        assert torch.equal(summed[~nan].view(torch.int16), expected[~nan].view(torch.int16)), cpu_isa


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 150), cols=st.integers(1, 300), scale=st.floats(0.01, 100.0),
       shift=st.floats(-50.0, 50.0), residual=st.booleans(), weight=st.booleans(),
       bias=st.booleans(), eps=st.sampled_from([1e-5, 1e-12, 0.1]))
def test_add_layer_norm_random_shapes(rows, cols, scale, shift, residual, weight, bias, eps):
    x, r, w, b = _inputs((rows, cols), torch.float32, residual=residual, weight=weight, bias=bias,
                         scale=scale)
    # A row mean far from zero relative to its spread tests the variance's stability.
    with torch.no_grad():
        x += shift * scale
    # In float32 the rounding of summed is amplified by rstd: a row's condition
    # number is max|summed| * rstd, ~3 for centred rows, ~50 at shift 50, and up
    # to 1e6 for a single element with eps = 1e-12 (where torch's own float32
    # LayerNorm is as far from the float64 result).
    # The input gradients are rstd times a projection of the upstream gradient, so their
    # rounding grows with rstd too; with two columns that projection is exactly zero, and
    # the rounding is all there is.
    tolerance = grad_tolerance = 10.0
    if rows:
        summed = x.detach().double() + (0 if r is None else r.detach().double())
        rstd = (summed.var(-1, unbiased=False, keepdim=True) + eps).rsqrt()
        tolerance = max(tolerance, (summed.abs() * rstd).max().item() / 5)
        grad_tolerance = tolerance * max(1.0, rstd.max().item() / 10)
    _compare((x, r, w, b), eps=eps, out_scale=tolerance, grad_scale=grad_tolerance)


def test_add_layer_norm_compiles_without_graph_breaks():
    inputs = _inputs((4, 9, 64), torch.float32)

    def block(x, r, w, b):
        out, summed = fusedlm.ops.add_layer_norm(x, r, w, b, backend="cpu")
        return out * 2 + summed

    compiled = torch.compile(block, fullgraph=True)
    got = compiled(*inputs)
    grad = torch.randn_like(got)
    got_grads = torch.autograd.grad(got, inputs, grad)
    ref_inputs = as_reference(*inputs)
    e_out, e_summed = reference.add_layer_norm(*ref_inputs)
    expected = e_out * 2 + e_summed
    e_grads = torch.autograd.grad(expected, ref_inputs, grad.double())
    assert_close(got, expected)
    for name, g, e in zip(GRAD_NAMES, got_grads, e_grads):
        assert_close(g, e, scale=10, name=name)


def test_add_layer_norm_compiles_post_ln():
    # Only out is used: the compiled backward gets no (or a zero) gradient for summed.
    inputs = _inputs((4, 9, 64), torch.float32)
    compiled = torch.compile(lambda *a: fusedlm.ops.add_layer_norm(*a, backend="cpu")[0],
                             fullgraph=True)
    got = compiled(*inputs)
    got.sum().backward()
    ref_inputs = as_reference(*inputs)
    expected = reference.add_layer_norm(*ref_inputs)[0]
    expected.sum().backward()
    assert_close(got, expected)
    for name, t, r in zip(GRAD_NAMES, inputs, ref_inputs):
        assert_close(t.grad, r.grad, scale=10, name=name)


# --- dropout -------------------------------------------------------------------------------------

def _dropout_dtype(backend):
    """float64 where the backend takes it (exact comparisons), else float32."""
    return first_taken(backend, "add_layer_norm", (torch.float64, torch.float32),
                       lambda dtype: (_inputs((2, 8), dtype, backend_device(backend)), {}))


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("absent", ["", "residual"])
@pytest.mark.parametrize("hidden", [48, 45])  # the cuda kernels' 16-byte vectors; one at a time
def test_add_layer_norm_dropout_replays_its_mask(backend, absent, hidden):
    inputs = _inputs((2, 13, hidden), _dropout_dtype(backend), backend_device(backend),
                     residual=absent != "residual")
    p = 0.3
    torch.manual_seed(1234)
    seed = next_seed(p)
    keep = keep_mask(backend, seed, inputs[0].shape, p)  # element order: x row-major
    torch.manual_seed(1234)
    out, summed, _ = _compare(inputs, backend, dropout_p=p, keep=keep)
    assert not keep.all() and keep.any()
    # The same seed repeats the run; another seed does not.
    torch.manual_seed(1234)
    again = fusedlm.ops.add_layer_norm(*inputs, dropout_p=p, backend=backend)
    assert torch.equal(again[0], out) and torch.equal(again[1], summed)
    other = fusedlm.ops.add_layer_norm(*inputs, dropout_p=p, backend=backend)
    assert not torch.equal(other[1], summed)


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_add_layer_norm_dropout_keeps_and_scales(backend, p):
    # Without a residual summed is the dropped x: zeros, or exactly x / (1 - p),
    # and x's gradient from summed is the upstream gradient through the same mask.
    x = fresh((32 if slow_backend(backend) else 512, 64), _dropout_dtype(backend),
              backend_device(backend))
    out, summed = fusedlm.ops.add_layer_norm(x, None, None, None, dropout_p=p, backend=backend)
    grad = torch.randn_like(summed)
    (dx,) = torch.autograd.grad(summed, x, grad)
    kept = summed != 0
    n = kept.numel()
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
    torch.testing.assert_close(summed[kept], x[kept] / (1 - p))
    torch.testing.assert_close(dx[kept], grad[kept] / (1 - p))
    assert torch.equal(dx[~kept], torch.zeros_like(dx[~kept]))


# --- edge cases ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
def test_add_layer_norm_one_row_and_empty_batch(backend):
    device = backend_device(backend)
    _compare(_inputs((1, 33), torch.float32, device), backend)
    for shape in ((0, 16), (2, 0, 16)):
        x, r, w, b = _inputs(shape, torch.float32, device)
        out, summed = fusedlm.ops.add_layer_norm(x, r, w, b, backend=backend)
        assert out.shape == summed.shape == shape
        dw, db = torch.autograd.grad((out * 1).sum() + summed.sum(), (w, b))
        assert torch.equal(dw, torch.zeros_like(dw)) and torch.equal(db, torch.zeros_like(db))


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
def test_add_layer_norm_non_contiguous_inputs(backend):
    device = backend_device(backend)
    x = fresh((40, 24), torch.float32, device).t()
    r = fresh((24, 80), torch.float32, device)[:, ::2]
    w = fresh((80,), torch.float32, device)[::2]
    b = fresh((40,), torch.float32, device)
    assert not (x.is_contiguous() or r.is_contiguous() or w.is_contiguous())
    _compare((x, r, w, b), backend)


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_add_layer_norm_outputs_are_not_views(backend, dropout_p):
    # FSDP2 warns about, and cannot follow in-place changes to, a view a module returns.
    x, r, w, b = _inputs((2, 3, 16), torch.float32, backend_device(backend))
    seed = next_seed(dropout_p)
    with torch.no_grad():
        outputs = torch.ops.fusedlm.add_layer_norm(x, r, w, b, 1e-5, dropout_p, seed, backend)
        out, summed, mean, rstd = outputs
        grads = torch.ops.fusedlm.add_layer_norm_backward(
            torch.randn_like(out), torch.randn_like(summed), summed, mean, rstd, w, True, True,
            dropout_p, seed, backend)
    assert [t._base is None for t in (*outputs, *grads)] == [True] * 8


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_add_layer_norm_large_values(backend, dtype):
    # Sums up to ~4e4 (below float16's 65504): their squares overflow float16.
    # Statistics in float32 keep everything finite.
    device = backend_device(backend)
    x = fresh((6, 200), dtype, device, scale=5e3)
    r = (fresh((6, 200), torch.float32, device, requires_grad=False) * 1e3 + 2e4).to(dtype)
    r.requires_grad_()
    w = fresh((200,), dtype, device)
    b = fresh((200,), dtype, device)
    out, summed, grads = _compare((x, r, w, b), backend, out_scale=2, grad_scale=2)
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_add_layer_norm_constant_rows(backend, dtype):
    # Variance 0: out is the bias, and the gradient is rstd = 1 / sqrt(eps) times the centred g.
    device = backend_device(backend)
    rows = torch.randn(5, 1, dtype=torch.float64)
    x = (rows * 3).expand(5, 768).to(dtype=dtype, device=device).requires_grad_()
    r = torch.randn(5, 1, dtype=torch.float64).expand(5, 768).to(dtype=dtype, device=device)
    r.requires_grad_()
    w = fresh((768,), dtype, device)
    b = fresh((768,), dtype, device)
    skip_if_refused(backend, "add_layer_norm", x, r, w, b)
    out, summed, _ = _compare((x, r, w, b), backend, eps=1e-5)
    assert_close(out, b.detach().double().expand(5, 768), name="out = bias")


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_add_layer_norm_is_deterministic(backend, dropout_p):
    # Several reduction blocks. Bit-identical across runs and thread counts.
    rows = 20 if slow_backend(backend) else 300
    device = backend_device(backend)
    inputs = _inputs((rows, 96), torch.float32, device)
    upstream = (torch.randn(rows, 96, device=device), torch.randn(rows, 96, device=device))

    def run(threads):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            torch.manual_seed(5)
            outs = fusedlm.ops.add_layer_norm(*inputs, dropout_p=dropout_p, backend=backend)
            return [*outs, *_grads(outs, inputs, upstream)]
        finally:
            torch.set_num_threads(before)

    first = run(2)
    for again in (run(2), run(1)):
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", [b for b in backends_for("add_layer_norm") if b.id == "triton"])
def test_add_layer_norm_hidden_too_large(backend):
    # The triton kernel holds a row in registers.
    x = torch.randn(1, 32769, device=backend_device(backend))
    with pytest.raises(RuntimeError, match="last dimension up to 32768, not 32769"):
        fusedlm.ops.add_layer_norm(x, None, None, None, backend=backend)


def test_add_layer_norm_rejects_bad_input():
    x, r, w, b = _inputs((4, 8), torch.float32)
    op = fusedlm.ops.add_layer_norm
    with pytest.raises(ValueError, match="residual"):
        op(x, torch.randn(4, 7), w, b)
    with pytest.raises(TypeError, match="residual"):
        op(x, r.half(), w, b)
    with pytest.raises(TypeError, match="residual"):
        op(x, [1.0] * 8, w, b)
    with pytest.raises(ValueError, match="weight"):
        op(x, r, torch.randn(7), b)
    with pytest.raises(ValueError, match="weight"):
        op(x, r, torch.randn(1, 8), b)
    with pytest.raises(TypeError, match="bias"):
        op(x, r, w, torch.randn(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        op(x, r, w, torch.randn(8, device="meta"))
    with pytest.raises(TypeError, match="x"):
        op(torch.ones(4, 8, dtype=torch.int64), None, None, None)
    with pytest.raises(ValueError, match="x"):
        op(torch.tensor(1.0), None, None, None)
    with pytest.raises(ValueError, match="x"):
        op(torch.randn(4, 0), None, None, None)
    with pytest.raises(ValueError, match="eps"):
        op(x, r, w, b, -1e-5)
    with pytest.raises(ValueError, match="eps"):
        op(x, r, w, b, float("nan"))
    with pytest.raises(ValueError, match="dropout_p"):
        op(x, r, w, b, dropout_p=1.0)


# --- real shapes (a GPU) -------------------------------------------------------------------------

REAL_SHAPES = {"bert-base": (32, 128, 768), "gpt2-small": (8, 1024, 768), "hidden-1024": (64, 1024),
               # Rows longer than the cuda kernels hold in registers (16384 elements
               # forward, 8192 backward), and an odd width (one element per load).
               "hidden-20000": (48, 20000), "hidden-1001": (300, 1001)}


@pytest.mark.parametrize("backend", backends_for("add_layer_norm", shapes="real"))
@pytest.mark.parametrize("shape", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_add_layer_norm_real_shapes(backend, shape, dtype, dropout_p):
    hidden = shape[-1]
    inputs = [fresh(shape, dtype, "cuda"), fresh(shape, dtype, "cuda"), fresh((hidden,), dtype, "cuda"),
              fresh((hidden,), dtype, "cuda")]
    skip_if_refused(backend, "add_layer_norm", *inputs, dropout_p=dropout_p)
    upstream = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2)]
    torch.manual_seed(7)
    seed = next_seed(dropout_p)
    keep = keep_mask(backend, seed, shape, dropout_p) if dropout_p else None
    poison_memory()
    torch.manual_seed(7)
    outs = fusedlm.ops.add_layer_norm(*inputs, dropout_p=dropout_p, backend=backend)
    got = grads(outs, inputs, upstream)

    ref_inputs = as_reference(*inputs, dtype=torch.float32)
    expected = reference.add_layer_norm(*ref_inputs, dropout_p=dropout_p, dropout_mask=keep)
    expected_grads = grads(expected, ref_inputs, [g.float() for g in upstream])
    for name, a, e in zip(("out", "summed"), outs, expected):
        assert_relative_error(a, e, dtype, name)
    for name, a, e in zip(GRAD_NAMES, got, expected_grads):
        assert_relative_error(a, e, dtype, name)


@pytest.mark.parametrize("backend", backends_for("add_layer_norm", shapes="real"))
def test_add_layer_norm_parameter_gradients_repeat_bit_for_bit(backend):
    shape = (32, 128, 768)
    inputs = [fresh(shape, torch.bfloat16, "cuda"), fresh(shape, torch.bfloat16, "cuda"),
              fresh((768,), torch.bfloat16, "cuda"), fresh((768,), torch.bfloat16, "cuda")]
    upstream = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    runs = [grads(fusedlm.ops.add_layer_norm(*inputs, backend=backend), inputs, upstream)
            for _ in range(3)]
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert torch.equal(a, b)


# --- traffic (the CUDA emulator's counts) ---------------------------------------------------------

def _bytes(t):
    return t.numel() * t.element_size()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden", [768, 1024, 4096, 1001])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
@pytest.mark.parametrize("marks", [pytest.param(None, marks=needs_emulator, id="emulated")])
def test_add_layer_norm_cuda_moves_each_row_once(dtype, hidden, dropout_p, marks):
    # The rows stay in registers between the passes: each row tensor is read or written
    # exactly once, none is read back, and the parameters are read at most once per row
    # (from the cache on a GPU).
    rows = 64
    x, r, w, b = _inputs((rows, hidden), dtype)
    row, param = _bytes(x), _bytes(w)
    with cuda_backend.count_launches() as forward:
        out, summed = fusedlm.ops.add_layer_norm(x, r, w, b, dropout_p=dropout_p, backend="cuda")
    [launch] = forward
    assert launch.traffic(x) == launch.traffic(r) == (row, 0)
    assert launch.traffic(out) == launch.traffic(summed) == (0, row)
    assert launch.traffic(w) == launch.traffic(b) == (rows * param, 0)
    assert sum(launch.written.values()) == 2 * row + 2 * rows * 4  # and mean and rstd, float32

    upstream = torch.randn_like(out), torch.randn_like(summed)
    with cuda_backend.count_launches() as backward:
        dx, dr, dw, db = torch.autograd.grad((out, summed), (x, r, w, b), upstream)
    [launch] = [c for c in backward if "add_layer_norm_backward" in c.kernel]
    for t in (*upstream, summed):
        assert launch.traffic(t) == (row, 0)
    assert launch.traffic(w)[0] <= rows * param
    # dsummed, dx apart under dropout, and a row of dweight and of dbias shares per block.
    partials = 2 * launch.grid[0] * hidden * 4
    assert sum(launch.written.values()) == (2 if dropout_p else 1) * row + partials
    second_stage = [c for c in backward if "sum_partials" in c.kernel]
    assert len(second_stage) == 2
    assert sum(sum(c.read.values()) for c in second_stage) == partials
    assert second_stage[0].traffic(dw) == (0, param)


# --- fuzz (tests/fuzz.py) --------------------------------------------------------------------------

def draw_add_layer_norm(d):
    dtype = d.dtype()
    # A row of one element, or a row expanded from one value, has no spread: its normalised
    # value is 0 / 0 regularised by eps, and its gradient zero by symmetry.
    hidden = d.size(2, 1100, (2, 3, 7, 8, 31, 33, 64, 100, 257, 768, 1025))
    rows = tuple(d.size(0, 5, (1,)) for _ in range(d.size(0, 2)))
    shape = (*rows, hidden)
    # A large mean next to a small spread: what one-pass variances lose.
    offset = d.choice([0.0, 0.0, 0.0, 1e2 if dtype in (torch.float16, torch.bfloat16) else 1e3])
    rows_only = range(len(rows))
    d.tensor("x", shape, dtype, scale=d.magnitude(), offset=offset, expand_dims=rows_only)
    if d.chance(0.7):
        d.tensor("residual", shape, dtype, expand_dims=rows_only)
    if d.chance(0.8):
        d.tensor("weight", (hidden,), dtype, offset=1.0)
    if d.chance(0.7):
        d.tensor("bias", (hidden,), dtype)
    eps = d.choice([1e-5, 1e-12, 0.1])

    def arguments(t):
        return (t["x"], t.get("residual"), t.get("weight"), t.get("bias"), eps), {}

    def reference_(t):
        summed = t["x"] if t.get("residual") is None else t["x"] + t["residual"]
        out = torch.nn.functional.layer_norm(summed, (hidden,), t.get("weight"), t.get("bias"), eps)
        return out, summed

    bad = [fuzz.with_extra_dim("weight")] if "weight" in d.leaves else []
    if "residual" in d.leaves:
        bad.append(fuzz.grown("residual", len(shape) - 1))
    if "bias" in d.leaves:
        bad.append(fuzz.grown("bias", 0))
    return Case("add_layer_norm", f"add_layer_norm {dtype} eps={eps} offset={offset}", arguments,
                reference_, floors=(1.0, fuzz.POINTWISE), dtype=dtype, bad=tuple(bad))


test_fuzz_add_layer_norm, test_fuzz_add_layer_norm_bad_inputs = fuzz.tests(draw_add_layer_norm, backends_for("add_layer_norm"))
