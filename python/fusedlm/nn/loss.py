"""Cross-entropy losses on fusedlm's fused softmax/cross-entropy."""
import warnings
from typing import Optional

import torch.nn.functional as F
from torch import Tensor, nn

from .. import ops
from ._autocast import lower
from ._eager import EagerModule


class CrossEntropyLoss(EagerModule, nn.CrossEntropyLoss):
    """torch.nn.CrossEntropyLoss (same arguments) on fusedlm.ops.cross_entropy.

    Logits are ``[N, C]`` or ``[..., C]`` with class-index targets. A class ``weight``
    is not fused: that case runs torch's own cross-entropy, and says so once.
    Unlike torch, a mean over no labelled targets is 0, not NaN.
    """

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        if self.weight is not None or target.is_floating_point():
            warnings.warn("fusedlm CrossEntropyLoss: class weights or probability targets run on "
                          "torch's unfused cross-entropy", stacklevel=2)
            return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                                   reduction=self.reduction, label_smoothing=self.label_smoothing)
        return ops.cross_entropy(input, target, ignore_index=self.ignore_index,
                                 label_smoothing=self.label_smoothing, reduction=self.reduction)


class LinearCrossEntropyLoss(EagerModule, nn.Module):
    """The projection and loss of a language-model head, fused: ``forward(hidden, weight,
    labels, bias=None)`` equals ``F.cross_entropy(hidden @ weight.T + bias, labels)`` but
    projects only the labelled rows, a chunk at a time, and never builds the full logits.

    ``weight`` is ``[vocab, hidden]`` (e.g. the tied word embeddings). Under autocast
    the projection runs in the autocast dtype and the loss in float32, as torch's would.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing

    def forward(self, hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor] = None) -> Tensor:
        hidden, weight, bias = lower(hidden, weight, bias)
        return ops.masked_lm_loss(hidden, weight, bias, labels, ignore_index=self.ignore_index,
                                  label_smoothing=self.label_smoothing, reduction=self.reduction)

    def extra_repr(self) -> str:
        return f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
