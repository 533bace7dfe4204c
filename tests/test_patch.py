"""fusedlm.patch on torch.nn models: same outputs and gradients, weights kept, idempotent."""
import copy

import pytest
import torch
from torch import nn

import fusedlm
from helpers import fresh


def _model():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 8),
                         nn.LayerNorm(8, elementwise_affine=False))


def test_patch_layer_norm_keeps_outputs_and_gradients():
    model = _model().double()
    patched = fusedlm.patch(_model().double().eval())
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


def test_patch_rejects_bad_input():
    with pytest.raises(TypeError, match="model"):
        fusedlm.patch("bert")
    with pytest.raises(ValueError, match="not been patched"):
        fusedlm.patch_report(nn.Linear(2, 2))


class _Encoder(nn.Module):
    """A small BERT-like classifier: a torch TransformerEncoder, attention pooling, a head."""

    def __init__(self, activation="gelu", pool_kwargs=None):
        super().__init__()
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, activation=activation,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(16),
                                             enable_nested_tensor=False)
        self.pool = nn.MultiheadAttention(16, 2, batch_first=True, **(pool_kwargs or {}))
        self.head = nn.Linear(16, 3)

    def forward(self, x, padding):
        h = self.encoder(x, src_key_padding_mask=padding)
        pooled, _ = self.pool(h[:, :1], h, h, key_padding_mask=padding, need_weights=False)
        return self.head(pooled)


def _batch(dtype=torch.float64):
    lengths = torch.tensor([7, 3, 5])
    return fresh((3, 7, 16), dtype, "cpu"), torch.arange(7)[None, :] >= lengths[:, None]


def _assert_same_outputs_and_gradients(model, patched):
    x, padding = _batch()
    grads = []
    for m in (model, patched):
        out = m(x, padding)
        grads.append(dict(zip([n for n, _ in m.named_parameters()],
                              torch.autograd.grad(out.pow(2).sum(), list(m.parameters())))))
        grads[-1]["out"] = out
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=name)


def _randomised(model):
    model = model.double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model


def test_patch_transformer_keeps_outputs_gradients_and_parameters():
    model = _randomised(_Encoder())
    patched = fusedlm.patch(copy.deepcopy(model))
    assert sorted(fusedlm.patch_report(patched).replaced) == ["encoder", "encoder.norm", "pool"]
    assert isinstance(patched.encoder, fusedlm.nn.TransformerEncoder)
    assert isinstance(patched.pool, fusedlm.nn.MultiheadAttention)
    _assert_same_outputs_and_gradients(model, patched)

    params = {id(p) for p in model.parameters()}
    fusedlm.patch(model.eval())
    assert {id(p) for p in model.parameters()} == params
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("activation", [torch.tanh, nn.GELU(approximate="tanh"), nn.ReLU()],
                         ids=["tanh", "GELU-tanh", "ReLU"])
def test_patch_takes_any_activation_and_attention_option(activation):
    model = _randomised(_Encoder(activation=activation,
                                 pool_kwargs={"add_bias_kv": True, "add_zero_attn": True}))
    patched = fusedlm.patch(copy.deepcopy(model))
    assert sorted(fusedlm.patch_report(patched).replaced) == ["encoder", "encoder.norm", "pool"]
    _assert_same_outputs_and_gradients(model, patched)


def test_patch_pins_the_backend():
    model = fusedlm.patch(_Encoder(), backend="reference")
    seen = []
    for module in model.modules():
        if type(module).__module__.startswith("fusedlm"):
            module.register_forward_pre_hook(lambda m, args: seen.append(fusedlm.get_backend()))
    model(torch.randn(2, 5, 16), torch.zeros(2, 5, dtype=torch.bool))
    assert seen and set(seen) == {"reference"}
    assert fusedlm.get_backend() is None  # only while the model runs
    with pytest.raises(ValueError, match="backend"):
        fusedlm.patch(_Encoder(), backend="gpu")


class _OwnLayer(nn.TransformerEncoderLayer):
    """A user's subclass: its forward may differ from torch's, so it is not replaced."""


def test_patch_says_why_it_left_modules_alone():
    model = _Encoder()
    model.encoder.layers[0] = _OwnLayer(16, 2, 32, dropout=0.0, batch_first=True)
    report = fusedlm.patch_report(fusedlm.patch(model))
    assert "layers.0: layer of type _OwnLayer" in report.left_alone["encoder"]
    # What fusedlm can run inside the layer left alone is still replaced.
    assert {"encoder.layers.0.self_attn", "encoder.layers.0.norm2", "encoder.layers.1"} <= set(report.replaced)
    assert "left 1 recognised module alone" in str(report)


def test_patch_returns_the_replacement_of_the_model_itself():
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32), 2,
                                    enable_nested_tensor=False).eval()
    patched = fusedlm.patch(encoder)
    assert type(patched) is fusedlm.nn.TransformerEncoder and not patched.training
    assert list(fusedlm.patch_report(patched).replaced) == [""]
    x = fresh((5, 3, 16), torch.float32, "cpu")
    torch.testing.assert_close(patched(x), encoder(x))
