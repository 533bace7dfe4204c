"""add_layer_norm on the GPU at BERT-base and GPT-2-small shapes, against the float32 reference."""
import pytest
import torch

import fusedlm
from fusedlm.backends import triton as triton_backend
from fusedlm.ops import reference
from fusedlm.ops._dropout import next_seed
from checks import (assert_relative_error, float32_copies, fresh, grads, needs_cuda,
                    poison_memory)

pytestmark = needs_cuda
SHAPES = {"bert-base": (32, 128, 768), "gpt2-small": (8, 1024, 768), "hidden-1024": (64, 1024)}


@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_add_layer_norm_real_shapes(shape, dtype, dropout_p):
    hidden = shape[-1]
    inputs = [fresh(shape, dtype), fresh(shape, dtype), fresh((hidden,), dtype),
              fresh((hidden,), dtype)]
    upstream = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2)]
    torch.manual_seed(7)
    seed = next_seed(dropout_p)
    keep = triton_backend.keep_mask(seed, shape, dropout_p, "cuda") if dropout_p else None
    poison_memory()
    torch.manual_seed(7)
    outs = fusedlm.ops.add_layer_norm(*inputs, dropout_p=dropout_p, backend="triton")
    got = grads(outs, inputs, upstream)

    ref_inputs = float32_copies(*inputs)
    expected = reference.add_layer_norm(*ref_inputs, dropout_p=dropout_p, dropout_mask=keep)
    expected_grads = grads(expected, ref_inputs, [g.float() for g in upstream])
    for name, a, e in zip(("out", "summed"), outs, expected):
        assert_relative_error(a, e, dtype, name)
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)


def test_add_layer_norm_parameter_gradients_repeat_bit_for_bit():
    shape = (32, 128, 768)
    inputs = [fresh(shape, torch.bfloat16), fresh(shape, torch.bfloat16),
              fresh((768,), torch.bfloat16), fresh((768,), torch.bfloat16)]
    upstream = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    runs = [grads(fusedlm.ops.add_layer_norm(*inputs, backend="triton"), inputs, upstream)
            for _ in range(3)]
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert torch.equal(a, b)
