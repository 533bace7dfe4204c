"""One call path per op: an eager call of fusedlm.ops.<op> is one call into torch's
dispatcher, whose C++ autograd node (csrc/ops) records it on every backend. The node must
give, bit for bit, what the backend's own forward and backward kernels give when called by
hand as the op documents them (the kernels' arguments, what the forward saves, which
gradient goes where), dropout included under the same seed."""
import pytest
import torch

import fusedlm.ops as F
from fusedlm.backends import kernel
from fusedlm.dtypes import acc_dtype
from fusedlm.ops._dropout import next_seed
from fusedlm.ops.cross_entropy import LOGITS_CHUNK_BYTES
from helpers import FunctionRecorder, Recorder, backend_device, backends_for, fresh

SEED = 1234


def _dtype(backend):
    """The widest dtype every kernel of the backend takes."""
    return {"cpu": torch.float64, "triton": torch.float32, "cuda": torch.bfloat16}[backend]


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _seeded(p):
    torch.manual_seed(SEED)
    return next_seed(p)


def _add_layer_norm(backend, device, dtype, p):
    x, r, w, b = _leaves(*(fresh(s, dtype, device) for s in ((3, 5, 32), (3, 5, 32), (32,), (32,))))
    g_out, g_sum = fresh((3, 5, 32), dtype, device), fresh((3, 5, 32), dtype, device)

    def public():
        torch.manual_seed(SEED)
        out, summed = F.add_layer_norm(x, r, w, b, 1e-5, dropout_p=p, backend=backend)
        return (out, summed), (g_out, g_sum), (x, r, w, b)

    def by_hand():
        k, seed = kernel(backend, "add_layer_norm"), _seeded(p)
        out, summed, mean, rstd = k.forward(x, r, w, b, 1e-5, p, seed)
        dsummed, dx, dw, db = k.backward(g_out, g_sum, summed, mean, rstd, w, True, True, p, seed)
        return (out, summed), (dx if p > 0 else dsummed, dsummed, dw, db)

    return public, by_hand


def _bias_gelu(backend, device, dtype, p):
    x, b = _leaves(fresh((4, 24), dtype, device), fresh((24,), dtype, device))
    g = fresh((4, 24), dtype, device)

    def public():
        return (F.bias_gelu(x, b, "tanh", backend=backend),), (g,), (x, b)

    def by_hand():
        k = kernel(backend, "bias_gelu")
        return (k.forward(x, b, "tanh"),), k.backward(g, x, b, "tanh")

    return public, by_hand


def _gelu_ffn(backend, device, dtype, p):
    x, w1, b1, w2, b2 = _leaves(fresh((20, 32), dtype, device), fresh((64, 32), dtype, device, 0.2),
                                fresh((64,), dtype, device), fresh((32, 64), dtype, device, 0.2),
                                fresh((32,), dtype, device))
    g = fresh((20, 32), dtype, device)

    def public():
        torch.manual_seed(SEED)
        return ((F.gelu_ffn(x, w1, b1, w2, b2, dropout_p=p, backend=backend),), (g,),
                (x, w1, b1, w2, b2))

    def by_hand():
        k, seed = kernel(backend, "gelu_ffn"), _seeded(p)
        out, pre = k.forward(x, w1, b1, w2, b2, "none", p, seed)
        return (out,), k.backward(g, x, pre, w1, b1, w2, b2, "none", p, seed)

    return public, by_hand


