"""What an op declares of its probes (small problems on which verification checks a backend's
kernels against the reference, fusedlm.verify.probes): the :class:`Probe`, and the inputs
probes draw, in float64 on the CPU from the probe's own generator."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Probe:
    name: str
    # make(generator) -> (args, kwargs) in float64 on the CPU; integer tensors as they are.
    make: Callable[[torch.Generator], tuple]
    size: str = "small"  # or "real"
    differentiable: bool = True
    constant: tuple = ()  # positions of floating arguments that take no gradient
    # The cuda kernel paths (fusedlm.backends.cuda.paths()) this problem takes when they are
    # on: where it fails, turning one off shows whether that path is the broken one.
    paths: tuple = ()
    op: str = ""  # set by the op's declaration (fusedlm.ops._op.Op)

    @classmethod
    def real(cls, name: str, make: Callable, **options) -> "Probe":
        return cls(name, make, size="real", **options)


# The cuda kernel paths probes name.
# Attention up to 512 keys: the one-kernel backward first, then the resident walk.
RESIDENT, WGMMA = ("attention_fused_backward", "attention_resident"), ("attention_wgmma",)
# The FFN's cuBLAS path first: with it off, the fused product runs (on wgmma on sm_90).
FFN_PATHS = ("ffn_cublas", "ffn_wgmma")


def randn(g, *shape, scale=1.0):
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


def padding(g, batch, seq):
    """bool [batch, seq], True = padding; the first row whole, the others at least half."""
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    lengths[0] = seq
    return torch.arange(seq)[None, :] >= lengths[:, None]


def labels(g, rows, classes, labelled=0.5):
    """int64 [rows] in [0, classes), about ``labelled`` of them; the rest -100 (ignored)."""
    y = torch.randint(0, classes, (rows,), generator=g)
    y[torch.rand(rows, generator=g) >= labelled] = -100
    y[0] = classes - 1
    return y
