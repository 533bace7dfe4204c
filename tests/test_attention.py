"""attention and attention_varlen against the reference, on every backend that has them."""
import math
import re
import sys
from contextlib import nullcontext

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fusedlm
import fuzz
from fusedlm.backends import cuda as cuda_backend
from fusedlm.ops import reference
from fuzz import Case, softmax_attention
from fusedlm.ops._dropout import next_seed
from helpers import (MAX_RELATIVE_ERROR, as_reference, assert_close, assert_relative_error,
                     backend_device, backends_for, first_taken, fresh, grads, keep_mask,
                     needs_emulator, poison_memory, skip_if_refused, slow_backend)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _padding_mask(batch, seq, device, *, empty_row=False):
    """Random key padding (True = padding), not only at the end of each row."""
    mask = torch.rand(batch, seq, device=device) < 0.3
    lengths = torch.randint(1, seq + 1, (batch,), device=device)
    mask |= torch.arange(seq, device=device)[None, :] >= lengths[:, None]
    if empty_row:
        mask[0] = True
    return mask


def backends_with_paths(op):
    """pytest params (backend, path): backends_for(op), with the cuda backend once per way
    its kernels walk the key (or query) tiles: "resident", the default, which holds every
    tile of a sequence of up to 512 rows in shared memory at once (longer ones stream),
    and "streamed" (set_path("attention_resident", False)), one tile at a time at any
    length, the path of long sequences and, on sm_90a, of the wgmma forward."""
    params = []
    for param in backends_for(op):
        (name,) = param.values
        for path in ("resident", "streamed") if name == "cuda" else ("",):
            params.append(pytest.param(name, path, id=f"{name}-{path}" if path else name,
                                       marks=param.marks))
    return params


def _take(path, cuda_paths):
    """Sends the cuda kernels down `path` for the rest of the test (the cuda_paths fixture)."""
    if path == "streamed":
        cuda_paths("attention_resident", False)


def _inputs(batch, heads, seq_q, seq_k, head_dim, dtype, device, *, layout="bhsd", head_dim_v=None,
            scale=1.0):
    """Leaf tensors and the [batch, heads, seq, dim] views of them the op takes.

    layout "bshd" makes leaves [batch, seq, heads, dim] and passes transposed views, the
    layout attention gets inside a transformer block."""
    shapes = [(seq_q, head_dim), (seq_k, head_dim), (seq_k, head_dim_v or head_dim)]
    if layout == "bshd":
        leaves = [fresh((batch, s, heads, d), dtype, device, scale) for s, d in shapes]
    else:
        leaves = [fresh((batch, heads, s, d), dtype, device, scale) for s, d in shapes]
    return leaves, _views(leaves, layout)


def _views(leaves, layout):
    return [t.transpose(1, 2) if layout == "bshd" else t for t in leaves]


