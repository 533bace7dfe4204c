"""fusedlm's ops. Each is differentiable, registered with torch.library (so
torch.compile traces it without graph breaks), and runs on the backend chosen
by fusedlm.backends; ``backend=`` names one explicitly.

Conventions: key_padding_mask is bool [batch, seq_k] with True = padding; with
seq_q != seq_k, causal aligns to the bottom right; rows with every key masked
are zeros; dropout draws its seed from torch's generator.
"""
from . import reference
from .attention import attention, attention_varlen
from .attention_kvcache import attention_with_kvcache
from .cross_entropy import cross_entropy, masked_lm_loss
from .gelu import bias_gelu, gelu_ffn
from .layer_norm import add_layer_norm
from .lstm import lstm_cell
from .padding import pad, unpad

__all__ = [
    "reference", "attention", "attention_varlen", "attention_with_kvcache", "unpad", "pad",
    "bias_gelu", "gelu_ffn", "add_layer_norm", "cross_entropy", "masked_lm_loss", "lstm_cell",
]
