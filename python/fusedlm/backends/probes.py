"""Probes: small problems that check a backend's kernels against the plain-PyTorch reference.

A probe is one call of an op (``fusedlm.ops.<op>``) on inputs drawn from its own
generator: the backend's forward and backward run in the call's dtype on the call's
device, the reference (fusedlm.ops.reference) in float64 on the CPU from the same
inputs after their rounding to that dtype, and the result is the largest norm-wise
relative error ‖out − ref‖ / ‖ref‖ over the outputs and the gradients. Probes draw
nothing from torch's global generator and use no dropout (whose seed would), so running
one does not change what a user's program computes.

``small`` probes take each kernel path a backend has for the op (the cuda attention's
resident and streamed K/V, head dims 64 and 128, the layer norm's vector and one-element
rows, ...) and run in milliseconds; ``real`` ones have the shapes of BERT-base, GPT-2
small and ELMo. First-use verification (fusedlm.backends.verify) runs the small ones;
``fusedlm selftest`` runs both.
"""
from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

# Norm-wise relative error a correct kernel stays under, by the dtype it computes in: a few
# roundings of that dtype over long reductions, with a wide margin (a wrong kernel is off
# by order 1).
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 5e-2}


@dataclass(frozen=True)
class Probe:
    op: str
    name: str
    # make(generator) -> (args, kwargs) in float64 on the CPU; integer tensors as they are.
    make: Callable[[torch.Generator], tuple]
    differentiable: bool = True
    # The cuda kernel paths (fusedlm.backends.cuda.paths()) this problem takes when they are
    # on: where it fails, turning one off shows whether that path is the broken one.
    paths: tuple = ()


@dataclass
class Outcome:
    error: float  # the largest norm-wise relative error (inf: a NaN or a wrong integer output)
    worst: str  # what it was measured on ("output 0", "gradient of input 1")

    def within(self, dtype: torch.dtype) -> bool:
        return self.error <= TOLERANCE.get(dtype, 5e-2)


def _randn(g, *shape, scale=1.0):
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def _padding(g, batch, seq):
    """bool [batch, seq], True = padding; the first row whole, the others at least half."""
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    return torch.arange(seq)[None, :] >= lengths[:, None]


def _labels(g, rows, classes, labelled=0.5):
    labels = torch.randint(0, classes, (rows,), generator=g)
    labels[torch.rand(rows, generator=g) >= labelled] = -100
    labels[0] = classes - 1
    return labels


def _attention(batch, heads, seq, head_dim, *, causal=False, masked=False):
    def make(g):
        q, k, v = (_randn(g, batch, heads, seq, head_dim) for _ in range(3))
        mask = _padding(g, batch, seq) if masked else None
        return (q, k, v), {"causal": causal, "key_padding_mask": mask}
    return make


def _varlen(lengths, heads, head_dim):
    def make(g):
        total = sum(lengths)
        q, k, v = (_randn(g, total, heads, head_dim) for _ in range(3))
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        return (q, k, v, cu, cu.clone(), max(lengths), max(lengths)), {"causal": True}
    return make


def _kvcache(batch, cache, heads, head_dim):
    def make(g):
        q, k_new, v_new = (_randn(g, batch, 1, heads, head_dim) for _ in range(3))
        k_cache, v_cache = (_randn(g, batch, cache, heads, head_dim) for _ in range(2))
        lengths = torch.randint(1, cache, (batch,), generator=g, dtype=torch.int32)
        return (q, k_cache, v_cache, lengths, k_new, v_new), {}
    return make


def _layer_norm(rows, hidden):
    def make(g):
        return (_randn(g, rows, hidden), _randn(g, rows, hidden), 1 + 0.1 * _randn(g, hidden),
                0.1 * _randn(g, hidden)), {}
    return make


def _bias_gelu(rows, cols, approximate):
    def make(g):
        return (_randn(g, rows, cols), _randn(g, cols), approximate), {}
    return make


def _gelu_ffn(rows, d_in, d_ff):
    def make(g):
        return (_randn(g, rows, d_in), _randn(g, d_ff, d_in, scale=d_in ** -0.5), _randn(g, d_ff),
                _randn(g, d_in, d_ff, scale=d_ff ** -0.5), _randn(g, d_in)), {}
    return make


def _cross_entropy(rows, classes):
    def make(g):
        return (_randn(g, rows, classes, scale=3.0), _labels(g, rows, classes)), {}
    return make


