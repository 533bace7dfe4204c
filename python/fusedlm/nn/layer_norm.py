"""LayerNorm: a drop-in for torch.nn.LayerNorm that can also fuse the residual add."""
import math
from typing import Optional, Union

from torch import Tensor, nn

from .. import ops
from ._autocast import norm_operands
from ._eager import EagerModule


class LayerNorm(EagerModule, nn.LayerNorm):
    """torch.nn.LayerNorm (same arguments, parameters and state_dict), on fusedlm's add_layer_norm.

    ``forward(x)`` returns the normalised x, as torch's does. ``forward(x, residual)``, with
    residual of x's shape (it is not broadcast), returns ``(layer_norm(x + residual),
    x + residual)`` in one pass over memory: the sum is what a pre-LN stack carries on as
    its residual stream. ``dropout_p`` drops elements of x before the add (a transformer
    layer's dropout on its branch).
    A bfloat16 or float16 x with float32 parameters is normalised in float32 and returned
    in x's dtype, as torch does (x is converted to float32 for the op). Under autocast
    the norm runs in, and returns, the widest dtype of its inputs and parameters.
    """

    def forward(self, x: Tensor, residual: Optional[Tensor] = None, *,
                dropout_p: float = 0.0) -> Union[Tensor, tuple]:
        shape = x.shape
        if shape[x.dim() - len(self.normalized_shape):] != self.normalized_shape:
            raise ValueError(f"x must end in normalized_shape {tuple(self.normalized_shape)}, "
                             f"got shape {tuple(shape)}")
        if residual is not None and residual.shape != shape:
            raise ValueError(f"residual must have x's shape {tuple(shape)}, got {tuple(residual.shape)}")
        flat, flat_residual, weight, bias = x, residual, self.weight, self.bias
        if len(self.normalized_shape) > 1:
            # Normalising over several trailing dims is normalising their flattened product.
            width = math.prod(self.normalized_shape)
            flat = x.reshape(*shape[: x.dim() - len(self.normalized_shape)], width)
            flat_residual = None if residual is None else residual.reshape(flat.shape)
            weight = None if weight is None else weight.reshape(width)
            bias = None if bias is None else bias.reshape(width)
        operands, dtype = norm_operands(flat, flat_residual, weight, bias)
        flat, flat_residual, weight, bias = operands
        out, summed = ops.add_layer_norm(flat, flat_residual, weight, bias, self.eps,
                                         dropout_p=dropout_p)
        out, summed = out.to(dtype), summed.to(dtype)
        if out.shape != shape:
            # Only then: the op's outputs are not views, and FSDP2 cannot follow in-place
            # changes to a view that a module returns.
            out, summed = out.view(shape), summed.view(shape)
        return out if residual is None else (out, summed)
