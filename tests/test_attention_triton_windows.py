"""The triton attention kernels' grouped key/value heads and sliding windows: the blocks each
program walks, and the results over several query and key blocks against the reference."""
import random

import pytest
import torch

import fusedlm
from fusedlm.ops import reference
from fusedlm.ops._dropout import next_seed
from helpers import (as_reference, assert_close, backend_device, backends_for, fresh, grads,
                     keep_mask)

TRITON = [p for p in backends_for("attention") if p.id == "triton"]


_kernels = None  # kernels/triton/attention.py, once a test imports it (triton may be absent)


def _walk_probe():
    """A kernel writing (full_first, full_end, edge block count, edge blocks...) of a block."""
    global _kernels
    import triton
    import triton.language as tl
    from fusedlm.backends.triton import _kernels_module
    _kernels = _kernels_module("attention")

    @triton.jit
    def probe(OUT, a0, a_len, b_len, lo, hi, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
        first, full_first, full_end, end = _kernels._blocks(a0, a_len, b_len, lo, hi, BLOCK_A,
                                                            BLOCK_B)
        edges = _kernels._edge_blocks(first, full_first, full_end, end, BLOCK_B)
        tl.store(OUT, full_first)
        tl.store(OUT + 1, full_end)
        tl.store(OUT + 2, edges)
        for t in range(0, edges):
            tl.store(OUT + 3 + t, _kernels._edge_block(t, first, full_first, full_end, BLOCK_B))

    return probe


@pytest.mark.parametrize("backend", TRITON)
def test_programs_walk_exactly_the_blocks_their_band_reaches(backend):
    # A block of one axis (queries, or keys for dK/dV) against the other: the blocks it
    # walks are those holding a pair its band allows, each once, and the unmasked ones lie
    # wholly inside every real row's band and the sequence.
    probe = _walk_probe()
    rng = random.Random(torch.initial_seed())
    for _ in range(300):
        block_a, block_b = rng.choice([(64, 32), (32, 64), (16, 16), (128, 64)])
        len_a, len_b = rng.randint(1, 200), rng.randint(0, 200)
        left, right = (rng.choice([rng.randint(0, 70), 400]) for _ in range(2))
        if rng.random() < 0.5:  # a query block: keys j in [i + lo, i + hi]
            off = len_b - len_a
            lo, hi = off - left, off + right
        else:  # a key block: queries i in [j - hi, j - lo]
            off = len_a - len_b
            lo, hi = -(off + right), left - off
        a0 = rng.randrange(0, len_a, block_a)
        out = torch.full((3 + 64,), -1, dtype=torch.int32, device=backend_device(backend))
        probe[(1,)](out, a0, len_a, len_b, lo, hi, block_a, block_b)
        full_first, full_end, edges, *rest = out.tolist()
        full = list(range(full_first, full_end, block_b))
        walked = rest[:edges] + full
        rows = range(a0, min(a0 + block_a, len_a))
        reached = {b // block_b * block_b for a in rows
                   for b in range(max(a + lo, 0), min(a + hi + 1, len_b))}
        case = dict(a0=a0, len_a=len_a, len_b=len_b, lo=lo, hi=hi, blocks=(block_a, block_b))
        assert sorted(walked) == sorted(reached), case
        assert all(b + block_b <= len_b and a + lo <= b and b + block_b - 1 <= a + hi
                   for b in full for a in rows), case


CASES = {
    # name: (batch, heads, kv_heads, seq_q, seq_k, window, causal, masked)
    "grouped, causal window": (2, 4, 2, 100, 100, (40, 0), True, True),
    "multi-query, two-sided": (1, 4, 1, 100, 100, (20, 20), False, True),
    "more keys, narrow": (1, 2, 1, 70, 130, (5, 3), False, False),
    "more queries, diagonal": (1, 2, 2, 130, 70, (0, 0), False, True),
    "right only": (1, 2, 1, 90, 90, (-1, 9), False, False),
    "left only, causal": (1, 3, 1, 90, 90, (33, -1), True, False),
}


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_windowed_attention_matches_reference(backend, case):
    batch, heads, kv_heads, seq_q, seq_k, window, causal, masked = CASES[case]
    device = backend_device(backend)
    q = fresh((batch, heads, seq_q, 16), torch.float32, device)
    k, v = (fresh((batch, kv_heads, seq_k, 16), torch.float32, device) for _ in range(2))
    mask = None
    if masked:
        mask = torch.rand(batch, seq_k, device=device) < 0.2
        mask[0, -seq_k // 3:] = True  # keys padded at the end as well
    options = dict(causal=causal, key_padding_mask=mask, window_size=window)
    out = fusedlm.ops.attention(q, k, v, **options, backend=backend)
    upstream = torch.randn_like(out)
    got = grads(out, [q, k, v], upstream)
    ref = as_reference(q, k, v)
    expected = reference.attention(*ref, **options)
    assert_close(out, expected, name="out")
    for name, a, e in zip(("dq", "dk", "dv"), got, grads(expected, ref, upstream.double())):
        assert_close(a, e, scale=2, name=name)
    # No atomics: the gradients repeat bit for bit.
    again = grads(fusedlm.ops.attention(q, k, v, **options, backend=backend), [q, k, v], upstream)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("backend", TRITON)
def test_grouped_windowed_attention_with_dropout_and_bias(backend):
    # Dropout's stream and the bias follow the query head; the bias gradient is zero
    # outside the band.
    batch, heads, kv_heads, seq, p = 1, 4, 2, 100, 0.2
    device = backend_device(backend)
    q = fresh((batch, heads, seq, 16), torch.float32, device)
    k, v = (fresh((batch, kv_heads, seq, 16), torch.float32, device) for _ in range(2))
    bias = fresh((heads, seq, seq), torch.float32, device)
    options = dict(causal=True, window_size=(30, -1), dropout_p=p)
    torch.manual_seed(4321)
    seed = next_seed(p)
    torch.manual_seed(4321)
    keep = keep_mask(backend, seed, (batch, heads, seq, seq), p)
    out = fusedlm.ops.attention(q, k, v, attn_bias=bias, **options, backend=backend)
    upstream = torch.randn_like(out)
    got = grads(out, [q, k, v, bias], upstream)
    ref = as_reference(q, k, v, bias)
    expected = reference.attention(*ref[:3], attn_bias=ref[3], dropout_mask=keep, **options)
    assert_close(out, expected, name="out")
    for name, a, e in zip(("dq", "dk", "dv", "dbias"), got,
                          grads(expected, ref, upstream.double())):
        assert_close(a, e, scale=4, name=name)
    rows = torch.arange(seq)[:, None]
    outside = (torch.arange(seq) > rows) | (torch.arange(seq) < rows - 30)
    assert not got[3][:, outside.to(device)].any()


@pytest.mark.parametrize("backend", TRITON)
@pytest.mark.parametrize("causal", [False, True])
def test_grouped_windowed_attention_varlen_matches_reference(backend, causal):
    # Each sequence aligns its window to its own bottom right; one without keys, one shorter
    # than a block, one over several.
    lengths_q, lengths_k, heads, kv_heads = [37, 4, 0, 90], [50, 0, 3, 70], 4, 2
    device = backend_device(backend)
    cu_q, cu_k = (torch.tensor([0] + n, device=device).cumsum(0).to(torch.int32)
                  for n in (lengths_q, lengths_k))
    q = fresh((sum(lengths_q), heads, 16), torch.float32, device)
    k, v = (fresh((sum(lengths_k), kv_heads, 16), torch.float32, device) for _ in range(2))
    args = (cu_q, cu_k, max(lengths_q), max(lengths_k))
    options = dict(causal=causal, window_size=(25, 6))
    out = fusedlm.ops.attention_varlen(q, k, v, *args, **options, backend=backend)
    upstream = torch.randn_like(out)
    got = grads(out, [q, k, v], upstream)
    ref = as_reference(q, k, v)
    expected = reference.attention_varlen(*ref, *args, **options)
    assert_close(out, expected, name="out")
    for name, a, e in zip(("dq", "dk", "dv"), got, grads(expected, ref, upstream.double())):
        assert_close(a, e, scale=2, name=name)
