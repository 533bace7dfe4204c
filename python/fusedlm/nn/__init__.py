"""Drop-in modules: same constructor arguments, parameters and state_dict keys as
the torch.nn modules they replace, running on fusedlm's ops.

Their ops run on the backend chosen per call, or the one ``fusedlm.use_backend`` pins.
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
