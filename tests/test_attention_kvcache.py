"""attention_with_kvcache against the reference, on every backend that has it: small
cases, and GPT-2-small decoding shapes on a GPU (with one decoding step captured in a CUDA
graph)."""
import pytest
import torch

import fusedlm
import fuzz
from fusedlm.ops import reference
from fuzz import Case, softmax_attention
from helpers import (assert_close, assert_relative_error, backend_device, backends_for, fresh,
                     poison_memory)

CASES = {
    # name: (batch, heads, seq_q, seq_new, max_len, head_dim, cached lengths, left padding[,
    # key/value heads, if fewer than heads])
    "decode": (4, 2, 1, 1, 40, 16, [0, 17, 39, 5], None),
    "prefill": (3, 2, 6, 6, 20, 16, [0, 9, 14], None),
    "read_only": (3, 3, 1, 0, 33, 8, [1, 33, 20], None),
    "queries_only": (2, 2, 5, 0, 24, 16, [3, 24], None),  # the first rows of short ones see nothing
    "fewer_queries_than_new": (2, 2, 2, 5, 30, 16, [0, 25], None),
    "left_padded": (4, 2, 1, 1, 36, 16, [7, 20, 35, 3], [3, 0, 30, 4]),
    "left_padded_prefill": (3, 2, 4, 4, 25, 24, [0, 10, 21], [2, 9, 0]),
    "long": (2, 2, 3, 3, 300, 32, [150, 297], [40, 0]),  # several key blocks
    "grouped_decode": (4, 6, 1, 1, 40, 16, [0, 17, 39, 5], [0, 3, 30, 1], 2),
    "multi_query_prefill": (3, 4, 4, 4, 25, 24, [0, 10, 21], [2, 9, 0], 1),
}


def _case(name, dtype, device):
    batch, heads, seq_q, seq_new, max_len, head_dim, cached, leftpad, *grouped = CASES[name]
    kv_heads = grouped[0] if grouped else heads
    q = fresh((batch, seq_q, heads, head_dim), dtype, device, requires_grad=False)
    caches = [fresh((batch, max_len, kv_heads, head_dim), dtype, device, requires_grad=False)
              for _ in range(2)]
    new = [fresh((batch, seq_new, kv_heads, head_dim), dtype, device, requires_grad=False)
           for _ in range(2)] if seq_new else [None, None]
    seqlens = torch.tensor(cached, dtype=torch.int32, device=device)
    pad = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32, device=device)
    return q, caches, new, seqlens, pad


def _double(t):
    return None if t is None else t.double()


@pytest.mark.parametrize("backend", backends_for("attention_with_kvcache"))
@pytest.mark.parametrize("case", CASES)
def test_attention_with_kvcache_matches_reference(backend, case):
    device = backend_device(backend)
    dtype = torch.float32
    q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _case(case, dtype, device)
    ref_caches = [k_cache.double(), v_cache.double()]
    before = [k_cache.clone(), v_cache.clone()]

    out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                             cache_leftpad=pad, backend=backend)
    expected = reference.attention_with_kvcache(q.double(), *ref_caches, seqlens, _double(k_new),
                                                _double(v_new), cache_leftpad=pad)
    assert out.shape == q.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, expected, name="out")
    # The append: the new tokens land at each sequence's length, nothing else moves.
    seq_new = 0 if k_new is None else k_new.shape[1]
    for cache, old, new in zip((k_cache, v_cache), before, (k_new, v_new)):
        for b, n in enumerate(seqlens.tolist()):
            assert torch.equal(cache[b, :n], old[b, :n])
            assert torch.equal(cache[b, n + seq_new:], old[b, n + seq_new:])
            if seq_new:
                assert torch.equal(cache[b, n:n + seq_new], new[b])


@pytest.mark.parametrize("backend", backends_for("attention_with_kvcache"))
def test_attention_with_kvcache_low_precision(backend):
    device = backend_device(backend)
    for dtype in (torch.bfloat16, torch.float16):
        q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _case("left_padded_prefill", dtype,
                                                                    device)
        ref_caches = [k_cache.double(), v_cache.double()]
        out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                                 cache_leftpad=pad, backend=backend)
        expected = reference.attention_with_kvcache(q.double(), *ref_caches, seqlens,
                                                    k_new.double(), v_new.double(),
                                                    cache_leftpad=pad)
        assert out.dtype == dtype
        assert_close(out, expected, name=f"out ({dtype})")


