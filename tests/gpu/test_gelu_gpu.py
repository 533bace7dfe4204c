"""bias_gelu and gelu_ffn on the GPU at BERT-base and GPT-2-small shapes, against the float32
reference."""
import pytest
import torch

import fusedlm
from fusedlm.backends import triton as triton_backend
from fusedlm.ops import reference
from fusedlm.ops._dropout import next_seed
from checks import (assert_relative_error, float32_copies, fresh, gpu_backends, grads, needs_cuda,
                    poison_memory)

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


@pytest.mark.parametrize("tokens", TOKENS.values(), ids=TOKENS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_gelu_ffn_real_shapes(tokens, dtype, dropout_p):
    inputs = [fresh((tokens, 768), dtype), fresh((3072, 768), dtype, scale=768 ** -0.5),
              fresh((3072,), dtype), fresh((768, 3072), dtype, scale=3072 ** -0.5),
              fresh((768,), dtype)]
    upstream = torch.randn(tokens, 768, device="cuda", dtype=dtype)
    torch.manual_seed(11)
    seed = next_seed(dropout_p)
    keep = triton_backend.keep_mask(seed, (tokens, 3072), dropout_p, "cuda") if dropout_p else None
    poison_memory()
    torch.manual_seed(11)
    out = fusedlm.ops.gelu_ffn(*inputs, dropout_p=dropout_p, backend="triton")
    got = grads([out], inputs, [upstream])
    ref_inputs = float32_copies(*inputs)
    expected = reference.gelu_ffn(*ref_inputs, dropout_p=dropout_p, dropout_mask=keep)
    expected_grads = grads([expected], ref_inputs, [upstream.float()])
    assert_relative_error(out, expected, dtype, "out")
    for name, a, e in zip(("dx", "dw1", "db1", "dw2", "db2"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)
