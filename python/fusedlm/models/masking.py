"""BERT's masking recipe, drawn afresh for every batch (dynamic masking, as RoBERTa).

Each real token (not special, not padding) is selected with probability
``probability``; a selected token becomes [MASK] with probability ``mask_fraction``,
a uniformly random token with probability ``random_fraction``, and stays as it was
otherwise. Labels hold the original ids at selected positions and -100 elsewhere.
"""
from typing import Iterable, Optional

import torch
from torch import Tensor

IGNORE_INDEX = -100


def mask_tokens(input_ids: Tensor, *, mask_token_id: int, vocab_size: int,
                special_token_ids: Iterable[int] = (), attention_mask: Optional[Tensor] = None,
                probability: float = 0.15, mask_fraction: float = 0.8, random_fraction: float = 0.1,
                generator: Optional[torch.Generator] = None) -> tuple:
    """(masked input_ids, labels), both [batch, seq] int64 on input_ids' device.

    ``attention_mask`` (1 = token) marks padding, which is never selected; so are the
    ``special_token_ids`` ([CLS], [SEP], [PAD], ...). ``generator`` makes the draw
    reproducible; it may live on the CPU for tensors elsewhere.
    """
    if not isinstance(input_ids, Tensor) or input_ids.is_floating_point():
        raise TypeError(f"input_ids must be an integer tensor, got "
                        f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}, got "
                         f"{tuple(attention_mask.shape)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if (isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int)
            or not 0 <= mask_token_id < vocab_size):
        raise ValueError(f"mask_token_id must be an int in [0, vocab_size), got {mask_token_id!r}")
    for name, value in (("probability", probability), ("mask_fraction", mask_fraction),
                        ("random_fraction", random_fraction)):
        if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a float in [0, 1], got {value!r}")
    if mask_fraction + random_fraction > 1.0:
        raise ValueError(f"mask_fraction + random_fraction must be at most 1, got "
                         f"{mask_fraction} + {random_fraction}")

    device = input_ids.device
    draw_device = generator.device if generator is not None else device

    def uniform() -> Tensor:
        return torch.rand(input_ids.shape, generator=generator, device=draw_device).to(device)

    special = torch.tensor(list(special_token_ids), dtype=input_ids.dtype, device=device)
    candidates = ~torch.isin(input_ids, special)
    if attention_mask is not None:
        candidates &= attention_mask.bool()
    selected = candidates & (uniform() < probability)
    labels = torch.where(selected, input_ids, IGNORE_INDEX)

    choice = uniform()
    to_mask = selected & (choice < mask_fraction)
    to_random = selected & (choice >= mask_fraction) & (choice < mask_fraction + random_fraction)
    random_ids = torch.randint(vocab_size, input_ids.shape, generator=generator, device=draw_device)
    masked = torch.where(to_mask, mask_token_id, input_ids)
    masked = torch.where(to_random, random_ids.to(device, input_ids.dtype), masked)
    return masked.long(), labels.long()