@pytest.mark.parametrize("backend", backends_for("attention_with_kvcache") + ["reference"])
@pytest.mark.parametrize("case", ["left_padded_prefill", "multi_query_prefill"])
def test_attention_with_kvcache_equals_attention_over_the_sequence(backend, case):
    # Each sequence's step is causal attention of its queries over its own keys
    # [leftpad, total), written out explicitly (grouped heads as attention groups them).
    device = backend_device(backend)
    q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _case(case, torch.float32, device)
    out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                             cache_leftpad=pad, backend=backend)
    for b in range(q.shape[0]):
        first, total = int(pad[b]), int(seqlens[b]) + k_new.shape[1]
        k = k_cache[b:b + 1, first:total].transpose(1, 2)
        v = v_cache[b:b + 1, first:total].transpose(1, 2)
        expected = fusedlm.ops.attention(q[b:b + 1].transpose(1, 2), k, v, causal=True,
                                         backend="cpu" if device.type == "cpu" else None)
        assert_close(out[b:b + 1], expected.transpose(1, 2).double(), name=f"sequence {b}")


@pytest.mark.parametrize("backend", backends_for("attention_with_kvcache"))
def test_decoding_token_by_token_equals_one_causal_pass(backend):
    # Prefill 5 tokens, then append 4 one at a time: each step's output is that row of
    # causal attention over the whole sequence.
    device = backend_device(backend)
    batch, heads, dim, steps = 2, 2, 16, 9
    q, k, v = (fresh((batch, steps, heads, dim), torch.float32, device, requires_grad=False)
               for _ in range(3))
    k_cache = torch.zeros(batch, 12, heads, dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
    outs = [fusedlm.ops.attention_with_kvcache(q[:, :5], k_cache, v_cache, seqlens, k[:, :5],
                                               v[:, :5], backend=backend)]
    seqlens += 5
    for t in range(5, steps):
        outs.append(fusedlm.ops.attention_with_kvcache(q[:, t:t + 1], k_cache, v_cache, seqlens,
                                                       k[:, t:t + 1], v[:, t:t + 1],
                                                       backend=backend))
        seqlens += 1
    expected = reference.attention(*(t.double().transpose(1, 2) for t in (q, k, v)), causal=True)
    assert_close(torch.cat(outs, dim=1), expected.transpose(1, 2), name="out")


def test_attention_with_kvcache_compiles_without_graph_breaks():
    q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _case("left_padded", torch.float32, "cpu")
    ref_caches = [k_cache.double(), v_cache.double()]

    def step(q, k_cache, v_cache, k_new, v_new):
        out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                                 cache_leftpad=pad, backend="cpu")
        return out * 2

    out = torch.compile(step, fullgraph=True)(q, k_cache, v_cache, k_new, v_new)
    expected = reference.attention_with_kvcache(q.double(), *ref_caches, seqlens, k_new.double(),
                                                v_new.double(), cache_leftpad=pad) * 2
    assert_close(out, expected)
    # The compiled step wrote into the caches the caller holds.
    assert_close(k_cache, ref_caches[0], name="k_cache")
    assert_close(v_cache, ref_caches[1], name="v_cache")


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_attention_with_kvcache_rejects_bad_input(backend):
    # The lengths are checked on the CPU whatever the backend: in the C++ op, or in Python.
    q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _case("left_padded", torch.float32, "cpu")
    ok = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=seqlens, k_new=k_new,
              v_new=v_new, cache_leftpad=pad)
    int32 = dict(dtype=torch.int32)
    cases = [
        (ValueError, "q", dict(q=q[0])),
        (ValueError, "k_cache", dict(k_cache=k_cache[:, :, :1].expand(-1, -1, 3, -1))),  # 3 of 2 heads
        (ValueError, "v_cache", dict(k_cache=k_cache[:, :, :1])),  # one key head, two value heads
        (ValueError, "v_cache", dict(v_cache=v_cache[:, :5])),
        (TypeError, "v_cache", dict(v_cache=v_cache.double())),
        (TypeError, "cache_seqlens", dict(cache_seqlens=seqlens.long())),
        (ValueError, "cache_seqlens", dict(cache_seqlens=seqlens[:2])),
        (ValueError, "cache_seqlens", dict(cache_seqlens=torch.tensor([7, 20, 36, 3], **int32))),
        (ValueError, "cache_seqlens", dict(cache_seqlens=torch.tensor([7, -1, 3, 3], **int32))),
        (TypeError, "cache_leftpad", dict(cache_leftpad=pad.float())),
        (ValueError, "cache_leftpad", dict(cache_leftpad=torch.tensor([3, 0, 37, 4], **int32))),
        (ValueError, "k_new", dict(k_new=k_new[:, :, :1])),
        (ValueError, "k_new and v_new", dict(v_new=None)),
        (ValueError, "scale", dict(scale=float("inf"))),
        (RuntimeError, "q requires grad", dict(q=q.clone().requires_grad_())),
    ]
    for error, name, change in cases:
        args = ok | change
        before = k_cache.clone()
        with pytest.raises(error, match=name):
            fusedlm.ops.attention_with_kvcache(*list(args.values())[:6], backend=backend,
                                               **{k: v for k, v in list(args.items())[6:]})
        assert torch.equal(k_cache, before), f"{name}: a rejected call changed the cache"
    with torch.no_grad():  # no grad mode: a tensor that requires grad is fine
        fusedlm.ops.attention_with_kvcache(q.clone().requires_grad_(), k_cache, v_cache, seqlens,
                                           backend=backend)


