"""bias_gelu and gelu_ffn on the GPU at BERT-base and GPT-2-small shapes, against the float32
reference."""
import pytest
import torch

import fusedlm
from fusedlm.ops import reference
from fusedlm.ops._dropout import next_seed
from checks import (MAX_RELATIVE_ERROR, assert_relative_error, float32_copies, fresh, gpu_backends,
                    grads, keep_mask, needs_cuda, poison_memory, skip_if_refused)

pytestmark = needs_cuda
TOKENS = {"bert-base": 32 * 128, "gpt2-small": 8 * 1024}
# BERT-base's and GPT-2's FFN width, and an odd one (one element per load in the cuda kernels).
WIDTHS = {"ffn-3072": 3072, "odd-3001": 3001}


@pytest.mark.parametrize("backend", gpu_backends("bias_gelu"))
@pytest.mark.parametrize("tokens", TOKENS.values(), ids=TOKENS.keys())
@pytest.mark.parametrize("width", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_real_shapes(backend, tokens, width, dtype, approximate):
    inputs = [fresh((tokens, width), dtype, scale=3.0), fresh((width,), dtype)]
    upstream = torch.randn(tokens, width, device="cuda", dtype=dtype)
    poison_memory()
    out = fusedlm.ops.bias_gelu(*inputs, approximate, backend=backend)
    got = grads([out], inputs, [upstream])
    ref_inputs = float32_copies(*inputs)
    expected = reference.bias_gelu(*ref_inputs, approximate)
    expected_grads = grads([expected], ref_inputs, [upstream.float()])
    assert_relative_error(out, expected, dtype, "out")
    for name, a, e in zip(("dx", "dbias"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)


# The FFN's tokens also at a count that leaves the cuda product's last 128-row block partial.
FFN_TOKENS = {**TOKENS, "odd-1000": 1000}


@pytest.mark.parametrize("backend", gpu_backends("gelu_ffn"))
@pytest.mark.parametrize("tokens", FFN_TOKENS.values(), ids=FFN_TOKENS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_gelu_ffn_real_shapes(backend, tokens, dtype, approximate, dropout_p):
    inputs = [fresh((tokens, 768), dtype), fresh((3072, 768), dtype, scale=768 ** -0.5),
              fresh((3072,), dtype), fresh((768, 3072), dtype, scale=3072 ** -0.5),
              fresh((768,), dtype)]
    skip_if_refused(backend, "gelu_ffn", *inputs)
    upstream = torch.randn(tokens, 768, device="cuda", dtype=dtype)
    torch.manual_seed(11)
    seed = next_seed(dropout_p)
    keep = keep_mask(backend, seed, (tokens, 3072), dropout_p) if dropout_p else None
    poison_memory()
    torch.manual_seed(11)
    out = fusedlm.ops.gelu_ffn(*inputs, approximate=approximate, dropout_p=dropout_p,
                               backend=backend)
    got = grads([out], inputs, [upstream])
    ref_inputs = float32_copies(*inputs)
    expected = reference.gelu_ffn(*ref_inputs, approximate=approximate, dropout_p=dropout_p,
                                  dropout_mask=keep)
    expected_grads = grads([expected], ref_inputs, [upstream.float()])
    assert_relative_error(out, expected, dtype, "out")
    for name, a, e in zip(("dx", "dw1", "db1", "dw2", "db2"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)


@pytest.mark.parametrize("backend", gpu_backends("gelu_ffn"))
def test_gelu_ffn_gradients_repeat_bit_for_bit(backend):
    inputs = [fresh((1000, 768), torch.bfloat16), fresh((3072, 768), torch.bfloat16, scale=0.03),
              fresh((3072,), torch.bfloat16), fresh((768, 3072), torch.bfloat16, scale=0.02),
              fresh((768,), torch.bfloat16)]
    upstream = torch.randn(1000, 768, device="cuda", dtype=torch.bfloat16)
    runs = [grads([fusedlm.ops.gelu_ffn(*inputs, backend=backend)], inputs, [upstream])
            for _ in range(2)]
    for name, a, b in zip(("dx", "dw1", "db1", "dw2", "db2"), *runs):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", [p for p in gpu_backends("gelu_ffn") if p.id == "cuda"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gelu_ffn_wgmma_product_matches_mma_sync(backend, dtype, monkeypatch):
    """On sm_90 the fused product runs on warpgroup products. At sizes that leave every tile
    partial (rows, d_ff, and both products' K, d_in and d_out, off the 128 x 128 x 64
    tiles) it must agree with the float32 reference, and with the mma.sync product (the
    same sums in another order) to half that bound."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma product runs on sm_90 devices only")
    tokens, d_in, d_ff, d_out = 1000, 776, 3000, 520
    inputs = [fresh((tokens, d_in), dtype), fresh((d_ff, d_in), dtype, scale=d_in ** -0.5),
              fresh((d_ff,), dtype), fresh((d_out, d_ff), dtype, scale=d_ff ** -0.5),
              fresh((d_out,), dtype)]
    upstream = torch.randn(tokens, d_out, device="cuda", dtype=dtype)
    torch.manual_seed(11)
    keep = keep_mask(backend, next_seed(0.1), (tokens, d_ff), 0.1)

    def step():
        torch.manual_seed(11)
        out = fusedlm.ops.gelu_ffn(*inputs, dropout_p=0.1, backend=backend)
        return [out] + grads([out], inputs, [upstream])

    wgmma = step()
    monkeypatch.setenv("FUSEDLM_FFN_WGMMA", "0")
    mma_sync = step()
    ref_inputs = float32_copies(*inputs)
    expected = reference.gelu_ffn(*ref_inputs, dropout_p=0.1, dropout_mask=keep)
    expected = [expected] + grads([expected], ref_inputs, [upstream.float()])
    for name, a, b, e in zip(("out", "dx", "dw1", "db1", "dw2", "db2"), wgmma, mma_sync, expected):
        assert_relative_error(a, e, dtype, name)
        assert_relative_error(a, b, dtype, name, MAX_RELATIVE_ERROR[dtype] / 2)
