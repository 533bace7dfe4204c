"""fastai's state-dict layouts of the AWD-LSTM models, both ways.

fastai names a language model ``0.`` (its AWD_LSTM) and ``1.decoder``; a classifier
``0.module.`` (the AWD_LSTM inside its SentenceEncoder) and ``1.layers.<block>`` (its
LinBnDrop blocks: batch norm ``0``, then dropout ``1`` where its rate is not 0, then the
linear layer); ``save_encoder`` writes the AWD_LSTM's own names. Its WeightDropout keeps
the hidden-to-hidden weight as ``weight_hh_l0_raw``; files of older fastai releases also
hold the dropped copy ``module.weight_hh_l0``, which fastai's own loader drops, as does
this one. The embedding appears twice (``encoder`` and ``encoder_dp.emb``, one tensor),
and a language model's decoder weight is the embedding too.
"""
from typing import Union

from torch import nn

# Where an AWD_LSTM's keys start in fastai's layouts: a classifier's, a language model's, its own.
ENCODER_PREFIXES = ("0.module.", "0.", "")


def _ours(model: nn.Module, direction: int) -> tuple:
    """(the prefix of direction's encoder in our state dict, of its head or None): the
    encoder model holds the LSTMs itself, a language model has decoders, a classifier
    classifiers."""
    root = "" if hasattr(model, "lstms") else "awd_lstm."
    head = None
    if hasattr(model, "decoders"):
        head = f"decoders.{direction}."
    elif hasattr(model, "classifiers"):
        head = f"classifiers.{direction}."
    return f"{root}lstms.{direction}.", head


def _names(model: nn.Module, direction: int, prefix: str) -> tuple:
    """({fastai key: our key} of one direction with its encoder at fastai's ``prefix``,
    {fastai key: the fastai key it copies} of the tensors fastai stores twice)."""
    encoder, head = _ours(model, direction)
    names = {f"{prefix}encoder.weight": f"{encoder}encoder.weight"}
    copies = {f"{prefix}encoder_dp.emb.weight": f"{prefix}encoder.weight"}
    for layer in range(model.config.n_layers):
        fa, ours = f"{prefix}rnns.{layer}.", f"{encoder}rnns.{layer}."
        names[f"{fa}weight_hh_l0_raw"] = f"{ours}weight_hh"
        copies[f"{fa}module.weight_hh_l0"] = f"{fa}weight_hh_l0_raw"
        for name in ("weight_ih", "bias_ih", "bias_hh"):
            names[f"{fa}module.{name}_l0"] = f"{ours}{name}"
    if hasattr(model, "decoders"):
        copies["1.decoder.weight"] = f"{prefix}encoder.weight"
        names["1.decoder.bias"] = f"{head}bias"
    elif hasattr(model, "classifiers"):
        for j, block in enumerate(model.classifiers[direction].layers):
            fa, ours = f"1.layers.{j}.", f"{head}layers.{j}."
            for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
                names[f"{fa}0.{name}"] = f"{ours}batch_norm.{name}"
            linear = 2 if block.dropout.p != 0 else 1
            names[f"{fa}{linear}.weight"] = f"{ours}linear.weight"
    return names, copies


def _directions(model, state_dicts, directions: tuple) -> list:
    n = len(directions)
    if isinstance(state_dicts, dict):
        state_dicts = (state_dicts,)
    if not isinstance(state_dicts, (tuple, list)) or len(state_dicts) != n:
        raise ValueError(f"state_dict must be {'a (forward, backward) pair of' if n > 1 else 'one'} "
                         f"fastai state dict{'s' if n > 1 else ''} for directions="
                         f"{model.config.directions!r}")
    # A checkpoint saved with its optimizer holds the weights under "model".
    return [sd["model"] if isinstance(sd.get("model"), dict) else sd for sd in state_dicts]


def load(model: nn.Module, state_dicts: Union[dict, tuple], strict: bool, directions: tuple) -> dict:
    """Loads fastai state dicts (one per name of ``directions``) into ``model``; returns the
    missing and unexpected keys (in fastai's names, prefixed with the direction when there
    are two)."""
    state = model.state_dict()
    missing, unexpected = [], []
    both = len(directions) > 1
    for d, sd in enumerate(_directions(model, state_dicts, directions)):
        tag = f"{directions[d]}:" if both else ""
        prefix = next((p for p in ENCODER_PREFIXES if f"{p}encoder.weight" in sd), None)
        if prefix is None:
            raise ValueError(f"state_dict{f' ({tag[:-1]})' if both else ''} holds no fastai "
                             "AWD_LSTM (no encoder.weight, 0.encoder.weight or "
                             "0.module.encoder.weight)")
        names, copies = _names(model, d, prefix)
        for fa, ours in names.items():
            if fa not in sd:
                missing.append(tag + fa)
                continue
            value = sd[fa]
            if tuple(value.shape) != tuple(state[ours].shape):
                raise ValueError(f"{tag}{fa} has shape {tuple(value.shape)}, but the config asks "
                                 f"for {tuple(state[ours].shape)}")
            state[ours] = value.detach().to(state[ours].dtype)
        unexpected += [tag + k for k in sd if k not in names and k not in copies]
    if strict and (missing or unexpected):
        raise ValueError(f"the fastai state dict does not match the model: missing "
                         f"{missing or 'none'}, unexpected {unexpected or 'none'}")
    model.load_state_dict(state)
    return {"missing_keys": missing, "unexpected_keys": unexpected}


def save(model: nn.Module, directions: tuple) -> Union[dict, tuple]:
    """fastai's state dict of each direction of ``model``, in the order fastai's modules
    list them (its loader for pretrained weights goes by that order)."""
    state = model.state_dict()
    prefix = model._fastai_encoder
    out = []
    for d in range(len(directions)):
        names, copies = _names(model, d, prefix)
        tensors = {fa: state[ours].detach().clone() for fa, ours in names.items()}
        ordered = {f"{prefix}encoder.weight": tensors[f"{prefix}encoder.weight"],
                   f"{prefix}encoder_dp.emb.weight": tensors[f"{prefix}encoder.weight"].clone()}
        for fa, value in tensors.items():
            if fa.startswith("1."):
                continue
            ordered.setdefault(fa, value)
        if "1.decoder.weight" in copies:
            ordered["1.decoder.weight"] = tensors[f"{prefix}encoder.weight"].clone()
        ordered.update((fa, value) for fa, value in tensors.items() if fa.startswith("1."))
        out.append(ordered)
    return out[0] if len(out) == 1 else tuple(out)
