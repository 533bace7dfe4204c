"""bias_gelu and gelu_ffn against the reference, on every backend that has them: small
cases, and BERT-base and GPT-2-small shapes on a GPU."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fusedlm
import fuzz
from fusedlm.ops import reference
from fuzz import Case
from fusedlm.ops._dropout import next_seed
from fusedlm.backends import cuda as cuda_backend
from helpers import (MAX_RELATIVE_ERROR, as_reference, assert_close, assert_relative_error,
                     backend_device, backends_for, first_taken, fresh, grads, keep_mask,
                     leaves_float_mode_as_found, needs_emulator, poison_memory, skip_if_refused,
                     slow_backend, subnormals_survive)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# The reference backend too: automatic choice falls back to it where a kernel is slower.
@pytest.mark.parametrize("backend", backends_for("bias_gelu") + ["reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("cols", [128, 130])  # the cuda kernels' 16-byte vectors; one at a time
def test_bias_gelu_matches_reference(backend, dtype, approximate, with_bias, cols):
    device = backend_device(backend)
    x = fresh((3, 37, cols), dtype, device, scale=3.0)
    bias = fresh((cols,), dtype, device) if with_bias else None
    out = fusedlm.ops.bias_gelu(x, bias, approximate, backend=backend)
    grad = torch.randn_like(out)
    out.backward(grad)

    x64, b64 = as_reference(x, bias)
    expected = reference.bias_gelu(x64, b64, approximate)
    expected.backward(grad.double())
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, expected, name="out")
    assert_close(x.grad, x64.grad, name="dx")
    if with_bias:
        # The bias gradient sums 111 rows: allow for the rounding of that many terms.
        assert_close(bias.grad, b64.grad, scale=10, name="dbias")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_gradcheck(approximate):
    x = fresh((4, 9), torch.float64, "cpu")
    bias = fresh((9,), torch.float64, "cpu")
    assert torch.autograd.gradcheck(lambda x, b: fusedlm.ops.bias_gelu(x, b, approximate, backend="cpu"), (x, bias))


def test_bias_gelu_every_instruction_set(cpu_isa):
    # Odd widths exercise the vector loops' remainders.
    for cols in (1, 7, 33, 1000):
        x = fresh((5, cols), torch.float32, "cpu", scale=4.0)
        bias = fresh((cols,), torch.float32, "cpu")
        for approximate in ("none", "tanh"):
            out = fusedlm.ops.bias_gelu(x, bias, approximate, backend="cpu")
            (dx, db) = torch.autograd.grad(out, (x, bias), torch.ones_like(out))
            x64, b64 = as_reference(x, bias)
            expected = reference.bias_gelu(x64, b64, approximate)
            (ex, eb) = torch.autograd.grad(expected, (x64, b64), torch.ones_like(expected))
            assert_close(out, expected, name=f"{cpu_isa} out")
            assert_close(dx, ex, name=f"{cpu_isa} dx")
            assert_close(db, eb, name=f"{cpu_isa} dbias")


def test_bias_gelu_negative_tail_keeps_its_digits(cpu_isa):
    # The cpu kernels compute Phi's lower tail relative to itself, so GELU and its slope far
    # on the negative side are accurate to a few parts per million, not merely tiny (torch's
    # float32 GELU is 0 there), down to where they leave float's normal range.
    z = torch.linspace(-13.1, -0.01, 4001, dtype=torch.float32).requires_grad_()
    out = fusedlm.ops.bias_gelu(z, None, "none", backend="cpu")
    (slope,) = torch.autograd.grad(out, z, torch.ones_like(out))
    z64 = z.detach().double()
    cdf = 0.5 * torch.erfc(-z64 / math.sqrt(2))  # not 1 + erf, which cancels here
    expected, expected_slope = z64 * cdf, cdf + z64 * torch.exp(-z64 ** 2 / 2) / math.sqrt(2 * math.pi)
    far = z64 < -1.5  # the slope crosses 0 at z = -0.75, where only its absolute error means much
    for name, got, want, where in (("value", out, expected, z64 < 0), ("slope", slope, expected_slope, far)):
        relative = torch.where(where, (got.double() - want) / want, 0.0).abs()
        assert relative.max() < 1e-5, f"{cpu_isa} {name}: {relative.max():.3g} at z = {z[relative.argmax()]:.4f}"


def test_bias_gelu_extremes_and_nan(cpu_isa):
    # Past |z| = 13.25 the cpu kernels cap |z| (the normal density is 0 there in float):
    # huge and infinite inputs give GELU's limits, z or 0 with slope 1 or 0, not NaN from
    # inf * 0; a NaN stays NaN.
    inf, nan = math.inf, math.nan
    z = torch.tensor([-inf, -1e30, -20.0, -13.3, -13.2, 13.2, 13.3, 20.0, 1e30, inf, nan],
                     requires_grad=True)
    out = fusedlm.ops.bias_gelu(z, None, "none", backend="cpu")
    (slope,) = torch.autograd.grad(out, z, torch.ones_like(out))
    z64 = z.detach().double()
    cdf = 0.5 * torch.erfc(-z64 / math.sqrt(2))
    density = torch.exp(-z64 ** 2 / 2) / math.sqrt(2 * math.pi)
    limits = torch.isinf(z64)
    expected = torch.where(limits, torch.where(z64 > 0, z64, 0.0), z64 * cdf)
    expected_slope = torch.where(limits, (z64 > 0).double(), cdf + torch.nan_to_num(z64 * density))
    # Float's subnormals (|GELU| near 1e-38 at z = -13.2) carry few digits: absolute there.
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-37, equal_nan=True)
    torch.testing.assert_close(slope.double(), expected_slope, rtol=1e-6, atol=1e-37, equal_nan=True)


def test_bias_gelu_flushes_subnormal_results_and_restores_the_thread(cpu_isa):
    # Where GELU and its slope fall below float's normal range (z = -13.2) the cpu kernels
    # give 0, not a subnormal, which costs x86 a microcode assist per vector; just inside it
    # (z = -13.1) they keep the value. They leave the thread's arithmetic as they found it.
    assert torch.set_flush_denormal(True), "this processor has no flush-to-zero mode"
    try:
        assert not subnormals_survive()  # the check sees a flushing thread
    finally:
        torch.set_flush_denormal(False)
    z = torch.tensor([-13.2, -13.1, -1.0], requires_grad=True)
    with leaves_float_mode_as_found(cpu_isa):
        out = fusedlm.ops.bias_gelu(z, None, "none", backend="cpu")
        (slope,) = torch.autograd.grad(out, z, torch.ones_like(out))
    assert out[0] == 0 and slope[0] == 0, (cpu_isa, out, slope)
    tiny = torch.finfo(torch.float32).tiny
    assert out[1].abs() >= tiny and slope[1].abs() >= tiny, (cpu_isa, out, slope)


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(0, 70), cols=st.integers(1, 300), scale=st.floats(0.1, 20.0),
       approximate=st.sampled_from(["none", "tanh"]))
def test_bias_gelu_random_shapes(rows, cols, scale, approximate):
    x = fresh((rows, cols), torch.float32, "cpu", scale=scale)
    bias = fresh((cols,), torch.float32, "cpu")
    out = fusedlm.ops.bias_gelu(x, bias, approximate, backend="cpu")
    out.sum().backward()
    x64, b64 = as_reference(x, bias)
    expected = reference.bias_gelu(x64, b64, approximate)
    expected.sum().backward()
    assert_close(out, expected)
    assert_close(x.grad, x64.grad)
    assert_close(bias.grad, b64.grad, scale=10)


@pytest.mark.parametrize("backend", backends_for("bias_gelu"))
def test_bias_gelu_edge_cases(backend):
    # Non-contiguous input, and extreme values that must not overflow in half precision.
    device = backend_device(backend)
    x = fresh((40, 24), torch.float32, device).t()
    bias = fresh((40,), torch.float32, device)
    assert_close(fusedlm.ops.bias_gelu(x, bias, backend=backend),
                 reference.bias_gelu(*as_reference(x, bias)))
    big = torch.tensor([[-60000.0, -20.0, 0.0, 20.0, 60000.0]], dtype=torch.float16, device=device)
    for approximate in ("none", "tanh"):
        out = fusedlm.ops.bias_gelu(big, None, approximate, backend=backend)
        assert torch.isfinite(out).all()
        assert_close(out, reference.bias_gelu(big.double(), None, approximate), dtype=torch.float16)


@pytest.mark.parametrize("backend", backends_for("bias_gelu"))
def test_bias_gelu_outputs_are_not_views(backend):
    # FSDP2 warns about, and cannot follow in-place changes to, a view a module returns.
    device = backend_device(backend)
    x, bias = fresh((2, 3, 16), torch.float32, device), fresh((16,), torch.float32, device)
    with torch.no_grad():
        out = torch.ops.fusedlm.bias_gelu(x, bias, "none", backend)
        grads = torch.ops.fusedlm.bias_gelu_backward(torch.randn_like(out), x, bias, "none",
                                                     backend)
    assert [t._base is None for t in (out, *grads)] == [True] * 3


def test_bias_gelu_compiles_without_graph_breaks():
    x = fresh((8, 64), torch.float32, "cpu")
    bias = fresh((64,), torch.float32, "cpu")
    compiled = torch.compile(lambda x, b: fusedlm.ops.bias_gelu(x, b, "tanh", backend="cpu") * 2, fullgraph=True)
    out = compiled(x, bias)
    out.sum().backward()
    x64, b64 = as_reference(x, bias)
    expected = reference.bias_gelu(x64, b64, "tanh") * 2
    expected.sum().backward()
    assert_close(out, expected)
    assert_close(x.grad, x64.grad)


def test_bias_gelu_rejects_bad_input():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="bias"):
        fusedlm.ops.bias_gelu(x, torch.randn(7))
    with pytest.raises(TypeError, match="bias"):
        fusedlm.ops.bias_gelu(x, torch.randn(8, dtype=torch.float64))
    with pytest.raises(TypeError, match="x"):
        fusedlm.ops.bias_gelu(torch.ones(4, 8, dtype=torch.int64), None)
    with pytest.raises(ValueError, match="approximate"):
        fusedlm.ops.bias_gelu(x, None, "sigmoid")
    with pytest.raises(ValueError, match="bias"):
        fusedlm.ops.bias_gelu(x, torch.randn(8, device="meta"))


# --- gelu_ffn ------------------------------------------------------------------------------------

def _ffn_inputs(dtype, device, d_in=48, d_ff=136, d_out=40, with_bias=True, shape=(2, 13)):
    x = fresh((*shape, d_in), dtype, device)
    w1 = fresh((d_ff, d_in), dtype, device, scale=d_in ** -0.5)
    b1 = fresh((d_ff,), dtype, device) if with_bias else None
    w2 = fresh((d_out, d_ff), dtype, device, scale=d_ff ** -0.5)
    b2 = fresh((d_out,), dtype, device) if with_bias else None
    return x, w1, b1, w2, b2


# The cuda backend's two FFN paths: cuBLAS's products around its GELU passes (the default),
# and its own product with them in the epilogue (ffn_cublas off).
FFN_PRODUCTS = pytest.mark.parametrize("products", ["cublas", "fused"])


def _use_products(backend, products, cuda_paths):
    if products == "fused":
        if backend != "cuda":
            pytest.skip("the fused product is the cuda backend's path")
        cuda_paths("ffn_cublas", False)


def _check_ffn(backend, inputs, **kwargs):
    """gelu_ffn and every gradient on `backend` against the float64 reference."""
    skip_if_refused(backend, "gelu_ffn", *inputs, **kwargs)
    out = fusedlm.ops.gelu_ffn(*inputs, **kwargs, backend=backend)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref_inputs = as_reference(*inputs)
    expected = reference.gelu_ffn(*ref_inputs, **kwargs)
    expected.backward(grad.double())
    # Matrix products in bf16/fp16 round their inputs and outputs: scale the tolerance.
    scale = 1 if inputs[0].dtype == torch.float32 else 3
    assert_close(out, expected, scale=scale, name="out")
    for name, t, r in zip(("x", "w1", "b1", "w2", "b2"), inputs, ref_inputs):
        if t is not None:
            assert_close(t.grad, r.grad, scale=10 * scale, name=f"d{name}")


@pytest.mark.parametrize("backend", backends_for("gelu_ffn"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_gelu_ffn_matches_reference(backend, dtype, approximate, with_bias):
    # 130 rows: two row tiles of the triton product (128 rows each).
    shape = (2, 65) if backend == "triton" and not slow_backend(backend) else (2, 13)
    inputs = _ffn_inputs(dtype, backend_device(backend), with_bias=with_bias, shape=shape)
    _check_ffn(backend, inputs, approximate=approximate)


@pytest.mark.parametrize("backend", backends_for("gelu_ffn"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False])
@FFN_PRODUCTS
def test_gelu_ffn_partial_tiles(backend, dtype, with_bias, products, cuda_paths):
    _use_products(backend, products, cuda_paths)
    # The cuda product's tiles (128 x 128, K 32 at a time through a ring of 3 stages, 64 on
    # sm_90a) left partial along every dimension: 130 rows (two row tiles, the bias
    # gradient summed over both), d_ff 136 (two column tiles), and K past the stage ring,
    # d_in 200 for the forward's product and d_out 232 for the backward's.
    inputs = _ffn_inputs(dtype, backend_device(backend), d_in=200, d_ff=136, d_out=232,
                         with_bias=with_bias, shape=(2, 65))
    _check_ffn(backend, inputs, approximate="tanh")


def test_gelu_ffn_gradcheck():
    inputs = _ffn_inputs(torch.float64, "cpu", d_in=5, d_ff=7, d_out=3)
    inputs = [t[:1, :3] if i == 0 else t for i, t in enumerate(inputs)]
    inputs[0] = inputs[0].detach().requires_grad_()
    assert torch.autograd.gradcheck(lambda *a: fusedlm.ops.gelu_ffn(*a, backend="cpu"), tuple(inputs))


def _widest_taken(backend, dtypes, **kwargs):
    """The first of `dtypes` whose gelu_ffn inputs the backend takes."""
    return first_taken(backend, "gelu_ffn", dtypes,
                       lambda dtype: (_ffn_inputs(dtype, backend_device(backend)), kwargs))


@pytest.mark.parametrize("backend", backends_for("gelu_ffn"))
@FFN_PRODUCTS
def test_gelu_ffn_dropout_replays_its_mask(backend, products, cuda_paths):
    _use_products(backend, products, cuda_paths)
    # The widest dtype the backend takes (float64: exact comparisons).
    dtype = _widest_taken(backend, (torch.float64, torch.float32, torch.bfloat16))
    scale = 3 if dtype == torch.bfloat16 else 1
    inputs = _ffn_inputs(dtype, backend_device(backend))
    p = 0.3
    torch.manual_seed(1234)
    seed = fusedlm.ops._dropout.next_seed(p)
    torch.manual_seed(1234)
    out = fusedlm.ops.gelu_ffn(*inputs, dropout_p=p, backend=backend)
    grad = torch.randn_like(out)
    out.backward(grad)

    keep = keep_mask(backend, seed, (26, inputs[1].shape[0]), p).view(2, 13, -1)
    ref_inputs = as_reference(*inputs)
    expected = reference.gelu_ffn(*ref_inputs, dropout_p=p, dropout_mask=keep)
    expected.backward(grad.double())
    assert_close(out, expected, scale=scale)
    for t, r in zip(inputs, ref_inputs):
        assert_close(t.grad, r.grad, scale=10 * scale)
    # The same seed repeats the run; another seed does not.
    torch.manual_seed(1234)
    assert torch.equal(fusedlm.ops.gelu_ffn(*inputs, dropout_p=p, backend=backend), out)
    assert not torch.equal(fusedlm.ops.gelu_ffn(*inputs, dropout_p=p, backend=backend), out)


@FFN_PRODUCTS
@pytest.mark.parametrize("marks", [pytest.param(None, marks=needs_emulator, id="emulated")])
def test_gelu_ffn_cuda_writes_its_activation_once(products, cuda_paths, marks):
    # Counted by the emulator (cuBLAS's products are not): the activation is written once
    # in each direction, beside the pre-activation in the fused product's forward and
    # the pre-activation's gradient in the backward, and the cuBLAS path's pass reads the
    # product it follows once.
    _use_products("cuda", products, cuda_paths)
    rows, d_ff = 130, 136
    inputs = _ffn_inputs(torch.bfloat16, "cpu", d_ff=d_ff, shape=(rows,))
    act = rows * d_ff * 2
    with cuda_backend.count_launches() as forward:
        out = fusedlm.ops.gelu_ffn(*inputs, dropout_p=0.1, backend="cuda")
    assert sum(sum(c.written.values()) for c in forward) == (act if products == "cublas" else 2 * act)
    if products == "cublas":
        [launch] = forward
        assert sum(launch.read.values()) == act
    with cuda_backend.count_launches() as backward:
        out.backward(torch.randn_like(out))
    partials = sum(sum(c.read.values()) for c in backward if "sum_partials" in c.kernel)
    [launch] = [c for c in backward if "sum_partials" not in c.kernel]
    assert sum(launch.written.values()) == 2 * act + partials
    if products == "cublas":
        assert sum(launch.read.values()) == 2 * act


def test_gelu_ffn_dropout_scales_kept_units():
    # With w2 = identity the output is the dropped activation: zeros or exactly gelu / (1 - p).
    d = 64
    x = fresh((512, d), torch.float64, "cpu", requires_grad=False)
    w1 = torch.eye(d, dtype=torch.float64)
    eye = torch.eye(d, dtype=torch.float64)
    p = 0.25
    out = fusedlm.ops.gelu_ffn(x, w1, None, eye, None, dropout_p=p, backend="cpu")
    full = reference.bias_gelu(x)
    kept = out != 0
    torch.testing.assert_close(out[kept], full[kept] / (1 - p))
    assert abs(kept.double().mean().item() - (1 - p)) < 0.01


def test_gelu_ffn_compiles_without_graph_breaks():
    inputs = _ffn_inputs(torch.float32, "cpu")
    compiled = torch.compile(lambda *a: fusedlm.ops.gelu_ffn(*a, backend="cpu"), fullgraph=True)
    out = compiled(*inputs)
    out.sum().backward()
    ref_inputs = as_reference(*inputs)
    expected = reference.gelu_ffn(*ref_inputs)
    expected.sum().backward()
    assert_close(out, expected)
    assert_close(inputs[1].grad, ref_inputs[1].grad, scale=10)


@pytest.mark.parametrize("backend", backends_for("gelu_ffn"))
def test_gelu_ffn_empty_batch(backend):
    device = backend_device(backend)
    dtype = _widest_taken(backend, (torch.float32, torch.bfloat16))
    x, w1, b1, w2, b2 = _ffn_inputs(dtype, device)
    x = torch.randn(0, 48, dtype=dtype, device=device, requires_grad=True)
    out = fusedlm.ops.gelu_ffn(x, w1, b1, w2, b2, backend=backend)
    assert out.shape == (0, 40)
    out.sum().backward()
    for t in (w1, b1, w2, b2):
        assert torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.parametrize("backend", backends_for("gelu_ffn"))
@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_gelu_ffn_outputs_are_not_views(backend, dropout_p):
    dtype = _widest_taken(backend, (torch.float32, torch.bfloat16), dropout_p=dropout_p)
    x, w1, b1, w2, b2 = _ffn_inputs(dtype, backend_device(backend))
    seed = next_seed(dropout_p)
    with torch.no_grad():
        out, pre = torch.ops.fusedlm.gelu_ffn(x, w1, b1, w2, b2, "none", dropout_p, seed, backend)
        grads = torch.ops.fusedlm.gelu_ffn_backward(torch.randn_like(out), x, pre, w1, b1, w2, b2,
                                                    "none", dropout_p, seed, backend)
    assert [t._base is None for t in (out, pre, *grads)] == [True] * 7


def test_gelu_ffn_rejects_bad_input():
    x, w1, b1, w2, b2 = _ffn_inputs(torch.float32, "cpu")
    with pytest.raises(ValueError, match="w1"):
        fusedlm.ops.gelu_ffn(x, w1.t(), b1, w2, b2)
    with pytest.raises(ValueError, match="b2"):
        fusedlm.ops.gelu_ffn(x, w1, b1, w2, b1)
    with pytest.raises(TypeError, match="w2"):
        fusedlm.ops.gelu_ffn(x, w1, b1, w2.half(), b2)
    with pytest.raises(ValueError, match="dropout_p"):
        fusedlm.ops.gelu_ffn(x, w1, b1, w2, b2, dropout_p=1.0)


# --- real shapes (a GPU) -------------------------------------------------------------------------

REAL_TOKENS = {"bert-base": 32 * 128, "gpt2-small": 8 * 1024}
# BERT-base's and GPT-2's FFN width, and an odd one (one element per load in the cuda kernels).
REAL_WIDTHS = {"ffn-3072": 3072, "odd-3001": 3001}


@pytest.mark.parametrize("backend", backends_for("bias_gelu", shapes="real"))
@pytest.mark.parametrize("tokens", REAL_TOKENS.values(), ids=REAL_TOKENS.keys())
@pytest.mark.parametrize("width", REAL_WIDTHS.values(), ids=REAL_WIDTHS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_real_shapes(backend, tokens, width, dtype, approximate):
    inputs = [fresh((tokens, width), dtype, "cuda", scale=3.0), fresh((width,), dtype, "cuda")]
    skip_if_refused(backend, "bias_gelu", *inputs, approximate)
    upstream = torch.randn(tokens, width, device="cuda", dtype=dtype)
    poison_memory()
    out = fusedlm.ops.bias_gelu(*inputs, approximate, backend=backend)
    got = grads([out], inputs, [upstream])
    ref_inputs = as_reference(*inputs, dtype=torch.float32)
    expected = reference.bias_gelu(*ref_inputs, approximate)
    expected_grads = grads([expected], ref_inputs, [upstream.float()])
    assert_relative_error(out, expected, dtype, "out")
    for name, a, e in zip(("dx", "dbias"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)


# The FFN's tokens also at a count that leaves the cuda product's last 128-row block partial.
REAL_FFN_TOKENS = {**REAL_TOKENS, "odd-1000": 1000}


def _real_ffn_inputs(tokens, dtype, d_in=768, d_ff=3072, d_out=768):
    return [fresh((tokens, d_in), dtype, "cuda"), fresh((d_ff, d_in), dtype, "cuda", scale=d_in ** -0.5),
            fresh((d_ff,), dtype, "cuda"), fresh((d_out, d_ff), dtype, "cuda", scale=d_ff ** -0.5),
            fresh((d_out,), dtype, "cuda")]


@pytest.mark.parametrize("backend", backends_for("gelu_ffn", shapes="real"))
@pytest.mark.parametrize("tokens", REAL_FFN_TOKENS.values(), ids=REAL_FFN_TOKENS.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_gelu_ffn_real_shapes(backend, tokens, dtype, approximate, dropout_p):
    inputs = _real_ffn_inputs(tokens, dtype)
    skip_if_refused(backend, "gelu_ffn", *inputs)
    upstream = torch.randn(tokens, 768, device="cuda", dtype=dtype)
    torch.manual_seed(11)
    seed = next_seed(dropout_p)
    keep = keep_mask(backend, seed, (tokens, 3072), dropout_p) if dropout_p else None
    poison_memory()
    torch.manual_seed(11)
    out = fusedlm.ops.gelu_ffn(*inputs, approximate=approximate, dropout_p=dropout_p,
                               backend=backend)
    got = grads([out], inputs, [upstream])
    ref_inputs = as_reference(*inputs, dtype=torch.float32)
    expected = reference.gelu_ffn(*ref_inputs, approximate=approximate, dropout_p=dropout_p,
                                  dropout_mask=keep)
    expected_grads = grads([expected], ref_inputs, [upstream.float()])
    assert_relative_error(out, expected, dtype, "out")
    for name, a, e in zip(("dx", "dw1", "db1", "dw2", "db2"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)


@pytest.mark.parametrize("backend", backends_for("gelu_ffn", shapes="real"))
def test_gelu_ffn_gradients_repeat_bit_for_bit(backend):
    inputs = [fresh((1000, 768), torch.bfloat16, "cuda"),
              fresh((3072, 768), torch.bfloat16, "cuda", scale=0.03),
              fresh((3072,), torch.bfloat16, "cuda"),
              fresh((768, 3072), torch.bfloat16, "cuda", scale=0.02),
              fresh((768,), torch.bfloat16, "cuda")]
    skip_if_refused(backend, "gelu_ffn", *inputs)
    upstream = torch.randn(1000, 768, device="cuda", dtype=torch.bfloat16)
    runs = [grads([fusedlm.ops.gelu_ffn(*inputs, backend=backend)], inputs, [upstream])
            for _ in range(2)]
    for name, a, b in zip(("dx", "dw1", "db1", "dw2", "db2"), *runs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", [p for p in backends_for("gelu_ffn", shapes="real")
                                     if p.id == "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_ffn_wgmma_product_matches_mma_sync(backend, dtype, cuda_paths):
    """On sm_90 the fused product runs on warpgroup products. At sizes that leave every tile
    partial (rows, d_ff, and both products' K, d_in and d_out, off the 128 x 128 x 64
    tiles) it must agree with the float32 reference, and with the mma.sync product (the
    same sums in another order) to half that bound."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma product runs on sm_90 devices only")
    tokens, d_in, d_ff, d_out = 1000, 776, 3000, 520
    inputs = _real_ffn_inputs(tokens, dtype, d_in, d_ff, d_out)
    upstream = torch.randn(tokens, d_out, device="cuda", dtype=dtype)
    torch.manual_seed(11)
    keep = keep_mask(backend, next_seed(0.1), (tokens, d_ff), 0.1)

    def step():
        torch.manual_seed(11)
        out = fusedlm.ops.gelu_ffn(*inputs, dropout_p=0.1, backend=backend)
        return [out] + grads([out], inputs, [upstream])

    cuda_paths("ffn_wgmma", True)
    wgmma = step()
    cuda_paths("ffn_wgmma", False)
    mma_sync = step()
    ref_inputs = as_reference(*inputs, dtype=torch.float32)
    expected = reference.gelu_ffn(*ref_inputs, dropout_p=0.1, dropout_mask=keep)
    expected = [expected] + grads([expected], ref_inputs, [upstream.float()])
    for name, a, b, e in zip(("out", "dx", "dw1", "db1", "dw2", "db2"), wgmma, mma_sync, expected):
        assert_relative_error(a, e, dtype, name)
        assert_relative_error(a, b, dtype, name, MAX_RELATIVE_ERROR[dtype] / 2)


