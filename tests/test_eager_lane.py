"""The eager lanes (fusedlm.backends.Kernel.eager): once dispatch has settled on the cpu
backend, add_layer_norm's and bias_gelu's public functions hand the whole call to one C++
call. A lane takes only calls the Python checks pass, gives that path's outputs and
gradients bit for bit, steps aside whenever something but autograd watches, and follows
every change of dispatch: a forced backend, a backend changed, the checks forgotten, a
kernel replaced."""

import pytest
import torch

import fusedlm
import fusedlm.ops as F
from fusedlm.backends import _REGISTRY, FLOATS, Supports, forget_choices, verify
from fusedlm.ops._dropout import next_seed
from fusedlm.ops.gelu import BIAS_GELU, plan_bias_gelu
from fusedlm.ops.layer_norm import ADD_LAYER_NORM, plan_add_layer_norm
from helpers import Recorder

ALL = set(FLOATS)  # a lane told that dispatch has settled in every dtype


@pytest.fixture(autouse=True)
def unsettled():
    """Each test starts with no lane open, and leaves none behind."""
    forget_choices()
    yield
    forget_choices()


def _variations(usual: list, variants: list) -> list:
    """usual, and every call made from it by changing one or two of its arguments."""
    calls = [usual]
    for i, values in enumerate(variants):
        for value in values:
            one = usual[:i] + [value] + usual[i + 1:]
            calls.append(one)
            for j in range(i + 1, len(variants)):
                calls += [one[:j] + [other] + one[j + 1:] for other in variants[j]]
    return calls


def _spy(lanes: dict, key):
    """Wraps the lane lanes[key]; returns the list of the calls it took."""
    taken, lane = [], lanes[key]

    def spy(*args):
        outputs = lane(*args)
        if outputs is not None:
            taken.append(1)
        return outputs

    lanes[key] = spy
    return taken


def _equal(a, b) -> bool:
    a, b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_the_add_layer_norm_lane_takes_only_calls_the_checks_pass():
    x, r = torch.randn(4, 8), torch.randn(4, 8)
    w, b = torch.randn(8), torch.randn(8)
    usual = [x, r, w, b, 1e-5, 0.0]
    calls = _variations(usual, [
        [x[0], x.half(), x.double(), x.new_empty(4, 0), x.long(), x.to("meta"), torch.tensor(1.0),
         torch.nn.Parameter(x), 1.0, None],
        [None, r[:, :7], r.half(), r.to("meta"), r[0], r.t().contiguous().t(), [1.0] * 8],
        [None, w[:7], w.reshape(1, 8), w.half(), w.to("meta"), w.long()],
        [None, b[:7], b.double(), b.to("meta"), 0.0],
        [0.0, 1, True, -1e-5, float("nan"), float("inf"), "1e-5"],
        [0, 0.5, 1.0, -0.1, True, float("nan")],
    ])
    taken = 0
    for call in calls:
        torch.manual_seed(0)
        outputs = fusedlm._C.add_layer_norm_eager(ALL, *call)
        if outputs is None:
            continue
        taken += 1
        *tensors, eps, p = call
        plan_add_layer_norm(*tensors, eps, dropout_p=p, backend="cpu")  # raises if it must not run
        torch.manual_seed(0)  # the same dropout seed, from the same generator
        expected = ADD_LAYER_NORM("cpu", *tensors, float(eps), float(p), next_seed(p))[:2]
        assert _equal(outputs, expected)
    assert taken > 5  # besides the usual call: float64, a Parameter, eps 0, dropout 0.5, ...


def test_the_bias_gelu_lane_takes_only_calls_the_checks_pass():
    x, b = torch.randn(3, 5, 16), torch.randn(16)
    calls = _variations([x, b, "none"], [
        [x[0, 0], x.half(), x.to("meta"), torch.tensor(1.0), x.long(), x.transpose(0, 2), None],
        [None, b[:15], b.double(), b.to("meta"), b.reshape(1, 16), 0.5],
        ["tanh", "erf", None, "None"],
    ])
    taken = 0
    for call in calls:
        out = fusedlm._C.bias_gelu_eager(ALL, *call)
        if out is None:
            continue
        taken += 1
        plan_bias_gelu(*call, backend="cpu")
        assert torch.equal(out, BIAS_GELU("cpu", *call))
    assert taken > 3


def test_a_lane_refuses_a_dtype_dispatch_has_not_settled():
    x, b = torch.randn(4, 16), torch.randn(16)
    assert fusedlm._C.bias_gelu_eager(set(), x, b, "none") is None
    assert fusedlm._C.bias_gelu_eager({torch.float64}, x, b, "none") is None
    assert fusedlm._C.bias_gelu_eager({torch.float32}, x, b, "none") is not None


def test_dispatch_settles_a_lane_per_forced_backend_and_dtype():
    x, r, w, b = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32), torch.randn(32)
    assert ADD_LAYER_NORM.lanes == {}
    F.add_layer_norm(x, r, w, b)
    F.add_layer_norm(x.double(), r.double(), w.double(), b.double(), backend="cpu")
    assert ADD_LAYER_NORM.lanes[None].args[0] == {torch.float32}
    assert ADD_LAYER_NORM.lanes["cpu"].args[0] == {torch.float64}
    with fusedlm.use_backend("cpu"):  # the same forcing as backend="cpu"
        F.add_layer_norm(x, r, w, b)
    assert ADD_LAYER_NORM.lanes["cpu"].args[0] == {torch.float32, torch.float64}
    F.add_layer_norm(x, r, w, b, backend="reference")
    assert "reference" not in ADD_LAYER_NORM.lanes  # a backend without a lane


