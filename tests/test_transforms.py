"""Every op under torch.func's transforms, forward-mode AD and double backward, on every
backend: what plain PyTorch's composition of the op (fusedlm.ops.reference) computes, or an
error that names the op.

Under a transform an op runs its plain-PyTorch composition (the kernels have no
forward-mode or batching rules); a gradient taken with create_graph=True is recomputed by
the reference backward, which autograd records, from what the backend's forward saved.
"""
import functools
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import grad, jacfwd, jacrev, jvp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlm
from fusedlm import ops
from fusedlm.backends import kernel
from fusedlm.backends.reference import keep_mask
from fusedlm.ops import reference
from helpers import backend_device, backends_for


@dataclass(frozen=True)
class Case:
    """``run(op, *inputs)``: one tensor from the op ``op(name)`` names, differentiable in every
    one of ``shapes``' inputs (drawn fresh); ``twice``: whether a double backward is
    supported (else it raises, naming the op)."""

    op: str
    shapes: tuple
    run: Callable
    twice: bool = True


def _lengths_mask(lengths, seq):
    return torch.arange(seq) >= torch.tensor(lengths)[:, None]  # True = padding


_PADDING = _lengths_mask([5, 3], 5)
_CU = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
_LABELS = torch.tensor([1, -100, 7, 0, 9, 3])


def _add_layer_norm(op, x, residual, weight, bias):
    out, summed = op("add_layer_norm")(x, residual, weight, bias)
    return 2 * out + summed  # both outputs, so each gradient path is taken


def _lstm_cell(op, gates, c_prev):
    h, c = op("lstm_cell")(gates, c_prev, cell_clip=2.0)
    return h + 3 * c


def _lstm_steps(op, gates, c_prev):
    """Two steps of a recurrence (ELMo's loop)."""
    h, c = op("lstm_cell")(gates, c_prev, cell_clip=2.0)
    h, c = op("lstm_cell")(gates * h.repeat(1, 4), c, cell_clip=2.0)
    return h + 3 * c


def _unpad_pad(op, hidden):
    packed, indices, _, _ = op("unpad")(hidden, _PADDING)
    return op("pad")(packed * packed, indices, 2, 5)


CASES = [
    Case("add_layer_norm", ((3, 8), (3, 8), (8,), (8,)), _add_layer_norm),
    Case("bias_gelu", ((3, 8), (8,)), lambda op, x, b: op("bias_gelu")(x, b)),
    Case("bias_gelu", ((3, 8), (8,)), lambda op, x, b: op("bias_gelu")(x, b, approximate="tanh")),
    Case("gelu_ffn", ((3, 8), (16, 8), (16,), (8, 16), (8,)),
         lambda op, *t: op("gelu_ffn")(*t)),
    # (head_dim 64: the cuda kernels take 64 and 128)
    Case("attention", ((2, 1, 5, 64),) * 3,
         lambda op, q, k, v: op("attention")(q, k, v, key_padding_mask=_PADDING)),
    Case("attention", ((1, 2, 5, 64),) * 3,
         lambda op, q, k, v: op("attention")(q, k, v, causal=True)),
    Case("attention_varlen", ((8, 1, 64),) * 3,
         lambda op, q, k, v: op("attention_varlen")(q, k, v, _CU, _CU, 4, 4, causal=True)),
    Case("lstm_cell", ((3, 16), (3, 4)), _lstm_cell),
    Case("lstm_cell", ((3, 16), (3, 4)), _lstm_steps),
    Case("masked_lm_loss", ((6, 8), (10, 8), (10,)),
         lambda op, h, w, b: op("masked_lm_loss")(h, w, b, _LABELS)),
    Case("cross_entropy", ((6, 10),), lambda op, logits: op("cross_entropy")(logits, _LABELS),
         twice=False),
    Case("distillation_loss", ((6, 10), (6, 10)),
         lambda op, student, teacher: op("distillation_loss")(student, teacher.detach()),
         twice=False),
    Case("unpad", ((2, 5, 4),), _unpad_pad),
]
CASE_IDS = [f"{case.op}-{i}" for i, case in enumerate(CASES)]


def _params():
    """(backend, case) for every case and every backend with the op's kernels, the
    reference and PyTorch's own composition (the torch backend) included."""
    params = []
    plain = [pytest.param("reference", id="reference"), pytest.param("torch", id="torch")]
    for case, case_id in zip(CASES, CASE_IDS):
        for backend in [*plain, *backends_for(case.op)]:
            params.append(pytest.param(*backend.values, case,
                                       id=f"{backend.id}-{case_id}", marks=backend.marks))
    return params


