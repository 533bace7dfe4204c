"""lstm_cell on the GPU at ELMo's shapes (cell 4096, a step of a batch of sentences), and the
ELMo model on CUDA tensors, against the float32 reference."""
import pytest
import torch

import fusedlm
from fusedlm.models import ELMo, ElmoConfig
from fusedlm.models.elmo import batch_to_ids
from fusedlm.ops import reference
from checks import assert_relative_error, float32_copies, fresh, gpu_backends, grads, needs_cuda, poison_memory

pytestmark = needs_cuda
# ELMo's cell at a training batch of 128 sentences and at 3000 rows (a step over a batch of
# packed tokens), and an odd cell (no vector-width rows).
SHAPES = {"elmo-128": (128, 4096), "elmo-3000": (3000, 4096), "odd-1001": (77, 1001)}


@pytest.mark.parametrize("backend", gpu_backends("lstm_cell"))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cell_clip", [None, 3.0])
def test_lstm_cell_real_shapes(backend, shape, dtype, cell_clip):
    rows, cell = shape
    inputs = [fresh((rows, 4 * cell), dtype, scale=2.0), fresh((rows, cell), dtype, scale=3.0)]
    upstream = [torch.randn(rows, cell, device="cuda", dtype=dtype) for _ in range(2)]
    poison_memory()
    outs = fusedlm.ops.lstm_cell(*inputs, cell_clip=cell_clip, backend=backend)
    got = grads(outs, inputs, upstream)
    ref_inputs = float32_copies(*inputs)
    expected = reference.lstm_cell(*ref_inputs, cell_clip=cell_clip)
    expected_grads = grads(expected, ref_inputs, [u.float() for u in upstream])
    for name, a, e in zip(("h", "c", "dgates", "dc_prev"), [*outs, *got], [*expected, *expected_grads]):
        assert_relative_error(a, e, dtype, name)


def test_elmo_on_cuda_matches_the_cpu():
    config = ElmoConfig(filters=[[1, 32], [2, 32], [3, 64]], lstm_dim=256, projection_dim=64,
                        dropout=0.0)
    model = ELMo(config).eval()
    ids = batch_to_ids([["A", "small", "test", "."], ["Another", "one"]])
    expected = model(ids).last_hidden_state
    got = model.cuda()(ids.cuda()).last_hidden_state
    assert_relative_error(got, expected, torch.float32, "elmo")
