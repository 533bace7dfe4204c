"""What one eager call of a fused op costs the host (``fusedlm bench --host``), against the
native PyTorch composition the op replaces.

The tensors are tiny (a batch of 2 x 4 tokens, hidden 16, vocabulary 16, one head of 8), so
the kernels cost next to nothing and a call's time is the host's: Python, the argument
checks, the dispatcher and autograd. Each op has two passes, each against its composition in
the same run:

- forward: the call under ``torch.no_grad()``;
- forward+backward: the call on inputs that require grad, then
  ``torch.autograd.backward(outputs, grads)`` with output gradients made beforehand (a
  scalar loss takes none, as ``.backward()``), one harness for both.

Each row names its native composition (:data:`CASES` builds them); the masks a composition
takes are made once, outside the call, as a model makes them once for all its layers (the
fused ops take the padding mask or the lengths themselves). The targets are the
ratio fusedlm / native: at most 1.25 for the forward, 1.1 for the forward+backward.

Times are wall-clock on one intra-op thread: rounds of many calls, fusedlm's and the
composition's rounds alternating, the fastest round per call (other processes only ever
add time), after a warm-up (the first calls run the device checks and memoise the
choice of backend). On a GPU a round starts on an empty queue and times the host issuing
its calls.
"""
from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from .. import ops
from ..backends import explain
from . import report

TARGETS = {"forward": 1.25, "forward+backward": 1.1}  # fusedlm's time / native's, at most

BATCH, SEQ, HIDDEN, FFN, VOCAB, HEAD_DIM = 2, 4, 16, 32, 16, 8
LENGTHS = (4, 3)  # the padded batch's sequences; each keeps a key (SDPA gives NaN otherwise)
ROWS = BATCH * SEQ // 2  # the row-wise ops' rows
MAX_CACHE = 8  # attention_with_kvcache's cache, holding CACHED tokens before the step
CACHED = 5
TEMPERATURE = 2.0


@dataclass(frozen=True)
class Pair:
    """One call of fusedlm.ops.<op>, fusedlm.ops.<op>(*inputs, **options), and the native
    composition it replaces, native(*native_inputs) (the tensors that require grad are the
    leaves of the forward+backward)."""
    inputs: tuple
    native: Callable
    native_inputs: tuple
    native_label: str
    options: dict = field(default_factory=dict)
    differentiated: int = 1  # the leading outputs whose gradients the backward takes
    backward: bool = True  # False: an inference op (attention_with_kvcache)


def _leaf(device, *shape, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device=device).requires_grad_(grad)


def _padding(device) -> torch.Tensor:
    """bool [BATCH, SEQ], True = padding (fusedlm's key_padding_mask)."""
    return torch.arange(SEQ, device=device) >= torch.tensor(LENGTHS, device=device)[:, None]


def _attention(device) -> Pair:
    qkv = tuple(_leaf(device, BATCH, 1, SEQ, HEAD_DIM) for _ in range(3))
    padding = _padding(device)
    keys = ~padding[:, None, None, :]  # SDPA's boolean attn_mask, True = attend (made once)
    return Pair(qkv, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keys), qkv,
                "F.scaled_dot_product_attention, the padding mask as a boolean attn_mask",
                options={"key_padding_mask": padding})


def _attention_varlen(device) -> Pair:
    packed = [_leaf(device, sum(LENGTHS), 1, HEAD_DIM) for _ in range(3)]
    keep = ~_padding(device)
    cu_seqlens = F.pad(torch.tensor(LENGTHS, device=device).cumsum(0), (1, 0)).to(torch.int32)

    def padded(t):  # [BATCH, 1, SEQ, HEAD_DIM]: the packed rows in place, zeros elsewhere
        out = t.new_zeros(BATCH, SEQ, 1, HEAD_DIM)
        out[keep] = t.detach()
        return out.transpose(1, 2).contiguous().requires_grad_()

    keys = keep[:, None, None, :]
    return Pair((*packed, cu_seqlens, cu_seqlens, SEQ, SEQ),
                lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=keys),
                tuple(padded(t) for t in packed),
                "F.scaled_dot_product_attention on the padded batch, its padding mask as a "
                "boolean attn_mask")


def _attention_with_kvcache(device) -> Pair:
    q, k_new, v_new = (_leaf(device, BATCH, 1, 1, HEAD_DIM, grad=False) for _ in range(3))
    caches = [_leaf(device, BATCH, MAX_CACHE, 1, HEAD_DIM, grad=False) for _ in range(2)]
    cache_seqlens = torch.full((BATCH,), CACHED, dtype=torch.int32, device=device)
    # What a model with a static cache holds for all its layers in a step: the position it
    # writes at and the keys its queries see.
    position = torch.tensor([CACHED], device=device)
    keys = (torch.arange(MAX_CACHE, device=device) <= cache_seqlens[:, None])[:, None, None, :]

    def native(q, k_cache, v_cache, k_new, v_new):
        k_cache.index_copy_(1, position, k_new)
        v_cache.index_copy_(1, position, v_new)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache.transpose(1, 2),
                                             v_cache.transpose(1, 2), attn_mask=keys)
        return out.transpose(1, 2)

    return Pair((q, *caches, cache_seqlens, k_new, v_new), native,
                (q, *[c.clone() for c in caches], k_new, v_new),
                "index_copy_ of the new keys and values into the caches, then "
                "F.scaled_dot_product_attention over the cache with its length mask",
                backward=False)