# --- real shapes (a GPU) -------------------------------------------------------------------------

BATCH, HEADS, HEAD_DIM, MAX_LEN = 8, 12, 64, 1024  # GPT-2 small decoding


def _real_step(dtype, seq_q, seq_new, leftpad, kv_heads=HEADS):
    def randn(*shape):
        return torch.randn(*shape, device="cuda").to(dtype)

    caches = [randn(BATCH, MAX_LEN, kv_heads, HEAD_DIM) for _ in range(2)]
    seqlens = torch.randint(0, MAX_LEN - seq_new + 1, (BATCH,), device="cuda", dtype=torch.int32)
    seqlens[0], seqlens[1] = 0, MAX_LEN - seq_new  # empty and full
    pad = None
    if leftpad:
        pad = (torch.rand(BATCH, device="cuda") * (seqlens + seq_new).float()).to(torch.int32)
    new = [randn(BATCH, seq_new, kv_heads, HEAD_DIM) for _ in range(2)] if seq_new else [None, None]
    return randn(BATCH, seq_q, HEADS, HEAD_DIM), caches, new, seqlens, pad


def _float(t):
    return None if t is None else t.float()


@pytest.mark.parametrize("backend", backends_for("attention_with_kvcache", shapes="real"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seq_q,seq_new", [(1, 1), (128, 128), (4, 0)], ids=["decode", "prefill", "read"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
@pytest.mark.parametrize("kv_heads", [HEADS, 4], ids=["", "grouped"])
def test_attention_with_kvcache_real_shapes(backend, dtype, seq_q, seq_new, leftpad, kv_heads):
    q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _real_step(dtype, seq_q, seq_new, leftpad,
                                                                     kv_heads)
    ref_caches = [k_cache.float(), v_cache.float()]
    poison_memory()
    out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                             cache_leftpad=pad, backend=backend)
    expected = reference.attention_with_kvcache(q.float(), *ref_caches, seqlens, _float(k_new),
                                                _float(v_new), cache_leftpad=pad)
    assert_relative_error(out, expected, dtype, "out")
    assert torch.equal(k_cache.float(), ref_caches[0]) and torch.equal(v_cache.float(), ref_caches[1])


@pytest.mark.parametrize("backend", backends_for("attention_with_kvcache", shapes="real"))
def test_a_decoding_step_replays_from_a_cuda_graph(backend):
    q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _real_step(torch.bfloat16, 1, 1, True)
    seqlens.clamp_(max=MAX_LEN - 2)
    step = lambda: fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                                      cache_leftpad=pad, backend=backend)
    step()  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    # New lengths and inputs, same buffers: the replay follows them.
    seqlens += 1
    q.normal_()
    k_new.normal_()
    ref_caches = [k_cache.float(), v_cache.float()]
    graph.replay()
    expected = reference.attention_with_kvcache(q.float(), *ref_caches, seqlens, k_new.float(),
                                                v_new.float(), cache_leftpad=pad)
    assert_relative_error(out, expected, torch.bfloat16, "out")


@pytest.mark.parametrize("backend", backends_for("attention_with_kvcache", shapes="real"))
def test_lengths_past_the_cache_write_nothing_outside_it(backend):
    # Unchecked on the GPU (without FUSEDLM_DEBUG): sequence 0's append past its end must
    # not land at sequence 1's first positions, which follow it in memory.
    q, (k_cache, v_cache), (k_new, v_new), seqlens, _ = _real_step(torch.float32, 1, 1, False)
    seqlens[0] = MAX_LEN
    before = k_cache.clone()
    out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                             backend=backend)
    assert int(seqlens[1]) > 0 and torch.equal(k_cache[1, 0], before[1, 0])
    assert torch.equal(k_cache[0], before[0]) and out[0].isfinite().all()


# --- fuzz (tests/fuzz.py) --------------------------------------------------------------------------