# --- fuzz (tests/fuzz.py) --------------------------------------------------------------------------

def _plain_gelu(z, approximate):
    """GELU in torch's operators, in forms that do not cancel for negative z (F.gelu's
    1 + erf and 1 + tanh do, in float64 too, which would make a poor truth): z * Phi(z)
    with Phi from erfc, and z * sigmoid(2u) for the tanh form."""
    if approximate == "tanh":
        return z * torch.sigmoid(2 * 0.7978845608028654 * (z + 0.044715 * z ** 3))
    return 0.5 * z * torch.special.erfc(-z * 0.7071067811865476)


def draw_bias_gelu(d):
    dtype = d.dtype()
    width = d.size(1, 300, (1, 3, 8, 31, 33, 64, 129))
    shape = (*(d.size(0, 6, (1,)) for _ in range(d.size(0, 2))), width)
    d.tensor("x", shape, dtype, scale=d.magnitude(1e2 if dtype == torch.float16 else 1e3))
    if d.chance(0.7):
        d.tensor("bias", (width,), dtype)
    approximate = d.choice(["none", "tanh"])

    def arguments(t):
        return (t["x"], t.get("bias"), t.get("approximate", approximate)), {}

    def reference_(t):
        z = t["x"] if t.get("bias") is None else t["x"] + t["bias"]
        return (_plain_gelu(z, approximate),)

    bad = [fuzz.replaced("approximate", "erf", "approximate='erf'")]
    if "bias" in d.leaves:
        bad.append(fuzz.grown("bias", 0))
    return Case("bias_gelu", f"bias_gelu {dtype} approximate={approximate}", arguments, reference_,
                floors=(fuzz.POINTWISE,), grad_floor={"x": fuzz.POINTWISE}, dtype=dtype, bad=tuple(bad))