def _dtype(backend, op):
    """The widest of float64, float32 and bfloat16 that ``backend``'s kernel of ``op`` takes."""
    if backend in ("reference", "torch"):
        return torch.float64
    return next(d for d in (torch.float64, torch.float32, torch.bfloat16)
                if d in kernel(backend, op).supports.dtypes)


# Norm-wise relative error allowed of a kernel's forward in a dtype narrower than float64,
# followed by a reference backward (taken twice, or batched), against float64: the
# forward's rounding reaches the gradients through its outputs, and second derivatives
# amplify it.
RELATIVE_ERROR = {torch.float32: 1e-3, torch.bfloat16: 3e-2}


def _on(backend):
    """The op named, pinned to ``backend``."""
    return lambda name: functools.partial(getattr(ops, name), backend=backend)


def _reference(name):
    return getattr(reference, name)


def _inputs(case, backend, dtype):
    device = backend_device(backend)
    return tuple(torch.randn(shape, dtype=torch.float64).to(dtype=dtype, device=device)
                 for shape in case.shapes)


def _assert_close(actual, expected, dtype, what):
    leaves = torch.utils._pytree.tree_leaves
    for a, e in zip(leaves(actual), leaves(expected), strict=True):
        assert a.abs().max() > 0 or e.abs().max() == 0, f"{what}: zeros where plain PyTorch is not"
        if dtype == torch.float64:
            torch.testing.assert_close(a, e, atol=1e-9, rtol=1e-7, msg=lambda m: f"{what}: {m}")
        else:
            error = (a.double() - e.double()).norm() / e.double().norm().clamp(min=1e-300)
            assert error < RELATIVE_ERROR[dtype], f"{what}: relative error {error:.2e}"


backend_and_case = pytest.mark.parametrize("backend, case", _params())


@backend_and_case
def test_jvp(backend, case):
    dtype = _dtype(backend, case.op)
    inputs, tangents = _inputs(case, backend, dtype), _inputs(case, backend, dtype)
    got = jvp(functools.partial(case.run, _on(backend)), inputs, tangents)
    expected = jvp(functools.partial(case.run, _reference), inputs, tangents)
    _assert_close(got, expected, dtype, "jvp")


@backend_and_case
def test_forward_mode_ad(backend, case):
    dtype = _dtype(backend, case.op)
    inputs, tangents = _inputs(case, backend, dtype), _inputs(case, backend, dtype)
    results = []
    for op in (_on(backend), _reference):
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(x, t) for x, t in zip(inputs, tangents)]
            results.append(forward_ad.unpack_dual(case.run(op, *duals)))
    _assert_close(tuple(results[0]), tuple(results[1]), dtype, "forward-mode AD")


@backend_and_case
@pytest.mark.parametrize("transform", [jacrev, jacfwd], ids=["jacrev", "jacfwd"])
def test_jacobians(backend, case, transform):
    dtype = _dtype(backend, case.op)
    inputs = _inputs(case, backend, dtype)
    argnums = tuple(range(len(inputs)))
    got = transform(functools.partial(case.run, _on(backend)), argnums)(*inputs)
    expected = transform(functools.partial(case.run, _reference), argnums)(*inputs)
    _assert_close(got, expected, dtype, transform.__name__)


@backend_and_case
def test_grad(backend, case):
    dtype = _dtype(backend, case.op)
    inputs = _inputs(case, backend, dtype)
    argnums = tuple(range(len(inputs)))

    def loss(op, *t):
        return case.run(op, *t).pow(2).sum()

    got = grad(functools.partial(loss, _on(backend)), argnums)(*inputs)
    expected = grad(functools.partial(loss, _reference), argnums)(*inputs)
    _assert_close(got, expected, dtype, "torch.func.grad")
    # grad of grad: a Hessian-vector product
    vector = _inputs(case, backend, dtype)

    def hvp(op, *t):
        first = grad(functools.partial(loss, op), argnums)(*t)
        return sum((g * v).sum() for g, v in zip(first, vector))

    _assert_close(grad(functools.partial(hvp, _on(backend)), argnums)(*inputs),
                  grad(functools.partial(hvp, _reference), argnums)(*inputs), dtype,
                  "grad of grad")


@backend_and_case
def test_vmap(backend, case):
    if case.op == "unpad":
        pytest.skip("unpad's output size depends on the mask's values, which vmap cannot batch")
    dtype = _dtype(backend, case.op)
    batched = tuple(torch.stack([x, 2 * x]) for x in _inputs(case, backend, dtype))
    argnums = tuple(range(len(batched)))
    got = vmap(functools.partial(case.run, _on(backend)))(*batched)
    expected = vmap(functools.partial(case.run, _reference))(*batched)
    _assert_close(got, expected, dtype, "vmap")

    def loss(op, *t):
        return case.run(op, *t).pow(2).sum()

    got = vmap(grad(functools.partial(loss, _on(backend)), argnums))(*batched)
    expected = vmap(grad(functools.partial(loss, _reference), argnums))(*batched)
    _assert_close(got, expected, dtype, "vmap of grad (per-sample gradients)")


