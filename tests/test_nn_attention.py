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


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="add_bias_kv"):
        fusedlm.nn.MultiheadAttention(EMBED, HEADS, add_bias_kv=True)
    mha = fusedlm.nn.MultiheadAttention(EMBED, HEADS, batch_first=True)
    q, kv = torch.randn(2, 5, EMBED), torch.randn(2, 7, EMBED)
    with pytest.raises(ValueError, match="attn_mask"):
        mha(q, kv, kv, attn_mask=torch.zeros(5, 5, dtype=torch.bool), need_weights=False)
    with pytest.raises(ValueError, match="is_causal"):
        mha(q, kv, kv, is_causal=True, need_weights=False)
    with pytest.raises(ValueError, match="key_padding_mask"):
        mha(q, kv, kv, key_padding_mask=torch.zeros(2, 5, dtype=torch.bool), need_weights=False)
    with pytest.raises(ValueError, match="query"):
        mha(q[None], kv, kv, need_weights=False)
