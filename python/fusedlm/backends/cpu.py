"""The cpu backend: fusedlm's C++ kernels (csrc/), vectorised per instruction set.

An op's kernels are fusedlm._C.<op>_forward and <op>_backward, and <op>_autograd and
<op>_eager where its autograd node and its eager lane (fusedlm.backends.Kernel) are written
in C++ too. They take every floating dtype (float64 for
gradcheck) and any shape.
"""
from .._extension import _C
from . import Backend, register


def _find(op):
    forward = getattr(_C, f"{op.name}_forward", None)
    if forward is None:
        return None
    return (forward, *(getattr(_C, f"{op.name}_{part}", None)
                       for part in ("backward", "autograd", "eager")))


BACKEND = register(Backend("cpu", ("cpu",), None, _find))


def capability() -> str:
    """The instruction set of the CPU kernels in use: baseline, avx2 or avx512."""
    return _C.cpu_capability()
