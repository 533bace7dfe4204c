"""The cpu backend: fusedlm's C++ kernels (csrc/), vectorised per instruction set."""
from .._extension import _C
from . import Backend, Kernel, register

BACKEND = register(
    Backend(
        "cpu",
        lambda: ("cpu",),
        lambda: None,
        {
            "bias_gelu": Kernel(_C.bias_gelu_forward, _C.bias_gelu_backward),
            "gelu_ffn": Kernel(_C.gelu_ffn_forward, _C.gelu_ffn_backward),
            "add_layer_norm": Kernel(_C.add_layer_norm_forward, _C.add_layer_norm_backward),
        },
    )
)


def capability() -> str:
    """The instruction set of the CPU kernels in use: baseline, avx2 or avx512."""
    return _C.cpu_capability()
