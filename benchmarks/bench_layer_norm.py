"""add_layer_norm on the CPU at the BERT-base shape, against eager PyTorch.

The op is memory-bound: fused, the forward reads x and the residual once and
writes out and summed once, where F.layer_norm(x + r) writes the sum and reads
it back. The backward reads the upstream gradient and summed and writes one
gradient that serves both x and the residual.
"""
import pytest
import torch
import torch.nn.functional as F

import fusedlm
from conftest import BATCH, HIDDEN, SEQ, forward_backward, role


def _torch_add_layer_norm(x, r, w, b):
    summed = x + r
    return F.layer_norm(summed, (HIDDEN,), w, b), summed


def _fusedlm_add_layer_norm(x, r, w, b):
    return fusedlm.ops.add_layer_norm(x, r, w, b, backend="cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["fusedlm", "torch"])
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_add_layer_norm(benchmark, dtype, impl, pass_):
    role(benchmark, f"add_layer_norm {pass_} {str(dtype)[6:]} [{BATCH * SEQ}x{HIDDEN}]", impl)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype, requires_grad=True)
    r = torch.randn(BATCH, SEQ, HIDDEN, dtype=dtype, requires_grad=True)
    w = torch.randn(HIDDEN, dtype=dtype, requires_grad=True)
    b = torch.randn(HIDDEN, dtype=dtype, requires_grad=True)
    fn = _fusedlm_add_layer_norm if impl == "fusedlm" else _torch_add_layer_norm
    inputs = (x, r, w, b)
    if pass_ == "forward":
        with torch.no_grad():
            benchmark(fn, *inputs)
    else:
        benchmark(forward_backward(fn, inputs))