def _attention(backend, device, dtype, p):
    # k and v of one head shared by q's two (multi-query), and a window of 3 keys back
    q, k_, v, bias = _leaves(*(fresh(s, dtype, device) for s in
                               ((2, 2, 6, 64), (2, 1, 6, 64), (2, 1, 6, 64), (1, 2, 6, 6))))
    mask = torch.tensor([[False] * 6, [False] * 4 + [True] * 2], device=device)
    g = fresh((2, 2, 6, 64), dtype, device)
    bias_arg = bias if backend != "cuda" else None  # (the cuda kernel takes no attn_bias)
    scale = 64 ** -0.5

    def public():
        torch.manual_seed(SEED)
        out = F.attention(q, k_, v, key_padding_mask=mask, attn_bias=bias_arg, dropout_p=p,
                          window_size=(3, -1), backend=backend)
        return (out,), (g,), (q, k_, v) + ((bias,) if bias_arg is not None else ())

    def by_hand():
        kern, seed = kernel(backend, "attention"), _seeded(p)
        out, lse = kern.forward(q, k_, v, mask, bias_arg, False, 3, -1, p, scale, seed)
        dq, dk, dv, dbias = kern.backward(g, q, k_, v, out, lse, mask, bias_arg, False, 3, -1, p,
                                          scale, seed, bias_arg is not None)
        return (out,), (dq, dk, dv) + ((dbias,) if bias_arg is not None else ())

    return public, by_hand


def _attention_varlen(backend, device, dtype, p):
    q, k_, v = _leaves(*(fresh((9, 2, 64), dtype, device) for _ in range(3)))
    cu = torch.tensor([0, 4, 9], dtype=torch.int32, device=device)
    g = fresh((9, 2, 64), dtype, device)

    def public():
        torch.manual_seed(SEED)
        out = F.attention_varlen(q, k_, v, cu, cu, 5, 5, causal=True, dropout_p=p,
                                 window_size=(2, -1), backend=backend)
        return (out,), (g,), (q, k_, v)

    def by_hand():
        kern, seed = kernel(backend, "attention_varlen"), _seeded(p)
        out, lse = kern.forward(q, k_, v, cu, cu, 5, 5, True, 2, -1, p, 64 ** -0.5, seed)
        return (out,), kern.backward(g, q, k_, v, out, lse, cu, cu, 5, 5, True, 2, -1, p,
                                     64 ** -0.5, seed)

    return public, by_hand


def _labels(device):
    return torch.tensor([3, -100, 0, 7, 15, -100], device=device)


def _cross_entropy(backend, device, dtype, p):
    (logits,) = _leaves(fresh((6, 16), dtype, device))
    g = torch.tensor(0.7, dtype=acc_dtype(dtype), device=device)

    def public():
        return (F.cross_entropy(logits, _labels(device), label_smoothing=0.1, backend=backend),), (g,), (logits,)

    def by_hand():
        loss, saved = kernel(backend, "cross_entropy").forward(logits, _labels(device), -100, 0.1,
                                                              "mean", True)
        return (loss,), (kernel(backend, "cross_entropy").backward(g, saved, "mean"),)

    return public, by_hand


def _distillation_loss(backend, device, dtype, p):
    student, = _leaves(fresh((6, 16), dtype, device))
    teacher = fresh((6, 16), dtype, device, requires_grad=False)
    g = torch.tensor(0.7, dtype=acc_dtype(dtype), device=device)

    def public():
        return (F.distillation_loss(student, teacher, temperature=2.0, backend=backend),), (g,), (student,)

    def by_hand():
        loss, saved = kernel(backend, "distillation_loss").forward(student, teacher, 2.0,
                                                                  "mean", True)
        return (loss,), (kernel(backend, "cross_entropy").backward(g, saved, "mean"),)

    return public, by_hand