@backend_and_case
def test_batched_gradients(backend, case):
    """torch.autograd.grad's is_grads_batched, which runs the backward under vmap: one
    gradient per row of a batch of output gradients, as plain PyTorch gives them."""
    dtype = _dtype(backend, case.op)
    inputs = _inputs(case, backend, dtype)
    results = []
    for op, dtype_used in ((_on(backend), dtype), (_reference, torch.float64)):
        leaves = [x.to(dtype_used).requires_grad_() for x in inputs]
        out = case.run(op, *leaves)
        if not results:
            batch = torch.randn(3, *out.shape, dtype=torch.float64)
        taken = torch.autograd.grad(out, leaves, batch.to(out.dtype), is_grads_batched=True,
                                    allow_unused=True)  # (a distillation teacher's is None)
        results.append([g for g in taken if g is not None])
    _assert_close(results[0], results[1], dtype, "batched gradients")


def _penalty_grads(run, inputs):
    """The gradients of a gradient penalty, ‖∂L/∂inputs‖², with respect to the inputs, by
    torch.autograd with create_graph=True (eager code's double backward)."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    first = torch.autograd.grad(run(*leaves).pow(2).sum(), leaves, create_graph=True,
                                allow_unused=True)  # (a distillation teacher's is None)
    penalty = sum(g.pow(2).sum() for g in first if g is not None)
    return [g for g in torch.autograd.grad(penalty, leaves, allow_unused=True) if g is not None]


# PyTorch's own limit, which the torch backend keeps: SDPA's fused kernels have no double
# backward.
SDPA_OPS = ("attention", "attention_varlen")


@backend_and_case
def test_double_backward(backend, case):
    dtype = _dtype(backend, case.op)
    inputs = _inputs(case, backend, dtype)
    run = functools.partial(case.run, _on(backend))
    if backend == "torch" and case.op in SDPA_OPS:
        with pytest.raises(RuntimeError, match="derivative for .* is not implemented"):
            _penalty_grads(run, inputs)
        return
    if not case.twice and backend != "torch":
        with pytest.raises(RuntimeError, match=f"fusedlm: {case.op}: double backward"):
            _penalty_grads(run, inputs)
        return
    got = _penalty_grads(run, inputs)
    expected = _penalty_grads(functools.partial(case.run, _reference),
                              tuple(x.double() for x in inputs))
    _assert_close(got, expected, dtype, "double backward")


def test_double_backward_with_dropout_on_the_reference():
    """The reference backend's backward redraws its forward's dropout mask from the seed."""
    x, residual = (torch.randn(3, 8, dtype=torch.float64) for _ in range(2))
    torch.manual_seed(5)
    keep = keep_mask(torch.randint(0, 2**62, (), dtype=torch.int64), x.shape, 0.25, x.device)
    torch.manual_seed(5)
    got = _penalty_grads(lambda x, r: ops.add_layer_norm(x, r, None, None, dropout_p=0.25,
                                                         backend="reference")[0], (x, residual))
    expected = _penalty_grads(lambda x, r: reference.add_layer_norm(
        x, r, None, None, dropout_p=0.25, dropout_mask=keep)[0], (x, residual))
    _assert_close(got, expected, torch.float64, "double backward with dropout")


@pytest.mark.parametrize("backend", backends_for("add_layer_norm"))
def test_reference_backward_with_dropout_refused(backend):
    dtype = _dtype(backend, "add_layer_norm")
    x, residual = (torch.randn(3, 8, dtype=dtype, device=backend_device(backend),
                               requires_grad=True) for _ in range(2))
    out, _ = ops.add_layer_norm(x, residual, None, None, dropout_p=0.25, backend=backend)
    with pytest.raises(RuntimeError, match="fusedlm: add_layer_norm: double backward .*dropout_p > 0"):
        torch.autograd.grad(out.pow(3).sum(), x, create_graph=True, retain_graph=True)
    with pytest.raises(RuntimeError, match="fusedlm: add_layer_norm: .*batched gradient.*dropout_p > 0"):
        torch.autograd.grad(out, x, torch.randn(2, *out.shape, dtype=dtype, device=out.device),
                            is_grads_batched=True)


@pytest.mark.parametrize("case", [c for c in CASES if c.twice], ids=[
    i for c, i in zip(CASES, CASE_IDS) if c.twice])
def test_gradgradcheck_cpu(case):
    """torch's own checks of first and second derivatives, in float64 on the cpu backend."""
    inputs = tuple(x.requires_grad_() for x in _inputs(case, "cpu", torch.float64))
    run = functools.partial(case.run, _on("cpu"))
    assert torch.autograd.gradcheck(run, inputs, fast_mode=True)
    assert torch.autograd.gradgradcheck(run, inputs, fast_mode=True)