def _masked_lm(rows, hidden, vocab):
    def make(g):
        return (_randn(g, rows, hidden), _randn(g, vocab, hidden, scale=hidden ** -0.5),
                _randn(g, vocab), _labels(g, rows, vocab, labelled=0.15)), {}
    return make


def _lstm(rows, cell):
    def make(g):
        return (_randn(g, rows, 4 * cell), _randn(g, rows, cell)), {"cell_clip": 3.0}
    return make


def _unpad(batch, seq, width):
    def make(g):
        return (_randn(g, batch, seq, width), _padding(g, batch, seq)), {}
    return make


def _pad(batch, seq, width):
    def make(g):
        keep = ~_padding(g, batch, seq)
        indices = torch.nonzero(keep.flatten()).flatten()
        return (_randn(g, indices.numel(), width), indices, batch, seq), {}
    return make


_RESIDENT, _WGMMA, _FFN_WGMMA = ("attention_resident",), ("attention_wgmma",), ("ffn_wgmma",)

SMALL = [
    Probe("attention", "padded, head dim 64", _attention(2, 3, 80, 64, masked=True), paths=_RESIDENT),
    Probe("attention", "causal, head dim 128", _attention(2, 2, 70, 128, causal=True), paths=_RESIDENT),
    Probe("attention", "seq 600 (streamed K/V)", _attention(1, 2, 600, 64), paths=_WGMMA),
    Probe("attention_varlen", "causal, 3 sequences", _varlen([37, 1, 70], 2, 64), paths=_RESIDENT),
    Probe("attention_with_kvcache", "decoding step", _kvcache(2, 24, 2, 64), differentiable=False),
    Probe("add_layer_norm", "hidden 256", _layer_norm(40, 256)),
    Probe("add_layer_norm", "hidden 100", _layer_norm(40, 100)),
    Probe("bias_gelu", "erf", _bias_gelu(64, 384, "none")),
    Probe("bias_gelu", "tanh", _bias_gelu(64, 384, "tanh")),
    Probe("gelu_ffn", "130 rows", _gelu_ffn(130, 128, 256), paths=_FFN_WGMMA),
    Probe("cross_entropy", "1000 classes", _cross_entropy(40, 1000)),
    Probe("masked_lm_loss", "vocab 1000", _masked_lm(60, 64, 1000)),
    Probe("lstm_cell", "cell 32", _lstm(16, 32)),
    Probe("unpad", "3 x 20", _unpad(3, 20, 64), differentiable=False),
    Probe("pad", "3 x 20", _pad(3, 20, 64)),
]

REAL = [
    Probe("attention", "BERT-base, padded 8 x 128", _attention(8, 12, 128, 64, masked=True),
          paths=_RESIDENT),
    Probe("attention", "GPT-2 small, causal 2 x 1024", _attention(2, 12, 1024, 64, causal=True),
          paths=_WGMMA),
    Probe("attention_varlen", "BERT-base, 8 sequences", _varlen([128, 77, 100, 64, 128, 90, 111, 70],
                                                                12, 64), paths=_RESIDENT),
    Probe("add_layer_norm", "BERT-base, 1024 x 768", _layer_norm(1024, 768)),
    Probe("bias_gelu", "BERT-base, 1024 x 3072", _bias_gelu(1024, 3072, "none")),
    Probe("gelu_ffn", "BERT-base, 1024 x 768 -> 3072", _gelu_ffn(1024, 768, 3072), paths=_FFN_WGMMA),
    Probe("cross_entropy", "GPT-2 small, 1024 x 50257", _cross_entropy(1024, 50257)),
    Probe("masked_lm_loss", "BERT-base, 1024 x 768 -> 30522", _masked_lm(1024, 768, 30522)),
    Probe("lstm_cell", "ELMo, 64 x 4096", _lstm(64, 4096)),
]


PROBED = frozenset(p.op for p in SMALL)  # the ops that have probes


def probes(op: str, size: str = "small") -> list:
    """The probes of ``op`` at ``size`` ("small" or "real")."""
    return [p for p in (SMALL if size == "small" else REAL) if p.op == op]


def _floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _leaves(outputs) -> list:
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _relative_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not got.is_floating_point():
        return 0.0 if torch.equal(got.cpu(), ref) else math.inf
    got = got.detach().to("cpu", torch.float64)
    if not torch.isfinite(got).all():
        return math.inf
    scale = ref.norm().item()
    return (got - ref).norm().item() / (scale if scale > 0 else 1.0)


