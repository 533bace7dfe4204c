"""rms_norm against the reference and torch.nn.functional.rms_norm, on every backend that
has it: small cases, torch's transforms and torch.compile, the fuzzer, and LLaMA shapes on
a GPU."""
import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jvp, vmap

import fusedlm
import fuzz
from fusedlm.ops import reference
from fuzz import Case
from helpers import (as_reference, assert_close, assert_relative_error, backend_device,
                     backends_for, fresh, grads, poison_memory, skip_if_refused, slow_backend)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, dtype, device="cpu", weight=True, scale=1.0):
    return fresh(shape, dtype, device, scale=scale), (fresh(shape[-1:], dtype, device)
                                                      if weight else None)


def _compare(x, weight, backend, *, eps=1e-6, grad_scale=1.0):
    """The op and the float64 reference on the same inputs: the output and every gradient."""
    out = fusedlm.ops.rms_norm(x, weight, eps, backend=backend)
    upstream = torch.randn_like(out)
    got = grads([out], [x, weight], [upstream])
    ref = as_reference(x, weight)
    expected_out = reference.rms_norm(*ref, eps)
    expected = grads([expected_out], ref, [upstream.double()])
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_close(out, expected_out, name="out")
    for name, g, e in zip(("dx", "dweight"), got, expected):
        if e is not None:
            assert g.dtype == x.dtype and g.shape == e.shape, name
            # The weight's gradient sums over every row: allow for that many roundings.
            assert_close(g, e, dtype=x.dtype, scale=grad_scale * (10 if name == "dweight" else 1),
                         name=name)
    return out, got


