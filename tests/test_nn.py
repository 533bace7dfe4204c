"""Drop-in modules: loading the torch module's state_dict gives the same outputs and gradients."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedlm.nn
from helpers import assert_close, fresh


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_low_precision_input_with_float32_parameters(dtype, bias):
    # As torch: computed in float32, returned in x's dtype, each gradient in its tensor's
    # dtype. Values are held to the norm in float64 (torch's weight and bias gradients
    # pass through x's dtype; these stay float32).
    torch_ln = nn.LayerNorm(48, bias=bias)
    with torch.no_grad():
        for p in torch_ln.parameters():
            p.normal_()
    ln = fusedlm.nn.LayerNorm(48, bias=bias)
    ln.load_state_dict(torch_ln.state_dict())
    exact_ln = nn.LayerNorm(48, bias=bias, dtype=torch.float64)
    exact_ln.load_state_dict(torch_ln.state_dict())
    x = fresh((3, 5, 48), dtype, "cpu")
    x_exact = x.detach().double().requires_grad_()
    out, expected = ln(x), exact_ln(x_exact)
    assert out.dtype == torch_ln(x).dtype == dtype
    assert_close(out, expected)
    upstream = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *ln.parameters()], upstream)
    want = torch.autograd.grad(expected, [x_exact, *exact_ln.parameters()], upstream.double())
    torch_grads = torch.autograd.grad(torch_ln(x), [x, *torch_ln.parameters()], upstream)
    torch_dtypes = [g.dtype for g in torch_grads]
    assert [g.dtype for g in got] == torch_dtypes == [dtype] + [torch.float32] * (1 + bias)
    for name, g, w in zip(["x", "weight", "bias"], got, want):
        assert_close(g, w, name=f"grad of {name}")
    residual = fresh((3, 5, 48), dtype, "cpu")
    out, summed = ln(x, residual)
    assert out.dtype == summed.dtype == dtype
    assert_close(summed, x.double() + residual.double())
    assert_close(out, exact_ln(x.double() + residual.double()))


def test_layer_norm_other_dtype_mixes_are_errors_naming_the_tensors():
    # As torch, which takes only a bfloat16 or float16 input beside float32 parameters.
    with pytest.raises(TypeError, match="weight has dtype torch.float32 but x has torch.float64"):
        fusedlm.nn.LayerNorm(8)(torch.randn(2, 8, dtype=torch.float64))
    ln = fusedlm.nn.LayerNorm(8)
    with pytest.raises(TypeError, match="residual has dtype torch.float32 but x has torch.bfloat16"):
        ln(torch.randn(2, 8, dtype=torch.bfloat16), torch.randn(2, 8))


# Rows past one block of the CPU kernels' sums (4096 elements), up to 9.4 million elements.
WIDE_ROWS = [4097, 100_003, (256, 256, 144)]


def _assert_layer_norm_keeps_float32_precision(normalized_shape, backend):
    """The output and the gradients of x, weight and bias within 4 float32 ulps (norm-wise)
    of torch.nn.LayerNorm's in float64, as torch's own float32 LayerNorm is (within about
    2), on inputs of mean 5, so that the mean's error counts too."""
    exact_ln = nn.LayerNorm(normalized_shape, dtype=torch.float64)
    with torch.no_grad():
        exact_ln.weight.normal_()
        exact_ln.bias.normal_()
    ln = fusedlm.nn.LayerNorm(normalized_shape)
    ln.load_state_dict(exact_ln.state_dict())
    x = fresh((1, *ln.normalized_shape), torch.float32, "cpu", scale=3.0, requires_grad=False)
    x = (x + 5.0).requires_grad_()
    exact_x = x.detach().double().requires_grad_()
    upstream = torch.randn(x.shape)
    with fusedlm.use_backend(backend):
        out = ln(x)
        got = [out, *torch.autograd.grad(out, [x, ln.weight, ln.bias], upstream)]
    out = exact_ln(exact_x)
    want = [out, *torch.autograd.grad(out, [exact_x, exact_ln.weight, exact_ln.bias],
                                      upstream.double())]
    bound = 4 * torch.finfo(torch.float32).eps
    for name, g, w in zip(["output", "grad of x", "grad of weight", "grad of bias"], got, want):
        error = ((g.double() - w).norm() / w.norm()).item()
        assert error <= bound, f"{name}: relative error {error:.3g} > {bound:.3g}"


@pytest.mark.parametrize("normalized_shape", WIDE_ROWS, ids=str)
def test_layer_norm_keeps_float32_precision_over_wide_rows_on_the_cpu(normalized_shape, cpu_isa):
    _assert_layer_norm_keeps_float32_precision(normalized_shape, "cpu")


@pytest.mark.parametrize("normalized_shape", WIDE_ROWS, ids=str)
def test_layer_norm_keeps_float32_precision_over_wide_rows_in_the_reference(normalized_shape):
    _assert_layer_norm_keeps_float32_precision(normalized_shape, "reference")


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
