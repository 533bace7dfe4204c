"""The cpu backend: fusedlm's C++ kernels (csrc/), vectorised per instruction set.

An op's kernels are fusedlm._C.<op>_forward and <op>_backward, which the ops' routing
calls without Python (csrc/ops/route.h). They take every floating dtype (float64 for
gradcheck) and any shape.
"""
from .._extension import _C
from .registry import Backend, register


def _find(op):
    forward = getattr(_C, f"{op.name}_forward", None)
    if forward is None:
        return None
    return forward, getattr(_C, f"{op.name}_backward", None)


BACKEND = register(Backend("cpu", ("cpu",), None, _find, compiled=True))


def capability() -> str:
    """The instruction set of the CPU kernels in use: baseline, avx2 or avx512."""
    return _C.cpu_capability()