def _add_layer_norm(device) -> Pair:
    inputs = (_leaf(device, ROWS, HIDDEN), _leaf(device, ROWS, HIDDEN), _leaf(device, HIDDEN),
              _leaf(device, HIDDEN))
    return Pair(inputs, lambda x, r, w, b: F.layer_norm(x + r, (HIDDEN,), w, b), inputs,
                "F.layer_norm(x + r, ...)")


def _bias_gelu(device) -> Pair:
    inputs = (_leaf(device, ROWS, HIDDEN), _leaf(device, HIDDEN))
    return Pair(inputs, lambda x, b: F.gelu(x + b), inputs, "F.gelu(x + b)")


def _gelu_ffn(device) -> Pair:
    inputs = (_leaf(device, ROWS, HIDDEN), _leaf(device, FFN, HIDDEN), _leaf(device, FFN),
              _leaf(device, HIDDEN, FFN), _leaf(device, HIDDEN))
    return Pair(inputs, lambda x, w1, b1, w2, b2: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2),
                inputs, "F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)")


def _cross_entropy(device) -> Pair:
    inputs = (_leaf(device, ROWS, VOCAB), torch.randint(VOCAB, (ROWS,), device=device))
    return Pair(inputs, F.cross_entropy, inputs, "F.cross_entropy")


def _distillation_loss(device) -> Pair:
    inputs = (_leaf(device, ROWS, VOCAB), _leaf(device, ROWS, VOCAB, grad=False))

    def native(s, t):
        return F.kl_div(F.log_softmax(s / TEMPERATURE, -1), F.softmax(t / TEMPERATURE, -1),
                        reduction="batchmean") * TEMPERATURE**2

    return Pair(inputs, native, inputs, 'F.kl_div(F.log_softmax(s / T, -1), '
                'F.softmax(t / T, -1), reduction="batchmean") * T**2',
                options={"temperature": TEMPERATURE})


def _masked_lm_loss(device) -> Pair:
    labels = torch.randint(VOCAB, (BATCH, SEQ), device=device)
    labels[:, ::2] = -100
    inputs = (_leaf(device, BATCH, SEQ, HIDDEN), _leaf(device, VOCAB, HIDDEN), _leaf(device, VOCAB),
              labels)

    def native(hidden, weight, bias, labels):
        labelled = labels != -100
        return F.cross_entropy(F.linear(hidden[labelled], weight, bias), labels[labelled])

    return Pair(inputs, native, inputs, "hidden[labels != -100], F.linear with the decoder's "
                "weight and bias, F.cross_entropy")


def _lstm_cell(device) -> Pair:
    inputs = (_leaf(device, ROWS, 4 * HIDDEN), _leaf(device, ROWS, HIDDEN))

    def native(gates, c_prev):
        i, f, g, o = gates.chunk(4, -1)
        c = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    return Pair(inputs, native, inputs, "i, f, g, o = gates.chunk(4, -1); c = sigmoid(f) * "
                "c_prev + sigmoid(i) * tanh(g); h = sigmoid(o) * tanh(c)", differentiated=2)


def _unpad(device) -> Pair:
    inputs = (_leaf(device, BATCH, SEQ, HIDDEN), _padding(device))

    def native(hidden, padding):
        keep = ~padding
        lengths = keep.sum(1, dtype=torch.int32)
        indices = keep.flatten().nonzero().flatten()
        cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
        return hidden.flatten(0, 1)[indices], indices, cu_seqlens, int(lengths.max())

    return Pair(inputs, native, inputs, "hidden.flatten(0, 1)[indices], indices the mask's "
                "nonzero, cu_seqlens the cumsum of its lengths, max_seqlen their max")


def _pad(device) -> Pair:
    indices = (~_padding(device)).flatten().nonzero().flatten()
    packed = _leaf(device, sum(LENGTHS), HIDDEN)

    def native(packed, indices):
        out = torch.zeros(BATCH * SEQ, HIDDEN, dtype=packed.dtype, device=packed.device)
        out.index_put_((indices,), packed)
        return out.view(BATCH, SEQ, HIDDEN)

    return Pair((packed, indices, BATCH, SEQ), native, (packed, indices),
                "torch.zeros(...).index_put_ of the rows")


CASES: dict[str, Callable[[torch.device], Pair]] = {
    "attention": _attention, "attention_varlen": _attention_varlen,
    "attention_with_kvcache": _attention_with_kvcache, "add_layer_norm": _add_layer_norm,
    "bias_gelu": _bias_gelu, "gelu_ffn": _gelu_ffn, "cross_entropy": _cross_entropy,
    "distillation_loss": _distillation_loss, "masked_lm_loss": _masked_lm_loss,
    "lstm_cell": _lstm_cell, "unpad": _unpad, "pad": _pad,
}


