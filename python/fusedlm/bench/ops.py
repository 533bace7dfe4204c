"""The fused ops' cases: each op and pass on every fusedlm kernel backend that takes the
call, against torch's eager composition of the same computation, torch.compile of it, and
SDPA for attention.

Shapes. GPU: BERT-base (32 x 128 tokens, hidden 768, FFN 3072, vocab 30522, 15% of tokens
labelled for the masked-LM loss), GPT-2 small (8 x 1024 tokens, vocab 50257), the
add+LayerNorm bandwidth target (65536 tokens x hidden 1024), padded BERT batches of
lengths 128 to 512 and long causal sequences (2048 to 8192) at head dims 64 and 128,
grouped-query attention (2 x 4096, 32 query heads sharing 8 key/value heads of 128) and a
sliding window (8192 tokens, 12 heads of 64, 64 keys each side), in bfloat16. CPU:
BERT-base at batch 8 x seq 128 in float32 (and bfloat16 where the op is memory-bound, and
for attention), one causal sequence of 1024, grouped-query attention over 1024 tokens and
the window over 4096. --quick: tiny shapes in float32, to check the command rather than
measure.

Each case's work is the least traffic (GB/s) or the matrix-product FLOPs (TFLOP/s) a
fused implementation needs; a baseline's rate is the same work over its own time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from .case import Bench, Case, passes


@dataclass(frozen=True)
class Shapes:
    dtypes: tuple  # the memory-bound ops and attention
    matmul_dtypes: tuple  # gelu_ffn and the losses
    tokens: int
    hidden: int
    ffn: int
    vocab: int
    layer_norm: tuple  # (tokens, hidden) ...
    ffn_tokens: tuple
    cross_entropy: tuple  # (tokens, vocab) ...
    heads: int
    bert_seqs: tuple  # padded batches of `tokens` tokens, lengths uniform in [seq/2, seq]
    long_seqs: tuple  # causal, `long_tokens` tokens a batch, `long_hidden` wide
    long_dims: tuple
    long_hidden: int
    long_tokens: int
    grouped: tuple  # causal grouped-query: (batch, seq, query heads, key/value heads, head_dim)
    windowed: tuple  # bidirectional local: (batch, seq, heads, head_dim, window each side)
    copy_bytes: int  # the ceilings
    matmul: int


_BF16, _FP32 = torch.bfloat16, torch.float32
GPU = Shapes(dtypes=(_BF16,), matmul_dtypes=(_BF16,), tokens=32 * 128, hidden=768, ffn=3072,
             vocab=30522, layer_norm=((65536, 1024), (32 * 128, 768)), ffn_tokens=(32 * 128, 8 * 1024),
             cross_entropy=((32 * 128, 30522), (8 * 1024, 50257)), heads=12,
             bert_seqs=(128, 256, 512), long_seqs=(2048, 4096, 8192), long_dims=(64, 128),
             long_hidden=2048, long_tokens=8192, grouped=(2, 4096, 32, 8, 128),
             windowed=(1, 8192, 12, 64, 64), copy_bytes=2 << 30, matmul=8192)
CPU = Shapes(dtypes=(_FP32, _BF16), matmul_dtypes=(_FP32,), tokens=8 * 128, hidden=768, ffn=3072,
             vocab=30522, layer_norm=((8 * 128, 768),), ffn_tokens=(8 * 128,),
             cross_entropy=((8 * 128, 30522),), heads=12, bert_seqs=(128,), long_seqs=(1024,),
             long_dims=(64,), long_hidden=768, long_tokens=1024, grouped=(1, 1024, 32, 8, 128),
             windowed=(1, 4096, 12, 64, 64), copy_bytes=256 << 20, matmul=2048)
QUICK = Shapes(dtypes=(_FP32,), matmul_dtypes=(_FP32,), tokens=16, hidden=32, ffn=64, vocab=300,
               layer_norm=((16, 48),), ffn_tokens=(16,), cross_entropy=((16, 300),), heads=2,
               bert_seqs=(8,), long_seqs=(24,), long_dims=(16,), long_hidden=32, long_tokens=24,
               grouped=(1, 24, 4, 2, 16), windowed=(1, 32, 2, 16, 4), copy_bytes=1 << 20, matmul=64)
LABELLED = 0.15


def shapes_for(bench: Bench) -> Shapes:
    if bench.quick:
        return QUICK
    shapes = GPU if bench.device.type == "cuda" else CPU
    return _bert_base(shapes) if bench.bert_shapes else shapes


def _bert_base(s: Shapes) -> Shapes:
    """BERT-base's shapes alone: its batch of tokens at its width and vocabulary, padded
    batches of 128-token sequences, and no long causal, grouped or windowed ones."""
    return replace(s, layer_norm=((s.tokens, s.hidden),), ffn_tokens=(s.tokens,),
                   cross_entropy=((s.tokens, s.vocab),), bert_seqs=(128,), long_seqs=(),
                   grouped=(), windowed=())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _against_eager(bench: Bench, op: str, shape: str, inputs: list, eager, *, unit: str,
                   work: tuple, baselines: Optional[dict] = None, **options) -> Iterator[Case]:
    """op's forward and forward+backward passes on `inputs` (with its keyword `options`) on
    every fusedlm backend that takes them, against `eager`, torch.compile of it and any
    other `baselines` ({name: function}); `work`: each pass's (forward, forward+backward)."""
    impls, skipped = bench.fused(op, inputs, **options)
    impls.update(eager=(eager, inputs), compiled=(bench.compile(eager), inputs),
                 **{name: (f, inputs) for name, f in (baselines or {}).items()})
    return passes(op, shape, impls, unit=unit, skipped=skipped,
                  work={"forward": work[0], "forward+backward": work[1]})