def _twins(name):
    """(fusedlm.nn module, its torch.nn namesake with the same weights, a float64 input, and
    how each is called)."""
    f64 = dict(dtype=torch.float64)
    if name == "LayerNorm":
        pair = fusedlm.nn.LayerNorm(8, **f64), torch.nn.LayerNorm(8, **f64)
        x, call = torch.randn(4, 8, **f64), lambda module, x: module(x)
    elif name == "MultiheadAttention":
        pair = (fusedlm.nn.MultiheadAttention(8, 2, batch_first=True, **f64),
                torch.nn.MultiheadAttention(8, 2, batch_first=True, **f64))
        x, call = torch.randn(2, 5, 8, **f64), lambda module, x: module(x, x, x, need_weights=False)[0]
    elif name == "GeluFFN":
        pair = fusedlm.nn.GeluFFN(8, 16, **f64), _LinearGeluLinear(8, 16, **f64)
        x, call = torch.randn(4, 8, **f64), lambda module, x: module(x)
    elif name == "CrossEntropyLoss":
        pair = fusedlm.nn.CrossEntropyLoss(), torch.nn.CrossEntropyLoss()
        x, call = torch.randn(6, 10, **f64), lambda module, x: module(x, _LABELS)
    elif name == "LinearCrossEntropyLoss":
        weight = torch.randn(10, 8, **f64)
        pair = fusedlm.nn.LinearCrossEntropyLoss(), _LinearCrossEntropy()
        x, call = torch.randn(6, 8, **f64), lambda module, x: module(x, weight, _LABELS)
    else:
        layers = [cls(8, 2, 16, dropout=0.0, activation="gelu", batch_first=True, **f64)
                  for cls in (fusedlm.nn.TransformerEncoderLayer, torch.nn.TransformerEncoderLayer)]
        pair = (layers if name == "TransformerEncoderLayer" else
                (fusedlm.nn.TransformerEncoder(layers[0], 2),
                 torch.nn.TransformerEncoder(layers[1], 2, enable_nested_tensor=False)))
        x, call = torch.randn(2, 5, 8, **f64), lambda module, x: module(x)
    pair[0].load_state_dict(pair[1].state_dict())
    for module in pair:
        module.eval()
    return (*pair, x, call)


class _LinearGeluLinear(torch.nn.Module):
    def __init__(self, d_model, d_ff, **factory):
        super().__init__()
        self.fc1 = torch.nn.Linear(d_model, d_ff, **factory)
        self.fc2 = torch.nn.Linear(d_ff, d_model, **factory)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _LinearCrossEntropy(torch.nn.Module):
    def forward(self, hidden, weight, labels):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight), labels)


MODULES = ["LayerNorm", "MultiheadAttention", "TransformerEncoderLayer", "TransformerEncoder",
           "GeluFFN", "CrossEntropyLoss", "LinearCrossEntropyLoss"]


@pytest.mark.parametrize("name", MODULES)
def test_modules_under_transforms(name):
    """fusedlm.nn's modules under jvp, jacrev, vmap, vmap of grad and a gradient penalty's
    double backward: torch.nn's answers."""
    ours, theirs, x, call = _twins(name)
    v = torch.randn_like(x)
    # (torch's fused CPU attention has no double backward: its math path does)
    with sdpa_kernel(SDPBackend.MATH):
        results = []
        for module in (ours, theirs):
            run = functools.partial(call, module)
            leaf = x.clone().requires_grad_()
            batched = torch.stack([x, 2 * x])
            results.append([jvp(run, (x,), (v,)), jacrev(run)(x), vmap(run)(batched),
                            vmap(grad(lambda x: run(x).pow(2).sum()))(batched)])
            if name == "CrossEntropyLoss" and module is ours:
                with pytest.raises(RuntimeError, match="fusedlm: cross_entropy: double backward"):
                    torch.autograd.grad(run(leaf), leaf, create_graph=True)
                continue
            (dx,) = torch.autograd.grad(run(leaf).pow(2).sum(), leaf, create_graph=True)
            wrt = [*module.parameters(), leaf][0]  # a weight where the module has one
            results[-1].append(torch.autograd.grad(dx.pow(2).sum(), wrt)[0])
    for what, got, expected in zip(("jvp", "jacrev", "vmap", "vmap of grad", "gradient penalty"),
                                   *results):
        _assert_close(got, expected, torch.float64, f"{name}: {what}")