def draw_gelu_ffn(d):
    dtype = d.dtype()
    aligned = d.chance(0.5)  # the sizes the tensor-core kernels take

    def size():
        return 8 * d.size(1, 12) if aligned else d.size(1, 100, (1, 3, 17, 65))

    d_in, d_ff, d_out = size(), size(), size()
    rows = tuple(d.size(0, 20, (1, 16, 17)) for _ in range(d.size(1, 2)))
    d.tensor("x", (*rows, d_in), dtype, scale=d.magnitude(30.0))
    d.tensor("w1", (d_ff, d_in), dtype, scale=d_in ** -0.5)
    d.tensor("w2", (d_out, d_ff), dtype, scale=d_ff ** -0.5)
    if d.chance(0.7):
        d.tensor("b1", (d_ff,), dtype)
    if d.chance(0.7):
        d.tensor("b2", (d_out,), dtype)
    approximate = d.choice(["none", "tanh"])

    def arguments(t):
        return (t["x"], t["w1"], t.get("b1"), t["w2"], t.get("b2")), {"approximate": approximate}

    def reference_(t):
        hidden = _plain_gelu(torch.nn.functional.linear(t["x"], t["w1"], t.get("b1")), approximate)
        return (torch.nn.functional.linear(hidden, t["w2"], t.get("b2")),)

    bad = [fuzz.grown("w1", 1), fuzz.grown("w2", 1), fuzz.with_extra_dim("w1")]
    return Case("gelu_ffn", f"gelu_ffn {dtype} {d_in}->{d_ff}->{d_out} approximate={approximate}",
                arguments, reference_, floors=(1.0,), dtype=dtype, bad=tuple(bad))


test_fuzz_bias_gelu, test_fuzz_bias_gelu_bad_inputs = fuzz.tests(draw_bias_gelu, backends_for("bias_gelu"))


test_fuzz_gelu_ffn, test_fuzz_gelu_ffn_bad_inputs = fuzz.tests(draw_gelu_ffn, backends_for("gelu_ffn"))