def add_layer_norm(bench: Bench) -> Iterator[Case]:
    for dtype in shapes_for(bench).dtypes:
        for tokens, hidden in shapes_for(bench).layer_norm:
            inputs = [bench.tensor(tokens, hidden, dtype=dtype), bench.tensor(tokens, hidden, dtype=dtype),
                      bench.tensor(hidden, dtype=dtype), bench.tensor(hidden, dtype=dtype)]

            def eager(x, r, w, b, hidden=hidden):
                summed = x + r
                return F.layer_norm(summed, (hidden,), w, b), summed

            # Forward: x and the residual read, out and summed written. Backward: the
            # upstream gradient and summed read, one gradient (x's = the residual's) written.
            size = tokens * hidden * inputs[0].element_size()
            yield from _against_eager(bench, "add_layer_norm", f"{tokens}x{hidden} {_name(dtype)}",
                                      inputs, eager, unit="GB/s", work=(4 * size, 7 * size))


def rms_norm(bench: Bench) -> Iterator[Case]:
    for dtype in shapes_for(bench).dtypes:
        for tokens, hidden in shapes_for(bench).layer_norm:
            inputs = [bench.tensor(tokens, hidden, dtype=dtype), bench.tensor(hidden, dtype=dtype)]

            def eager(x, w, hidden=hidden):
                return F.rms_norm(x, (hidden,), w, 1e-6)

            def transformers_llama(x, w):
                """LlamaRMSNorm's forward, as transformers runs it: float32, then x's dtype."""
                xf = x.float()
                return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

            # Forward: x read, out written. Backward: the upstream gradient and x read, dx
            # written.
            size = tokens * hidden * inputs[0].element_size()
            yield from _against_eager(bench, "rms_norm", f"{tokens}x{hidden} {_name(dtype)}",
                                      inputs, eager, unit="GB/s", work=(2 * size, 5 * size),
                                      baselines={"transformers-llama": transformers_llama})


def bias_gelu(bench: Bench) -> Iterator[Case]:
    s = shapes_for(bench)
    for dtype in s.dtypes:
        inputs = [bench.tensor(s.tokens, s.ffn, dtype=dtype), bench.tensor(s.ffn, dtype=dtype)]

        def eager(x, b):
            return F.gelu(x + b)

        # Forward: x read, y written; backward: the upstream gradient and x read, dx written.
        size = s.tokens * s.ffn * inputs[0].element_size()
        yield from _against_eager(bench, "bias_gelu", f"{s.tokens}x{s.ffn} {_name(dtype)}", inputs,
                                  eager, unit="GB/s", work=(2 * size, 5 * size))


def gelu_ffn(bench: Bench) -> Iterator[Case]:
    s = shapes_for(bench)
    d, f = s.hidden, s.ffn
    for dtype in s.matmul_dtypes:
        for tokens in s.ffn_tokens:
            inputs = [bench.tensor(tokens, d, dtype=dtype),
                      bench.tensor(f, d, dtype=dtype, scale=d ** -0.5), bench.tensor(f, dtype=dtype),
                      bench.tensor(d, f, dtype=dtype, scale=f ** -0.5), bench.tensor(d, dtype=dtype)]

            def eager(x, w1, b1, w2, b2):
                return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

            def matmuls(x, w1, b1, w2, b2):
                """The two bare products: what the fused op should come close to."""
                return (x @ w1.t()) @ w2.t()

            flops = 2 * 2 * tokens * d * f
            yield from _against_eager(bench, "gelu_ffn", f"{tokens}x{d}->{f}->{d} {_name(dtype)}",
                                      inputs, eager, unit="TFLOP/s", work=(flops, 3 * flops),
                                      baselines={"matmuls": matmuls})


