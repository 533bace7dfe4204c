"""fusedlm.nn.TransformerEncoderLayer / TransformerEncoder against torch's with the same weights:
outputs at real tokens and the gradients of every parameter and of the input."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fusedlm
import fusedlm.nn
from helpers import assert_close, fresh

BATCH, SEQ, D_MODEL, HEADS, D_FF = 4, 10, 32, 4, 48


def _randomise(module):
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.3)  # biases and norm weights start constant in torch: make them count


def _layers(dtype=torch.float64, **kwargs):
    ref = nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, dtype=dtype, **kwargs)
    _randomise(ref)
    layer = fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, dtype=dtype, **kwargs)
    layer.load_state_dict(ref.state_dict())
    return ref, layer


def _padding():
    """Mixed lengths in [2, SEQ], one row whole and one padded: True = padding."""
    lengths = torch.randint(2, SEQ + 1, (BATCH,))
    lengths[0], lengths[-1] = SEQ, int(torch.randint(2, SEQ, ()))
    return torch.arange(SEQ)[None, :] >= lengths[:, None]


def _input(batch_first, dtype=torch.float64):
    return fresh((BATCH, SEQ, D_MODEL) if batch_first else (SEQ, BATCH, D_MODEL), dtype, "cpu")


def _outputs_and_grads(module, x, real, batch_first, **kwargs):
    """The output at real tokens, and the gradients of a random loss over them with respect
    to every parameter and x. ``real`` is [batch, seq], True = a real token."""
    out = module(x, **kwargs)
    out = out if batch_first else out.transpose(0, 1)
    torch.manual_seed(1)
    loss = (out[real] * torch.randn(out[real].shape, dtype=out.dtype)).sum()
    params = [p for _, p in module.named_parameters()]
    return out[real], torch.autograd.grad(loss, params + [x])


def _compare(ref, fused, x, real, batch_first, dtype=None, **kwargs):
    expected, expected_grads = _outputs_and_grads(ref, x, real, batch_first, **kwargs)
    out, grads = _outputs_and_grads(fused, x, real, batch_first, **kwargs)
    assert_close(out, expected, dtype=dtype)
    names = [n for n, _ in ref.named_parameters()] + ["src"]
    assert names[:-1] == [n for n, _ in fused.named_parameters()]
    for name, got, want in zip(names, grads, expected_grads):
        assert_close(got, want, dtype=dtype, name=f"grad of {name}")


# torch warns about a bool padding mask beside a float src_mask, and accepts it.
@pytest.mark.filterwarnings("ignore:Support for mismatched src_key_padding_mask")
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("masks", ["none", "padding", "padding+causal", "padding+float mask"])
def test_layer_matches_torch(batch_first, norm_first, activation, masks):
    ref, layer = _layers(dropout=0.0, activation=activation, batch_first=batch_first,
                         norm_first=norm_first)
    x = _input(batch_first)
    padding = None if masks == "none" else _padding()
    kwargs = {"src_key_padding_mask": padding}
    if masks == "padding+causal":
        kwargs.update(src_mask=nn.Transformer.generate_square_subsequent_mask(SEQ, dtype=torch.float64),
                      is_causal=True)
    if masks == "padding+float mask":
        kwargs["src_mask"] = torch.randn(SEQ, SEQ, dtype=torch.float64)
    real = torch.ones(BATCH, SEQ, dtype=torch.bool) if padding is None else ~padding
    _compare(ref, layer, x, real, batch_first, **kwargs)


def test_float32_relative_error_within_1e_4():
    ref, layer = _layers(torch.float32, dropout=0.0, activation="gelu", batch_first=True)
    x = _input(True, torch.float32)
    padding = _padding()
    expected, expected_grads = _outputs_and_grads(ref, x, ~padding, True, src_key_padding_mask=padding)
    out, grads = _outputs_and_grads(layer, x, ~padding, True, src_key_padding_mask=padding)
    for got, want in zip([out, *grads], [expected, *expected_grads]):
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


@pytest.mark.parametrize("norm_first", [False, True], ids=["post-LN", "pre-LN"])
def test_encoder_matches_torch_and_packs_once(norm_first, monkeypatch):
    kwargs = dict(dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first)
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, **kwargs), 3,
                                norm=nn.LayerNorm(D_MODEL), enable_nested_tensor=False).double()
    _randomise(ref)
    encoder = fusedlm.nn.TransformerEncoder(
        fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, **kwargs), 3,
        norm=fusedlm.nn.LayerNorm(D_MODEL), enable_nested_tensor=False).double()
    encoder.load_state_dict(ref.state_dict())
    calls = []
    unpad = fusedlm.ops.unpad
    monkeypatch.setattr(fusedlm.ops, "unpad", lambda *a, **k: calls.append(1) or unpad(*a, **k))
    padding = _padding()
    x = _input(True)
    _compare(ref, encoder, x, ~padding, True, src_key_padding_mask=padding)
    assert len(calls) == 1  # once for the stack of 3 layers
    ref.train(False), encoder.train(False)
    with torch.no_grad():
        assert_close(encoder(x, src_key_padding_mask=padding)[~padding],
                     ref(x, src_key_padding_mask=padding)[~padding])


def test_encoder_detects_a_causal_mask():
    ref = nn.TransformerEncoder(nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, dropout=0.0),
                                2, enable_nested_tensor=False).double()
    _randomise(ref)
    encoder = fusedlm.nn.TransformerEncoder(
        fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, dropout=0.0), 2).double()
    encoder.load_state_dict(ref.state_dict())
    x = _input(False)
    mask = nn.Transformer.generate_square_subsequent_mask(SEQ, dtype=torch.bool)
    padding = _padding()
    _compare(ref, encoder, x, ~padding, False, mask=mask, src_key_padding_mask=padding)


def test_padding_positions_are_zero_and_unbatched_input_works():
    ref, layer = _layers(dropout=0.0)
    padding = _padding()
    out = layer(_input(False), src_key_padding_mask=padding)
    assert out.transpose(0, 1)[padding].abs().max() == 0
    x = fresh((SEQ, D_MODEL), torch.float64, "cpu")
    assert_close(layer(x, src_key_padding_mask=padding[1])[~padding[1]],
                 ref(x, src_key_padding_mask=padding[1])[~padding[1]])


def test_state_dict_loads_both_ways():
    ref, layer = _layers(norm_first=True, bias=False)
    assert list(layer.state_dict()) == list(ref.state_dict())
    back = nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, norm_first=True, bias=False,
                                      dtype=torch.float64)
    back.load_state_dict(layer.state_dict())
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, ref.state_dict()[name]), name


def test_dropout_only_in_training():
    ref, layer = _layers(dropout=0.3, activation="gelu", batch_first=True)
    x = _input(True)
    padding = _padding()
    first, second = (layer(x, src_key_padding_mask=padding)[~padding] for _ in range(2))
    assert not torch.allclose(first, second)
    # Dropout keeps the mean of each branch: outputs stay close to the eval-mode ones.
    layer.eval()
    clean = layer(x, src_key_padding_mask=padding)[~padding]
    assert 0 < (first - clean).abs().mean() < clean.abs().mean()
    ref.eval()
    assert_close(clean, ref(x, src_key_padding_mask=padding)[~padding])


# Each spelling of an activation, and whether the layer runs it in one fused gelu_ffn.
ACTIVATIONS = {
    "'relu'": ("relu", False), "F.relu": (F.relu, False), "nn.ReLU()": (nn.ReLU(), False),
    "'gelu'": ("gelu", True), "F.gelu": (F.gelu, True), "nn.GELU()": (nn.GELU(), True),
    "nn.GELU('tanh')": (nn.GELU(approximate="tanh"), True), "nn.SiLU()": (nn.SiLU(), False),
    "torch.tanh": (torch.tanh, False), "lambda": (lambda x: x * torch.sigmoid(1.5 * x), False),
    "nn.PReLU()": (nn.PReLU(dtype=torch.float64), False),  # a parameter: activation.weight
}


@pytest.mark.parametrize("masks", ["none", "padding"])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_any_activation_matches_torch(activation, masks, monkeypatch):
    activation, fused = ACTIVATIONS[activation]
    ref, layer = _layers(dropout=0.0, activation=activation, batch_first=True)
    assert layer.activation is ref.activation  # as torch keeps it: a module is a submodule
    calls = []
    gelu_ffn = fusedlm.ops.gelu_ffn
    monkeypatch.setattr(fusedlm.ops, "gelu_ffn", lambda *a, **k: calls.append(k) or gelu_ffn(*a, **k))
    padding = None if masks == "none" else _padding()
    real = torch.ones(BATCH, SEQ, dtype=torch.bool) if padding is None else ~padding
    _compare(ref, layer, _input(True), real, True, src_key_padding_mask=padding)
    assert bool(calls) == fused
    if fused:
        assert calls[0]["approximate"] == getattr(layer.activation, "approximate", "none")


def test_a_gelu_with_a_hook_or_a_subclass_runs_unfused(monkeypatch):
    # What a hook or a subclass adds is never skipped by the fusion.
    class ScaledGELU(nn.GELU):
        def forward(self, x):
            return 2 * super().forward(x)
    hooked = nn.GELU()
    hooked.register_forward_hook(lambda module, args, out: out * 0.5)
    monkeypatch.setattr(fusedlm.ops, "gelu_ffn", None)  # any fused call fails
    for activation in (ScaledGELU(), hooked):
        ref, layer = _layers(dropout=0.0, activation=activation, batch_first=True)
        _compare(ref, layer, _input(True), torch.ones(BATCH, SEQ, dtype=torch.bool), True)


@pytest.mark.parametrize("module", ["layer", "encoder"])
def test_bad_inputs_are_named_as_passed(module):
    layer = fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, batch_first=True)
    encoder = fusedlm.nn.TransformerEncoder(layer, 2)
    call, mask_name = (layer, "src_mask") if module == "layer" else (encoder, "mask")
    x = torch.randn(2, 5, D_MODEL)
    cases = [
        ({"src": torch.randn(2, 5, 6)}, r"src must have shape \(batch, seq, d_model=32\) or, "
                                        r"unbatched, \(seq, d_model=32\), got \(2, 5, 6\)"),
        ({"src": x, "src_key_padding_mask": torch.zeros(2, 4, dtype=torch.bool)},
         r"src_key_padding_mask must have shape \(batch, seq\) = \(2, 5\), got \(2, 4\)"),
        ({"src": x[0], "src_key_padding_mask": torch.zeros(2, 5, dtype=torch.bool)},
         r"src_key_padding_mask must have shape \(seq,\) = \(5,\), got \(2, 5\)"),
        ({"src": x, mask_name: torch.zeros(4, 4)},
         rf"{mask_name} must have shape \(seq, seq\) = \(5, 5\) or \(batch \* nhead, seq, seq\) = "
         r"\(8, 5, 5\), got \(4, 4\)"),
    ]
    for kwargs, error in cases:
        with pytest.raises(ValueError, match=error):
            call(**kwargs)
    with pytest.raises(TypeError, match=f"{mask_name} must be bool or floating point"):
        call(x, **{mask_name: torch.zeros(5, 5, dtype=torch.long)})


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors():
    # torch's inference fast path takes a NestedTensor; fusedlm's attention hands it to
    # torch, and its layers, which pack padded inputs themselves, say so.
    nested = torch.nested.nested_tensor([torch.randn(3, D_MODEL), torch.randn(5, D_MODEL)])
    ref = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True).eval()
    mha = fusedlm.nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True).eval()
    mha.load_state_dict(ref.state_dict())
    with torch.no_grad():
        out, _ = mha(nested, nested, nested, need_weights=False)
        expected, _ = ref(nested, nested, nested, need_weights=False)
    for got, want in zip(out.unbind(), expected.unbind()):
        torch.testing.assert_close(got, want)
    layer = fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, D_FF, batch_first=True).eval()
    with pytest.raises(TypeError, match="src must be a padded tensor, not a NestedTensor"):
        layer(nested)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="activation must be 'relu', 'gelu' or a callable, got 'swish'"):
        fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, activation="swish")
    with pytest.raises(TypeError, match="activation must be 'relu', 'gelu' or a callable, got 3"):
        fusedlm.nn.TransformerEncoderLayer(D_MODEL, HEADS, activation=3)
    with pytest.raises(TypeError, match="encoder_layer"):
        fusedlm.nn.TransformerEncoder(nn.TransformerEncoderLayer(D_MODEL, HEADS), 2)
