"""The cpu backend: fusedlm's C++ kernels (csrc/), vectorised per instruction set.

Every op, every floating dtype (float64 for gradcheck), any shape.
"""
from .._extension import _C
from . import Backend, Kernel, register


def _kernel(op: str, forward: str = "forward", backward: str = "backward") -> Kernel:
    return Kernel(getattr(_C, f"{op}_{forward}"),
                  getattr(_C, f"{op}_{backward}") if backward else None)


BACKEND = register(Backend("cpu", ("cpu",), None, {
    "bias_gelu": _kernel("bias_gelu"),
    "gelu_ffn": _kernel("gelu_ffn"),
    "cross_entropy": _kernel("cross_entropy"),
    "masked_lm_loss": _kernel("masked_lm_loss"),
    "attention": _kernel("attention"),
    "attention_varlen": _kernel("attention_varlen"),
    "attention_with_kvcache": _kernel("attention_kvcache", backward=None),
    "unpad": _kernel("unpad", backward=None),  # its backward is the pad op
    "pad": _kernel("pad"),
    "add_layer_norm": _kernel("add_layer_norm"),
    "lstm_cell": _kernel("lstm_cell"),
}))


def capability() -> str:
    """The instruction set of the CPU kernels in use: baseline, avx2 or avx512."""
    return _C.cpu_capability()