@contextlib.contextmanager
def _no_autocast():
    with contextlib.ExitStack() as stack:
        for device_type in ("cpu", "cuda"):
            if torch.amp.is_autocast_available(device_type):
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


class _Call:
    """A probe's inputs on ``device`` in ``dtype`` (floating tensors rounded to it, those
    taking gradients as leaves), and one forward and backward of ``fn`` over them."""

    def __init__(self, probe: Probe, device, dtype, generator: torch.Generator):
        args, kwargs = probe.make(generator)
        self.args = [a.to(device, dtype) if _floating(a)
                     else a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        self.kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                       for k, v in kwargs.items()}
        self.grad_of = [i for i, a in enumerate(args) if _floating(a)] if probe.differentiable else []
        for i in self.grad_of:
            self.args[i].requires_grad_()

    def __call__(self, fn: Callable, upstream=None) -> tuple:
        """(outputs, gradients of the floating inputs), in the inputs' dtype whatever autocast
        or inference mode the caller is in. ``upstream``: the outputs' gradients, a function
        of the outputs that gives them, or None (ones)."""
        with torch.inference_mode(False), torch.enable_grad(), _no_autocast():
            out = _leaves(fn(*self.args, **self.kwargs))
            if callable(upstream):
                upstream = upstream(out)
            elif upstream is None:
                upstream = [torch.ones_like(o) if _floating(o) else None for o in out]
            pairs = [(o, u) for o, u in zip(out, upstream) if u is not None and o.requires_grad]
            grads = []
            if self.grad_of and pairs:
                grads = torch.autograd.grad(
                    [o for o, _ in pairs], [self.args[i] for i in self.grad_of],
                    [u.to(o.device, o.dtype) for o, u in pairs], allow_unused=True)
        return out, list(grads)


def run(probe: Probe, backend: str, device: torch.device, dtype: torch.dtype,
        seed: int = 0) -> Outcome:
    """The probe on ``backend`` in ``dtype`` on ``device``, against the float64 reference
    computed on the CPU from the same inputs."""
    import fusedlm.ops as ops
    from fusedlm.ops import reference

    call = _Call(probe, device, dtype, torch.Generator().manual_seed(seed))
    ref_call = _Call(probe, "cpu", dtype, torch.Generator().manual_seed(seed))
    ref_call.args = [a.detach().double().requires_grad_(a.requires_grad) if _floating(a) else a
                     for a in ref_call.args]
    generator, upstream = torch.Generator().manual_seed(seed + 1), []

    def draw(outputs):  # random output gradients, the same for the backend's call
        upstream.extend(_randn(generator, *o.shape) if _floating(o) else None for o in outputs)
        return upstream

    ref_out, ref_grads = ref_call(getattr(reference, probe.op), draw)
    out, grads = call(lambda *a, **k: getattr(ops, probe.op)(*a, backend=backend, **k), upstream)

    measured = [(f"output {i}", _relative_error(o, r)) for i, (o, r) in enumerate(zip(out, ref_out))
                if isinstance(r, torch.Tensor)]
    measured += [(f"gradient of input {i}", _relative_error(g, r))
                 for i, g, r in zip(call.grad_of, grads, ref_grads) if r is not None and g is not None]
    measured += [(f"gradient of input {i}", math.inf)
                 for i, g, r in zip(call.grad_of, grads, ref_grads) if r is not None and g is None]
    worst, error = max(measured, key=lambda m: m[1])
    return Outcome(error, worst)


def time_ms(probe: Probe, device: torch.device, dtype: torch.dtype,
            backend: Optional[str] = None, rounds: int = 5) -> Optional[float]:
    """The median time of the probe's forward and backward on ``backend`` (None: in plain
    PyTorch, fusedlm.ops.reference's eager composition) after one call to warm up; None
    where plain PyTorch has no kernel for this dtype here."""
    import fusedlm.ops as ops
    from fusedlm.ops import reference

    fn = (getattr(reference, probe.op) if backend is None
          else lambda *a, **k: getattr(ops, probe.op)(*a, backend=backend, **k))
    call = _Call(probe, device, dtype, torch.Generator().manual_seed(0))
    times = []
    try:
        for _ in range(rounds + 1):
            start = time.perf_counter()
            call(fn)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append((time.perf_counter() - start) * 1e3)
    except (RuntimeError, NotImplementedError):
        if backend is not None:
            raise
        return None
    return statistics.median(times[1:])
