"""Language-model heads whose loss runs through fusedlm's masked_lm_loss.

The patched model keeps its class; its ``forward`` is replaced on the instance by
one that runs the base model and the head's transform as before, then:

- training with labels: the vocabulary projection and cross-entropy run fused,
  projecting only the labelled rows; ``logits`` is None (never built);
- otherwise: the logits are computed as before, and the loss (with labels) by
  fusedlm's cross_entropy from them.

Causal heads shift the labels one token left, as transformers' causal-LM loss does.
"""
import inspect
import types
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ... import nn as fused

IGNORE_INDEX = -100


@dataclass(frozen=True)
class LMHead:
    base: str  # attribute holding the base model
    transform: Callable[[nn.Module, Tensor], Tensor]  # (model, last hidden state) -> decoder input
    decoder: Callable[[nn.Module], nn.Linear]  # the vocabulary projection
    output: type  # transformers' output class; its fields but loss and logits are the base model's
    causal: bool = False


def bind(model: nn.Module, head: LMHead) -> None:
    # Positional arguments keep the meaning they have in the class's own forward.
    signature = inspect.signature(type(model).forward)
    names = list(signature.parameters)[1:]
    # hidden_states, attentions, the cache ...: named as this transformers release names them.
    extras = [f.name for f in fields(head.output) if f.name not in ("loss", "logits")]
    fused_losses, losses = {}, {}
    for reduction in ("mean", "sum"):
        fused_losses[reduction] = fused.LinearCrossEntropyLoss(IGNORE_INDEX, reduction)
        losses[reduction] = fused.CrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction=reduction)

    def forward(self, *args, **kwargs):
        kwargs.update(zip(names, args))
        labels = kwargs.pop("labels", None)
        return_dict = kwargs.pop("return_dict", None)
        keep = kwargs.pop("logits_to_keep", 0)
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        outputs = getattr(self, head.base)(**kwargs, return_dict=True)
        hidden = _keep(outputs[0], keep)
        hidden = head.transform(self, hidden)
        decoder = head.decoder(self)
        if labels is not None and head.causal:
            labels = shift_labels if shift_labels is not None else F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
        if labels is not None:
            labels = labels.to(hidden.device)
        # transformers' MLM heads take the mean over labelled tokens; its causal-LM loss
        # divides the sum by num_items_in_batch when given (gradient accumulation).
        reduction = "sum" if head.causal and num_items is not None else "mean"
        logits = loss = None
        if labels is not None and self.training and not _slices(keep):
            loss = fused_losses[reduction](hidden, decoder.weight, labels, decoder.bias)
        else:
            logits = decoder(hidden)
            if labels is not None:
                loss = losses[reduction](logits, labels)
        if loss is not None and reduction == "sum":
            loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
        output = head.output(loss=loss, logits=logits,
                             **{name: getattr(outputs, name, None) for name in extras})
        if return_dict is False or (return_dict is None and not getattr(self.config, "return_dict", True)):
            return output.to_tuple()
        return output

    # generate() reads the signature to decide which inputs (position_ids, ...) to pass.
    forward.__signature__ = signature
    model.forward = types.MethodType(forward, model)


def _slices(keep) -> bool:
    return torch.is_tensor(keep) or keep != 0


def _keep(hidden: Tensor, keep) -> Tensor:
    """transformers' logits_to_keep: the last ``keep`` positions (0 = all), or those indexed."""
    if torch.is_tensor(keep):
        return hidden[:, keep, :]
    return hidden[:, -keep:, :] if keep else hidden
