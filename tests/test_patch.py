"""fusedlm.patch on torch.nn models: same outputs and gradients, weights kept, idempotent."""
import pytest
import torch
from torch import nn

import fusedlm
from conftest import fresh


def _model():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8),
                         nn.LayerNorm(8, elementwise_affine=False))


def test_patch_layer_norm_keeps_outputs_and_gradients():
    model = _model().double()
    patched = fusedlm.patch(_model().double().eval(), inplace=True)
    patched.load_state_dict(model.state_dict())
    assert not patched.training
    x = fresh((4, 16), torch.float64, "cpu")
    grads = []
    for m in (model, patched):
        m.zero_grad()
        m(x).pow(2).sum().backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    torch.testing.assert_close(patched(x), model(x))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)
    report = fusedlm.patch_report(patched)
    assert sorted(report.replaced) == ["1", "4"]
    assert isinstance(patched[1], fusedlm.nn.LayerNorm)


def test_patch_keeps_parameters_and_is_idempotent():
    model = _model()
    weight = model[1].weight
    fusedlm.patch(model)
    assert model[1].weight is weight
    once = dict(fusedlm.patch_report(model).replaced)
    fusedlm.patch(model)
    assert fusedlm.patch_report(model).replaced == once
    assert type(model[1]) is fusedlm.nn.LayerNorm


def test_patch_not_inplace_leaves_the_original():
    model = _model()
    copy = fusedlm.patch(model, inplace=False)
    assert type(model[1]) is nn.LayerNorm and type(copy[1]) is fusedlm.nn.LayerNorm


def test_patch_rejects_bad_input():
    with pytest.raises(TypeError, match="model"):
        fusedlm.patch("bert")
    with pytest.raises(ValueError, match="not been patched"):
        fusedlm.patch_report(nn.Linear(2, 2))