def _masked_lm_loss(backend, device, dtype, p):
    hidden, weight, bias = _leaves(fresh((6, 32), dtype, device), fresh((16, 32), dtype, device, 0.2),
                                   fresh((16,), dtype, device))
    g = torch.tensor(0.7, dtype=acc_dtype(dtype), device=device)

    def public():
        return ((F.masked_lm_loss(hidden, weight, bias, _labels(device), backend=backend),), (g,),
                (hidden, weight, bias))

    def by_hand():
        kern = kernel(backend, "masked_lm_loss")
        chunk = max(1, LOGITS_CHUNK_BYTES // (16 * hidden.element_size()))
        loss, *saved = kern.forward(hidden, weight, bias, _labels(device), -100, 0.0, "mean", chunk,
                                    True, True, True)
        return (loss,), kern.backward(g, hidden, weight, bias, _labels(device), *saved, -100, 0.0,
                                      "mean", chunk, True, True, True)

    return public, by_hand


def _lstm_cell(backend, device, dtype, p):
    gates, c_prev = _leaves(fresh((5, 64), dtype, device), fresh((5, 16), dtype, device))
    g_h, g_c = fresh((5, 16), dtype, device), fresh((5, 16), dtype, device)

    def public():
        return F.lstm_cell(gates, c_prev, cell_clip=1.5, backend=backend), (g_h, g_c), (gates, c_prev)

    def by_hand():
        kern = kernel(backend, "lstm_cell")
        return kern.forward(gates, c_prev, 1.5), kern.backward(g_h, g_c, gates, c_prev, 1.5)

    return public, by_hand


def _padding_case(device):
    mask = torch.tensor([[False, False, True, True], [False, False, False, True]], device=device)
    indices = torch.nonzero(~mask.flatten()).flatten()
    return mask, indices


def _pad(backend, device, dtype, p):
    mask, indices = _padding_case(device)
    (packed,) = _leaves(fresh((5, 8), dtype, device))
    g = fresh((2, 4, 8), dtype, device)

    def public():
        return (F.pad(packed, indices, 2, 4, backend=backend),), (g,), (packed,)

    def by_hand():
        kern = kernel(backend, "pad")
        return (kern.forward(packed, indices, 2, 4),), (kern.backward(g, indices),)

    return public, by_hand


def _unpad(backend, device, dtype, p):
    mask, indices = _padding_case(device)
    (hidden,) = _leaves(fresh((2, 4, 8), dtype, device))
    g = fresh((5, 8), dtype, device)

    def public():
        packed, *_ = F.unpad(hidden, mask, backend=backend)
        return (packed,), (g,), (hidden,)

    def by_hand():
        packed, found, _, _ = kernel(backend, "unpad").forward(hidden, mask)
        return (packed,), (kernel(backend, "pad").forward(g, found, 2, 4),)

    return public, by_hand


CASES = {
    "add_layer_norm": (_add_layer_norm, (0.0, 0.3)),
    "bias_gelu": (_bias_gelu, (0.0,)),
    "gelu_ffn": (_gelu_ffn, (0.0, 0.3)),
    "attention": (_attention, (0.0, 0.2)),
    "attention_varlen": (_attention_varlen, (0.0, 0.2)),
    "cross_entropy": (_cross_entropy, (0.0,)),
    "distillation_loss": (_distillation_loss, (0.0,)),
    "masked_lm_loss": (_masked_lm_loss, (0.0,)),
    "lstm_cell": (_lstm_cell, (0.0,)),
    "pad": (_pad, (0.0,)),
    "unpad": (_unpad, (0.0,)),
}


def _params():
    for op, (_, dropouts) in CASES.items():
        for param in backends_for(op):
            for p in dropouts:
                yield pytest.param(op, *param.values, p, marks=param.marks,
                                   id=f"{param.id}-{op}-p{p}")


@pytest.mark.parametrize("op, backend, p", list(_params()))
def test_the_ops_node_gives_its_kernels_results_bit_for_bit(op, backend, p):
    device = backend_device(backend)
    public, by_hand = CASES[op][0](backend, device, _dtype(backend), p)
    outputs, upstream, leaves = public()
    node = outputs[0].grad_fn
    # The node is the op's own C++ node (csrc/ops), not a Python Function's.
    assert not isinstance(node, torch.autograd.function.BackwardCFunction), type(node)
    assert node.name().startswith("fusedlm::") and node.name().endswith("Backward"), node.name()
    grads = torch.autograd.grad(outputs, leaves, upstream)
    with torch.no_grad():
        expected_outputs, expected_grads = by_hand()
    assert len(expected_outputs) == len(outputs) and len(expected_grads) == len(grads)
    for i, (got, want) in enumerate(zip(outputs, expected_outputs)):
        assert torch.equal(got, want), f"output {i}"
    for i, (got, want) in enumerate(zip(grads, expected_grads)):
        assert torch.equal(got, want), f"gradient {i}"


@pytest.mark.parametrize("op", list(CASES))
def test_an_eager_call_is_one_dispatcher_call_and_its_backward_another(op):
    # Seen from a dispatch mode below autograd: the op's forward, then its backward op (or,
    # for unpad and distillation_loss, the op that is their backward), and nothing else of
    # fusedlm's.
    public, _ = CASES[op][0]("cpu", torch.device("cpu"), torch.float64, 0.0)
    outputs, upstream, leaves = public()
    with Recorder() as recorder:
        outputs, upstream, leaves = public()
        torch.autograd.grad(outputs, leaves, upstream)
    ours = [name for name in recorder.ops if name.startswith("fusedlm.")]
    backward = {"unpad": "pad", "distillation_loss": "cross_entropy_backward"}.get(op, f"{op}_backward")
    assert ours == [f"fusedlm.{op}.default", f"fusedlm.{backward}.default"], ours


def test_a_backward_op_autograd_would_record_raises():
    # A backward op runs below autograd (its node calls it with grad mode off; a gradient to
    # be differentiated again is the reference backward's): a call autograd would record has
    # no derivative to record, and says so instead of returning gradients that silently
    # have none.
    summed = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(4, 8, dtype=torch.float64)
    stats = torch.zeros(4, dtype=torch.float64)
    op = torch.ops.fusedlm.add_layer_norm_backward
    call = (grad, None, summed, stats, stats + 1, None, False, True, 0.0, next_seed(0.0), "cpu")
    with pytest.raises(RuntimeError, match="add_layer_norm_backward has no derivative"):
        op(*call)
    with torch.no_grad():
        dsummed, *_ = op(*call)
    assert dsummed.shape == summed.shape


class _Watched(torch.Tensor):
    seen = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(str(func))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def test_calls_watched_by_torch_function_reach_it_through_the_op():
    # The compiled entry hands a call a torch function mode or a tensor's own
    # __torch_function__ watches to the OpOverload, which shows it to them; the answer is
    # the entry's.
    logits = torch.randn(6, 10, dtype=torch.float64)
    labels = torch.randint(10, (6,))
    expected = F.cross_entropy(logits, labels, backend="cpu")
    with FunctionRecorder() as mode:
        got = F.cross_entropy(logits, labels, backend="cpu")
    assert "fusedlm.cross_entropy.default" in mode.ops
    assert torch.equal(got, expected)
    _Watched.seen.clear()
    got = F.cross_entropy(logits.as_subclass(_Watched), labels, backend="cpu")
    assert "fusedlm.cross_entropy.default" in _Watched.seen
    assert torch.equal(got.as_subclass(torch.Tensor), expected)
    # A Parameter's __torch_function__ is torch's disabled one: the entry takes it.
    w = torch.nn.Parameter(torch.randn(8, dtype=torch.float64))
    x = torch.randn(4, 8, dtype=torch.float64)
    out, _ = F.add_layer_norm(x, None, w, None, 1e-5, backend="cpu")
    assert out.grad_fn.name() == "fusedlm::AddLayerNormBackward"


def test_the_compiled_entry_checks_its_arguments():
    from fusedlm.ops.cross_entropy import CROSS_ENTROPY
    logits, labels = torch.randn(4, 8), torch.randint(8, (4,))
    with pytest.raises(TypeError, match="fusedlm::cross_entropy takes 7 arguments, got 2"):
        CROSS_ENTROPY.call("cpu", logits)
    with pytest.raises(TypeError, match="fusedlm::cross_entropy: argument 1 has an unexpected type"):
        CROSS_ENTROPY.call("cpu", logits, "labels", -100, 0.0, "mean", False)
    with pytest.raises(RuntimeError, match="op nonesuch has no eager entry"):
        from fusedlm._extension import _C
        _C.op_entry("nonesuch", print)
