"""Ops that call their kernel directly when nothing watches (no grad, no compile, no
dispatch mode) give the registered op's results, and step aside when something does."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlm.ops as F
from helpers import backends_for


class Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _calls():
    x, r = torch.randn(3, 5, 64), torch.randn(3, 5, 64)
    w, b = torch.randn(64), torch.randn(64)
    q = torch.randn(2, 1, 4, 16)
    cache = torch.randn(2, 8, 4, 16)
    lengths = torch.tensor([3, 5], dtype=torch.int32)
    new = torch.randn(2, 1, 4, 16)
    return {
        "add_layer_norm": lambda backend: F.add_layer_norm(x, r, w, b, backend=backend),
        "bias_gelu": lambda backend: F.bias_gelu(x, b, "tanh", backend=backend),
        "attention_with_kvcache": lambda backend: F.attention_with_kvcache(
            q, cache.clone(), cache.clone(), lengths, new, new, backend=backend),
    }


OPS = ["add_layer_norm", "bias_gelu", "attention_with_kvcache"]


@pytest.mark.parametrize("op, backend", [
    pytest.param(op, *param.values, marks=param.marks, id=f"{param.id}-{op}")
    for op in OPS for param in backends_for(op)])
def test_a_direct_call_gives_the_registered_ops_result(op, backend):
    call = _calls()[op]
    with torch.no_grad():
        direct = call(backend)
    registered = call(backend)  # grad mode on: the registered op runs
    for a, b in zip(torch.utils._pytree.tree_leaves(direct), torch.utils._pytree.tree_leaves(registered)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("op", OPS)
def test_a_dispatch_mode_still_sees_the_op(op):
    with torch.no_grad(), Recorder() as recorder:
        _calls()[op]("cpu")
    assert any(name.startswith(f"fusedlm.{op}") for name in recorder.ops), recorder.ops
