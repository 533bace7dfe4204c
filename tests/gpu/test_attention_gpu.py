"""attention and attention_varlen on the GPU at real shapes, against the float32 reference.

BERT-base (12 heads of 64, seq 128 and 512, mixed padding), GPT-2 small (seq 1024,
causal), long causal sequences, the head dims of common models, and packed sequences.
The cuda backend's sequences up to 512 take its resident path and longer ones its
streamed path: both are here, with padding, causal masks and dropout.
Half-precision products and the probabilities rounded before P V bound the error at
1e-2 norm-wise for both bfloat16 and float16.
"""
import pytest
import torch

import fusedlm
from fusedlm.ops import reference
from fusedlm.ops._dropout import next_seed
from checks import (MAX_RELATIVE_ERROR, assert_relative_error, float32_copies, fresh, gpu_backends,
                    grads, keep_mask, needs_cuda, poison_memory, skip_if_refused)

pytestmark = needs_cuda
DTYPES = [torch.bfloat16, torch.float16]
BOUND = 1e-2

SHAPES = {
    # name: (batch, heads, seq_q, seq_k, head_dim, options)
    "bert-base-128": (32, 12, 128, 128, 64, {"mask": True}),
    "bert-base-512": (8, 12, 512, 512, 64, {"mask": True, "layout": "bshd"}),
    "gpt2-small-1024": (8, 12, 1024, 1024, 64, {"causal": True, "layout": "bshd"}),
    "long-2048-dim128": (2, 16, 2048, 2048, 128, {"causal": True}),
    "long-4096": (1, 16, 4096, 4096, 64, {"causal": True}),
    "long-8192": (1, 4, 8192, 8192, 64, {"causal": True}),
    "dim-32": (4, 8, 256, 256, 32, {"mask": True}),
    "dim-80": (4, 8, 256, 300, 80, {"causal": True}),
    "dim-96": (4, 8, 333, 256, 96, {"mask": True, "causal": True}),
    "dim-128": (4, 8, 256, 256, 128, {}),
    "padded-640x768": (4, 12, 768, 640, 64, {"mask": True}),
    "bias-per-head": (4, 12, 128, 128, 64, {"bias": (12, 128, 128)}),
    "bias-full": (2, 4, 200, 180, 64, {"bias": (2, 4, 200, 180), "causal": True}),
}


def _padding(batch, seq):
    """Lengths between seq / 2 and seq, the first full; True = padding."""
    lengths = torch.randint(seq // 2, seq + 1, (batch,), device="cuda")
    lengths[0] = seq
    return torch.arange(seq, device="cuda")[None, :] >= lengths[:, None]


def _views(leaves, layout):
    return [t.transpose(1, 2) if layout == "bshd" else t for t in leaves]


def _run(backend, batch, heads, seq_q, seq_k, head_dim, dtype, opts, dropout_p=0.0):
    opts = dict(opts)
    layout = opts.pop("layout", "bhsd")
    shapes = [(seq_q, head_dim), (seq_k, head_dim), (seq_k, head_dim)]
    leaves = [fresh((batch, s, heads, d) if layout == "bshd" else (batch, heads, s, d), dtype)
              for s, d in shapes]
    if opts.pop("mask", False):
        opts["key_padding_mask"] = _padding(batch, seq_k)
    bias_shape = opts.pop("bias", None)
    bias = fresh(bias_shape, dtype) if bias_shape else None
    wrt = leaves + ([bias] if bias is not None else [])
    skip_if_refused(backend, "attention", *_views(leaves, layout), attn_bias=bias,
                    dropout_p=dropout_p, **opts)
    torch.manual_seed(7)
    seed = next_seed(dropout_p)
    keep = keep_mask(backend, seed, (batch, heads, seq_q, seq_k), dropout_p) if dropout_p else None
    poison_memory()
    torch.manual_seed(7)
    out = fusedlm.ops.attention(*_views(leaves, layout), attn_bias=bias, dropout_p=dropout_p,
                                backend=backend, **opts)
    upstream = torch.randn_like(out)
    got = grads(out, wrt, upstream)

    ref = float32_copies(*wrt)
    expected = reference.attention(*_views(ref[:3], layout), attn_bias=ref[3] if bias is not None
                                   else None, dropout_p=dropout_p, dropout_mask=keep, **opts)
    expected_grads = grads(expected, ref, upstream.float())
    assert_relative_error(out, expected, dtype, "out", BOUND)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), got, expected_grads):
        assert a.dtype == dtype and a.shape == e.shape
        assert_relative_error(a, e, dtype, name, BOUND)


