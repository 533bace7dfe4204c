"""attention_with_kvcache on the GPU at GPT-2-small decoding shapes, against the float32
reference, and one decoding step captured in a CUDA graph."""
import pytest
import torch

import fusedlm
from fusedlm.ops import reference
from checks import assert_relative_error, needs_cuda, poison_memory

pytestmark = needs_cuda
BATCH, HEADS, HEAD_DIM, MAX_LEN = 8, 12, 64, 1024


def _step(dtype, seq_q, seq_new, leftpad):
    def randn(*shape):
        return torch.randn(*shape, device="cuda").to(dtype)

    caches = [randn(BATCH, MAX_LEN, HEADS, HEAD_DIM) for _ in range(2)]
    seqlens = torch.randint(0, MAX_LEN - seq_new + 1, (BATCH,), device="cuda", dtype=torch.int32)
    seqlens[0], seqlens[1] = 0, MAX_LEN - seq_new  # empty and full
    pad = None
    if leftpad:
        pad = (torch.rand(BATCH, device="cuda") * (seqlens + seq_new).float()).to(torch.int32)
    new = [randn(BATCH, seq_new, HEADS, HEAD_DIM) for _ in range(2)] if seq_new else [None, None]
    return randn(BATCH, seq_q, HEADS, HEAD_DIM), caches, new, seqlens, pad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("seq_q,seq_new", [(1, 1), (128, 128), (4, 0)], ids=["decode", "prefill", "read"])
@pytest.mark.parametrize("leftpad", [False, True], ids=["", "leftpad"])
def test_attention_with_kvcache_real_shapes(dtype, seq_q, seq_new, leftpad):
    q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _step(dtype, seq_q, seq_new, leftpad)
    ref_caches = [k_cache.float(), v_cache.float()]
    poison_memory()
    out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                             cache_leftpad=pad, backend="triton")
    expected = reference.attention_with_kvcache(
        q.float(), *ref_caches, seqlens, None if k_new is None else k_new.float(),
        None if v_new is None else v_new.float(), cache_leftpad=pad)
    assert_relative_error(out, expected, dtype, "out")
    assert torch.equal(k_cache.float(), ref_caches[0]) and torch.equal(v_cache.float(), ref_caches[1])


def test_a_decoding_step_replays_from_a_cuda_graph():
    q, (k_cache, v_cache), (k_new, v_new), seqlens, pad = _step(torch.bfloat16, 1, 1, True)
    seqlens.clamp_(max=MAX_LEN - 2)
    step = lambda: fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                                      cache_leftpad=pad, backend="triton")
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


def test_lengths_past_the_cache_write_nothing_outside_it():
    # Unchecked on the GPU (without FUSEDLM_DEBUG): sequence 0's append past its end must
    # not land at sequence 1's first positions, which follow it in memory.
    q, (k_cache, v_cache), (k_new, v_new), seqlens, _ = _step(torch.float32, 1, 1, False)
    seqlens[0] = MAX_LEN
    before = k_cache.clone()
    out = fusedlm.ops.attention_with_kvcache(q, k_cache, v_cache, seqlens, k_new, v_new,
                                             backend="triton")
    assert int(seqlens[1]) > 0 and torch.equal(k_cache[1, 0], before[1, 0])
    assert torch.equal(k_cache[0], before[0]) and out[0].isfinite().all()
