"""The cuda attention kernels with grouped key/value heads and sliding windows, at lengths
past their tiles (64 and 128 rows), the one-kernel backward's chunks of 128 keys and its
limit of 512: windows whose bounds cross tile boundaries, key blocks and query tiles that
no query sees, on both ways the kernels walk their tiles. The fuzzers draw the same
options at short lengths."""
import pytest
import torch

import fusedlm
from fuzz import softmax_attention
from helpers import assert_relative_error, backend_device, skip_if_refused
from test_attention import _padding_mask, _take, backends_with_paths

CUDA_PATHS = [p for p in backends_with_paths("attention") if p.values[0] == "cuda"]
CUDA_VARLEN_PATHS = [p for p in backends_with_paths("attention_varlen") if p.values[0] == "cuda"]

CASES = {
    # name: (batch, heads, kv_heads, seq_q, seq_k, head_dim, options)
    # A left bound that crosses the tiles, with causal: the first key tiles of later query
    # blocks are skipped, and the first query tiles of later key blocks.
    "gqa_left_causal": (1, 8, 2, 600, 600, 64, {"window_size": (70, -1), "causal": True}),
    # The one-kernel backward's 4 chunks of keys, each seen by a few query tiles alone.
    "gqa_left_chunks": (1, 4, 2, 500, 500, 64, {"window_size": (70, -1), "causal": True}),
    # Past 512 keys (dQ and dK/dV kernels), multi-query, both bounds.
    "mqa_band_long": (1, 4, 1, 1000, 1000, 64, {"window_size": (100, 30)}),
    # Fewer queries than keys (bottom right), head dim 128, padding.
    "gqa_band_padding": (2, 4, 2, 300, 600, 128,
                         {"window_size": (130, 5), "causal": True, "mask": True}),
    # More queries than keys and a right bound: the first 360 queries see no key, and
    # whole query tiles none of the keys.
    "right_more_queries": (1, 4, 4, 600, 200, 64, {"window_size": (-1, 40)}),
    # A left bound alone, two chunks of keys in the one-kernel backward.
    "left_two_chunks": (1, 2, 1, 150, 200, 128, {"window_size": (20, -1)}),
    # A narrow band about the diagonal (a query that sees one key alone has dQ zero).
    "narrow": (1, 4, 2, 130, 130, 64, {"window_size": (2, 1)}),
}


def _gradients(out, leaves, grad):
    return torch.autograd.grad(out, leaves, grad)


def _check(out, leaves, expected_of, dtype):
    grad = torch.randn_like(out)
    grads = _gradients(out, leaves, grad)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    expected = expected_of(*ref)
    ref_grads = torch.autograd.grad(expected, ref, grad.double())
    assert_relative_error(out, expected, dtype, "out")
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert g.shape == r.shape
        assert_relative_error(g, r, dtype, name)


@pytest.mark.parametrize("backend, path", CUDA_PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_attention_grouped_and_windowed(backend, path, case, cuda_paths):
    _take(path, cuda_paths)
    batch, heads, kv_heads, seq_q, seq_k, head_dim, options = CASES[case]
    options = dict(options)
    dtype, device = torch.float16, backend_device(backend)
    q = torch.randn(batch, heads, seq_q, head_dim, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(batch, kv_heads, seq_k, head_dim, dtype=dtype, device=device,
                    requires_grad=True)
    v = torch.randn(batch, kv_heads, seq_k, head_dim, dtype=dtype, device=device,
                    requires_grad=True)
    mask = _padding_mask(batch, seq_k, device) if options.pop("mask", False) else None
    skip_if_refused(backend, "attention", q, k, v, key_padding_mask=mask, **options)
    out = fusedlm.ops.attention(q, k, v, key_padding_mask=mask, backend=backend, **options)
    _check(out, [q, k, v],
           lambda q, k, v: softmax_attention(q, k, v, key_padding_mask=mask, **options),
           dtype)


@pytest.mark.parametrize("backend, path", CUDA_VARLEN_PATHS)
@pytest.mark.parametrize("window", [(64, 64), (-1, 10), (200, -1)])
def test_cuda_attention_varlen_grouped_and_windowed(backend, path, window, cuda_paths):
    _take(path, cuda_paths)
    lengths_q, lengths_k = [600, 37, 300], [520, 90, 300]
    heads, kv_heads, head_dim, dtype = 6, 3, 64, torch.float16
    device = backend_device(backend)
    q = torch.randn(sum(lengths_q), heads, head_dim, dtype=dtype, device=device,
                    requires_grad=True)
    k = torch.randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype, device=device,
                    requires_grad=True)
    v = torch.randn(sum(lengths_k), kv_heads, head_dim, dtype=dtype, device=device,
                    requires_grad=True)

    def offsets(lengths):
        return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                            device=device)

    cu_q, cu_k = offsets(lengths_q), offsets(lengths_k)
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    skip_if_refused(backend, "attention_varlen", q, k, v, *args, causal=True, window_size=window)
    out = fusedlm.ops.attention_varlen(q, k, v, *args, causal=True, window_size=window,
                                       backend=backend)

    def expected_of(q, k, v):
        outs, q0, k0 = [], 0, 0
        for len_q, len_k in zip(lengths_q, lengths_k):
            outs.append(softmax_attention(
                q[q0:q0 + len_q].transpose(0, 1), k[k0:k0 + len_k].transpose(0, 1),
                v[k0:k0 + len_k].transpose(0, 1), causal=True,
                window_size=window).transpose(0, 1))
            q0, k0 = q0 + len_q, k0 + len_k
        return torch.cat(outs)

    _check(out, [q, k, v], expected_of, dtype)


@pytest.mark.parametrize("backend, path", CUDA_PATHS)
@pytest.mark.parametrize("seq", [100, 600])
def test_cuda_attention_grouped_backward_repeats_bit_for_bit(backend, path, seq, cuda_paths):
    # Each query head's dK and dV share is written once and the group's shares are added in
    # head order: no atomics, so two runs agree bit for bit.
    _take(path, cuda_paths)
    device = backend_device(backend)
    q = torch.randn(1, 4, seq, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    k = torch.randn(1, 2, seq, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    v = torch.randn(1, 2, seq, 64, dtype=torch.bfloat16, device=device, requires_grad=True)
    options = {"causal": True, "window_size": (90, -1)}
    skip_if_refused(backend, "attention", q, k, v, **options)
    grad = torch.randn(1, 4, seq, 64, dtype=torch.bfloat16, device=device)
    runs = []
    for _ in range(2):
        out = fusedlm.ops.attention(q, k, v, backend=backend, **options)
        runs.append(torch.autograd.grad(out, [q, k, v], grad))
    for first, second in zip(*runs):
        assert torch.equal(first, second)