@pytest.mark.parametrize("backend", gpu_backends("attention"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(SHAPES))
def test_attention_real_shapes(backend, dtype, case):
    batch, heads, seq_q, seq_k, head_dim, opts = SHAPES[case]
    _run(backend, batch, heads, seq_q, seq_k, head_dim, dtype, opts)


@pytest.mark.parametrize("backend", gpu_backends("attention"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq", [256, 640])
def test_attention_dropout_replays_its_mask(backend, dtype, seq):
    _run(backend, 4, 12, seq, seq, 64, dtype, {"mask": True, "causal": True}, dropout_p=0.1)


@pytest.mark.parametrize("backend", gpu_backends("attention_varlen"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq,causal", [(128, False), (512, False), (1024, True)])
def test_attention_varlen_real_shapes(backend, dtype, seq, causal):
    batch, heads, head_dim = 4096 // seq, 12, 64
    lengths = torch.randint(1, seq + 1, (batch,)).tolist()
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (fresh((sum(lengths), heads, head_dim), dtype) for _ in range(3))
    poison_memory()
    out = fusedlm.ops.attention_varlen(q, k, v, cu, cu, seq, seq, causal=causal, backend=backend)
    upstream = torch.randn_like(out)
    got = grads(out, [q, k, v], upstream)
    ref = float32_copies(q, k, v)
    expected = reference.attention_varlen(*ref, cu, cu, seq, seq, causal=causal)
    expected_grads = grads(expected, ref, upstream.float())
    assert_relative_error(out, expected, dtype, "out", BOUND)
    for name, a, e in zip(("dq", "dk", "dv"), got, expected_grads):
        assert_relative_error(a, e, dtype, name, BOUND)


@pytest.mark.parametrize("backend", gpu_backends("attention"))
def test_attention_gradients_repeat_bit_for_bit(backend):
    leaves = [fresh((8, 12, 512, 64), torch.bfloat16) for _ in range(3)]
    bias = fresh((12, 512, 512), torch.bfloat16)
    mask = _padding(8, 512)
    # (The cuda kernels take no bias: test_attention.py repeats their gradients without one.)
    skip_if_refused(backend, "attention", *leaves, key_padding_mask=mask, attn_bias=bias,
                    causal=True)

    def step():
        out = fusedlm.ops.attention(*leaves, key_padding_mask=mask, attn_bias=bias, causal=True,
                                    backend=backend)
        return grads(out, leaves + [bias], torch.ones_like(out))

    first = step()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, step()))


@pytest.mark.parametrize("backend", [p for p in gpu_backends("attention") if p.id == "cuda"])
@pytest.mark.parametrize("causal,dropout_p", [(False, 0.0), (True, 0.1)])
def test_attention_resident_path_matches_the_streamed_one(backend, causal, dropout_p, monkeypatch):
    """Up to 512 tokens the cuda kernels hold a sequence's tiles in shared memory; every
    row still meets the same tiles in the same order, so the results are the streamed
    path's bit for bit, dropout included."""
    leaves = [fresh((4, 12, 320, 64), torch.bfloat16) for _ in range(3)]
    mask = _padding(4, 320)

    def step():
        torch.manual_seed(11)
        out = fusedlm.ops.attention(*leaves, key_padding_mask=mask, causal=causal,
                                    dropout_p=dropout_p, backend=backend)
        return [out] + grads(out, leaves, torch.ones_like(out))

    resident = step()
    monkeypatch.setenv("FUSEDLM_ATTENTION_RESIDENT", "0")
    streamed = step()
    for name, a, b in zip(("out", "dq", "dk", "dv"), resident, streamed):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", [p for p in gpu_backends("attention") if p.id == "cuda"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_wgmma_forward_matches_mma_sync(backend, head_dim, dtype, monkeypatch):
    """On sm_90 the streamed forward runs on warpgroup products; it must agree with the
    mma.sync forward (the same scores in another summation order) to the output's rounding,
    and its backward, which reads the saved log-sum-exp, must agree as well."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma forward runs on sm_90 devices only")
    leaves = [fresh((2, 8, 1000, head_dim), dtype) for _ in range(3)]
    mask = _padding(2, 1000)

    def step():
        torch.manual_seed(5)
        out = fusedlm.ops.attention(*leaves, key_padding_mask=mask, causal=True, dropout_p=0.1,
                                    backend=backend)
        return [out] + grads(out, leaves, torch.ones_like(out))

    wgmma = step()
    monkeypatch.setenv("FUSEDLM_ATTENTION_WGMMA", "0")
    mma_sync = step()
    for name, a, b in zip(("out", "dq", "dk", "dv"), wgmma, mma_sync):
        assert_relative_error(a, b, dtype, name, MAX_RELATIVE_ERROR[dtype] / 2)
