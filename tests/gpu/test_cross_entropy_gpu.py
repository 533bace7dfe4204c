"""cross_entropy and masked_lm_loss on the GPU at BERT-base and GPT-2-small shapes, against
the float32 reference."""
import pytest
import torch

import fusedlm
from fusedlm.ops import reference
from checks import (assert_relative_error, float32_copies, fresh, gpu_backends, grads, needs_cuda,
                    poison_memory)

pytestmark = needs_cuda
# (tokens, vocab)
SHAPES = {"bert-base": (32 * 128, 30522), "gpt2-small": (8 * 1024, 50257)}


def _labels(tokens, vocab, ignored):
    labels = torch.randint(0, vocab, (tokens,), device="cuda")
    return labels.masked_fill(torch.rand(tokens, device="cuda") < ignored, -100)


@pytest.mark.parametrize("backend", gpu_backends("cross_entropy"))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_real_shapes(backend, shape, dtype, label_smoothing, reduction):
    tokens, vocab = shape
    logits = fresh(shape, dtype, scale=3.0)
    labels = _labels(tokens, vocab, ignored=0.1)
    poison_memory()
    loss = fusedlm.ops.cross_entropy(logits, labels, label_smoothing=label_smoothing,
                                     reduction=reduction, backend=backend)
    upstream = torch.rand_like(loss) + 0.5
    (got,) = grads([loss], [logits], [upstream])
    (ref,) = float32_copies(logits)
    expected = reference.cross_entropy(ref, labels, label_smoothing=label_smoothing,
                                       reduction=reduction)
    (expected_grad,) = grads([expected], [ref], [upstream])
    # The loss is float32 whatever the logits' dtype.
    assert_relative_error(loss, expected, torch.float32, "loss")
    assert_relative_error(got, expected_grad, dtype, "dlogits")


@pytest.mark.parametrize("backend", gpu_backends("masked_lm_loss"))
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_masked_lm_loss_real_shapes(backend, shape, dtype, reduction):
    tokens, vocab = shape
    inputs = [fresh((tokens, 768), dtype), fresh((vocab, 768), dtype, scale=768 ** -0.5),
              fresh((vocab,), dtype)]
    labels = _labels(tokens, vocab, ignored=0.85)
    poison_memory()
    loss = fusedlm.ops.masked_lm_loss(*inputs, labels, reduction=reduction, backend=backend)
    upstream = torch.rand_like(loss) + 0.5
    got = grads([loss], inputs, [upstream])
    ref_inputs = float32_copies(*inputs)
    expected = reference.masked_lm_loss(*ref_inputs, labels, reduction=reduction)
    expected_grads = grads([expected], ref_inputs, [upstream])
    # bf16 logits are rounded products: the loss is as exact as the dtype's logits.
    assert_relative_error(loss, expected, dtype, "loss")
    for name, a, e in zip(("dhidden", "dweight", "dbias"), got, expected_grads):
        assert_relative_error(a, e, dtype, name)
