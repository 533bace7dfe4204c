"""add_layer_norm on the GPU at BERT-base and GPT-2-small shapes, against the float32 reference."""
import pytest
import torch

import fusedlm
from fusedlm.ops import reference
from fusedlm.ops._dropout import cpu_keep_mask, next_seed
from checks import (assert_relative_error, float32_copies, fresh, gpu_backends, grads, keep_mask,
                    needs_cuda, poison_memory)

pytestmark = needs_cuda
SHAPES = {"bert-base": (32, 128, 768), "gpt2-small": (8, 1024, 768), "hidden-1024": (64, 1024)}
# Rows longer than the cuda kernels hold in registers (8192 float32 elements forward, 4096
# backward), and an odd width (one element per load).
CUDA_SHAPES = {"hidden-20000": (48, 20000), "hidden-1001": (300, 1001)}


def _cases():
    triton, cuda = gpu_backends("add_layer_norm")
    return [pytest.param(backend.values[0], shape, id=f"{backend.id}-{name}", marks=backend.marks)
            for backend, shapes in ((triton, SHAPES), (cuda, {**SHAPES, **CUDA_SHAPES}))
            for name, shape in shapes.items()]


@pytest.mark.parametrize("backend,shape", _cases())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_add_layer_norm_real_shapes(backend, shape, dtype, dropout_p):
    hidden = shape[-1]
    inputs = [fresh(shape, dtype), fresh(shape, dtype), fresh((hidden,), dtype),
              fresh((hidden,), dtype)]
    upstream = [torch.randn(shape, device="cuda", dtype=dtype) for _ in range(2)]
    torch.manual_seed(7)
    seed = next_seed(dropout_p)
    keep = keep_mask(backend, seed, shape, dropout_p) if dropout_p else None
    poison_memory()
    torch.manual_seed(7)
    outs = fusedlm.ops.add_layer_norm(*inputs, dropout_p=dropout_p, backend=backend)
    got = grads(outs, inputs, upstream)

    ref_inputs = float32_copies(*inputs)
    expected = reference.add_layer_norm(*ref_inputs, dropout_p=dropout_p, dropout_mask=keep)
    expected_grads = grads(expected, ref_inputs, [g.float() for g in upstream])
    for name, a, e in zip(("out", "summed"), outs, expected):
        assert_relative_error(a, e, dtype, name)
    for name, a, e in zip(("dx", "dresidual", "dweight", "dbias"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)


@pytest.mark.parametrize("backend", gpu_backends("add_layer_norm"))
def test_add_layer_norm_parameter_gradients_repeat_bit_for_bit(backend):
    shape = (32, 128, 768)
    inputs = [fresh(shape, torch.bfloat16), fresh(shape, torch.bfloat16),
              fresh((768,), torch.bfloat16), fresh((768,), torch.bfloat16)]
    upstream = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    runs = [grads(fusedlm.ops.add_layer_norm(*inputs, backend=backend), inputs, upstream)
            for _ in range(3)]
    for again in runs[1:]:
        for a, b in zip(runs[0], again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("backend", gpu_backends("add_layer_norm")[1:])
def test_cuda_dropout_stream_is_the_cpu_stream(backend):
    # Both draw Philox-4x32-10 keyed by element index: the masks agree bit for bit, at an
    # offset and a length that are not multiples of the 4 elements a Philox call decides.
    import fusedlm._C as C
    seed = torch.tensor(123456789012345)
    for p in (0.1, 0.5):
        gpu = C.cuda.dropout_mask(seed, 7, [1001, 37], p, torch.cuda.current_device())
        assert torch.equal(gpu.cpu(), cpu_keep_mask(seed, (1001, 37), p, offset=7))
