"""ULMFiT's fine-tuning recipe (Howard and Ruder, 2018) for the AWD-LSTM models:

- layer groups, as fastai splits the models (``awd_lstm_lm_split``, ``awd_lstm_clas_split``);
- discriminative learning rates: each group's rate is the one above it divided by 2.6;
- the slanted triangular schedule: a short linear rise (``cut_frac`` of the steps) to the
  peak, then a long linear fall to peak / ``ratio``;
- gradual unfreezing: the top group trains first, one more group each stage;
- fastai's optimizer settings: AdamW (beta1 0.7 as the paper's, beta2 0.99, eps 1e-5,
  decoupled weight decay 0.01 on the matrices) and gradient norm clipping at 0.1.

    groups = layer_groups(model)
    optimizer = ulmfit_optimizer(model, lr=1e-2)
    schedule = slanted_triangular(optimizer, total_steps)
    for stage in range(1, len(groups) + 1):
        unfreeze_top(model, stage)
        ...  # an epoch: loss.backward(); clip_grad_norm_(model.parameters(), CLIP);
             # optimizer.step(); schedule.step()
"""
import math
from typing import Optional

import torch
from torch import nn

from .awd_lstm import AWDLSTMForLanguageModeling, AWDLSTMForSequenceClassification, AWDLSTMModel

DISCRIMINATIVE_FACTOR = 2.6
CUT_FRAC, RATIO = 0.1, 32
BETAS, EPS, WEIGHT_DECAY = (0.7, 0.99), 1e-5, 0.01
CLIP = 0.1


def layer_groups(model: nn.Module) -> list:
    """The model's parameters in groups from the bottom up: a language model's LSTM
    layers, then its embedding with the decoder; a classifier's embedding, its LSTM layers,
    then its heads (each group holds both directions' parts)."""
    encoder = model if isinstance(model, AWDLSTMModel) else getattr(model, "awd_lstm", None)
    if encoder is None:
        raise TypeError(f"layer_groups takes an AWD-LSTM model, got {type(model).__name__}")
    lstms = encoder.lstms
    embeddings = [p for lstm in lstms for p in lstm.encoder.parameters()]
    layers = [[p for lstm in lstms for p in lstm.rnns[i].parameters()]
              for i in range(encoder.config.n_layers)]
    if isinstance(model, AWDLSTMForLanguageModeling):
        return layers + [embeddings + list(model.decoders.parameters())]
    if isinstance(model, AWDLSTMForSequenceClassification):
        return [embeddings] + layers + [list(model.classifiers.parameters())]
    return [embeddings] + layers


def discriminative_lrs(lr: float, groups: int, factor: float = DISCRIMINATIVE_FACTOR) -> list:
    """The learning rate of each of ``groups`` groups, bottom up: ``lr`` for the top one,
    each one below divided by ``factor``."""
    return [lr / factor ** (groups - 1 - i) for i in range(groups)]


def ulmfit_optimizer(model: nn.Module, lr: float, factor: float = DISCRIMINATIVE_FACTOR,
                     betas: tuple = BETAS, eps: float = EPS,
                     weight_decay: float = WEIGHT_DECAY) -> torch.optim.AdamW:
    """AdamW over the layer groups at discriminative rates (weight decay on matrices only:
    not on biases or batch norms, as fastai's default)."""
    groups = layer_groups(model)
    param_groups = []
    for params, group_lr in zip(groups, discriminative_lrs(lr, len(groups), factor)):
        for decay in (True, False):
            chosen = [p for p in params if (p.dim() >= 2) == decay]
            if chosen:
                param_groups.append({"params": chosen, "lr": group_lr,
                                     "weight_decay": weight_decay if decay else 0.0})
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps)


def slanted_triangular(optimizer: torch.optim.Optimizer, total_steps: int, cut_frac: float = CUT_FRAC,
                       ratio: float = RATIO) -> torch.optim.lr_scheduler.LambdaLR:
    """The slanted triangular schedule over ``total_steps`` steps, as a factor of each
    group's rate: from 1 / ratio up to 1 at step floor(total_steps * cut_frac), then down
    to 1 / ratio at the last step (the paper's equation 3)."""
    if total_steps < 1 or not 0 < cut_frac < 1 or ratio < 1:
        raise ValueError(f"slanted_triangular needs total_steps >= 1, 0 < cut_frac < 1 and "
                         f"ratio >= 1, got {total_steps}, {cut_frac}, {ratio}")
    cut = max(math.floor(total_steps * cut_frac), 1)

    def factor(step: int) -> float:
        t = min(step, total_steps)
        if t < cut:
            p = t / cut
        else:
            p = 1 - (t - cut) / max(cut * (1 / cut_frac - 1), 1)
        return (1 + max(p, 0.0) * (ratio - 1)) / ratio

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def unfreeze_top(model: nn.Module, groups: Optional[int]) -> None:
    """Gradual unfreezing: only the top ``groups`` layer groups train (None: all)."""
    all_groups = layer_groups(model)
    keep = len(all_groups) if groups is None else max(min(groups, len(all_groups)), 1)
    for i, params in enumerate(all_groups):
        for p in params:
            p.requires_grad_(i >= len(all_groups) - keep)
