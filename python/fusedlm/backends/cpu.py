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
            "cross_entropy": Kernel(_C.cross_entropy_forward, _C.cross_entropy_backward),
            "masked_lm_loss": Kernel(_C.masked_lm_loss_forward, _C.masked_lm_loss_backward),
            "attention": Kernel(_C.attention_forward, _C.attention_backward),
            "attention_varlen": Kernel(_C.attention_varlen_forward, _C.attention_varlen_backward),
            "attention_with_kvcache": Kernel(_C.attention_kvcache_forward),
            # unpad's backward is the pad op.
            "unpad": Kernel(_C.unpad_forward),
            "pad": Kernel(_C.pad_forward, _C.pad_backward),
            "add_layer_norm": Kernel(_C.add_layer_norm_forward, _C.add_layer_norm_backward),
            "lstm_cell": Kernel(_C.lstm_cell_forward, _C.lstm_cell_backward),
        },
    )
)


def capability() -> str:
    """The instruction set of the CPU kernels in use: baseline, avx2 or avx512."""
    return _C.cpu_capability()