def _check_against_reference(backend, leaves, layout, *, bias=None, out_scale=1.0, grad_scale=1.0,
                             **kwargs):
    """Runs attention and the float64 reference on the same inputs; compares the output and
    the gradients of every leaf (and of the bias when it requires grad)."""
    q, k, v = _views(leaves, layout)
    skip_if_refused(backend, "attention", q, k, v, attn_bias=bias, **kwargs)
    out = fusedlm.ops.attention(q, k, v, attn_bias=bias, backend=backend, **kwargs)
    grad = torch.randn_like(out)
    wrt = leaves + ([bias] if bias is not None and bias.requires_grad else [])
    grads = torch.autograd.grad(out, wrt, grad)

    ref_wrt = as_reference(*wrt)
    ref_bias = ref_wrt[3] if len(wrt) == 4 else (None if bias is None else bias.double())
    expected = reference.attention(*_views(ref_wrt[:3], layout), attn_bias=ref_bias, **kwargs)
    ref_grads = torch.autograd.grad(expected, ref_wrt, grad.double())

    assert out.dtype == q.dtype and out.shape == expected.shape
    assert_close(out, expected, scale=out_scale, name="out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert g.dtype == q.dtype and g.shape == r.shape
        assert_close(g, r, dtype=q.dtype, scale=grad_scale, name=name)
    return out, grads


def _assert_matches(out, leaves, expected_of, *, out_scale=1.0, grad_scale=1.0):
    """out, and the gradients of ``leaves`` under one random output gradient, against
    ``expected_of`` applied to float64 copies of the leaves."""
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad)
    ref = as_reference(*leaves)
    expected = expected_of(*ref)
    ref_grads = torch.autograd.grad(expected, ref, grad.double())
    assert_close(out, expected, scale=out_scale, name="out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g, r, scale=grad_scale, name=name)


CASES = {
    # name: (batch, heads, seq_q, seq_k, head_dim, options)
    "plain": (2, 3, 37, 37, 32, {}),
    "causal": (2, 2, 33, 33, 16, {"causal": True}),
    "causal_fewer_queries": (2, 2, 13, 29, 16, {"causal": True}),
    "causal_more_queries": (2, 2, 29, 13, 16, {"causal": True}),  # the first rows see no key
    "padding": (3, 2, 31, 40, 24, {"mask": True}),
    "padding_causal": (3, 2, 40, 40, 24, {"mask": True, "causal": True}),
    "bias_full": (2, 2, 19, 23, 16, {"bias": (2, 2, 19, 23)}),
    "bias_per_head": (2, 3, 19, 23, 16, {"bias": (3, 1, 23), "mask": True}),
    "bias_per_key": (2, 3, 19, 23, 16, {"bias": (2, 1, 1, 23), "causal": True}),
    "bias_shared": (2, 3, 19, 23, 16, {"bias": (19, 23)}),
    "bias_per_query": (2, 3, 19, 23, 16, {"bias": (1, 3, 19, 1)}),
    "head_dim_40": (2, 2, 21, 21, 40, {"mask": True}),
    "head_dim_80": (1, 2, 21, 26, 80, {"causal": True}),
    "value_dim_differs": (2, 2, 17, 20, 24, {"head_dim_v": 40}),
    "one_token": (2, 2, 1, 1, 16, {}),
    "one_query": (2, 2, 1, 20, 16, {"causal": True, "mask": True}),
    "bshd_layout": (2, 3, 25, 25, 16, {"layout": "bshd", "mask": True, "causal": True}),
    # Several query and key blocks: the online softmax rescales across key blocks.
    "many_blocks": (1, 2, 300, 530, 16, {"bias": (1, 2, 1, 530)}),
    "many_blocks_padding": (2, 1, 140, 600, 16, {"mask": True, "causal": True}),
    "scale": (2, 2, 12, 12, 16, {"scale": 0.37}),
    # The head dims of the cuda kernels, over several query and key blocks of 64, the last
    # ones partial. Up to 128 keys the cuda backward is one kernel, which takes delta from P
    # and dP themselves.
    "head_dim_64": (2, 3, 37, 45, 64, {"mask": True}),
    "head_dim_64_blocks": (1, 2, 150, 200, 64, {"causal": True, "mask": True, "layout": "bshd"}),
    "head_dim_128": (2, 2, 70, 70, 128, {"causal": True}),
    "head_dim_128_more_queries": (1, 2, 130, 67, 128, {"causal": True, "mask": True}),
    "head_dim_128_short": (2, 2, 45, 37, 128, {"causal": True, "mask": True}),
    # Past 512 keys: the cuda forward and dQ stream their key tiles whatever the path.
    "head_dim_64_long": (1, 2, 20, 530, 64, {"mask": True}),
}
# On the slow backends (Triton's interpreter, 64 queries and 32 keys per block; the CUDA
# emulator, 64 or 128 rows a block) the many-block cases shrink and still span several
# query and key blocks.
SLOW_CASES = {
    "many_blocks": (1, 2, 150, 230, 16, {"bias": (1, 2, 1, 230)}),
    "many_blocks_padding": (2, 1, 100, 230, 16, {"mask": True, "causal": True}),
    "head_dim_64_blocks": (1, 1, 130, 150, 64, {"causal": True, "mask": True, "layout": "bshd"}),
    "head_dim_128": (1, 2, 70, 70, 128, {"causal": True}),
    "head_dim_128_more_queries": (1, 1, 130, 67, 128, {"causal": True, "mask": True}),
}


@pytest.mark.parametrize("backend, path", backends_with_paths("attention"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_reference(backend, path, dtype, case, cuda_paths):
    _take(path, cuda_paths)
    device = backend_device(backend)
    cases = SLOW_CASES if slow_backend(backend) and case in SLOW_CASES else CASES
    batch, heads, seq_q, seq_k, head_dim, opts = cases[case]
    opts = dict(opts)
    layout = opts.pop("layout", "bhsd")
    leaves, _ = _inputs(batch, heads, seq_q, seq_k, head_dim, dtype, device, layout=layout,
                        head_dim_v=opts.pop("head_dim_v", None))
    if opts.pop("mask", False):
        opts["key_padding_mask"] = _padding_mask(batch, seq_k, device)
    bias_shape = opts.pop("bias", None)
    bias = fresh(bias_shape, dtype, device) if bias_shape else None
    # Half precision: the output's rounding, plus the rounded output feeding backward's
    # rowsum(dO * O); a bias gradient sums over its broadcast dimensions.
    grad_scale = 2 if dtype == torch.float32 else 3
    if bias_shape and math.prod(bias_shape) < batch * heads * seq_q * seq_k:
        grad_scale *= 4
    _check_against_reference(backend, leaves, layout, bias=bias, grad_scale=grad_scale, **opts)


@pytest.mark.parametrize("backend, path", backends_with_paths("attention"))
@pytest.mark.parametrize("dtype, head_dim", [(torch.float32, 16), (torch.bfloat16, 64)])
def test_attention_rows_with_every_key_masked_are_zero(backend, path, dtype, head_dim, cuda_paths):
    _take(path, cuda_paths)
    device = backend_device(backend)
    leaves, (q, k, v) = _inputs(3, 2, 9, 6, head_dim, dtype, device)
    mask = _padding_mask(3, 6, device, empty_row=True)
    for causal in (False, True):  # causal with 9 queries over 6 keys: the first 3 rows see nothing
        out, grads = _check_against_reference(backend, leaves, "bhsd", key_padding_mask=mask,
                                              causal=causal, grad_scale=2 if dtype == torch.float32 else 3)
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.equal(grads[0][0], torch.zeros_like(grads[0][0]))
        assert torch.equal(grads[1][0], torch.zeros_like(grads[1][0]))
        if causal:
            assert torch.equal(out[:, :, :3], torch.zeros_like(out[:, :, :3]))
    # Padding keys get zero gradients.
    out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, backend=backend)
    dk, dv = torch.autograd.grad(out.sum(), (k, v))
    assert (dk[mask[:, None, :, None].expand_as(dk)] == 0).all()
    assert (dv[mask[:, None, :, None].expand_as(dv)] == 0).all()


def _attention_in_dtype(q, k, v, causal):
    """Plain attention with every product and the softmax in the inputs' dtype."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    seq_q, seq_k = scores.shape[-2:]
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("backend, path", backends_with_paths("attention"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seq_k", [24, 300])
def test_attention_large_logits_do_not_overflow(backend, path, dtype, seq_k, cuda_paths):
    # Scores in the hundreds: exp would overflow even float32 without subtracting the row max.
    _take(path, cuda_paths)
    device = backend_device(backend)
    batch = 1 if slow_backend(backend) else 2
    q = fresh((batch, 2, 24, 64), dtype, device, 12.0)
    k, v = (fresh((batch, 2, seq_k, 64), dtype, device, 12.0) for _ in range(2))
    skip_if_refused(backend, "attention", q, k, v, causal=True)
    out = fusedlm.ops.attention(q, k, v, causal=True, backend=backend)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref = as_reference(q, k, v)
    expected = reference.attention(*ref, causal=True)
    ref_grads = torch.autograd.grad(expected, ref, grad.double())
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    # Errors in roundings of the dtype, relative to each tensor's largest entry, or for dq
    # and dk to the largest sum of |terms| behind one of their entries where that is
    # larger: with scores in the hundreds the softmax is nearly one-hot, and
    # dS = P (dP - delta) cancels terms in the hundreds (delta = rowsum(dO * O), from the
    # output as stored in the dtype on the long rows, as FlashAttention does) down to a
    # gradient up to 40 times smaller. Against its own largest entry such a gradient was
    # 320 bfloat16 roundings off (and 5 times what attention computed wholly in bfloat16
    # makes) in 1 draw of 150; against its terms, at most 0.46 in those 150. Rows that fit
    # one key block take delta from the exact probabilities. As in FlashAttention's tests,
    # twice the error of the same computation in the dtype itself is allowed too (for
    # short rows the reference with inputs rounded to the dtype; for long ones attention
    # in the dtype).
    low = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    low_out = (reference.attention if seq_k <= 256 else _attention_in_dtype)(*low, causal=True)
    low_results = (low_out, *torch.autograd.grad(low_out, low, grad))
    terms = (None, *_score_gradient_terms(*ref, grad.double()), None)
    bound = 3 if seq_k <= 256 else 8
    eps = torch.finfo(dtype).eps
    for name, a, low_a, e, size in zip(("out", "dq", "dk", "dv"), (out, *grads), low_results,
                                       (expected, *ref_grads), terms):
        scale = e.abs().max() if size is None else max(e.abs().max(), size)
        error = (a.double() - e).abs().max() / scale
        low_error = (low_a.double() - e).abs().max() / scale
        allowed = max(bound * eps, 2 * low_error)
        assert error < allowed, (f"{name}: relative error {error:.3g} ({error / eps:.1f} eps; "
                                 f"{low_error / eps:.1f} eps in {str(dtype)[6:]} itself)")


def _score_gradient_terms(q, k, v, grad):
    """The largest sum of |terms| behind one entry of dq and of dk (causal attention, float64
    inputs): dS = P (dP - delta) taken as P (|dP| + |delta|)."""
    q, k, v = (t.detach() for t in (q, k, v))
    scale = q.shape[-1] ** -0.5
    scores = (q @ k.transpose(-1, -2)) * scale
    seq_q, seq_k = scores.shape[-2:]
    allowed = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).tril(seq_k - seq_q)
    p = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    delta = (grad * (p @ v)).sum(-1, keepdim=True)
    ds = p * ((grad @ v.transpose(-1, -2)).abs() + delta.abs())
    return (ds @ k.abs()).max() * scale, (ds.transpose(-1, -2) @ q.abs()).max() * scale


@pytest.mark.parametrize("backend", backends_for("attention"))
@pytest.mark.parametrize("head_dim, head_dim_v", [(264, 16), (16, 300)], ids=["q", "v"])
def test_attention_a_refused_call_says_why_and_runs_elsewhere(backend, head_dim, head_dim_v):
    # Head dims past what a backend's kernels take (the triton kernels hold a row block in
    # registers): asked for by name, the backend raises what its limits refuse; left to
    # the automatic choice, the call runs on a backend that takes it.
    device = backend_device(backend)
    q, k = (torch.randn(1, 1, 4, head_dim, device=device) for _ in range(2))
    v = torch.randn(1, 1, 4, head_dim_v, device=device)
    try:
        fusedlm.explain("attention", q, k, v, backend=backend)
        pytest.skip(f"{backend} takes head dims {head_dim} and {head_dim_v}")
    except RuntimeError as error:
        refusal = str(error)
    with pytest.raises(RuntimeError, match=re.escape(refusal)):
        fusedlm.ops.attention(q, k, v, backend=backend)
    assert_close(fusedlm.ops.attention(q, k, v), reference.attention(q.double(), k.double(), v.double()))


def test_attention_gradcheck():
    q, k, v = (fresh((2, 2, s, 5), torch.float64, "cpu") for s in (4, 6, 6))
    bias = fresh((2, 1, 6), torch.float64, "cpu")
    mask = torch.tensor([[False, False, True, False, False, False],
                         [False, False, False, False, True, True]])
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v, b: fusedlm.ops.attention(q, k, v, causal=causal, key_padding_mask=mask,
                                                     attn_bias=b, backend="cpu"),
            (q, k, v, bias))


@settings(max_examples=20, deadline=None)
@given(batch=st.integers(1, 3), heads=st.integers(1, 3), seq_q=st.integers(1, 40),
       seq_k=st.integers(1, 40), head_dim=st.integers(1, 48), causal=st.booleans(),
       masked=st.booleans(), bias_dims=st.sampled_from([None, (0, 1, 2, 3), (1, 3), (3,), (0, 2)]),
       layout=st.sampled_from(["bhsd", "bshd"]))
def test_attention_random_shapes(batch, heads, seq_q, seq_k, head_dim, causal, masked, bias_dims,
                                 layout):
    leaves, _ = _inputs(batch, heads, seq_q, seq_k, head_dim, torch.float32, "cpu", layout=layout)
    mask = _padding_mask(batch, seq_k, "cpu") if masked else None
    bias = None
    if bias_dims is not None:  # a bias over some of [batch, heads, seq_q, seq_k], size 1 elsewhere
        full = (batch, heads, seq_q, seq_k)
        bias = fresh(tuple(full[d] if d in bias_dims else 1 for d in range(4)), torch.float32, "cpu")
    _check_against_reference("cpu", leaves, layout, bias=bias, causal=causal, key_padding_mask=mask,
                             grad_scale=10)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_keys_padded_at_the_ends(layout, dtype, causal):
    # Padding only at the ends of a sequence leaves its valid keys consecutive: the CPU
    # products then write dK and dV in place (over query blocks of 128 and key blocks of
    # 256 here) and zero the padding keys' rows around them.
    batch, seq_q, seq_k = 5, 300, 530
    first = torch.tensor([0, 0, 17, 200, 0])  # first valid key of each sequence
    end = torch.tensor([530, 260, 530, 401, 0])  # one past its last; the last sequence has none
    position = torch.arange(seq_k)[None, :]
    mask = (position < first[:, None]) | (position >= end[:, None])
    leaves, _ = _inputs(batch, 2, seq_q, seq_k, 16, dtype, "cpu", layout=layout)
    _check_against_reference("cpu", leaves, layout, key_padding_mask=mask, causal=causal,
                             grad_scale=10)


def test_attention_every_instruction_set(cpu_isa):
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        leaves, _ = _inputs(2, 2, 21, 35, 20, dtype, "cpu", layout="bshd")
        bias = fresh((2, 1, 21, 35), dtype, "cpu")
        _check_against_reference("cpu", leaves, "bshd", bias=bias, causal=True,
                                 key_padding_mask=_padding_mask(2, 35, "cpu"), grad_scale=12)


def test_attention_outputs_follow_the_input_layout():
    # The output of [batch, seq, heads, dim] views is laid out [batch, seq, heads, dim] too,
    # so merging the heads back is a view; gradients keep their inputs' layout.
    leaves, (q, k, v) = _inputs(2, 3, 8, 8, 16, torch.float32, "cpu", layout="bshd")
    out = fusedlm.ops.attention(q, k, v, backend="cpu")
    assert out.transpose(1, 2).is_contiguous()
    out.sum().backward()
    assert all(t.grad.is_contiguous() for t in leaves)


@pytest.mark.parametrize("backend", backends_for("attention"))
@pytest.mark.parametrize("bias_shape", [(2, 3, 8, 8), (3, 8, 8), (2, 1, 1, 8)])
def test_attention_outputs_are_not_views(backend, bias_shape):
    # FSDP2 warns about, and cannot follow in-place changes to, a view a module returns. A
    # float32 bias: its gradient needs no conversion, which would copy it anyway; of every
    # pair, or summed over the broadcast dimensions. The inputs are [batch, seq, heads, dim]
    # views, whose layout the outputs take.
    device = backend_device(backend)
    _, (q, k, v) = _inputs(2, 3, 8, 8, 16, torch.float32, device, layout="bshd")
    bias = fresh(bias_shape, torch.float32, device)
    skip_if_refused(backend, "attention", q, k, v, attn_bias=bias)
    seed = next_seed(0.0)
    with torch.no_grad():
        out, lse = torch.ops.fusedlm.attention(q, k, v, None, bias, False, -1, -1, 0.0, 0.25, seed,
                                               backend)
        grads = torch.ops.fusedlm.attention_backward(torch.randn_like(out), q, k, v, out, lse, None,
                                                     bias, False, -1, -1, 0.0, 0.25, seed, True,
                                                     backend)
    assert grads[3].shape == bias.shape
    assert [t._base is None for t in (out, lse, *grads)] == [True] * 6


def test_attention_empty_batch():
    leaves, (q, k, v) = _inputs(0, 2, 5, 7, 16, torch.float32, "cpu")
    out = fusedlm.ops.attention(q, k, v, key_padding_mask=torch.zeros(0, 7, dtype=torch.bool),
                                causal=True, backend="cpu")
    assert out.shape == (0, 2, 5, 16)
    out.sum().backward()
    assert all(t.grad.shape == t.shape for t in leaves)
    # No keys at all: every row is empty, so zeros.
    q, k, v = (torch.randn(1, 2, s, 8) for s in (3, 0, 0))
    assert torch.equal(fusedlm.ops.attention(q, k, v, backend="cpu"), torch.zeros(1, 2, 3, 8))


@pytest.mark.parametrize("backend, path",
                         [p for p in backends_with_paths("attention") if p.values[0] == "cuda"])
@pytest.mark.parametrize("keys", ["one_block", "several_blocks"])
def test_cuda_attention_backward_repeats_bit_for_bit(backend, path, keys, cuda_paths):
    # No atomics: dK/dV per key block and dQ per query block, each element written once;
    # up to 128 keys one kernel sums each query's delta over its warps in a fixed order.
    _take(path, cuda_paths)
    batch, heads, seq_q, seq_k = (1, 1, 70, 130) if slow_backend(backend) else (2, 3, 200, 260)
    if keys == "one_block":
        seq_k = 100
    device = backend_device(backend)
    leaves, (q, k, v) = _inputs(batch, heads, seq_q, seq_k, 64, torch.bfloat16, device,
                                layout="bshd")
    mask = _padding_mask(batch, seq_k, device)
    grad = torch.randn(batch, heads, seq_q, 64, dtype=torch.bfloat16, device=device)
    results = []
    for _ in range(2):
        out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, causal=True, backend=backend)
        results.append(torch.autograd.grad(out, leaves, grad))
    for first, second in zip(*results):
        assert torch.equal(first, second)


@pytest.mark.parametrize("backend", [p for p in backends_for("attention") if p.id == "cuda"])
@pytest.mark.parametrize("seq_k", [100, 200])
def test_cuda_attention_backward_in_three_kernels_agrees_with_the_one_kernel(backend, seq_k,
                                                                            cuda_paths):
    # The attention_fused_backward path off (FUSEDLM_ATTENTION_FUSED_BACKWARD=0) keeps the
    # three kernels (delta, dQ, dK/dV) at every length, the other side of the measurement
    # between them. Both compute the same gradients, summed in other orders.
    device = backend_device(backend)
    batch, heads, seq_q = (1, 2, 70) if slow_backend(backend) else (4, 12, 150)
    leaves, (q, k, v) = _inputs(batch, heads, seq_q, seq_k, 64, torch.bfloat16, device,
                                layout="bshd")
    mask = _padding_mask(batch, seq_k, device)
    grad = torch.randn(batch, heads, seq_q, 64, dtype=torch.bfloat16, device=device)
    runs = []
    for fused in (True, False):
        cuda_paths("attention_fused_backward", fused)
        out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, causal=True, backend=backend)
        counting = cuda_backend.count_launches() if cuda_backend.emulated() else nullcontext()
        with counting as launches:
            runs.append(torch.autograd.grad(out, leaves, grad))
        if launches is not None:
            assert len(launches) == (1 if fused else 3)
    for name, one, three in zip(("dq", "dk", "dv"), *runs):
        assert_relative_error(one, three, torch.bfloat16, name)


@pytest.mark.parametrize("seq, head_dim", [(64, 64), (64, 128), (128, 64), (128, 128),
                                           (320, 64), (512, 128)])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("marks", [pytest.param(None, marks=needs_emulator, id="emulated")])
def test_cuda_attention_backward_up_to_512_keys_is_one_kernel_of_five_products(
        seq, head_dim, causal, marks):
    # Up to 512 keys one kernel does the whole backward, one block a (sequence, head), with
    # FlashAttention-2's 5 products a tile pair (S^T, dP^T, dV, dK and dQ), each over
    # seq_q x seq_k x head_dim multiply-adds where no mask skips a tile. K and V are read
    # once, and each gradient written once. Up to 128 keys it takes the delta from P and dP,
    # never O, and reads Q and dO once too; past them it reads O and dO once for the
    # deltas, and Q and dO once per 128 keys unless they stay in shared memory.
    batch, heads = (2, 3) if seq <= 128 else (1, 2)
    leaves, (q, k, v) = _inputs(batch, heads, seq, seq, head_dim, torch.bfloat16,
                                backend_device("cuda"))
    out = fusedlm.ops.attention(q, k, v, causal=causal, backend="cuda")
    grad = torch.randn_like(out)
    with cuda_backend.count_launches() as backward:
        dq, dk, dv = torch.autograd.grad(out, leaves, grad)
    [launch] = backward
    assert launch.grid == (1, heads, batch)
    every_pair = 5 * batch * heads * seq * seq * head_dim
    if causal:
        assert launch.tensor_core_macs <= every_pair
    else:
        assert launch.tensor_core_macs == every_pair
    size = q.numel() * q.element_size()
    chunks = -(-seq // 128)
    for t in (k, v):
        assert launch.traffic(t) == (size, 0)
    for t, for_deltas in ((q, 0), (grad, 0 if chunks == 1 else size)):
        reads, writes = launch.traffic(t)
        walks = reads - for_deltas
        assert writes == 0 and (walks == size if chunks == 1 else size <= walks <= chunks * size)
    assert launch.traffic(out) == (0 if chunks == 1 else size, 0)
    for t in (dq, dk, dv):
        assert launch.traffic(t) == (0, size)


@pytest.mark.parametrize("backend", [b for b in backends_for("attention") if b.id == "cuda"])
def test_cuda_attention_empty_inputs(backend):
    device = backend_device(backend)
    leaves, (q, k, v) = _inputs(0, 2, 5, 7, 64, torch.float16, device)
    out = fusedlm.ops.attention(q, k, v, causal=True, backend=backend)
    assert out.shape == (0, 2, 5, 64)
    out.sum().backward()
    assert all(t.grad.shape == t.shape for t in leaves)
    # No keys at all: every row is empty, so zeros, and so are the gradients.
    q, k, v = (torch.randn(1, 2, s, 128, dtype=torch.bfloat16, device=device, requires_grad=True)
               for s in (3, 0, 0))
    out = fusedlm.ops.attention(q, k, v, backend=backend)
    assert torch.equal(out, torch.zeros_like(out))
    (dq,) = torch.autograd.grad(out.sum(), q)
    assert torch.equal(dq, torch.zeros_like(dq))


def test_attention_gradients_do_not_depend_on_thread_count():
    # dK, dV and a bias shared across the batch are reductions: each must come out bit for bit
    # the same whatever the number of threads.
    leaves, (q, k, v) = _inputs(4, 3, 150, 140, 16, torch.float32, "cpu")
    bias = fresh((3, 150, 140), torch.float32, "cpu")
    mask = _padding_mask(4, 140, "cpu")
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, attn_bias=bias, causal=True,
                                        backend="cpu")
            results.append(torch.autograd.grad(out, leaves + [bias], torch.ones_like(out)))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_attention_compiles_without_graph_breaks():
    leaves, _ = _inputs(2, 2, 12, 16, 16, torch.float32, "cpu", layout="bshd")
    bias = fresh((2, 1, 16), torch.float32, "cpu")
    mask = _padding_mask(2, 16, "cpu")

    def block(q, k, v, bias):
        out = fusedlm.ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                    key_padding_mask=mask, attn_bias=bias, causal=True, backend="cpu")
        return out.transpose(1, 2).flatten(2) * 2

    out = torch.compile(block, fullgraph=True)(*leaves, bias)
    _assert_matches(out, leaves + [bias], lambda q, k, v, bias: reference.attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), key_padding_mask=mask,
        attn_bias=bias, causal=True).transpose(1, 2).flatten(2) * 2, grad_scale=5)


# --- dropout -------------------------------------------------------------------------------------

def _replay_seed(p, seed=4321):
    """The seed the next fusedlm call will draw after torch.manual_seed(seed)."""
    torch.manual_seed(seed)
    drawn = next_seed(p)
    torch.manual_seed(seed)
    return drawn


def _widest_taken(backend, op, call, dtypes=(torch.float64, torch.float32)):
    """The first of `dtypes` whose call(dtype) -> (args, kwargs) of `op` the backend takes:
    float64 where it can, so a replay compares at a tight tolerance."""
    return first_taken(backend, op, dtypes, call)


@pytest.mark.parametrize("backend", backends_for("attention"))
def test_attention_dropout_replays_its_mask(backend):
    p = 0.3
    batch, heads, seq_q, seq_k = 2, 3, 20, 27
    device = backend_device(backend)
    # Padding not only at the end: kept keys are gathered, and must meet their own stream elements.
    mask = _padding_mask(batch, seq_k, device)

    def inputs(dtype):
        leaves, views = _inputs(batch, heads, seq_q, seq_k, 16, dtype, device, layout="bshd")
        bias = fresh((heads, 1, seq_k), dtype, device)
        return (leaves, bias), (views, dict(key_padding_mask=mask, attn_bias=bias, causal=True,
                                            dropout_p=p))

    dtype = _widest_taken(backend, "attention", lambda dtype: inputs(dtype)[1])
    (leaves, bias), ((q, k, v), options) = inputs(dtype)
    seed = _replay_seed(p)
    keep = keep_mask(backend, seed, (batch, heads, seq_q, seq_k), p)
    out = fusedlm.ops.attention(q, k, v, **options, backend=backend)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves + [bias], grad)
    ref = as_reference(*leaves, bias)
    expected = reference.attention(*_views(ref[:3], "bshd"), key_padding_mask=mask, attn_bias=ref[3],
                                   causal=True, dropout_p=p, dropout_mask=keep)
    ref_grads = torch.autograd.grad(expected, ref, grad.double())
    assert_close(out, expected, name="out")
    for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads):
        assert_close(g, r, scale=4 if name == "dbias" else 2, name=name)
    # The same seed repeats the output; the next seed does not.
    torch.manual_seed(4321)
    again = fusedlm.ops.attention(q, k, v, **options, backend=backend)
    assert torch.equal(again, out)
    other = fusedlm.ops.attention(q, k, v, **options, backend=backend)
    assert not torch.equal(other, out)


@pytest.mark.parametrize("backend", backends_for("attention"))
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_attention_dropout_keeps_one_minus_p_and_scales_by_its_inverse(backend, p):
    # With v = identity over the keys the output is the probability matrix itself, so each
    # entry is either dropped (0) or the undropped probability times 1 / (1 - p): v's
    # head_dim is the 64 keys, so q's is 16 or, where v must have q's, 64.
    batch, heads, seq = (2, 2, 64) if slow_backend(backend) else (4, 4, 64)
    device = backend_device(backend)

    def inputs(dtype, head_dim):
        q, k = (fresh((batch, heads, seq, head_dim), dtype, device, requires_grad=False)
                for _ in range(2))
        v = torch.eye(seq, dtype=dtype, device=device).expand(batch, heads, seq, seq)
        return (q, k, v), dict(dropout_p=p)

    options = [(dtype, head_dim) for dtype in (torch.float64, torch.float32, torch.bfloat16)
               for head_dim in (16, 64)]
    q, k, v = inputs(*first_taken(backend, "attention", options, lambda o: inputs(*o)))[0]
    probs = fusedlm.ops.attention(q, k, v, backend=backend)
    out = fusedlm.ops.attention(q, k, v, dropout_p=p, backend=backend)
    kept = out != 0
    torch.testing.assert_close(out[kept], probs[kept] / (1 - p))
    n = kept.numel()
    assert abs(kept.double().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5


@pytest.mark.parametrize("backend, path", backends_with_paths("attention"))
def test_attention_dropout_is_the_backends_stream(backend, path, cuda_paths):
    # Each backend's own stream, element (b, h, i, j) of [batch, heads, seq_q, seq_k], over
    # several query and key blocks, with padding and the causal diagonal.
    _take(path, cuda_paths)
    p = 0.2
    batch, heads, seq_q, seq_k = 2, 2, 70, 90
    device = backend_device(backend)
    leaves, (q, k, v) = _inputs(batch, heads, seq_q, seq_k, 64, torch.bfloat16, device,
                                layout="bshd")
    mask = _padding_mask(batch, seq_k, device)
    skip_if_refused(backend, "attention", q, k, v, key_padding_mask=mask, causal=True, dropout_p=p)
    seed = _replay_seed(p)
    keep = keep_mask(backend, seed, (batch, heads, seq_q, seq_k), p)
    out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, causal=True, dropout_p=p,
                                backend=backend)
    _assert_matches(out, leaves, lambda *ref: reference.attention(
        *_views(ref, "bshd"), key_padding_mask=mask, causal=True, dropout_p=p, dropout_mask=keep),
        out_scale=2, grad_scale=4)


VARLEN_DROPOUT_CASES = {
    # name: (lengths_q, lengths_k, max_q, max_k, head_dim, dtypes, out_scale, grad_scale); the
    # max lengths larger than the longest: the stream's pitch follows these.
    "short": ([5, 0, 11], [7, 3, 9], 12, 10, 8, (torch.float64, torch.float32), 1, 2),
    # Several query and key blocks, at the head dim of the cuda kernels.
    "blocks": ([5, 0, 80], [70, 3, 9], 81, 75, 64, (torch.bfloat16,), 2, 4),
}


@pytest.mark.parametrize("backend, path", backends_with_paths("attention_varlen"))
@pytest.mark.parametrize("case", list(VARLEN_DROPOUT_CASES))
def test_attention_varlen_dropout_replays_its_mask(backend, path, case, cuda_paths):
    # Each backend's own stream, element (b, h, i, j) of [batch, heads, max_q, max_k].
    _take(path, cuda_paths)
    p = 0.25
    lengths_q, lengths_k, max_q, max_k, head_dim, dtypes, out_scale, grad_scale = (
        VARLEN_DROPOUT_CASES[case])
    heads = 2

    def build(dtype):
        q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, head_dim, dtype,
                                      backend_device(backend))
        return (q, k, v, cu_q, cu_k, max_q, max_k), dict(causal=True, dropout_p=p)

    (q, k, v, cu_q, cu_k, *_), _ = build(_widest_taken(backend, "attention_varlen", build, dtypes))
    seed = _replay_seed(p)
    keep = keep_mask(backend, seed, (3, heads, max_q, max_k), p)
    out = fusedlm.ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True, dropout_p=p,
                                       backend=backend)
    _assert_matches(out, (q, k, v), lambda *ref: reference.attention_varlen(
        *ref, cu_q, cu_k, max_q, max_k, causal=True, dropout_p=p, dropout_mask=keep),
        out_scale=out_scale, grad_scale=grad_scale)


# --- attention_varlen ----------------------------------------------------------------------------

def _packed(lengths_q, lengths_k, heads, head_dim, dtype, device="cpu", head_dim_v=None):
    cu_q = torch.tensor([0] + lengths_q, device=device).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k, device=device).cumsum(0).to(torch.int32)
    q = fresh((int(cu_q[-1]), heads, head_dim), dtype, device)
    k = fresh((int(cu_k[-1]), heads, head_dim), dtype, device)
    v = fresh((int(cu_k[-1]), heads, head_dim_v or head_dim), dtype, device)
    return q, k, v, cu_q, cu_k


VARLEN_CASES = {
    # name: (lengths_q, lengths_k, head_dim, head_dim_v)
    "short": ([9, 0, 17, 4, 1], [9, 5, 12, 0, 30], 24, 40),
    # The head dim of the cuda kernels, sequences over several blocks of 64.
    "blocks": ([9, 0, 130, 4, 70], [9, 5, 90, 0, 140], 64, 64),
}


@pytest.mark.parametrize("backend, path", backends_with_paths("attention_varlen"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_attention_varlen_matches_reference(backend, path, dtype, causal, case, cuda_paths):
    # Sequences of their own lengths for q and k, one with no queries, one with no keys.
    _take(path, cuda_paths)
    lengths_q, lengths_k, head_dim, head_dim_v = VARLEN_CASES[case]
    heads = 2 if slow_backend(backend) else 3
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k, heads, head_dim, dtype,
                                  backend_device(backend), head_dim_v=head_dim_v)
    skip_if_refused(backend, "attention_varlen", q, k, v, cu_q, cu_k, max(lengths_q),
                     max(lengths_k), causal=causal)
    out = fusedlm.ops.attention_varlen(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k),
                                       causal=causal, backend=backend)
    _assert_matches(out, (q, k, v), lambda *ref: reference.attention_varlen(
        *ref, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=causal),
        grad_scale=2 if dtype == torch.float32 else 3)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_varlen_equals_padded_attention_with_the_mask(causal):
    batch, seq, heads, head_dim = 4, 50, 2, 16
    lengths = torch.tensor([50, 1, 33, 17])
    mask = torch.arange(seq)[None, :] >= lengths[:, None]
    leaves = [fresh((batch, seq, heads, head_dim), torch.float32, "cpu") for _ in range(3)]
    padded = fusedlm.ops.attention(*(t.transpose(1, 2) for t in leaves), key_padding_mask=mask,
                                   causal=causal, backend="cpu").transpose(1, 2)
    grad = torch.randn_like(padded).masked_fill(mask[:, :, None, None], 0)
    padded_grads = torch.autograd.grad(padded, leaves, grad)

    packed, indices, cu, max_len = zip(*(fusedlm.ops.unpad(t, mask, backend="cpu") for t in leaves))
    out = fusedlm.ops.attention_varlen(*packed, cu[0], cu[0], max_len[0], max_len[0], causal=causal,
                                       backend="cpu")
    out = fusedlm.ops.pad(out, indices[0], batch, seq, backend="cpu")
    grads = torch.autograd.grad(out, leaves, grad)
    valid = ~mask
    # The padded op also computes the rows of padding queries; varlen leaves them out.
    torch.testing.assert_close(out[valid], padded[valid], atol=1e-6, rtol=1e-5)
    assert (out[mask] == 0).all()
    for g, r in zip(grads, padded_grads):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5)


def test_attention_varlen_gradcheck():
    q, k, v, cu_q, cu_k = _packed([3, 1, 4], [2, 5, 4], 2, 3, torch.float64)
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v: fusedlm.ops.attention_varlen(q, k, v, cu_q, cu_k, 4, 5, causal=causal,
                                                         backend="cpu"),
            (q, k, v))


def test_attention_varlen_empty():
    q, k, v, cu_q, cu_k = _packed([0, 0], [0, 0], 2, 8, torch.float32)
    out = fusedlm.ops.attention_varlen(q, k, v, cu_q, cu_k, 0, 0, backend="cpu")
    assert out.shape == (0, 2, 8)
    out.sum().backward()
    assert q.grad.shape == q.shape


def test_attention_varlen_compiles_without_graph_breaks():
    q, k, v, cu_q, cu_k = _packed([6, 11, 3], [9, 4, 12], 2, 16, torch.float32)

    def attend(q, k, v):
        return fusedlm.ops.attention_varlen(q, k, v, cu_q, cu_k, 11, 12, causal=True,
                                            backend="cpu") * 2

    out = torch.compile(attend, fullgraph=True)(q, k, v)
    _assert_matches(out, (q, k, v), lambda *ref: reference.attention_varlen(
        *ref, cu_q, cu_k, 11, 12, causal=True) * 2, grad_scale=2)


def test_unpad_attention_varlen_pad_compiles_without_graph_breaks():
    # unpad's token count and max_seqlen are unbacked SymInts under compile; they flow into
    # attention_varlen and pad without a graph break.
    batch, seq, heads, head_dim = 3, 20, 2, 16
    mask = torch.arange(seq)[None, :] >= torch.tensor([20, 7, 13])[:, None]
    leaves = [fresh((batch, seq, heads, head_dim), torch.float32, "cpu") for _ in range(3)]

    def layer(q, k, v):
        q, indices, cu, max_len = fusedlm.ops.unpad(q, mask, backend="cpu")
        k = fusedlm.ops.unpad(k, mask, backend="cpu")[0]
        v = fusedlm.ops.unpad(v, mask, backend="cpu")[0]
        out = fusedlm.ops.attention_varlen(q, k, v, cu, cu, max_len, max_len, causal=True,
                                           backend="cpu")
        return fusedlm.ops.pad(out, indices, batch, seq, backend="cpu") * 2

    out = torch.compile(layer, fullgraph=True)(*leaves)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad)
    eager = layer(*leaves)
    eager_grads = torch.autograd.grad(eager, leaves, grad)
    torch.testing.assert_close(out, eager)
    for g, r in zip(grads, eager_grads):
        torch.testing.assert_close(g, r)
    expected = reference.attention(*(t.transpose(1, 2) for t in leaves), key_padding_mask=mask,
                                   causal=True).transpose(1, 2) * 2
    torch.testing.assert_close(out[~mask], expected[~mask], atol=1e-5, rtol=1e-4)


# --- bad input -----------------------------------------------------------------------------------

def test_attention_rejects_bad_input():
    q, k, v = (torch.randn(2, 3, s, 8) for s in (5, 6, 6))
    mask = torch.zeros(2, 6, dtype=torch.bool)
    cases = [
        (ValueError, "q", dict(q=q[0])),
        (ValueError, "k", dict(k=torch.randn(2, 3, 6, 4))),
        (ValueError, "v", dict(v=torch.randn(2, 3, 7, 8))),
        (TypeError, "v", dict(v=v.double())),
        (TypeError, "q", dict(q=q.long())),
        (TypeError, "key_padding_mask", dict(key_padding_mask=mask.float())),
        (ValueError, "key_padding_mask", dict(key_padding_mask=mask[:, :5])),
        (ValueError, "attn_bias", dict(attn_bias=torch.randn(3, 5, 5))),
        (ValueError, "attn_bias", dict(attn_bias=torch.randn(1, 2, 3, 5, 6))),
        (TypeError, "attn_bias", dict(attn_bias=torch.randn(5, 6, dtype=torch.float64))),
        (ValueError, "dropout_p", dict(dropout_p=1.0)),
        (ValueError, "scale", dict(scale=float("nan"))),
        (TypeError, "causal", dict(causal=1)),
        (ValueError, "q", dict(q=torch.randn(2, 3, 5, 0), k=torch.randn(2, 3, 6, 0))),
        (ValueError, "attn_bias", dict(attn_bias=torch.randn(5, 6, device="meta"))),
    ]
    for error, name, change in cases:
        args = dict(q=q, k=k, v=v) | change
        with pytest.raises(error, match=name):
            fusedlm.ops.attention(args.pop("q"), args.pop("k"), args.pop("v"), backend="cpu", **args)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_attention_varlen_rejects_bad_input(backend):
    # cu_seqlens are checked on the CPU whatever the backend: in the C++ op, or in Python.
    q, k, v, cu_q, cu_k = _packed([3, 4], [5, 2], 2, 8, torch.float32)
    ok = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=5)
    cases = [
        (ValueError, "q", dict(q=q[None])),
        (ValueError, "v", dict(v=v[:, :1])),
        (ValueError, "v must have as many tokens as k", dict(v=v[1:])),
        (TypeError, "cu_seqlens_q", dict(cu_seqlens_q=cu_q.long())),
        (ValueError, "cu_seqlens_k", dict(cu_seqlens_k=cu_k[:2])),
        (ValueError, "cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 4, 3], dtype=torch.int32))),
        (ValueError, "cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([1, 3, 7], dtype=torch.int32))),
        (ValueError, "cu_seqlens_k", dict(cu_seqlens_k=torch.tensor([0, 5, 6], dtype=torch.int32))),
        (ValueError, "max_seqlen_q", dict(max_seqlen_q=3)),
        (ValueError, "max_seqlen_k", dict(max_seqlen_k=-1)),
        (TypeError, "max_seqlen_k", dict(max_seqlen_k=5.0)),
    ]
    for error, name, change in cases:
        args = ok | change
        with pytest.raises(error, match=name):
            fusedlm.ops.attention_varlen(*args.values(), backend=backend)


# --- real shapes (a GPU) -------------------------------------------------------------------------
# BERT-base (12 heads of 64, seq 128 and 512, mixed padding), GPT-2 small (seq 1024,
# causal), long causal sequences, the head dims of common models, and packed sequences.
# The cuda backend's sequences up to 512 take its resident path and longer ones its
# streamed path: both are here, with padding, causal masks and dropout. Half-precision
# products and the probabilities rounded before P V bound the error at 1e-2 norm-wise for
# both bfloat16 and float16.

REAL_DTYPES = [torch.bfloat16, torch.float16]
REAL_BOUND = 1e-2

REAL_CASES = {
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


def _real_padding(batch, seq):
    """Lengths between seq / 2 and seq, the first full; True = padding."""
    lengths = torch.randint(seq // 2, seq + 1, (batch,), device="cuda")
    lengths[0] = seq
    return torch.arange(seq, device="cuda")[None, :] >= lengths[:, None]


def _check_real_shapes(backend, batch, heads, seq_q, seq_k, head_dim, dtype, opts, dropout_p=0.0):
    """attention at a real shape in poisoned memory, against the float32 reference."""
    opts = dict(opts)
    layout = opts.pop("layout", "bhsd")
    shapes = [(seq_q, head_dim), (seq_k, head_dim), (seq_k, head_dim)]
    leaves = [fresh((batch, s, heads, d) if layout == "bshd" else (batch, heads, s, d), dtype,
                    "cuda") for s, d in shapes]
    if opts.pop("mask", False):
        opts["key_padding_mask"] = _real_padding(batch, seq_k)
    bias_shape = opts.pop("bias", None)
    bias = fresh(bias_shape, dtype, "cuda") if bias_shape else None
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

    ref = as_reference(*wrt, dtype=torch.float32)
    expected = reference.attention(*_views(ref[:3], layout), attn_bias=ref[3] if bias is not None
                                   else None, dropout_p=dropout_p, dropout_mask=keep, **opts)
    expected_grads = grads(expected, ref, upstream.float())
    assert_relative_error(out, expected, dtype, "out", REAL_BOUND)
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), got, expected_grads):
        assert a.dtype == dtype and a.shape == e.shape
        assert_relative_error(a, e, dtype, name, REAL_BOUND)


@pytest.mark.parametrize("backend", backends_for("attention", shapes="real"))
@pytest.mark.parametrize("dtype", REAL_DTYPES)
@pytest.mark.parametrize("case", list(REAL_CASES))
def test_attention_real_shapes(backend, dtype, case):
    batch, heads, seq_q, seq_k, head_dim, opts = REAL_CASES[case]
    _check_real_shapes(backend, batch, heads, seq_q, seq_k, head_dim, dtype, opts)


@pytest.mark.parametrize("backend", backends_for("attention", shapes="real"))
@pytest.mark.parametrize("dtype", REAL_DTYPES)
@pytest.mark.parametrize("seq", [256, 640])
def test_attention_dropout_replays_its_mask_at_real_shapes(backend, dtype, seq):
    _check_real_shapes(backend, 4, 12, seq, seq, 64, dtype, {"mask": True, "causal": True},
                       dropout_p=0.1)


@pytest.mark.parametrize("backend", backends_for("attention_varlen", shapes="real"))
@pytest.mark.parametrize("dtype", REAL_DTYPES)
@pytest.mark.parametrize("seq,causal", [(128, False), (512, False), (1024, True)])
def test_attention_varlen_real_shapes(backend, dtype, seq, causal):
    batch, heads, head_dim = 4096 // seq, 12, 64
    lengths = torch.randint(1, seq + 1, (batch,)).tolist()
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (fresh((sum(lengths), heads, head_dim), dtype, "cuda") for _ in range(3))
    skip_if_refused(backend, "attention_varlen", q, k, v, cu, cu, seq, seq, causal=causal)
    poison_memory()
    out = fusedlm.ops.attention_varlen(q, k, v, cu, cu, seq, seq, causal=causal, backend=backend)
    upstream = torch.randn_like(out)
    got = grads(out, [q, k, v], upstream)
    ref = as_reference(q, k, v, dtype=torch.float32)
    expected = reference.attention_varlen(*ref, cu, cu, seq, seq, causal=causal)
    expected_grads = grads(expected, ref, upstream.float())
    assert_relative_error(out, expected, dtype, "out", REAL_BOUND)
    for name, a, e in zip(("dq", "dk", "dv"), got, expected_grads):
        assert_relative_error(a, e, dtype, name, REAL_BOUND)


@pytest.mark.parametrize("backend", backends_for("attention", shapes="real"))
def test_attention_gradients_repeat_bit_for_bit(backend):
    leaves = [fresh((8, 12, 512, 64), torch.bfloat16, "cuda") for _ in range(3)]
    bias = fresh((12, 512, 512), torch.bfloat16, "cuda")
    mask = _real_padding(8, 512)
    # (Where a backend takes no bias, test_cuda_attention_backward_repeats_bit_for_bit
    # repeats its gradients without one.)
    skip_if_refused(backend, "attention", *leaves, key_padding_mask=mask, attn_bias=bias,
                    causal=True)

    def step():
        out = fusedlm.ops.attention(*leaves, key_padding_mask=mask, attn_bias=bias, causal=True,
                                    backend=backend)
        return grads(out, leaves + [bias], torch.ones_like(out))

    first = step()
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(first, step()))


def _with_and_without(path, cuda_paths, backend, leaves, seed, **kwargs):
    """attention's output and gradients with the cuda kernels' `path` on, then off, from
    the same dropout seed."""
    runs = []
    for enabled in (True, False):
        cuda_paths(path, enabled)
        torch.manual_seed(seed)
        out = fusedlm.ops.attention(*leaves, **kwargs, backend=backend)
        runs.append([out] + grads(out, leaves, torch.ones_like(out)))
    return runs


@pytest.mark.parametrize("backend", [p for p in backends_for("attention", shapes="real")
                                     if p.id == "cuda"])
@pytest.mark.parametrize("causal,dropout_p", [(False, 0.0), (True, 0.1)])
def test_attention_resident_path_matches_the_streamed_one(backend, causal, dropout_p, cuda_paths):
    """Up to 512 tokens the cuda kernels hold a sequence's tiles in shared memory; every
    row still meets the same tiles in the same order, so the results are the streamed
    path's bit for bit, dropout included."""
    leaves = [fresh((4, 12, 320, 64), torch.bfloat16, "cuda") for _ in range(3)]
    resident, streamed = _with_and_without(
        "attention_resident", cuda_paths, backend, leaves, 11,
        key_padding_mask=_real_padding(4, 320), causal=causal, dropout_p=dropout_p)
    for name, a, b in zip(("out", "dq", "dk", "dv"), resident, streamed):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", [p for p in backends_for("attention", shapes="real")
                                     if p.id == "cuda"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", REAL_DTYPES)
def test_attention_wgmma_forward_matches_mma_sync(backend, head_dim, dtype, cuda_paths):
    """On sm_90 the streamed forward runs on warpgroup products; it must agree with the
    mma.sync forward (the same scores in another summation order) to the output's rounding,
    and its backward, which reads the saved log-sum-exp, must agree as well."""
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the wgmma forward runs on sm_90 devices only")
    leaves = [fresh((2, 8, 1000, head_dim), dtype, "cuda") for _ in range(3)]
    wgmma, mma_sync = _with_and_without(
        "attention_wgmma", cuda_paths, backend, leaves, 5,
        key_padding_mask=_real_padding(2, 1000), causal=True, dropout_p=0.1)
    for name, a, b in zip(("out", "dq", "dk", "dv"), wgmma, mma_sync):
        assert_relative_error(a, b, dtype, name, MAX_RELATIVE_ERROR[dtype] / 2)


# --- fuzz (tests/fuzz.py) --------------------------------------------------------------------------

HEAD_DIM_EDGES = (1, 3, 17, 40, 63, 65, 72)


def _head_dims(d):
    """Mostly the head dims the kernels are built for, often odd ones; v's sometimes differs."""
    head_dim = d.choice([64, 128]) if d.chance(0.5) else d.size(1, 72, HEAD_DIM_EDGES)
    head_dim_v = head_dim if d.chance(0.7) else d.size(1, 72, HEAD_DIM_EDGES)
    return head_dim, head_dim_v


def _fuzz_scale(d):
    return None if d.chance(0.7) else d.choice([0.01, 0.3, 2.0])


def _window(d):
    """Mostly none; often a left bound, a right one or both, down to 0 (the diagonal)."""
    if d.chance(0.6):
        return (-1, -1)
    bound = [d.choice([0, 1, 5, 31, 64]) for _ in range(2)]
    return d.choice([(bound[0], -1), (-1, bound[1]), tuple(bound)])


def _more_kv_heads(heads):
    """A corruption: k with more heads than q (which no number of query heads divides)."""
    def corrupt(t):
        k = t["k"].detach()
        return {**t, "k": k[:, :1].expand(-1, heads + 1, -1, -1).contiguous()}
    return "k with more heads than q", "k", corrupt


def draw_attention(d):
    dtype = d.dtype()
    batch, heads = d.size(0, 3), d.size(1, 4)
    kv_heads = fuzz.kv_heads(d, heads)
    seq_q, seq_k = d.size(0, 70, (1, 63, 64, 65)), d.size(0, 70, (1, 63, 64, 65))
    head_dim, head_dim_v = _head_dims(d)
    magnitude = d.magnitude(30.0 if dtype in (torch.float16, torch.bfloat16) else 1e3)
    # Expanded over batch or heads (as multi-query attention shares k and v), not over a
    # sequence: equal keys or values make gradients zero by symmetry.
    d.tensor("q", (batch, heads, seq_q, head_dim), dtype, scale=magnitude, expand_dims=(0, 1))
    d.tensor("k", (batch, kv_heads, seq_k, head_dim), dtype, expand_dims=(0, 1))
    d.tensor("v", (batch, kv_heads, seq_k, head_dim_v), dtype, expand_dims=(0, 1))
    causal = d.chance(0.4)
    options = {"causal": causal, "scale": _fuzz_scale(d), "window_size": _window(d)}
    if d.chance(0.4):
        mask = torch.rand(batch, seq_k, generator=d.generator) < d.choice([0.1, 0.5, 1.0])
        d.index_tensor("key_padding_mask", mask, ("contiguous", "strided", "transposed"))
    if d.chance(0.3):
        shape = [s if d.chance(0.5) else 1 for s in (batch, heads, seq_q, seq_k)]
        shape = shape[d.rng.randrange(4):]
        # A bias constant over the keys shifts whole rows of scores, which softmax ignores:
        # its gradient is zero, and any kernel's is rounding noise. Only others require grad.
        d.tensor("attn_bias", shape, dtype, grad=shape[-1] == seq_k > 1 and d.chance(0.5),
                 expand_dims=range(len(shape) - 1))

    def arguments(t):
        return (t["q"], t["k"], t["v"]), {**options, "key_padding_mask": t.get("key_padding_mask"),
                                          "attn_bias": t.get("attn_bias"),
                                          "window_size": t.get("window_size", options["window_size"])}

    def reference_(t):
        return (softmax_attention(t["q"], t["k"], t["v"], key_padding_mask=t.get("key_padding_mask"),
                                  attn_bias=t.get("attn_bias"), **options),)

    bad = [fuzz.grown("k", 3), fuzz.grown("v", 2), fuzz.with_extra_dim("q"), _more_kv_heads(heads),
           fuzz.replaced("window_size", (-2, 3), "window_size below -1")]
    if "key_padding_mask" in d.index:
        bad.append(fuzz.grown("key_padding_mask", 1))
    bias = d.leaves.get("attn_bias")
    if bias is not None and len(bias[0].shape) == 4:
        bad.append(fuzz.with_extra_dim("attn_bias"))
    return Case("attention", f"attention {dtype} causal={causal} scale={options['scale']} "
                f"kv_heads={kv_heads}/{heads} window={options['window_size']}",
                arguments, reference_, floors=(1.0,), dtype=dtype, bad=tuple(bad))


def _fuzz_tests(draw, op):
    """fuzz.tests, with the cuda backend's cases split between the two ways its kernels
    walk their tiles (each path half of them: the backend runs fuzz.CASES in all)."""
    @pytest.mark.parametrize("backend, path", backends_with_paths(op))
    def test_cases(backend, path, cuda_paths, request):
        _take(path, cuda_paths)
        fuzz.run(draw, backend, request.node.nodeid,
                 cases=max(1, fuzz.CASES // 2) if path else fuzz.CASES)

    return test_cases, fuzz.tests(draw, backends_for(op))[1]


test_fuzz_attention, test_fuzz_attention_bad_inputs = _fuzz_tests(draw_attention, "attention")


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()],
                        dtype=torch.int32)


def draw_attention_varlen(d):
    batch = d.size(0, 4)
    lengths_q = [d.size(0, 40, (1, 31, 32, 33)) for _ in range(batch)]
    lengths_k = lengths_q if d.chance(0.5) else [d.size(0, 40, (1, 31, 32, 33)) for _ in range(batch)]
    return _varlen_case(d, lengths_q, lengths_k)


def _varlen_case(d, lengths_q, lengths_k, causal=None, window=None):
    """attention_varlen over sequences of these lengths (and this causal and window where
    given), the rest drawn."""
    dtype, batch, heads = d.dtype(), len(lengths_q), d.size(1, 4)
    kv_heads = fuzz.kv_heads(d, heads)
    head_dim, head_dim_v = _head_dims(d)
    magnitude = d.magnitude(30.0 if dtype in (torch.float16, torch.bfloat16) else 1e3)
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    d.tensor("q", (total_q, heads, head_dim), dtype, scale=magnitude, expand_dims=(1,))
    d.tensor("k", (total_k, kv_heads, head_dim), dtype, expand_dims=(1,))
    d.tensor("v", (total_k, kv_heads, head_dim_v), dtype, expand_dims=(1,))
    d.index_tensor("cu_seqlens_q", _offsets(lengths_q))
    d.index_tensor("cu_seqlens_k", _offsets(lengths_k))
    # max_seqlen may exceed the longest sequence (it bounds them)
    max_q = max(lengths_q, default=0) + (d.size(0, 5) if d.chance(0.2) else 0)
    max_k = max(lengths_k, default=0) + (d.size(0, 5) if d.chance(0.2) else 0)
    causal = d.chance(0.5) if causal is None else causal
    scale = _fuzz_scale(d)
    window = _window(d) if window is None else window
    d.note(f"lengths_q={lengths_q} lengths_k={lengths_k} kv_heads={kv_heads}/{heads} "
           f"window={window}")

    def arguments(t):
        return ((t["q"], t["k"], t["v"], t["cu_seqlens_q"], t["cu_seqlens_k"],
                 t.get("max_seqlen_q", max_q), max_k),
                {"causal": causal, "scale": scale, "window_size": window})

    def reference_(t):
        outs = []
        for b in range(batch):
            rows_q = slice(sum(lengths_q[:b]), sum(lengths_q[:b + 1]))
            rows_k = slice(sum(lengths_k[:b]), sum(lengths_k[:b + 1]))
            outs.append(softmax_attention(t["q"][rows_q].transpose(0, 1), t["k"][rows_k].transpose(0, 1),
                                          t["v"][rows_k].transpose(0, 1), causal=causal,
                                          scale=scale, window_size=window).transpose(0, 1))
        return (torch.cat(outs) if outs else t["q"].new_zeros((0, heads, head_dim_v)),)

    cu_q = _offsets(lengths_q)
    wrong = cu_q.clone()
    wrong[-1] += 1
    bad = [fuzz.grown("k", 2), fuzz.grown("v", 0), fuzz.with_extra_dim("q"),
           fuzz.replaced("cu_seqlens_q", wrong, "cu_seqlens_q ending past the tokens")]
    if batch and max(lengths_q):
        bad.append(fuzz.replaced("max_seqlen_q", max(lengths_q) - 1, "max_seqlen_q below the longest"))
    if batch >= 2 and lengths_q[0] > 0:
        decreasing = cu_q.clone()
        decreasing[1] = cu_q[2] + 1
        bad.append(fuzz.replaced("cu_seqlens_q", decreasing, "cu_seqlens_q decreasing"))
    return Case("attention_varlen", f"attention_varlen {dtype} causal={causal} scale={scale}",
                arguments, reference_, floors=(1.0,), dtype=dtype, bad=tuple(bad))


test_fuzz_attention_varlen, test_fuzz_attention_varlen_bad_inputs = _fuzz_tests(
    draw_attention_varlen, "attention_varlen")


# Found by the fuzzer: a sequence with one key has a zero dK by symmetry (its one
# probability is 1), and the triton kernels left it rounding noise when another sequence
# passed one key block, taking delta from the rounded O instead of from the exact
# probabilities; 8 times plain PyTorch's error in float32. Delta is now exact for each
# sequence whose keys fit one block.
@pytest.mark.parametrize("backend, path", backends_with_paths("attention_varlen"))
def test_attention_varlen_one_key_sequence_beside_long_ones(backend, path, cuda_paths, request):
    _take(path, cuda_paths)
    fuzz.run(lambda d: _varlen_case(d, [7, 1, 3], [1, 1, 140]), backend, request.node.nodeid,
             cases=20)


# Found by the fuzzer: with a window of one key (causal, window_size (0, -1)) no query has a
# score gradient, so dQ and dK are zero, and the triton kernels left rounding noise in them
# (6 times the float32 slack) where a sequence spans two key blocks: delta came from the
# rounded O. A row whose band lies inside the block now takes the exact delta.
@pytest.mark.parametrize("backend, path", backends_with_paths("attention_varlen"))
def test_attention_varlen_one_key_window_across_key_blocks(backend, path, cuda_paths, request):
    _take(path, cuda_paths)
    lengths = [1, 40, 25, 70]
    fuzz.run(lambda d: _varlen_case(d, lengths, lengths, causal=True, window=(0, -1)),
             backend, request.node.nodeid, cases=20)


# Found by the fuzzer: the triton kernels read cu_seqlens with stride 1, and a strided view
# (every other element of a buffer) gave 1e38-sized garbage or NaN. The op now passes
# index tensors on contiguous.
@pytest.mark.parametrize("backend, path", backends_with_paths("attention_varlen"))
def test_attention_varlen_takes_strided_cu_seqlens(backend, path, cuda_paths):
    _take(path, cuda_paths)
    device = backend_device(backend)
    dtype = first_taken(backend, "attention_varlen", (torch.float32, torch.float16),
                        lambda dt: _varlen_call(dt, device))
    (q, k, v, cu_q, cu_k, max_q, max_k), kwargs = _varlen_call(dtype, device)
    assert "copies cu_seqlens_q, cu_seqlens_k" in fusedlm.explain(
        "attention_varlen", q, k, v, cu_q, cu_k, max_q, max_k, backend=backend, **kwargs)
    out = fusedlm.ops.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, backend=backend, **kwargs)
    expected = reference.attention_varlen(q.double().cpu(), k.double().cpu(), v.double().cpu(),
                                          cu_q.cpu(), cu_k.cpu(), max_q, max_k, **kwargs)
    assert_close(out.cpu(), expected, dtype)


# Unchecked on a GPU (without FUSEDLM_DEBUG), cu_seqlens' values reached the kernels as
# they were: a sequence past the tensor's rows read and wrote outside it. Each span is now
# clamped into the rows and to max_seqlen, so bad offsets compute on the rows they clamp to.
# The cpu backend checks them always.
@pytest.mark.parametrize("backend, path", [p for p in backends_with_paths("attention_varlen")
                                           if p.values[0] != "cpu"])
def test_attention_varlen_unchecked_offsets_stay_inside_the_tensors(backend, path, cuda_paths,
                                                                    monkeypatch):
    _take(path, cuda_paths)
    device = backend_device(backend)
    heads, head_dim, pad = 2, 64, 16
    # A negative start, an end past the 10 query and 12 key rows, and spans longer than
    # max_seqlen (5 and 6). They clamp to queries [0, 2), [2, 2), [2, 7) and keys [0, 3),
    # [3, 3), [3, 9): sequences that do not overlap (overlapping ones would race).
    bad_q, bad_k = [-3, 2, 2, 50], [-5, 3, 3, 60]
    clamped_q, clamped_k = [0, 2, 2, 7], [0, 3, 3, 9]

    def call(dtype):
        q, k, v = (torch.zeros(n, heads, head_dim, dtype=dtype, device=device) for n in (10, 12, 12))
        cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device=device) for o in (clamped_q, clamped_k))
        return (q, k, v, cu_q, cu_k, 5, 6), {}

    monkeypatch.setattr(sys.modules["fusedlm.ops.attention"], "check_index_data", lambda *_: False)
    dtype = first_taken(backend, "attention_varlen", (torch.float32, torch.float16), call)

    def inside_nan(t):
        """t, as a view into a buffer that holds NaN on either side of it."""
        buffer = torch.full((t.shape[0] + 2 * pad, *t.shape[1:]), float("nan"), dtype=dtype,
                            device=device)
        buffer[pad:pad + t.shape[0]] = t
        return buffer[pad:pad + t.shape[0]].requires_grad_()

    q, k, v = (fresh((n, heads, head_dim), dtype, device, requires_grad=False) for n in (10, 12, 12))
    grad = fresh((10, heads, head_dim), dtype, device, requires_grad=False)
    results = []
    for offsets_q, offsets_k, leaves in ((bad_q, bad_k, [inside_nan(t) for t in (q, k, v)]),
                                         (clamped_q, clamped_k, [t.clone().requires_grad_()
                                                                 for t in (q, k, v)])):
        cu_q, cu_k = (torch.tensor(o, dtype=torch.int32, device=device) for o in (offsets_q, offsets_k))
        out = fusedlm.ops.attention_varlen(*leaves, cu_q, cu_k, 5, 6, backend=backend)
        out.backward(grad)
        results.append((out[:7], leaves[0].grad[:7], leaves[1].grad[:9], leaves[2].grad[:9]))
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert got.isfinite().all(), f"{name} read outside the tensors"
        assert torch.equal(got, want), name


