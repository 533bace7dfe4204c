"""A malformed call of a compiled entry point (fusedlm._C) raises rather than touching memory
outside its tensors."""
import pytest
import torch

import fusedlm
from fusedlm.backends import cuda as cuda_backend


def _malformed_calls():
    """Calls of the compiled entry points that, unchecked, would let a CPU kernel read or
    write out of bounds (the Python layer never makes them)."""
    C = fusedlm._C
    x = torch.randn(4, 8)
    q = torch.randn(1, 2, 5, 8)
    packed = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    seed = torch.tensor([0])
    out, lse = C.attention_forward(q, q, q, None, None, False, -1, -1, 0.0, 1.0, seed)
    return {
        "layer_norm residual shape": lambda: C.add_layer_norm_forward(
            x, torch.randn(3, 8), None, None, 1e-5, 0.0, seed),
        "layer_norm statistics": lambda: C.add_layer_norm_backward(
            x, None, x, torch.zeros(2), torch.ones(4), None, False, False, 0.0, seed),
        "gelu bias shape": lambda: C.bias_gelu_forward(x, torch.randn(7), "none"),
        "label out of range": lambda: C.cross_entropy_forward(
            x, torch.tensor([0, 1, 8, 2]), -100, 0.0, "mean", True),
        "masked-LM label out of range": lambda: C.masked_lm_loss_forward(
            x, torch.randn(5, 8), None, torch.tensor([0, 9, -100, 1]), -100, 0.0, "mean", 2,
            True, True, False),
        "cu_seqlens past the tokens": lambda: C.attention_varlen_forward(
            packed, packed, packed, cu, torch.tensor([0, 7], dtype=torch.int32), 6, 7, False,
            -1, -1, 0.0, 1.0, seed),
        "sequence longer than max_seqlen": lambda: C.attention_varlen_forward(
            packed, packed, packed, cu, cu, 4, 6, False, -1, -1, 0.0, 1.0, seed),
        "key padding mask shape": lambda: C.attention_forward(
            q, q, q, torch.zeros(1, 4, dtype=torch.bool), None, False, -1, -1, 0.0, 1.0, seed),
        "saved lse shape": lambda: C.attention_backward(
            out, q, q, q, out, lse[:, :1], None, None, False, -1, -1, 0.0, 1.0, seed, False),
        "kv cache overflow": lambda: C.attention_with_kvcache_forward(
            q.transpose(1, 2), torch.zeros(1, 4, 2, 8), torch.zeros(1, 4, 2, 8),
            torch.tensor([3], dtype=torch.int32), torch.randn(1, 2, 2, 8), torch.randn(1, 2, 2, 8),
            None, 1.0),
        "pad index out of range": lambda: C.pad_forward(x, torch.tensor([0, 1, 2, 9]), 2, 4),
        "lstm gradient shape": lambda: C.lstm_cell_backward(
            torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 8), torch.randn(2, 2), 1.0),
    }


@pytest.mark.parametrize("call", list(_malformed_calls()))
def test_a_malformed_direct_call_raises_instead_of_reading_out_of_bounds(call):
    with pytest.raises((ValueError, TypeError, RuntimeError, IndexError)):
        _malformed_calls()[call]()


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_backend.emulated(), reason="not a FUSEDLM_CUDA=emulate build")
def test_a_cuda_launch_past_the_grid_limits_raises_naming_the_grid(cuda_paths):
    # One row more than 65535 tiles of 128: the FFN's fused product's grid has the row
    # tiles on its y dimension, which holds 65535. Unchecked, the count would wrap and rows
    # go unwritten.
    cuda_paths("ffn_cublas", False)
    x = torch.randn(65535 * 128 + 1, 8, dtype=torch.bfloat16)
    w1, w2 = torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(8, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"grid of \(1, 65536, 1\) blocks, past CUDA's limits"):
        fusedlm._C.cuda.gelu_ffn_forward(x, w1, None, w2, None, "none", 0.0, torch.tensor([0]))
