"""GeluFFN: Linear -> GELU -> dropout -> Linear on fusedlm's gelu_ffn."""
from typing import Optional

from torch import Tensor, nn

from .. import ops
from ._autocast import lower


class GeluFFN(nn.Module):
    """The transformer feed-forward block with bias+GELU fused into one op.

    Parameters are two ``nn.Linear`` (``fc1``: d_model -> d_ff, ``fc2``: d_ff -> d_out),
    so weights load from any Linear-GELU-Linear block. ``dropout`` applies to the
    activation between the two products, in training only. Under autocast the block
    runs in the autocast dtype, as torch's Linear layers would.
    """

    backend: Optional[str] = None  # pins the op to one backend; None chooses per call

    def __init__(self, d_model: int, d_ff: int, d_out: Optional[int] = None, *, approximate: str = "none",
                 dropout: float = 0.0, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff, bias=bias, device=device, dtype=dtype)
        self.fc2 = nn.Linear(d_ff, d_out or d_model, bias=bias, device=device, dtype=dtype)
        self.approximate = approximate
        self.dropout = dropout

    def forward(self, x: Tensor) -> Tensor:
        x, w1, b1, w2, b2 = lower(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias)
        return ops.gelu_ffn(x, w1, b1, w2, b2, approximate=self.approximate,
                            dropout_p=self.dropout if self.training else 0.0, backend=self.backend)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, dropout={self.dropout}"
