"""Drop-in modules: loading the torch module's state_dict gives the same outputs and gradients."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedlm.nn
from helpers import assert_close


def test_layer_norm_matches_torch():
    torch_ln = nn.LayerNorm(48, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        torch_ln.weight.normal_()
        torch_ln.bias.normal_()
    ln = fusedlm.nn.LayerNorm(48, eps=1e-6, dtype=torch.float64)
    ln.load_state_dict(torch_ln.state_dict())
    x = torch.randn(3, 5, 48, dtype=torch.float64, requires_grad=True)
    r = torch.randn(3, 5, 48, dtype=torch.float64)
    assert_close(ln(x), torch_ln(x))
    out, summed = ln(x, r)
    assert_close(out, torch_ln(x + r))
    assert_close(summed, x + r)
    ln(x).sum().backward()
    assert ln.weight.grad is not None and ln.bias.grad is not None


def test_layer_norm_over_several_trailing_dims():
    torch_ln = nn.LayerNorm((4, 6), dtype=torch.float64)
    ln = fusedlm.nn.LayerNorm((4, 6), dtype=torch.float64)
    with torch.no_grad():
        torch_ln.weight.normal_()
    ln.load_state_dict(torch_ln.state_dict())
    x = torch.randn(2, 4, 6, dtype=torch.float64)
    assert_close(ln(x), torch_ln(x))


@pytest.mark.parametrize("normalized_shape", [48, (4, 12)])
def test_layer_norm_rejects_inputs_of_another_shape(normalized_shape):
    # A residual of another shape is never reshaped into x's, even with as many elements.
    ln = fusedlm.nn.LayerNorm(normalized_shape)
    with pytest.raises(ValueError, match=r"x must end in normalized_shape .*got shape \(2, 50\)"):
        ln(torch.randn(2, 50))
    x = torch.randn(2, *ln.normalized_shape)
    with pytest.raises(ValueError, match=r"residual must have x's shape \(2, .*\), got \(96,\)"):
        ln(x, x.flatten())
    out, summed = ln(x, x)
    assert out.shape == summed.shape == x.shape


def test_gelu_ffn_loads_linear_gelu_linear_weights():
    torch_ffn = nn.Sequential(nn.Linear(16, 64), nn.GELU(approximate="tanh"), nn.Linear(64, 16)).double()
    ffn = fusedlm.nn.GeluFFN(16, 64, approximate="tanh", dtype=torch.float64)
    ffn.fc1.load_state_dict(torch_ffn[0].state_dict())
    ffn.fc2.load_state_dict(torch_ffn[2].state_dict())
    x = torch.randn(4, 7, 16, dtype=torch.float64)
    assert_close(ffn(x), torch_ffn(x))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_loss_matches_torch(reduction):
    logits = torch.randn(20, 11, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (20,))
    labels[::4] = -100
    loss = fusedlm.nn.CrossEntropyLoss(reduction=reduction, label_smoothing=0.1)(logits, labels)
    expected = nn.CrossEntropyLoss(reduction=reduction, label_smoothing=0.1)(logits, labels)
    assert_close(loss, expected)


def test_cross_entropy_loss_with_class_weights_says_it_is_unfused():
    weight = torch.rand(5)
    with pytest.warns(UserWarning, match="unfused"):
        fusedlm.nn.CrossEntropyLoss(weight=weight)(torch.randn(4, 5), torch.randint(0, 5, (4,)))


def test_linear_cross_entropy_equals_projection_then_loss():
    hidden = torch.randn(6, 9, 32, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(100, 32, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 100, (6, 9))
    labels[torch.rand(6, 9) < 0.8] = -100
    labels[0, 0] = 3
    loss = fusedlm.nn.LinearCrossEntropyLoss()(hidden, weight, labels)
    expected = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten())
    assert_close(loss, expected)
    (dh, dw) = torch.autograd.grad(loss, (hidden, weight))
    (eh, ew) = torch.autograd.grad(expected, (hidden, weight))
    assert_close(dh, eh)
    assert_close(dw, ew)
