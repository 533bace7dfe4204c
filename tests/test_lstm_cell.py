"""lstm_cell against the reference, on every backend that has it: small cases, and ELMo's
shapes on a GPU (with the ELMo model on CUDA tensors)."""
import pytest
import torch

import fusedlm
import fuzz
from fusedlm.ops import reference
from fuzz import Case
from fusedlm.models import ELMo, ElmoConfig
from fusedlm.models.elmo import batch_to_ids
from helpers import (as_reference, assert_close, assert_relative_error, backend_device, backends_for,
                     fresh, gpu_test, grads, leaves_float_mode_as_found, poison_memory, slow_backend)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _inputs(shape, cell, dtype, device):
    # Scale 2: the new cell values spread over about [-4, 4], across a clip of 1.
    return fresh((*shape, 4 * cell), dtype, device, scale=2.0), fresh((*shape, cell), dtype, device, scale=2.0)


def _check(gates, c_prev, cell_clip, backend, scale=1.0):
    """Runs forward and backward on `backend` and on the float64 reference; compares h, c,
    dgates and dc_prev. Returns the reference's c."""
    h, c = fusedlm.ops.lstm_cell(gates, c_prev, cell_clip=cell_clip, backend=backend)
    grad_h, grad_c = torch.randn_like(h), torch.randn_like(c)
    torch.autograd.backward((h, c), (grad_h, grad_c))
    g64, c64 = as_reference(gates, c_prev)
    eh, ec = reference.lstm_cell(g64, c64, cell_clip=cell_clip)
    torch.autograd.backward((eh, ec), (grad_h.double(), grad_c.double()))
    assert h.dtype == gates.dtype and h.shape == c_prev.shape and c.shape == c_prev.shape
    assert_close(h, eh, name="h", scale=scale)
    assert_close(c, ec, name="c", scale=scale)
    assert_close(gates.grad, g64.grad, name="dgates", scale=scale)
    assert_close(c_prev.grad, c64.grad, name="dc_prev", scale=scale)
    return ec