def draw_attention_with_kvcache(d):
    dtype = d.dtype()
    batch, heads, seq_q = d.size(1, 3), d.size(1, 4), d.size(1, 5)
    kv_heads = fuzz.kv_heads(d, heads)
    max_len = d.size(1, 40, (1, 31, 32, 33))
    seq_new = d.size(0, min(3, max_len)) if d.chance(0.7) else 0
    head_dim = d.choice([64, 128]) if d.chance(0.5) else d.size(1, 72, (1, 3, 17, 40, 65))
    head_dim_v = head_dim if d.chance(0.7) else d.size(1, 72, (1, 3, 17, 40, 65))
    cached = [d.size(0, max_len - seq_new) for _ in range(batch)]
    leftpad = [d.size(0, c + seq_new) for c in cached] if d.chance(0.3) else None
    # The caches are written in place: never expanded.
    writable = ("contiguous", "permuted", "sliced")
    d.tensor("q", (batch, seq_q, heads, head_dim), dtype, scale=d.magnitude(30.0), grad=False)
    d.tensor("k_cache", (batch, max_len, kv_heads, head_dim), dtype, grad=False, layouts=writable)
    d.tensor("v_cache", (batch, max_len, kv_heads, head_dim_v), dtype, grad=False, layouts=writable)
    if seq_new:
        d.tensor("k_new", (batch, seq_new, kv_heads, head_dim), dtype, grad=False)
        d.tensor("v_new", (batch, seq_new, kv_heads, head_dim_v), dtype, grad=False)
    d.index_tensor("cache_seqlens", torch.tensor(cached, dtype=torch.int32))
    if leftpad is not None:
        d.index_tensor("cache_leftpad", torch.tensor(leftpad, dtype=torch.int32))
    scale = None if d.chance(0.7) else d.choice([0.01, 0.3, 2.0])
    d.note(f"cached={cached} leftpad={leftpad} kv_heads={kv_heads}/{heads}")

    def arguments(t):
        return ((t["q"], t["k_cache"], t["v_cache"], t["cache_seqlens"], t.get("k_new"), t.get("v_new")),
                {"cache_leftpad": t.get("cache_leftpad"), "scale": scale})

    def reference_(t):
        k_cache, v_cache, outs = t["k_cache"], t["v_cache"], []
        for b in range(batch):
            if seq_new:
                k_cache[b, cached[b]:cached[b] + seq_new] = t["k_new"][b]
                v_cache[b, cached[b]:cached[b] + seq_new] = t["v_new"][b]
            first = 0 if leftpad is None else leftpad[b]
            total = cached[b] + seq_new
            keys = slice(first, total)
            # query i sees keys up to total - seq_q + i: causal, bottom right, over [first, total)
            out = softmax_attention(t["q"][b].transpose(0, 1), k_cache[b, keys].transpose(0, 1),
                                    v_cache[b, keys].transpose(0, 1), causal=True, scale=scale)
            outs.append(out.transpose(0, 1))
        return torch.stack(outs), k_cache, v_cache

    def outputs(result, t):
        return result, t["k_cache"], t["v_cache"]

    too_long = torch.tensor([max_len - seq_new + 1] * batch, dtype=torch.int32)
    bad = [fuzz.grown("k_cache", 3), fuzz.grown("v_cache", 0), fuzz.with_extra_dim("q"),
           fuzz.replaced("cache_seqlens", too_long, "cache_seqlens past max_cache_len"),
           fuzz.replaced("cache_seqlens", -torch.ones(batch, dtype=torch.int32), "cache_seqlens < 0")]
    if seq_new:
        bad.append(fuzz.grown("k_new", 1))
    return Case("attention_with_kvcache", f"attention_with_kvcache {dtype} scale={scale}", arguments,
                reference_, floors=(1.0, fuzz.POINTWISE, fuzz.POINTWISE), dtype=dtype,
                differentiable=False, outputs=outputs, bad=tuple(bad))


test_fuzz_attention_with_kvcache, test_fuzz_attention_with_kvcache_bad_inputs = fuzz.tests(draw_attention_with_kvcache, backends_for("attention_with_kvcache"))


# Found by the fuzzer: a strided cache_seqlens (every other element of a buffer) gave the
# triton kernel wrong rows. The op now passes index tensors on contiguous.
@pytest.mark.parametrize("backend", backends_for("attention_with_kvcache"))
def test_attention_with_kvcache_takes_strided_lengths(backend):
    device = backend_device(backend)
    q = fresh((3, 1, 2, 16), torch.float32, device, requires_grad=False)
    k_cache, v_cache = (fresh((3, 12, 2, 16), torch.float32, device, requires_grad=False) for _ in "kv")
    buffer = torch.tensor([4, -7, 11, -7, 0, -7], dtype=torch.int32, device=device)
    lengths = buffer[::2]
    assert "copies cache_seqlens" in fusedlm.explain("attention_with_kvcache", q, k_cache, v_cache,
                                                     lengths, backend=backend)
    out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, lengths, backend=backend)
    expected = reference.attention_with_kvcache(q.double().cpu(), k_cache.double().cpu(),
                                                v_cache.double().cpu(), lengths.cpu())
    assert_close(out.cpu(), expected, torch.float32)
