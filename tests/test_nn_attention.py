"""fusedlm.nn.MultiheadAttention against torch.nn.MultiheadAttention with the same weights:
outputs and the gradients of every parameter and input, in float64."""
import pytest
import torch
from torch import nn

import fusedlm.nn
from helpers import assert_close, fresh

BATCH, SEQ_Q, SEQ_K, EMBED, HEADS, KDIM = 3, 9, 11, 32, 4, 24


def _pair(**kwargs):
    ref = nn.MultiheadAttention(EMBED, HEADS, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)  # biases start at zero in torch: make them count
    mha = fusedlm.nn.MultiheadAttention(EMBED, HEADS, dtype=torch.float64, **kwargs)
    mha.load_state_dict(ref.state_dict())
    return ref, mha


def _padding(batch, seq):
    """Mixed lengths, each at least 1: True = padding."""
    lengths = torch.randint(1, seq + 1, (batch,))
    lengths[0] = seq
    return torch.arange(seq)[None, :] >= lengths[:, None]


MASKS = ["none", "bool padding", "float padding", "bool attn_mask", "float attn_mask per head",
         "causal"]


def _masks(kind, seq_q, seq_k):
    """(key_padding_mask, attn_mask, is_causal) in each form torch accepts."""
    padding = _padding(BATCH, seq_k)
    if kind == "none":
        return None, None, False
    if kind == "bool padding":
        return padding, None, False
    if kind == "float padding":
        return torch.randn(BATCH, seq_k, dtype=torch.float64), None, False
    if kind == "bool attn_mask":
        mask = torch.rand(seq_q, seq_k) < 0.3
        mask[:, 0] = False  # every query keeps a key
        return padding, mask, False
    if kind == "float attn_mask per head":
        return None, torch.randn(BATCH * HEADS, seq_q, seq_k, dtype=torch.float64), False
    if kind == "causal":
        causal = torch.triu(torch.ones(seq_q, seq_k, dtype=torch.bool), diagonal=1)
        return padding.logical_and(torch.arange(seq_k)[None, :] > 0), causal, True
    raise AssertionError(kind)


def _inputs(self_attention, batch_first, kdim):
    def shaped(seq, width):
        shape = (BATCH, seq, width) if batch_first else (seq, BATCH, width)
        return fresh(shape, torch.float64, "cpu")
    if self_attention:
        x = shaped(SEQ_Q, EMBED)
        return x, x, x
    return shaped(SEQ_Q, EMBED), shaped(SEQ_K, kdim or EMBED), shaped(SEQ_K, kdim or EMBED)


def _grads(module, loss, inputs):
    params = [p for _, p in module.named_parameters()]
    leaves = list(dict.fromkeys(inputs))  # self-attention passes one tensor three times
    return torch.autograd.grad(loss, params + leaves)


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("self_attention,kdim,masks", [
    pytest.param(self_attention, kdim, masks, id=f"{name}-{masks}")
    for self_attention, kdim, name in [(True, None, "self"), (False, None, "cross"),
                                       (False, KDIM, "cross-kdim")]
    for masks in MASKS if self_attention or masks != "causal"])
def test_matches_torch(batch_first, self_attention, kdim, masks):
    ref, mha = _pair(batch_first=batch_first, kdim=kdim, vdim=kdim)
    inputs = _inputs(self_attention, batch_first, kdim)
    key_padding_mask, attn_mask, is_causal = _masks(masks, SEQ_Q, SEQ_Q if self_attention else SEQ_K)
    kwargs = dict(key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False,
                  is_causal=is_causal)
    out, weights = mha(*inputs, **kwargs)
    expected, _ = ref(*inputs, **kwargs)
    assert weights is None
    assert_close(out, expected)
    upstream = torch.randn_like(expected)
    for name, got, want in zip([n for n, _ in mha.named_parameters()] + ["inputs"] * 3,
                               _grads(mha, (out * upstream).sum(), inputs),
                               _grads(ref, (expected * upstream).sum(), inputs)):
        assert_close(got, want, name=f"grad of {name}")


def test_need_weights_returns_torchs_weights():
    ref, mha = _pair(batch_first=True)
    x = fresh((BATCH, SEQ_Q, EMBED), torch.float64, "cpu")
    padding = _padding(BATCH, SEQ_Q)
    for average in (True, False):
        out, weights = mha(x, x, x, key_padding_mask=padding, average_attn_weights=average)
        expected, expected_weights = ref(x, x, x, key_padding_mask=padding,
                                         average_attn_weights=average)
        assert_close(out, expected)
        assert_close(weights, expected_weights, name="weights")


def test_unbatched_input():
    ref, mha = _pair()
    x = fresh((SEQ_Q, EMBED), torch.float64, "cpu")
    padding = _padding(1, SEQ_Q)[0]
    out, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
    assert_close(out, ref(x, x, x, key_padding_mask=padding, need_weights=False)[0])


def test_dropout_only_in_training():
    ref, mha = _pair(batch_first=True, dropout=0.5)
    x = fresh((BATCH, SEQ_Q, EMBED), torch.float64, "cpu")
    first, second = (mha(x, x, x, need_weights=False)[0] for _ in range(2))
    assert not torch.allclose(first, second)
    mha.eval(), ref.eval()
    assert_close(mha(x, x, x, need_weights=False)[0], ref(x, x, x, need_weights=False)[0])


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
@pytest.mark.parametrize("options", [{"add_bias_kv": True}, {"add_zero_attn": True},
                                     {"add_bias_kv": True, "add_zero_attn": True, "kdim": KDIM,
                                      "vdim": KDIM}], ids=["bias_kv", "zero_attn", "both-kdim"])
