"""Running a stack of transformer layers: packed once, optionally checkpointed.

With padding, every layer of an encoder would spend work on tokens no one reads.
``run_stack`` packs the real tokens once (fusedlm.ops.unpad) before the first layer,
runs every layer on the packed [tokens, width] rows with varlen attention, and pads
once after the last. Outputs at padding positions are then zeros.

Each layer is called as ``step(layer, h, packing)`` (default ``layer(h, packing)``): ``h``
is [batch, seq, width], or [tokens, width] when ``packing`` = (cu_seqlens, max_seqlen) is
not None. With ``checkpointing`` (in training, with grad enabled) each call is
recomputed in the backward instead of keeping its activations; the recomputation
restores torch's RNG state, and with it the dropout seeds fusedlm drew in the forward.
"""
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .. import ops


def run_layers(layers: Sequence[nn.Module], h, *args, checkpointing: bool = False,
               step: Optional[Callable] = None, states: Optional[list] = None,
               record: Callable = lambda h: h):
    """h = step(layer, h, *args) for each layer in turn (checkpointed when asked, in
    training with grad enabled); ``record(h)`` of the input and of each layer's output is
    appended to ``states`` when it is a list. ``step`` defaults to ``layer(h, *args)``."""
    step = step or (lambda layer, h, *args: layer(h, *args))
    if states is not None:
        states.append(record(h))
    for layer in layers:
        if checkpointing and layer.training and torch.is_grad_enabled():
            h = checkpoint(step, layer, h, *args, use_reentrant=False, preserve_rng_state=True)
        else:
            h = step(layer, h, *args)
        if states is not None:
            states.append(record(h))
    return h


def padding_of(attention_mask: Optional[Tensor]) -> Optional[Tensor]:
    """transformers' attention_mask [batch, seq] (1 = token) -> bool padding mask (True =
    padding), or None when there is nothing to skip. Whether a batch has padding is
    data: torch.compile would break the graph to read it, and on a GPU reading it would
    synchronise the host with the device, so a compiled forward and one on a GPU pack
    every masked batch (the same result)."""
    if attention_mask is None:
        return None
    padding = attention_mask == 0
    if (attention_mask.device.type == "cpu" and not torch.compiler.is_compiling()
            and not bool(padding.any())):
        return None
    return padding


def run_stack(layers: Sequence[nn.Module], x: Tensor, padding_mask: Optional[Tensor] = None, *,
              step: Optional[Callable] = None, checkpointing: bool = False,
              output_hidden_states: bool = False) -> tuple:
    """x [batch, seq, width]; padding_mask bool [batch, seq], True = padding: the layers
    run on the packed tokens (or on x as it is when None). Returns (last hidden state
    [batch, seq, width], the stack's input and each layer's output as a tuple when
    ``output_hidden_states``, else None)."""
    batch, seq = x.shape[:2]
    packing, unpack = None, (lambda h: h)
    if padding_mask is not None:
        x, indices, cu_seqlens, max_seqlen = ops.unpad(x, padding_mask)
        packing = (cu_seqlens, max_seqlen)
        unpack = lambda h: ops.pad(h, indices, batch, seq)  # noqa: E731
    states = [] if output_hidden_states else None
    h = run_layers(layers, x, packing, checkpointing=checkpointing, step=step, states=states,
                   record=unpack)
    return unpack(h), None if states is None else tuple(states)
