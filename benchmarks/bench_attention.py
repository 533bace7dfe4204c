"""attention on the CPU at BERT-base shapes, against F.scaled_dot_product_attention.

Batch 8, 12 heads, seq 128, head_dim 64, q/k/v passed as transposed views of
[batch, seq, heads, head_dim] tensors (the layout a BERT layer produces). With padding,
each sequence's length is uniform in [64, 128]; SDPA gets the same mask as a bool
attn_mask broadcast over heads and queries. fusedlm skips the padding keys, so with
padding it should do about 3/4 of SDPA's work; without padding both do the same
products and the comparison shows the cost of everything around them.
"""
import pytest
import torch
import torch.nn.functional as F

import fusedlm
from conftest import BATCH, HEADS, HIDDEN, SEQ, forward_backward, role

HEAD_DIM = HIDDEN // HEADS


def _inputs(dtype):
    return [torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, dtype=dtype, requires_grad=True)
            for _ in range(3)]


def _padding():
    lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,))
    return torch.arange(SEQ)[None, :] >= lengths[:, None]  # True = padding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("padded", [True, False], ids=["padding", "no-padding"])
@pytest.mark.parametrize("impl", ["fusedlm", "sdpa"])
@pytest.mark.parametrize("pass_", ["forward", "forward+backward"])
def test_attention(benchmark, dtype, padded, impl, pass_):
    shape = f"{BATCH}x{HEADS}x{SEQ}x{HEAD_DIM}"
    role(benchmark, f"attention {pass_} {str(dtype)[6:]} [{shape}] "
                    f"{'padding' if padded else 'no padding'}", impl)
    inputs = _inputs(dtype)
    mask = _padding() if padded else None
    if impl == "fusedlm":
        def fn(q, k, v):
            return fusedlm.ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         key_padding_mask=mask, backend="cpu")
    else:
        attn_mask = None if mask is None else ~mask[:, None, None, :]

        def fn(q, k, v):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), attn_mask=attn_mask)
    if pass_ == "forward":
        with torch.no_grad():
            benchmark(fn, *inputs)
    else:
        benchmark(forward_backward(fn, inputs))