def test_add_bias_kv_and_add_zero_attn_run_torchs_path(options, batch_first, need_weights):
    ref, mha = _pair(batch_first=batch_first, **options)
    assert list(mha.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in mha.named_parameters()] == [n for n, _ in ref.named_parameters()]
    inputs = _inputs(False, batch_first, options.get("kdim"))
    key_padding_mask = _padding(BATCH, SEQ_K)
    kwargs = dict(key_padding_mask=key_padding_mask, need_weights=need_weights)
    out, weights = mha(*inputs, **kwargs)
    expected, expected_weights = ref(*inputs, **kwargs)
    assert_close(out, expected)
    if need_weights:
        assert_close(weights, expected_weights, name="weights")
    else:
        assert weights is None and expected_weights is None
    upstream = torch.randn_like(expected)
    for got, want in zip(_grads(mha, (out * upstream).sum(), inputs),
                         _grads(ref, (expected * upstream).sum(), inputs)):
        assert_close(got, want, name="gradient")


# Calls torch rejects, and the error each must raise, naming the argument as passed.
BAD_CALLS = [
    # batch_first, shapes of query, key and value, masks ("dtype shape") or is_causal, error
    (False, (4, 2, EMBED), (4, EMBED), (4, 2, EMBED), {},
     r"key must have shape \(seq_k, batch=2, kdim=32\) for a batched query, got \(4, 32\)"),
    (True, (2, 4, EMBED), (1, 4, 4, 4, 1), (2, 4, EMBED), {},
     r"key must have shape \(batch=2, seq_k, kdim=32\) for a batched query, got \(1, 4, 4, 4, 1\)"),
    (True, (2, 4, EMBED), (2, 4, EMBED), (3, 4, EMBED), {},
     r"value must have shape \(batch=2, seq_k=4, vdim=32\) for a batched query, got \(3, 4, 32\)"),
    (True, (2, 4, EMBED), (2, 4, EMBED), (2, 5, EMBED), {},
     r"value must have shape \(batch=2, seq_k=4, vdim=32\) for a batched query, got \(2, 5, 32\)"),
    (False, (4, EMBED), (4, 2, EMBED), (4, EMBED), {},
     r"key must have shape \(seq_k, kdim=32\) for an unbatched query, got \(4, 2, 32\)"),
    (True, (1, 2, 4, EMBED), (2, 4, EMBED), (2, 4, EMBED), {},
     r"query must have shape \(batch, seq_q, embed_dim=32\) or, unbatched, \(seq_q, embed_dim=32\), "
     r"got \(1, 2, 4, 32\)"),
    (False, (4, 16), (4, EMBED), (4, EMBED), {},
     r"query must have shape \(seq_q, embed_dim=32\), got \(4, 16\)"),
    (True, (2, 4, EMBED), (2, 6, EMBED), (2, 6, EMBED), {"key_padding_mask": "bool 2 4"},
     r"key_padding_mask must have shape \(batch, seq_k\) = \(2, 6\), got \(2, 4\)"),
    (False, (4, EMBED), (6, EMBED), (6, EMBED), {"key_padding_mask": "bool 1 6"},
     r"key_padding_mask must have shape \(seq_k,\) = \(6,\), got \(1, 6\)"),
    (True, (2, 4, EMBED), (2, 4, EMBED), (2, 4, EMBED), {"attn_mask": "bool 4 6"},
     r"attn_mask must have shape \(seq_q, seq_k\) = \(4, 4\) or \(batch \* num_heads, seq_q, seq_k\) "
     r"= \(8, 4, 4\), got \(4, 6\)"),
    (False, (4, EMBED), (6, EMBED), (6, EMBED), {"attn_mask": "float 8 4 6"},
     r"attn_mask must have shape \(seq_q, seq_k\) = \(4, 6\) or \(num_heads, seq_q, seq_k\) = "
     r"\(4, 4, 6\), got \(8, 4, 6\)"),
    (True, (2, 4, EMBED), (2, 6, EMBED), (2, 6, EMBED), {"is_causal": True},
     r"is_causal needs as many queries as keys, got 4 and 6"),
]


def _mask(spec: str) -> torch.Tensor:
    dtype, *shape = spec.split()
    return torch.zeros([int(n) for n in shape], dtype={"bool": torch.bool, "int": torch.long,
                                                        "float": torch.float32}[dtype])


@pytest.mark.parametrize("batch_first,query,key,value,options,error", BAD_CALLS)
def test_bad_inputs_are_named_as_passed(batch_first, query, key, value, options, error):
    mha = fusedlm.nn.MultiheadAttention(EMBED, HEADS, batch_first=batch_first)
    options = {name: _mask(v) if isinstance(v, str) else v for name, v in options.items()}
    with pytest.raises(ValueError, match=error):
        mha(torch.randn(query), torch.randn(key), torch.randn(value), need_weights=False, **options)


def test_arguments_of_other_types_are_errors():
    # torch takes bool and floating-point masks only: an integer mask is never added as a float one.
    mha = fusedlm.nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
    x = torch.randn(2, 4, EMBED)
    for name, mask in (("key_padding_mask", _mask("int 2 4")), ("attn_mask", _mask("int 4 4"))):
        with pytest.raises(TypeError, match=f"{name} must be bool or floating point, got torch.int64"):
            mha(x, x, x, need_weights=False, **{name: mask})
    with pytest.raises(TypeError, match="value must be a torch.Tensor, got list"):
        mha(x, x, [1.0], need_weights=False)