def _varlen_call(dtype, device):
    """Sequences of 3, 0 and 5 queries over 4, 0 and 2 keys, head dim 8, with cu_seqlens
    every other element of a buffer."""
    def offsets(lengths):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        buffer = torch.full((2 * cu.numel(),), 999, dtype=torch.int32)
        buffer[::2] = cu
        return buffer[::2].to(device)

    q, k, v = (fresh((n, 2, 8), dtype, device, requires_grad=False) for n in (8, 6, 6))
    return (q, k, v, offsets([3, 0, 5]), offsets([4, 0, 2]), 5, 4), {"causal": True}


# --- grouped key/value heads and windows on the cpu kernel ---------------------------------------
# The fuzzers draw both, on sequences within one block of queries and keys; these walk
# several blocks, where a window skips whole key blocks and a group's dK and dV sum over
# several sets of query heads: one rank of consecutive groups at a time (6/3, 10/5: a set
# of 4 groups and one of 1), or a group's heads stacked (8/2, 6/2, 12/2: sets of 4 and 2).

def _middle_padding(batch, seq_k):
    """Padding inside the keys of the first sequence and at both ends of the last."""
    mask = torch.zeros(batch, seq_k, dtype=torch.bool)
    mask[0, seq_k // 3:seq_k // 3 + 100] = True
    mask[-1, :7] = True
    mask[-1, -50:] = True
    return mask


def _grouped(batch, heads, kv_heads, seq_q, seq_k, dtype, layout="bhsd", head_dim=16):
    shapes = [(heads, seq_q, head_dim), (kv_heads, seq_k, head_dim), (kv_heads, seq_k, 8)]
    if layout == "bshd":
        leaves = [fresh((batch, s, h, d), dtype, "cpu") for h, s, d in shapes]
    else:
        leaves = [fresh((batch, h, s, d), dtype, "cpu") for h, s, d in shapes]
    return leaves, _views(leaves, layout)


@pytest.mark.parametrize("heads, kv_heads, seq_q, seq_k, causal, window", [
    (8, 2, 700, 700, False, (128, 0)),
    (8, 2, 700, 700, False, (64, 64)),
    (6, 3, 700, 700, True, (200, -1)),
    (6, 2, 300, 700, False, (64, 64)),
    (10, 5, 700, 700, True, (64, 64)),
    (12, 2, 700, 300, False, (-1, 40)),
    (4, 4, 700, 700, False, (0, 0)),  # padding on the diagonal leaves rows with no key
])
def test_cpu_attention_groups_and_windows_over_many_blocks(heads, kv_heads, seq_q, seq_k, causal,
                                                           window):
    mask = _middle_padding(2, seq_k)
    leaves, (q, k, v) = _grouped(2, heads, kv_heads, seq_q, seq_k, torch.float64)
    out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, causal=causal, window_size=window,
                                backend="cpu")
    _assert_matches(out, leaves, lambda q, k, v: softmax_attention(
        q, k, v, key_padding_mask=mask, causal=causal, window_size=window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads", [(8, 2), (6, 3)])
def test_cpu_attention_groups_and_windows_in_place_and_packed(dtype, heads, kv_heads):
    # float32 [batch, seq, heads, dim] views are read and written in place; bfloat16 is
    # packed. A bias shared by the sequences and heads: its gradient sums over both.
    seq = 400
    mask = _middle_padding(2, seq)
    leaves, (q, k, v) = _grouped(2, heads, kv_heads, seq, seq, dtype, layout="bshd")
    bias = fresh((1, 1, 1, seq), dtype, "cpu")
    out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, attn_bias=bias, causal=True,
                                window_size=(150, -1), backend="cpu")
    _assert_matches(out, leaves + [bias], lambda q, k, v, bias: softmax_attention(
        *_views([q, k, v], "bshd"), key_padding_mask=mask, attn_bias=bias, causal=True,
        window_size=(150, -1)), out_scale=2, grad_scale=4)


def test_cpu_attention_varlen_groups_and_windows_over_many_blocks():
    lengths_q, lengths_k = [700, 0, 300, 5], [500, 3, 700, 5]
    heads, kv_heads, window = 6, 2, (100, 30)
    q, k, v = (fresh((sum(n), h, d), torch.float64, "cpu") for n, h, d in (
        (lengths_q, heads, 16), (lengths_k, kv_heads, 16), (lengths_k, kv_heads, 8)))
    out = fusedlm.ops.attention_varlen(q, k, v, _offsets(lengths_q), _offsets(lengths_k),
                                       max(lengths_q), max(lengths_k), window_size=window,
                                       backend="cpu")

    def expected(q, k, v):
        outs = []
        for b in range(len(lengths_q)):
            rows_q = slice(sum(lengths_q[:b]), sum(lengths_q[:b + 1]))
            rows_k = slice(sum(lengths_k[:b]), sum(lengths_k[:b + 1]))
            outs.append(softmax_attention(*(t[rows].transpose(0, 1) for t, rows in (
                (q, rows_q), (k, rows_k), (v, rows_k))), window_size=window).transpose(0, 1))
        return torch.cat(outs)

    _assert_matches(out, [q, k, v], expected)


def test_cpu_attention_groups_draw_each_query_heads_dropout():
    # k and v of a group read in place give what their copies per query head give, dropout
    # included (its stream is per query head); dK and dV sum over the group.
    p, heads, kv_heads = 0.2, 8, 2
    mask = _middle_padding(2, 300)
    leaves, (q, k, v) = _grouped(2, heads, kv_heads, 300, 300, torch.float64)
    options = dict(key_padding_mask=mask, window_size=(64, 64), dropout_p=p, backend="cpu")
    torch.manual_seed(5)
    out = fusedlm.ops.attention(q, k, v, **options)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad)
    copies = [q.detach().requires_grad_()] + [t.detach().repeat_interleave(heads // kv_heads, 1)
                                              .requires_grad_() for t in (k, v)]
    torch.manual_seed(5)
    expected = fusedlm.ops.attention(*copies, **options)
    dq, dk, dv = torch.autograd.grad(expected, copies, grad)
    assert_close(out, expected, name="out")
    assert_close(grads[0], dq, name="dq")
    for name, g, r in (("dk", grads[1], dk), ("dv", grads[2], dv)):
        assert_close(g, r.unflatten(1, (kv_heads, heads // kv_heads)).sum(2), name=name)


def test_cpu_attention_groups_and_windows_sum_in_one_order_on_any_number_of_threads():
    def run(threads):
        torch.set_num_threads(threads)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2, h, 600, 32, generator=g).requires_grad_() for h in (6, 2, 2))
        bias = torch.randn(1, 6, 1, 600, generator=g).requires_grad_()
        out = fusedlm.ops.attention(q, k, v, key_padding_mask=_middle_padding(2, 600),
                                    attn_bias=bias, window_size=(100, 100), backend="cpu")
        return [out, *torch.autograd.grad(out, [q, k, v, bias], torch.randn(out.shape, generator=g))]

    threads = torch.get_num_threads()
    try:
        one, two = run(1), run(2)
    finally:
        torch.set_num_threads(threads)
    for i, (a, b) in enumerate(zip(one, two)):
        assert torch.equal(a, b), i
