"""bias_gelu and gelu_ffn on the CPU at BERT-base shapes, against eager PyTorch.

bias_gelu is memory-bound: the fused op reads x and bias once and writes y once,
where F.gelu(x + b) writes and re-reads the sum. gelu_ffn's time is ~95% matrix
products; the target there is only to be no slower than Linear-GELU-Linear.
"""
import pytest
import torch
import torch.nn.functional as F

import fusedlm
from conftest import BATCH, FFN, HIDDEN, SEQ, forward_backward, role


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", ["fusedlm", "torch"])
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_bias_gelu(benchmark, dtype, impl, pass_):
    role(benchmark, f"bias_gelu {pass_} {str(dtype)[6:]} [{BATCH * SEQ}x{FFN}]", impl)
    x = torch.randn(BATCH * SEQ, FFN, dtype=dtype, requires_grad=True)
    b = torch.randn(FFN, dtype=dtype, requires_grad=True)
    fn = (lambda x, b: fusedlm.ops.bias_gelu(x, b, backend="cpu")) if impl == "fusedlm" else (lambda x, b: F.gelu(x + b))
    if pass_ == "forward":
        with torch.no_grad():
            benchmark(fn, x, b)
    else:
        benchmark(forward_backward(fn, (x, b)))


@pytest.mark.parametrize("impl", ["fusedlm", "torch"])
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_gelu_ffn(benchmark, impl, pass_):
    role(benchmark, f"gelu_ffn {pass_} float32 [{BATCH * SEQ}x{HIDDEN}->{FFN}->{HIDDEN}]", impl)
    x = torch.randn(BATCH, SEQ, HIDDEN, requires_grad=True)
    w1 = (torch.randn(FFN, HIDDEN) * HIDDEN**-0.5).requires_grad_()
    b1 = torch.randn(FFN, requires_grad=True)
    w2 = (torch.randn(HIDDEN, FFN) * FFN**-0.5).requires_grad_()
    b2 = torch.randn(HIDDEN, requires_grad=True)
    if impl == "fusedlm":
        def fn(*a):
            return fusedlm.ops.gelu_ffn(*a, backend="cpu")
    else:
        def fn(x, w1, b1, w2, b2):
            return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    inputs = (x, w1, b1, w2, b2)
    if pass_ == "forward":
        with torch.no_grad():
            benchmark(fn, *inputs)
    else:
        benchmark(forward_backward(fn, inputs))
