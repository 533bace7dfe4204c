"""Rules for torch.nn's modules."""
from torch import nn

from .. import nn as fused
from . import Rule, register


def _layer_norm(module: nn.LayerNorm, backend):
    new = fused.LayerNorm(module.normalized_shape, eps=module.eps,
                          elementwise_affine=module.elementwise_affine,
                          bias=module.bias is not None, device="meta")
    new.weight, new.bias = module.weight, module.bias  # the same Parameters: optimizers keep them
    return new


register(Rule("torch.nn.LayerNorm -> fusedlm.nn.LayerNorm", lambda m: type(m) is nn.LayerNorm,
              _layer_norm))