@pytest.mark.parametrize("backend", backends_for("rms_norm") + ["reference", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("hidden", [128, 130, 1, 33])  # 16-byte vectors; one element at a time
def test_rms_norm_matches_reference(backend, dtype, weight, hidden):
    rows = (3, 5) if slow_backend(backend) else (4, 37)
    _compare(*_inputs((*rows, hidden), dtype, backend_device(backend), weight=weight), backend)


def test_rms_norm_is_torch_rms_norm():
    x, w = _inputs((6, 96), torch.float64)
    for eps in (1e-6, 1e-5, 0.1):
        expected = F.rms_norm(x, (96,), w, eps)
        assert_close(fusedlm.ops.rms_norm(x, w, eps, backend="cpu"), expected)
        assert_close(reference.rms_norm(x, w, eps), expected)


@pytest.mark.parametrize("backend", backends_for("rms_norm"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_long_rows(backend, dtype):
    # Past what the GPU kernels hold in registers, and past a block of the CPU's row sums.
    for hidden in (9000, 8200) if slow_backend(backend) else (9000, 8200, 20000):
        _compare(*_inputs((2, hidden), dtype, backend_device(backend)), backend)


@pytest.mark.parametrize("backend", backends_for("rms_norm"))
def test_rms_norm_one_row_empty_batch_and_views(backend):
    device = backend_device(backend)
    _compare(*_inputs((1, 64), torch.float32, device), backend)
    x, w = _inputs((0, 64), torch.float32, device)
    out = fusedlm.ops.rms_norm(x, w, backend=backend)
    assert out.shape == (0, 64)
    (out.sum() + 0 * w.sum()).backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    # A transposed view, and one whose data starts off a 16-byte boundary.
    t = fresh((64, 5), torch.float32, device).t()
    _compare(t, fresh((64,), torch.float32, device), backend)
    flat = torch.randn(3 * 64 + 1, device=device)
    misaligned = flat[1:].view(3, 64).requires_grad_()
    _compare(misaligned, flat[1:65].clone().requires_grad_(), backend)


@pytest.mark.parametrize("backend", backends_for("rms_norm"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_large_and_zero_rows(backend, dtype):
    # Values whose squares overflow float16 (not float32, where the sums are taken) or come
    # near float32's limit, and a row of zeros: its output is 0 and its gradient
    # dy * weight / sqrt(eps).
    device = backend_device(backend)
    big = 300.0 if dtype == torch.float16 else 1e18
    x = (torch.randn(3, 48, dtype=torch.float64) * big).to(dtype).to(device)
    x[1] = 0
    x.requires_grad_()
    w = fresh((48,), dtype, device)
    out, _ = _compare(x, w, backend)
    assert torch.isfinite(out).all()


def test_rms_norm_gradcheck_and_double_backward():
    for weight in (True, False):
        x, w = _inputs((3, 2, 7), torch.float64, weight=weight)
        inputs = (x, w) if weight else (x,)

        def fn(*t):
            return fusedlm.ops.rms_norm(t[0], t[1] if weight else None, 1e-3, backend="cpu")

        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


def test_rms_norm_every_instruction_set(cpu_isa):
    for dtype in DTYPES:
        for hidden in (1, 7, 33, 768, 1000):
            try:
                _compare(*_inputs((5, hidden), dtype, scale=2.0), "cpu")
            except AssertionError as e:
                raise AssertionError(f"{cpu_isa}, {dtype}, hidden {hidden}: {e}") from e


@pytest.mark.parametrize("backend", backends_for("rms_norm") + ["torch"])
def test_rms_norm_under_torch_func(backend):
    # Under a transform every backend runs the reference's plain PyTorch.
    device = backend_device(backend)
    x, w = (t.detach() for t in _inputs((4, 16), torch.float64 if backend in ("cpu", "torch")
                                        else torch.float32, device))
    ref = lambda x, w: reference.rms_norm(x, w, 1e-6)  # noqa: E731
    op = lambda x, w: fusedlm.ops.rms_norm(x, w, 1e-6, backend=backend)  # noqa: E731
    tangents = torch.randn_like(x), torch.randn_like(w)
    for a, b in zip(jvp(op, (x, w), tangents), jvp(ref, (x, w), tangents)):
        assert_close(a, b)
    assert_close(vmap(op, in_dims=(0, None))(x[None].expand(3, -1, -1), w), ref(x, w).expand(3, -1, -1))
    for a, b in zip(grad(lambda x, w: op(x, w).square().sum(), (0, 1))(x, w),
                    grad(lambda x, w: ref(x, w).square().sum(), (0, 1))(x, w)):
        assert_close(a, b, scale=10)


def test_rms_norm_compiles_without_graph_breaks():
    x, w = _inputs((4, 9, 64), torch.float32)

    def block(x, w):
        return fusedlm.ops.rms_norm(x * 2, w, backend="cpu") + x

    got = torch.compile(block, fullgraph=True)(x, w)
    upstream = torch.randn_like(got)
    ref = as_reference(x, w)
    expected = reference.rms_norm(ref[0] * 2, ref[1]) + ref[0]
    assert_close(got, expected)
    for name, g, e in zip(("dx", "dweight"), grads([got], [x, w], [upstream]),
                          grads([expected], ref, [upstream.double()])):
        assert_close(g, e, scale=10, name=name)


@pytest.mark.parametrize("backend", backends_for("rms_norm"))
def test_rms_norm_is_deterministic(backend):
    x, w = _inputs((300, 96) if not slow_backend(backend) else (20, 96), torch.float32,
                   backend_device(backend))
    upstream = torch.randn_like(x)
    runs = [grads([fusedlm.ops.rms_norm(x, w, backend=backend)], [x, w], [upstream])
            for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", [b for b in backends_for("rms_norm") if b.id == "triton"])
def test_rms_norm_hidden_too_large_for_triton(backend):
    x = torch.randn(1, 32769, device=backend_device(backend))
    with pytest.raises(RuntimeError, match="last dimension up to 32768, not 32769"):
        fusedlm.ops.rms_norm(x, backend=backend)


def test_rms_norm_rejects_bad_input():
    x, w = _inputs((4, 8), torch.float32)
    op = fusedlm.ops.rms_norm
    for bad, error in ((torch.randn(7), ValueError), (torch.randn(1, 8), ValueError),
                       (torch.randn(8, dtype=torch.float64), TypeError),
                       (torch.randn(8, device="meta"), ValueError), ([1.0] * 8, TypeError)):
        with pytest.raises(error, match="weight"):
            op(x, bad)
    with pytest.raises(TypeError, match="x"):
        op(torch.ones(4, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="x"):
        op(torch.tensor(1.0))
    with pytest.raises(ValueError, match="x"):
        op(torch.randn(4, 0))
    for eps in (-1e-5, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="eps"):
            op(x, w, eps)
    with pytest.raises(ValueError, match="backend"):
        op(x, w, backend="nonesuch")


def test_rms_norm_malformed_direct_calls_raise():
    # The compiled entry points check what the Python layer always passes right.
    C, x = fusedlm._C, torch.randn(4, 8)
    with pytest.raises(ValueError, match="weight"):
        C.rms_norm_forward(x, torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="rstd"):
        C.rms_norm_backward(x, x, torch.ones(3), None, 1e-6)
    with pytest.raises(ValueError, match="grad_out"):
        C.rms_norm_backward(torch.randn(4, 9), x, torch.ones(4), None, 1e-6)


# --- real shapes (a GPU) -------------------------------------------------------------------------

REAL_SHAPES = {"llama-7b": (8, 512, 4096), "t5-base": (32, 128, 768),
               # Past what the cuda kernels hold in registers, and an odd width.
               "hidden-20000": (48, 20000), "hidden-1001": (300, 1001)}


@pytest.mark.parametrize("backend", backends_for("rms_norm", shapes="real"))
@pytest.mark.parametrize("shape", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_real_shapes(backend, shape, dtype):
    x, w = fresh(shape, dtype, "cuda"), fresh(shape[-1:], dtype, "cuda")
    skip_if_refused(backend, "rms_norm", x, w)
    upstream = torch.randn(shape, device="cuda", dtype=dtype)
    poison_memory()
    out = fusedlm.ops.rms_norm(x, w, backend=backend)
    got = grads([out], [x, w], [upstream])
    ref = as_reference(x, w, dtype=torch.float32)
    expected = reference.rms_norm(*ref)
    assert_relative_error(out, expected, dtype, "out")
    for name, a, e in zip(("dx", "dweight"), got, grads([expected], ref, [upstream.float()])):
        assert_relative_error(a, e, dtype, name)


# --- fuzz (tests/fuzz.py) --------------------------------------------------------------------------

def draw_rms_norm(d):
    dtype = d.dtype()
    hidden = d.size(1, 1100, (1, 2, 7, 8, 31, 33, 64, 100, 257, 768, 1025))
    rows = tuple(d.size(0, 5, (1,)) for _ in range(d.size(0, 2)))
    shape = (*rows, hidden)
    d.tensor("x", shape, dtype, scale=d.magnitude(), offset=d.choice([0.0, 0.0, 3.0]),
             expand_dims=range(len(rows)))
    if d.chance(0.8):
        d.tensor("weight", (hidden,), dtype, offset=1.0)
    eps = d.choice([1e-6, 1e-12, 0.1])

    def arguments(t):
        return (t["x"], t.get("weight"), eps), {}

    def reference_(t):
        return (F.rms_norm(t["x"], (hidden,), t.get("weight"), eps),)

    bad = (fuzz.with_extra_dim("weight"), fuzz.grown("weight", 0)) if "weight" in d.leaves else ()
    return Case("rms_norm", f"rms_norm {dtype} eps={eps}", arguments, reference_,
                floors=(fuzz.POINTWISE,), dtype=dtype, bad=bad)


test_fuzz_rms_norm, test_fuzz_rms_norm_bad_inputs = fuzz.tests(draw_rms_norm, backends_for("rms_norm"))
