"""Drop-in modules: same constructor arguments, parameters and state_dict keys as
the torch.nn modules they replace, running on fusedlm's ops."""
from .ffn import GeluFFN
from .layer_norm import LayerNorm
from .loss import CrossEntropyLoss, LinearCrossEntropyLoss

__all__ = ["CrossEntropyLoss", "GeluFFN", "LayerNorm", "LinearCrossEntropyLoss"]