def cross_entropy(bench: Bench) -> Iterator[Case]:
    s = shapes_for(bench)
    for dtype in s.matmul_dtypes:
        for tokens, vocab in s.cross_entropy:
            inputs = [bench.tensor(tokens, vocab, dtype=dtype),
                      torch.randint(0, vocab, (tokens,), device=bench.device)]

            def eager(x, y):
                return F.cross_entropy(x.float(), y)

            # The logits read; with the backward, their gradient written too.
            size = tokens * vocab * inputs[0].element_size()
            yield from _against_eager(bench, "cross_entropy", f"{tokens}x{vocab} {_name(dtype)}",
                                      inputs, eager, unit="GB/s", work=(size, 2 * size))


def distillation_loss(bench: Bench) -> Iterator[Case]:
    s = shapes_for(bench)
    for dtype in s.matmul_dtypes:
        for tokens, vocab in s.cross_entropy:
            # The teacher's logits come from a model run without gradients.
            inputs = [bench.tensor(tokens, vocab, dtype=dtype, scale=3.0),
                      bench.tensor(tokens, vocab, dtype=dtype, scale=3.0).detach()]

            def eager(student, teacher, temperature=2.0):
                """DistilBERT's distiller: KLDivLoss(batchmean) of the two softmaxes, times T²."""
                return F.kl_div(F.log_softmax(student.float() / temperature, dim=-1),
                                F.softmax(teacher.float() / temperature, dim=-1),
                                reduction="batchmean") * temperature ** 2

            # Both rows of logits read; with the backward, the student's gradient written too.
            size = tokens * vocab * inputs[0].element_size()
            yield from _against_eager(bench, "distillation_loss",
                                      f"{tokens}x{vocab} {_name(dtype)}, T=2", inputs, eager,
                                      unit="GB/s", work=(2 * size, 3 * size), temperature=2.0)


def masked_lm_loss(bench: Bench) -> Iterator[Case]:
    s = shapes_for(bench)
    tokens, d, vocab = s.tokens, s.hidden, s.vocab
    for dtype in s.matmul_dtypes:
        labels = torch.randint(0, vocab, (tokens,), device=bench.device)
        labels = labels.masked_fill(torch.rand(tokens, device=bench.device) >= LABELLED, -100)
        inputs = [bench.tensor(tokens, d, dtype=dtype), bench.tensor(vocab, d, dtype=dtype, scale=d ** -0.5),
                  bench.tensor(vocab, dtype=dtype), labels]

        def eager(h, w, b, y):
            """What BERT implementations run: logits for every token, then the loss."""
            return F.cross_entropy(F.linear(h, w, b).float(), y)

        def gathered(h, w, b, y):
            """The labelled rows selected first: the cheap half of the fused op's saving."""
            keep = y != -100
            return F.cross_entropy(F.linear(h[keep], w, b).float(), y[keep])

        flops = 2 * int((labels != -100).sum()) * d * vocab  # the labelled rows' projection
        yield from _against_eager(bench, "masked_lm_loss",
                                  f"{tokens}x{d}->{vocab} {_name(dtype)}, {LABELLED:.0%} labelled",
                                  inputs, eager, unit="TFLOP/s", work=(flops, 3 * flops),
                                  baselines={"eager-gathered": gathered})