def test_a_dtype_the_kernel_is_declared_slower_in_gets_no_automatic_lane():
    # The cpu bias_gelu is declared slower than torch's in bfloat16 without a gradient: the
    # automatic choice there depends on more than the dtype, so bfloat16 calls take the
    # Python path, which chooses per call. Named, the cpu backend runs them all.
    x, b = torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert fusedlm.explain("bias_gelu", x, b).startswith("bias_gelu -> reference")
        F.bias_gelu(x, b)
        F.bias_gelu(x, b, backend="cpu")
    F.bias_gelu(x.float(), b.float())
    assert BIAS_GELU.lanes[None].args[0] == {torch.float32}
    assert BIAS_GELU.lanes["cpu"].args[0] == {torch.bfloat16}


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_a_settled_add_layer_norm_gives_the_registered_ops_outputs_and_gradients(dtype, dropout_p):
    inputs = [torch.randn(3, 5, 64, dtype=dtype) for _ in range(2)] + [torch.randn(64, dtype=dtype) for _ in range(2)]
    upstream = [torch.randn(3, 5, 64, dtype=dtype) for _ in range(2)]

    def run():
        leaves = [t.clone().requires_grad_() for t in inputs]
        torch.manual_seed(1)  # the same dropout seed
        outputs = F.add_layer_norm(*leaves, dropout_p=dropout_p)
        torch.autograd.backward(outputs, upstream)
        return outputs, [t.grad for t in leaves]

    run()  # settles
    taken = _spy(ADD_LAYER_NORM.lanes, None)
    with Recorder() as recorder:  # a dispatch mode watches: the registered op and its autograd
        registered = run()
    assert any(name.startswith("fusedlm.add_layer_norm") for name in recorder.ops) and not taken
    assert _equal(run(), registered) and len(taken) == 1
    for mode in (torch.no_grad(), torch.inference_mode()):
        with mode:
            torch.manual_seed(1)
            assert _equal(F.add_layer_norm(*inputs, dropout_p=dropout_p), registered[0])
    assert len(taken) == 3


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_settled_bias_gelu_gives_the_registered_ops_output_and_gradients(dtype, approximate):
    x, b = torch.randn(3, 5, 64, dtype=dtype), torch.randn(64, dtype=dtype)
    upstream = torch.randn(3, 5, 64, dtype=dtype)

    def run():
        leaves = [x.clone().requires_grad_(), b.clone().requires_grad_()]
        out = F.bias_gelu(*leaves, approximate)
        out.backward(upstream)
        return out, [t.grad for t in leaves]

    run()
    taken = _spy(BIAS_GELU.lanes, None)
    with Recorder():
        registered = run()
    assert not taken and _equal(run(), registered) and len(taken) == 1


@pytest.mark.filterwarnings("ignore:`torch.jit.trace` is deprecated")
def test_a_lane_steps_aside_when_something_but_autograd_watches():
    x, b = torch.randn(4, 16), torch.randn(16)
    lane = fusedlm._C.bias_gelu_eager
    with Recorder():
        assert lane(ALL, x, b, "none") is None
    assert torch.func.vmap(lambda row: lane(ALL, row, b, "none") is None and row)(x).shape == x.shape
    assert torch.func.grad(lambda t: (lane(ALL, t, b, "none") is None) * t.sum())(x).shape == x.shape
    traced = torch.jit.trace(lambda t: t * float(lane(ALL, t, b, "none") is None), (x,),
                             check_trace=False)
    assert torch.equal(traced(x), x)


def test_a_forced_backend_takes_calls_off_the_automatic_lane():
    x, r, w, b = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32), torch.randn(32)
    F.add_layer_norm(x, r, w, b)
    taken = _spy(ADD_LAYER_NORM.lanes, None)
    with fusedlm.use_backend("reference"):
        out, _ = F.add_layer_norm(x, r, w, b)
    assert not taken
    assert torch.equal(out, F.add_layer_norm(x, r, w, b, backend="reference")[0])
    fusedlm.set_backend("reference")
    try:
        F.add_layer_norm(x, r, w, b)
        assert not taken
    finally:
        fusedlm.set_backend(None)
    with fusedlm.use_backend(None):  # forces nothing
        F.add_layer_norm(x, r, w, b)
    assert len(taken) == 1


def test_a_change_to_dispatch_closes_the_lanes(monkeypatch):
    x, b = torch.randn(4, 16), torch.randn(16)
    F.bias_gelu(x, b)
    assert BIAS_GELU.lanes
    verify.forget()  # the checks' results: the lanes rest on them
    assert not BIAS_GELU.lanes
    F.bias_gelu(x, b)
    monkeypatch.setattr(_REGISTRY["cpu"], "supports", Supports())
    assert not BIAS_GELU.lanes
    monkeypatch.undo()
    F.bias_gelu(x, b)
    assert BIAS_GELU.lanes
    kernels = _REGISTRY["cpu"].kernels
    monkeypatch.setitem(kernels, "bias_gelu", kernels["bias_gelu"])  # a kernel swapped at run time
    assert not BIAS_GELU.lanes
