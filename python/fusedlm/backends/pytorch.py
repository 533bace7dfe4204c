"""The torch backend: each op as PyTorch's own composition, in the inputs' dtype, on any
device: what users run without fusedlm (scaled_dot_product_attention, cuBLAS products and
eager elementwise passes, layer_norm, cross_entropy).

It is the yardstick fusedlm's kernels must beat on a GPU: timing at first use
(fusedlm.verify.tuning) measures it beside them, and an automatic choice goes to it where
it is faster. Where no fusedlm kernel can take a call, it runs the call rather than the
reference, which computes in float32 or wider and is slower.

An op declares its composition in its own file (fusedlm/ops/<op>.py) with the arguments
of the op's kernels; it returns the op's forward outputs (None for those only a backward
kernel reads) as tensors autograd records, so it needs no backward kernel, and it draws
dropout from torch's generator. Every op has one, so that ``use_backend("torch")`` runs a
whole model as plain PyTorch would.
"""
from .registry import Backend, register


def _find(op):
    return None if op.composition is None else (op.composition, None)


BACKEND = register(Backend("torch", ("any",), None, _find, composed=True))