def _eager_attention(q, k, v, allowed=None, causal=False):
    """The unfused composition: key/value heads repeated for their groups of query heads,
    scores, mask, softmax, product."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        seq_q, seq_k = scores.shape[-2:]
        above = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(seq_k - seq_q + 1)
        scores = scores.masked_fill(above, float("-inf"))
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _attention_flops(pairs: int, heads: int, head_dim: int) -> dict:
    """QK^T and PV over `pairs` (query, key) pairs forward, and 2.5 times that again
    backward (dV, dP, dS K, dS^T Q)."""
    forward = 4 * pairs * heads * head_dim
    return {"forward": forward, "forward+backward": 3.5 * forward}


def _attention_baselines(bench: Bench, inputs: list, **mask) -> dict:
    def sdpa(q, k, v):
        grouped = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
        if "allowed" in mask:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask["allowed"], **grouped)
        return F.scaled_dot_product_attention(q, k, v, is_causal=mask.get("causal", False),
                                              **grouped)

    def eager(q, k, v):
        return _eager_attention(q, k, v, **mask)

    return {"sdpa": (sdpa, inputs), "eager": (eager, inputs), "compiled": (bench.compile(eager), inputs)}


def attention(bench: Bench) -> Iterator[Case]:
    """BERT batches without padding; BERT batches with padding (fusedlm packs the real
    tokens and runs attention_varlen, as its BERT does; torch gets the padded batch and a
    mask); long causal sequences; causal grouped-query attention (key/value heads read in
    place; SDPA with enable_gqa, eager repeats them); a bidirectional sliding window, as
    ModernBERT's local layers (SDPA and eager get the window as a mask; the work counts
    the pairs inside it)."""
    s = shapes_for(bench)
    heads, head_dim = s.heads, s.hidden // s.heads
    generator = torch.Generator().manual_seed(0)
    for dtype in s.dtypes:
        for seq in s.bert_seqs:
            batch = s.tokens // seq
            shape = f"{batch}x{heads}x{seq}x{head_dim} {_name(dtype)}"
            inputs = [bench.tensor(batch, heads, seq, head_dim, dtype=dtype) for _ in range(3)]
            impls, skipped = bench.fused("attention", inputs)
            impls.update(_attention_baselines(bench, inputs))
            yield from passes("attention", shape, impls, unit="TFLOP/s", skipped=skipped,
                              work=_attention_flops(batch * seq * seq, heads, head_dim))

            lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=generator).tolist()
            lengths[0] = seq  # the longest fills the padded batch
            allowed = torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]
            allowed = allowed.to(bench.device)[:, None, None, :]
            cu_seqlens = torch.tensor([0] + lengths, device=bench.device).cumsum(0).to(torch.int32)
            packed = [bench.tensor(sum(lengths), heads, head_dim, dtype=dtype) for _ in range(3)]
            packed += [cu_seqlens, cu_seqlens, seq, seq]
            impls, skipped = bench.fused("attention_varlen", packed)
            impls.update(_attention_baselines(bench, inputs, allowed=allowed))
            yield from passes("attention padded", f"{shape}, lengths {seq // 2}-{seq}", impls,
                              unit="TFLOP/s", skipped=skipped,
                              work=_attention_flops(sum(n * n for n in lengths), heads, head_dim))
        for dim in s.long_dims:
            wide = s.long_hidden // dim  # heads
            for seq in s.long_seqs:
                batch = max(1, s.long_tokens // seq)
                inputs = [bench.tensor(batch, wide, seq, dim, dtype=dtype) for _ in range(3)]
                impls, skipped = bench.fused("attention", inputs, causal=True)
                impls.update(_attention_baselines(bench, inputs, causal=True))
                yield from passes("attention causal", f"{batch}x{wide}x{seq}x{dim} {_name(dtype)}",
                                  impls, unit="TFLOP/s", skipped=skipped,
                                  work=_attention_flops(batch * seq * (seq + 1) // 2, wide, dim))
        if s.grouped:
            batch, seq, heads_q, heads_kv, dim = s.grouped
            inputs = [bench.tensor(batch, n, seq, dim, dtype=dtype) for n in (heads_q, heads_kv, heads_kv)]
            impls, skipped = bench.fused("attention", inputs, causal=True)
            impls.update(_attention_baselines(bench, inputs, causal=True))
            yield from passes("attention causal, grouped-query",
                              f"{batch}x{heads_q}/{heads_kv}x{seq}x{dim} {_name(dtype)}", impls,
                              unit="TFLOP/s", skipped=skipped,
                              work=_attention_flops(batch * seq * (seq + 1) // 2, heads_q, dim))
        if s.windowed:
            batch, seq, wide, dim, side = s.windowed
            inputs = [bench.tensor(batch, wide, seq, dim, dtype=dtype) for _ in range(3)]
            rows = torch.arange(seq)[:, None]
            allowed = ((torch.arange(seq) - rows).abs() <= side).to(bench.device)
            impls, skipped = bench.fused("attention", inputs, window_size=(side, side))
            impls.update(_attention_baselines(bench, inputs, allowed=allowed))
            yield from passes("attention, sliding window",
                              f"{batch}x{wide}x{seq}x{dim} {_name(dtype)}, {side} keys each side",
                              impls, unit="TFLOP/s", skipped=skipped,
                              work=_attention_flops(batch * int(allowed.sum()), wide, dim))


OPS = {"attention": attention, "add_layer_norm": add_layer_norm, "rms_norm": rms_norm,
       "bias_gelu": bias_gelu, "gelu_ffn": gelu_ffn, "cross_entropy": cross_entropy,
       "distillation_loss": distillation_loss, "masked_lm_loss": masked_lm_loss}
