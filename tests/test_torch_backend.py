"""The torch backend: each op as PyTorch's own composition in the inputs' dtype
(fusedlm.backends.pytorch), held to the float64 reference like every backend, with the
op's promises kept where SDPA's differ (rows with no key, causal alignment, layouts)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlm
from fusedlm.backends import _REGISTRY, declared
from fusedlm.ops import reference
from fusedlm.verify import probes

from helpers import needs_cuda

F64 = torch.float64
# Its compositions run on any device: here on the CPU, and on a GPU where there is one.
DEVICES = ["cpu", pytest.param("cuda", marks=needs_cuda)]
SMALL_PROBES = [pytest.param(p, id=f"{p.op}-{p.name}") for info in declared().values()
                for p in info.probes if p.size == "small"]


def test_every_op_has_a_composition():
    assert set(_REGISTRY["torch"].kernels) == set(declared())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("probe", SMALL_PROBES)
def test_probes_match_the_float64_reference(probe, dtype, device):
    outcome = probes.run(probe, "torch", torch.device(device), dtype,
                         seed=int(torch.randint(1000, ())))
    assert outcome.within(dtype), f"{outcome.worst}: relative error {outcome.error:.3g}"


def _grads(out, inputs, upstream):
    return torch.autograd.grad(out, inputs, upstream, allow_unused=True)


def _assert_attention_matches(inputs, upstream=None, **options):
    out = fusedlm.ops.attention(*inputs, backend="torch", **options)
    expected = reference.attention(*inputs, **options)
    torch.testing.assert_close(out, expected)
    upstream = torch.randn_like(out) if upstream is None else upstream
    leaves = [t for t in (*inputs, options.get("attn_bias")) if t is not None and t.requires_grad]
    for got, want in zip(_grads(out, leaves, upstream), _grads(expected, leaves, upstream)):
        torch.testing.assert_close(got, want)
    return out


def _qkv(batch, heads, seq_q, seq_k, dim=8, device="cpu"):
    return tuple(torch.randn(batch, heads, seq, dim, dtype=F64, device=device, requires_grad=True)
                 for seq in (seq_q, seq_k, seq_k))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_rows_with_no_key_are_zeros_with_zero_gradients(device):
    # SDPA's own answer for a row whose keys are all masked is NaN; the op promises zeros.
    q, k, v = _qkv(3, 2, 5, 5, device=device)
    mask = torch.zeros(3, 5, dtype=torch.bool, device=device)
    mask[1, 2:] = True
    mask[2] = True  # a sequence of padding only
    upstream = torch.randn(3, 2, 5, 8, dtype=F64, device=device)
    out = _assert_attention_matches((q, k, v), upstream, key_padding_mask=mask)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    dq, = _grads(fusedlm.ops.attention(q, k, v, key_padding_mask=mask, backend="torch"), (q,),
                 upstream)
    assert torch.isfinite(dq).all() and torch.equal(dq[2], torch.zeros_like(dq[2]))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seq_q, seq_k", [(5, 5), (3, 7), (7, 3)])
@pytest.mark.parametrize("masked", [False, True])
def test_attention_causal_aligns_to_the_bottom_right(seq_q, seq_k, masked, device):
    # SDPA's is_causal aligns to the top left: the composition uses it only where both agree.
    q, k, v = _qkv(2, 2, seq_q, seq_k, device=device)
    mask = torch.zeros(2, seq_k, dtype=torch.bool, device=device)
    mask[1, seq_k // 2:] = masked
    _assert_attention_matches((q, k, v), causal=True, key_padding_mask=mask if masked else None)


def test_attention_bias_takes_its_gradient_and_combines_with_masks():
    q, k, v = _qkv(2, 3, 4, 6)
    bias = torch.randn(1, 3, 4, 6, dtype=F64, requires_grad=True)  # broadcast over the batch
    mask = torch.tensor([[False] * 6, [False] * 3 + [True] * 3])
    _assert_attention_matches((q, k, v), attn_bias=bias, key_padding_mask=mask, causal=True)


def test_attention_output_is_laid_out_like_q():
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2) for t in _qkv(2, 3, 5, 5))
    out = fusedlm.ops.attention(q, k, v, backend="torch")
    assert out.stride() == q.stride()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_pads_each_sequence_and_gathers_it_back(causal, device):
    lengths_q, lengths_k = [3, 0, 5, 1], [4, 2, 5, 1]
    cu_q = torch.tensor([0, 3, 3, 8, 9], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 6, 11, 12], dtype=torch.int32, device=device)
    q = torch.randn(sum(lengths_q), 2, 8, dtype=F64, device=device, requires_grad=True)
    k, v = (torch.randn(sum(lengths_k), 2, 8, dtype=F64, device=device, requires_grad=True)
            for _ in range(2))
    args = (q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k))
    out = fusedlm.ops.attention_varlen(*args, causal=causal, backend="torch")
    expected = reference.attention_varlen(*args, causal=causal)
    torch.testing.assert_close(out, expected)
    upstream = torch.randn_like(out)
    for got, want in zip(_grads(out, (q, k, v), upstream), _grads(expected, (q, k, v), upstream)):
        torch.testing.assert_close(got, want)


def test_decoding_writes_the_caches_as_the_reference_does():
    q = torch.randn(2, 1, 2, 8, dtype=F64)
    caches = [torch.randn(2, 6, 2, 8, dtype=F64) for _ in range(2)]
    lengths = torch.tensor([2, 4], dtype=torch.int32)
    k_new, v_new = torch.randn(2, 1, 2, 8, dtype=F64), torch.randn(2, 1, 2, 8, dtype=F64)
    expected_caches = [c.clone() for c in caches]
    out = fusedlm.ops.attention_with_kvcache(q, *caches, lengths, k_new=k_new, v_new=v_new,
                                             backend="torch")
    expected = reference.attention_with_kvcache(q, *expected_caches, lengths, k_new, v_new)
    torch.testing.assert_close(out, expected)
    for cache, want in zip(caches, expected_caches):
        assert torch.equal(cache, want)


def test_dropout_draws_from_torchs_generator_and_its_gradient_follows_the_mask():
    x, residual = torch.randn(64, 256, requires_grad=True), torch.randn(64, 256)
    torch.manual_seed(3)
    out, summed = fusedlm.ops.add_layer_norm(x, residual, None, None, dropout_p=0.25,
                                             backend="torch")
    torch.manual_seed(3)
    again, _ = fusedlm.ops.add_layer_norm(x, residual, None, None, dropout_p=0.25, backend="torch")
    assert torch.equal(out, again)
    kept = summed != residual
    assert 0.70 < kept.float().mean() < 0.80
    dx, = torch.autograd.grad(summed.sum(), x)
    torch.testing.assert_close(dx, kept.float() / 0.75)


class _FusedlmOpsCalled(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedlm":
            self.ops.append(func)
        return func(*args, **(kwargs or {}))


def test_a_whole_model_runs_on_the_torch_backend():
    # Forced, every op runs PyTorch's composition: a padded BERT batch (unpad, packed
    # attention, pad, add+LayerNorm, the FFN) against the reference backend.
    transformers = pytest.importorskip("transformers")
    from fusedlm.models import BertForMaskedLM

    config = transformers.BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64,
                                     max_position_embeddings=16, hidden_dropout_prob=0.0,
                                     attention_probs_dropout_prob=0.0)
    model = BertForMaskedLM(config).double().eval()
    ids = torch.randint(0, 50, (3, 10))
    attention_mask = torch.ones(3, 10, dtype=torch.long)
    attention_mask[1, 6:] = 0
    labels = torch.where(torch.rand(3, 10) < 0.3, ids, -100)
    labels[0, 0] = ids[0, 0]
    with fusedlm.use_backend("torch"), _FusedlmOpsCalled() as called:
        loss = model(ids, attention_mask=attention_mask, labels=labels).loss
        grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert called.ops == []
    with fusedlm.use_backend("reference"):
        expected = model(ids, attention_mask=attention_mask, labels=labels).loss
        expected_grads = torch.autograd.grad(expected, list(model.parameters()), allow_unused=True)
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, expected_grads):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want)


def test_torch_compile_traces_the_compositions_into_one_graph():
    x, residual = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16)

    def step(x, residual):
        out, summed = fusedlm.ops.add_layer_norm(x, residual, None, None, backend="torch")
        q = out.view(1, 4, 2, 8).transpose(1, 2)
        return fusedlm.ops.attention(q, q, q, causal=True, backend="torch").sum() + summed.sum()

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(x, residual)
    expected = step(x, residual)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got, x)[0], torch.autograd.grad(expected, x)[0])


def test_outputs_are_their_own_tensors():
    # A plain LayerNorm (no residual, no dropout): its sum is x's values, in a tensor of its
    # own, as on every backend.
    x = torch.randn(3, 8)
    _, summed = fusedlm.ops.add_layer_norm(x, None, None, None, backend="torch")
    assert torch.equal(summed, x) and summed.data_ptr() != x.data_ptr()