@pytest.mark.parametrize("backend", backends_for("lstm_cell"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell_clip", [None, 1.0])
def test_lstm_cell_matches_reference(backend, dtype, cell_clip):
    shape, cell = ((3,), 24) if slow_backend(backend) else ((37,), 67)
    gates, c_prev = _inputs(shape, cell, dtype, backend_device(backend))
    ec = _check(gates, c_prev, cell_clip, backend)
    if cell_clip is not None:  # the clip was exercised on both sides, and left units inside
        assert (ec == cell_clip).any() and (ec == -cell_clip).any() and (ec.abs() < cell_clip).any()


@pytest.mark.parametrize("backend", backends_for("lstm_cell"))
def test_lstm_cell_leading_dims_and_non_contiguous(backend):
    device = backend_device(backend)
    gates = fresh((2, 12, 3), torch.float32, device, scale=2.0).transpose(1, 2)
    c_prev = fresh((3, 2, 3), torch.float32, device, scale=2.0).permute(1, 0, 2)
    gates.retain_grad(), c_prev.retain_grad()
    _check(gates, c_prev, 2.5, backend)


@pytest.mark.parametrize("backend", backends_for("lstm_cell"))
def test_lstm_cell_outputs_are_not_views(backend):
    # FSDP2 warns about, and cannot follow in-place changes to, a view a module returns.
    gates, c_prev = _inputs((2, 3), 5, torch.float32, backend_device(backend))
    with torch.no_grad():
        h, c = torch.ops.fusedlm.lstm_cell(gates, c_prev, 2.5, backend)
        grads = torch.ops.fusedlm.lstm_cell_backward(torch.randn_like(h), torch.randn_like(c),
                                                     gates, c_prev, 2.5, backend)
    assert [t._base is None for t in (h, c, *grads)] == [True] * 4


def test_lstm_cell_every_instruction_set(cpu_isa):
    # Odd widths exercise the vector loops' remainders.
    for cell in (1, 7, 33, 300):
        for clip in (None, 0.5):
            gates, c_prev = _inputs((5,), cell, torch.float32, "cpu")
            _check(gates, c_prev, clip, "cpu")


@pytest.mark.parametrize("cell_clip", [None, 0.7])
def test_lstm_cell_gradcheck(cell_clip):
    gates, c_prev = _inputs((4,), 5, torch.float64, "cpu")
    assert torch.autograd.gradcheck(
        lambda g, c: fusedlm.ops.lstm_cell(g, c, cell_clip=cell_clip, backend="cpu"), (gates, c_prev))


@pytest.mark.parametrize("backend", backends_for("lstm_cell"))
def test_lstm_cell_saturated_gates_stay_finite(backend):
    device = backend_device(backend)
    for dtype in DTYPES:
        big = torch.tensor([[-60000.0, -30.0, 30.0, 60000.0] * 4], dtype=dtype, device=device)
        c_prev = torch.tensor([[-5.0, 0.5, -0.5, 5.0]], dtype=dtype, device=device)
        big.requires_grad_(), c_prev.requires_grad_()
        h, c = fusedlm.ops.lstm_cell(big, c_prev, cell_clip=3.0, backend=backend)
        (h.sum() + c.sum()).backward()
        assert all(torch.isfinite(t).all() for t in (h, c, big.grad, c_prev.grad))
        eh, ec = reference.lstm_cell(big.double(), c_prev.double(), cell_clip=3.0)
        assert_close(h, eh, dtype=dtype)
        assert_close(c, ec, dtype=dtype)


def test_lstm_cell_underflowing_gates_restore_the_thread(cpu_isa):
    # Gates near -53 and -87 give products and sigmoids below float's normal range, which
    # the cpu kernels flush to 0; the results still match, and the thread's arithmetic is
    # left as it was found.
    gates = torch.tensor([[-53.0, -87.2, -53.0, -87.2] * 2], requires_grad=True)
    c_prev = torch.tensor([[0.0, 0.5]], requires_grad=True)
    with leaves_float_mode_as_found(cpu_isa):
        h, c = fusedlm.ops.lstm_cell(gates, c_prev, backend="cpu")
        (h.sum() + c.sum()).backward()
    g64, c64 = as_reference(gates, c_prev)
    eh, ec = reference.lstm_cell(g64, c64)
    (eh.sum() + ec.sum()).backward()
    for name, got, want in (("h", h, eh), ("c", c, ec), ("dgates", gates.grad, g64.grad),
                            ("dc_prev", c_prev.grad, c64.grad)):
        assert_close(got, want, name=f"{cpu_isa} {name}")


def test_lstm_cell_compiles_without_graph_breaks():
    gates, c_prev = _inputs((6,), 16, torch.float32, "cpu")

    def step(g, c):
        h, c = fusedlm.ops.lstm_cell(g, c, cell_clip=1.5, backend="cpu")
        return h * 2 + c

    out = torch.compile(step, fullgraph=True)(gates, c_prev)
    out.sum().backward()
    g64, c64 = as_reference(gates, c_prev)
    eh, ec = reference.lstm_cell(g64, c64, cell_clip=1.5)
    (eh * 2 + ec).sum().backward()
    assert_close(out, eh * 2 + ec)
    assert_close(gates.grad, g64.grad)
    assert_close(c_prev.grad, c64.grad)


def test_lstm_cell_rejects_bad_input():
    gates, c_prev = torch.randn(4, 12), torch.randn(4, 3)
    with pytest.raises(ValueError, match="gates"):
        fusedlm.ops.lstm_cell(torch.randn(4, 10), c_prev)
    with pytest.raises(ValueError, match="c_prev"):
        fusedlm.ops.lstm_cell(gates, torch.randn(4, 4))
    with pytest.raises(TypeError, match="c_prev"):
        fusedlm.ops.lstm_cell(gates, c_prev.double())
    with pytest.raises(TypeError, match="gates"):
        fusedlm.ops.lstm_cell(gates.long(), c_prev)
    for bad in (0.0, -1.0, True, "3"):
        with pytest.raises(ValueError, match="cell_clip"):
            fusedlm.ops.lstm_cell(gates, c_prev, cell_clip=bad)
    with pytest.raises(ValueError, match="c_prev"):
        fusedlm.ops.lstm_cell(gates, c_prev.to("meta"))


# --- real shapes (a GPU) -------------------------------------------------------------------------

# ELMo's cell at a training batch of 128 sentences and at 3000 rows (a step over a batch of
# packed tokens), and an odd cell (no vector-width rows).
REAL_SHAPES = {"elmo-128": (128, 4096), "elmo-3000": (3000, 4096), "odd-1001": (77, 1001)}


@pytest.mark.parametrize("backend", backends_for("lstm_cell", shapes="real"))
@pytest.mark.parametrize("shape", REAL_SHAPES.values(), ids=REAL_SHAPES.keys())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cell_clip", [None, 3.0])
def test_lstm_cell_real_shapes(backend, shape, dtype, cell_clip):
    rows, cell = shape
    inputs = [fresh((rows, 4 * cell), dtype, "cuda", scale=2.0),
              fresh((rows, cell), dtype, "cuda", scale=3.0)]
    upstream = [torch.randn(rows, cell, device="cuda", dtype=dtype) for _ in range(2)]
    poison_memory()
    outs = fusedlm.ops.lstm_cell(*inputs, cell_clip=cell_clip, backend=backend)
    got = grads(outs, inputs, upstream)
    ref_inputs = as_reference(*inputs, dtype=torch.float32)
    expected = reference.lstm_cell(*ref_inputs, cell_clip=cell_clip)
    expected_grads = grads(expected, ref_inputs, [u.float() for u in upstream])
    for name, a, e in zip(("h", "c", "dgates", "dc_prev"), [*outs, *got], [*expected, *expected_grads]):
        assert_relative_error(a, e, dtype, name)


@gpu_test
def test_elmo_on_cuda_matches_the_cpu():
    config = ElmoConfig(filters=[[1, 32], [2, 32], [3, 64]], lstm_dim=256, projection_dim=64,
                        dropout=0.0)
    model = ELMo(config).eval()
    ids = batch_to_ids([["A", "small", "test", "."], ["Another", "one"]])
    expected = model(ids).last_hidden_state
    got = model.cuda()(ids.cuda()).last_hidden_state
    assert_relative_error(got, expected, torch.float32, "elmo")


# --- fuzz (tests/fuzz.py) --------------------------------------------------------------------------

def draw_lstm_cell(d):
    dtype = d.dtype()
    cell = d.size(1, 300, (1, 3, 8, 31, 33, 64, 129))
    rows = tuple(d.size(0, 6, (1,)) for _ in range(d.size(0, 2)))
    d.tensor("gates", (*rows, 4 * cell), dtype, scale=d.magnitude(30.0))
    d.tensor("c_prev", (*rows, cell), dtype)
    cell_clip = None if d.chance(0.5) else d.choice([0.5, 3.0, float("inf")])

    def arguments(t):
        return (t["gates"], t["c_prev"]), {"cell_clip": cell_clip}

    def reference_(t):
        i, f, g, o = t["gates"].chunk(4, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(g) + torch.sigmoid(f) * t["c_prev"]
        if cell_clip is not None:
            c = c.clamp(-cell_clip, cell_clip)
        return torch.sigmoid(o) * torch.tanh(c), c

    return Case("lstm_cell", f"lstm_cell {dtype} cell_clip={cell_clip}", arguments, reference_,
                floors=(fuzz.POINTWISE, fuzz.POINTWISE), grad_floor=fuzz.POINTWISE, dtype=dtype,
                bad=(fuzz.grown("c_prev", len(rows)), fuzz.grown("gates", len(rows))))


test_fuzz_lstm_cell, test_fuzz_lstm_cell_bad_inputs = fuzz.tests(draw_lstm_cell, backends_for("lstm_cell"))


# Found by the fuzzer: tanh came from (1 - e) / (1 + e), e = exp(-2|x|), which cancels for
# small |x|: h = o * tanh(c) was off by up to 1e-3 relative where the cell was near zero.
@pytest.mark.parametrize("backend", backends_for("lstm_cell"))
def test_lstm_cell_is_accurate_for_small_cells(backend):
    cell = 64
    gates = torch.randn(4, 4 * cell, dtype=torch.float64)
    gates[:, 2 * cell:3 * cell] *= 1e-3  # g small, c_prev 0: c = i * g small, without cancellation
    c_prev = torch.zeros(4, cell, dtype=torch.float64)
    device = backend_device(backend)
    h, c = fusedlm.ops.lstm_cell(gates.float().to(device), c_prev.float().to(device), backend=backend)
    expected_h, expected_c = reference.lstm_cell(gates.float().double(), c_prev.float().double())
    for got, want in ((h, expected_h), (c, expected_c)):
        relative = ((got.double().cpu() - want).abs() / want.abs()).max().item()
        assert relative < 1e-6, relative