# --- the harness -----------------------------------------------------------------------------

def outputs(out) -> tuple:
    """A function's outputs as a tuple (one tensor or several)."""
    return out if isinstance(out, tuple) else (out,)


def calls(op: str, pair: Pair) -> dict:
    """{"native": (function, inputs), "fusedlm": (function, inputs)}."""
    return {"native": (pair.native, pair.native_inputs),
            "fusedlm": (partial(getattr(ops, op), **pair.options), pair.inputs)}


def _forward(fn: Callable, inputs: tuple) -> Callable[[], None]:
    def step():
        with torch.no_grad():
            fn(*inputs)

    return step


def _forward_backward(fn: Callable, inputs: tuple, differentiated: int) -> Callable[[], None]:
    first = outputs(fn(*inputs))[:differentiated]
    grads = None if first[0].dim() == 0 else tuple(torch.randn_like(t) for t in first)

    def step():
        torch.autograd.backward(outputs(fn(*inputs))[:differentiated], grads)

    return step


def _microseconds(steps: dict, device: torch.device, calls_per_round: int, rounds: int) -> dict:
    """{name: µs per call}: the fastest of `rounds` rounds of `calls_per_round` calls, the
    steps' rounds alternating."""
    best = dict.fromkeys(steps, math.inf)
    for _ in range(rounds):
        for name, step in steps.items():
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls_per_round):
                step()
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: seconds / calls_per_round * 1e6 for name, seconds in best.items()}


def _rows(op: str, device: torch.device, calls_per_round: int, rounds: int, warm_up: int) -> list:
    pair = CASES[op](device)
    backend = explain(op, *pair.inputs, **pair.options).partition(" -> ")[2].partition(":")[0]
    rows = []
    for pass_ in TARGETS if pair.backward else ("forward",):
        if pass_ == "forward":
            steps = {name: _forward(*call) for name, call in calls(op, pair).items()}
        else:
            steps = {name: _forward_backward(*call, pair.differentiated)
                     for name, call in calls(op, pair).items()}
        for step in steps.values():
            for _ in range(warm_up):
                step()
        us = _microseconds(steps, device, calls_per_round, rounds)
        ratio = us["fusedlm"] / us["native"]
        rows.append({"op": op, "pass": pass_, "backend": backend, "native": pair.native_label,
                     "native_us": us["native"], "fusedlm_us": us["fusedlm"], "ratio": ratio,
                     "target": TARGETS[pass_], "met": ratio <= TARGETS[pass_]})
    return rows


def run(device: torch.device, names, quick: bool = False) -> dict:
    """The rows of the ops `names` (keys of CASES), one per op and pass: {op, pass, backend
    (fusedlm's choice), native (the composition), native_us, fusedlm_us, ratio (fusedlm /
    native), target, met}, with the device, torch's version, the threads and the load
    average (1, 5 and 15 minutes) at the start and the end. Timed on one intra-op thread,
    the caller's number restored after. --quick: a few calls, to check the harness."""
    calls_per_round, rounds, warm_up = (2, 2, 2) if quick else (100, 30, 50)
    torch.manual_seed(0)
    load_start = os.getloadavg()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [row for op in names
                for row in _rows(op, device, calls_per_round, rounds, warm_up)]
        device_name = report.device_name(device)
    finally:
        torch.set_num_threads(threads)
    return {"device": device_name, "date": datetime.date.today().isoformat(),
            "commit": report.git_commit(), "torch": torch.__version__, "threads": 1,
            "loadavg": {"start": list(load_start), "end": list(os.getloadavg())},
            "quick": quick, "calls_per_round": calls_per_round, "rounds": rounds, "rows": rows}


def table(result: dict) -> str:
    """One line per op and pass, in the style of report.table."""
    start, end = result["loadavg"]["start"][0], result["loadavg"]["end"][0]
    lines = [f"device: {result['device']}; torch {result['torch']}; load average {start:.2f} "
             f"-> {end:.2f}; times: fastest round of {result['calls_per_round']} calls, "
             "µs per call; ratio: fusedlm / native, at most the target"]
    header = ["op", "pass", "backend", "native µs", "fusedlm µs", "ratio", "target", "", "native"]
    cells = [[r["op"], r["pass"], r["backend"], f"{r['native_us']:.1f}", f"{r['fusedlm_us']:.1f}",
              f"{r['ratio']:.2f}", f"{r['target']:.2f}", "met" if r["met"] else "MISSED",
              r["native"]] for r in result["rows"]]
    widths = [max(len(r[i]) for r in cells + [header]) for i in range(len(header))]
    right = {3, 4, 5, 6}
    for r in [header] + cells:
        lines.append("  ".join(v.rjust(w) if i in right else v.ljust(w)
                               for i, (v, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines)
