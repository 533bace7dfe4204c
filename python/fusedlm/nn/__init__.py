"""Drop-in modules: same constructor arguments, parameters and state_dict keys as
the torch.nn modules they replace, running on fusedlm's ops.

Each has a ``backend`` attribute (None: chosen per call) that pins its ops to one
backend; fusedlm.patch(model, backend=...) sets it.
"""
from .attention import MultiheadAttention
from .ffn import GeluFFN, is_plain_linear, linear_gelu_linear
from .layer_norm import LayerNorm
from .loss import CrossEntropyLoss, LinearCrossEntropyLoss
from .stack import padding_of, run_layers, run_stack
from .transformer import TransformerEncoder, TransformerEncoderLayer

__all__ = ["CrossEntropyLoss", "GeluFFN", "LayerNorm", "LinearCrossEntropyLoss",
           "MultiheadAttention", "TransformerEncoder", "TransformerEncoderLayer", "is_plain_linear",
           "linear_gelu_linear", "padding_of", "run_layers", "run_stack"]
