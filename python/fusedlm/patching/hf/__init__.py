"""Rules for Hugging Face transformers models: BERT, RoBERTa, ELECTRA, DistilBERT, ALBERT
and GPT-2.

- self-attention: the module is unchanged, and the model runs the "fusedlm" attention
  implementation (hf_attention.py). transformers picks the implementation (of the
  attention and of the mask) from ``config._attn_implementation``, and one config
  object may serve several models, so the switch is made on a copy that every module
  of the patched model holding that config gets in its place: models sharing the
  original keep their implementation;
- BERT-style SelfOutput/Output and Intermediate, GPT-2's MLP, DistilBERT's
  TransformerBlock, ALBERT's AlbertAttention and AlbertLayer (one object that every layer
  of its group runs, so it is fused once): fused blocks (hf/layers.py) holding the same
  submodules;
- masked-LM and causal-LM models: the loss runs through the fused head (hf/heads.py).

transformers records hidden_states and attentions by hooks on the modules of the classes a
model names in ``_can_record_outputs``, found by ``isinstance``: a fused block that takes
the place of one derives from its class (hf/layers.py), and patching drops the hooks a
model already has, so that transformers installs them anew on the patched modules.

Each rule matches one exact class of one model family. A module whose layout this
transformers release changed is left alone, with a reason naming the release.
"""
import copy
import importlib
import sys

import transformers
from torch import nn
from transformers import activations

from ..rules import PATCHED, Rule, register
from .. import hf_attention as attention
from .heads import LMHead, bind
from .layers import (AddNormOutput, AlbertAttentionAddNorm, AlbertFusedLayer, DistilBertBlock,
                     GeluIntermediate, GeluMLP)

try:  # transformers 5 hooks the modules it records outputs from, once per model
    from transformers.utils import output_capturing
except ImportError:  # earlier releases wrap them for the length of each call
    output_capturing = None

VERSION = transformers.__version__
_ATTENTION_UNAVAILABLE = attention.register()
# Implementations fusedlm takes over; others (flash, flex, paged) were chosen on purpose.
_REPLACEABLE = (None, "eager", "sdpa", attention.NAME)
_GELU = {"GELUActivation": "none", "NewGELUActivation": "tanh", "GELUTanh": "tanh",
         "PytorchGELUTanh": "tanh"}


def _layout(module: nn.Module, *attrs: str):
    """None when module has every attribute the fused version reads, else why it is left alone."""
    missing = [a for a in attrs if not hasattr(module, a)]
    if missing:
        return (f"transformers {VERSION}: {type(module).__name__} has no {', '.join(missing)} "
                f"(fusedlm knows the layout of transformers 4.53 to 5.x)")
    return None


def _approximate(act):
    """The GELU flavour an activation module computes exactly, or None."""
    name = type(act).__name__
    if getattr(activations, name, None) is type(act):
        return _GELU.get(name)
    return None


def _attention(module: nn.Module):
    config = module.config
    if _ATTENTION_UNAVAILABLE:
        return _ATTENTION_UNAVAILABLE
    if getattr(module, "is_cross_attention", False) or getattr(config, "add_cross_attention", False):
        return "cross-attention configs are not supported"
    if getattr(config, "is_decoder", False) and not getattr(module, "is_causal", False):
        return "decoder configs of an encoder model are not supported"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"relative position embeddings ({config.position_embedding_type}) are not supported"
    if getattr(config, "output_attentions", False):
        # (a call's output_attentions=True is served: see attention.attention_forward)
        return "config.output_attentions is set, which transformers allows with eager attention only"
    current = config._attn_implementation
    if current not in _REPLACEABLE:
        return f"attn_implementation {current!r} was chosen explicitly"
    setattr(module, attention.MARK, True)
    return module


def _switch_configs(model: nn.Module) -> None:
    """Gives the configs of the attention modules patched to fusedlm's implementation
    the name "fusedlm", each on a copy that replaces it in every module of ``model``."""
    configs = {id(m.config): m.config for m in model.modules()
               if hasattr(m, attention.MARK) and m.config._attn_implementation != attention.NAME}
    copies = {}
    for key, config in configs.items():
        copies[key] = copy.deepcopy(config)  # its sub-configs too: the name is set on them
        copies[key]._attn_implementation = attention.NAME
    for module in model.modules():
        own = copies.get(id(vars(module).get("config")))
        if own is not None:
            module.config = own


def _drop_output_hooks(model: nn.Module) -> None:
    """Removes the hooks transformers installed to record ``model``'s outputs, and its mark
    that they are installed: they sit on the modules the model had before patching, some
    of which are gone, and transformers installs them anew at the next call asking for
    outputs, on the patched modules."""
    if output_capturing is None:
        return
    for module in model.modules():
        hooks = module._forward_hooks
        for key in [k for k, hook in hooks.items()
                    if getattr(hook, "__module__", None) == output_capturing.__name__]:
            del hooks[key]
        vars(module).pop("_output_capturing_hooks_installed", None)


def _add_norm(module: nn.Module):
    return _layout(module, "dense", "LayerNorm", "dropout") or AddNormOutput(
        module.dense, _handled(module.LayerNorm), module.dropout)


def _gelu_of(act: nn.Module):
    """(approximate, None), or (None, why) for an activation that is not a GELU fusedlm computes."""
    approximate = _approximate(act)
    if approximate is None:
        return None, f"activation {type(act).__name__} is not a GELU fusedlm computes"
    return approximate, None


def _intermediate(module: nn.Module):
    why = _layout(module, "dense", "intermediate_act_fn")
    if why:
        return why
    approximate, why = _gelu_of(module.intermediate_act_fn)
    return why or GeluIntermediate(module.dense, approximate)


def _distilbert_block(module: nn.Module):
    why = (_layout(module, "attention", "sa_layer_norm", "ffn", "output_layer_norm")
           or _layout(module.ffn, "lin1", "lin2", "activation", "dropout"))
    if why:
        return why
    if getattr(module.ffn, "chunk_size_feed_forward", 0):
        return "chunk_size_feed_forward is set (the fused FFN runs whole)"
    approximate, why = _gelu_of(module.ffn.activation)
    if why:
        return why
    _handled(module.sa_layer_norm)
    _handled(module.output_layer_norm)
    return DistilBertBlock(module, approximate)


def _albert_attention(module: nn.Module):
    why = _layout(module, "query", "key", "value", "dense", "LayerNorm", "attention_dropout",
                  "output_dropout", "attention_head_size", "scaling")
    if why:
        return why
    checked = _attention(module)
    if isinstance(checked, str):
        return checked
    fused = AlbertAttentionAddNorm(module)
    setattr(fused, attention.MARK, True)
    _handled(module.LayerNorm)
    return fused


def _albert_layer(module: nn.Module):
    why = _layout(module, "attention", "ffn", "ffn_output", "activation", "full_layer_layer_norm")
    if why:
        return why
    if getattr(module, "chunk_size_feed_forward", 0):
        return "chunk_size_feed_forward is set (the fused FFN runs whole)"
    approximate, why = _gelu_of(module.activation)
    if why:
        return why
    _handled(module.full_layer_layer_norm)
    return AlbertFusedLayer(module, approximate)


def _gpt2_mlp(module: nn.Module):
    why = _layout(module, "c_fc", "c_proj", "act", "dropout")
    if why:
        return why
    approximate, why = _gelu_of(module.act)
    return why or GeluMLP(module.c_fc, module.c_proj, module.dropout, approximate)


def _handled(layer_norm: nn.LayerNorm) -> nn.LayerNorm:
    """Marks a LayerNorm a fused block reads the parameters of, so that no rule swaps it."""
    setattr(layer_norm, PATCHED, True)
    return layer_norm


def _head_rule(head: LMHead, *attrs: str):
    def replace(model: nn.Module):
        why = _layout(model, head.base, *attrs)
        if why:
            return why
        bind(model, head)
        return model
    return replace


def _bert_transform(model, hidden):
    return model.cls.predictions.transform(hidden)


def _roberta_transform(model, hidden):
    head = model.lm_head
    gelu = sys.modules[type(head).__module__].gelu
    return head.layer_norm(gelu(head.dense(hidden)))


def _electra_transform(model, hidden):
    return model.generator_predictions(hidden)


def _gpt2_transform(model, hidden):
    return hidden


def _distilbert_transform(model, hidden):
    return model.vocab_layer_norm(model.activation(model.vocab_transform(hidden)))


def _albert_transform(model, hidden):
    head = model.predictions
    return head.LayerNorm(head.activation(head.dense(hidden)))


def _families():
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, MaskedLMOutput

    heads = {
        "BertForMaskedLM": (LMHead("bert", _bert_transform, lambda m: m.cls.predictions.decoder,
                                   MaskedLMOutput), ("cls",)),
        "RobertaForMaskedLM": (LMHead("roberta", _roberta_transform, lambda m: m.lm_head.decoder,
                                      MaskedLMOutput), ("lm_head",)),
        "ElectraForMaskedLM": (LMHead("electra", _electra_transform, lambda m: m.generator_lm_head,
                                      MaskedLMOutput),
                               ("generator_predictions", "generator_lm_head")),
        "GPT2LMHeadModel": (LMHead("transformer", _gpt2_transform, lambda m: m.lm_head,
                                   CausalLMOutputWithCrossAttentions, causal=True),
                            ("lm_head",)),
        "DistilBertForMaskedLM": (LMHead("distilbert", _distilbert_transform,
                                         lambda m: m.vocab_projector, MaskedLMOutput),
                                  ("vocab_transform", "activation", "vocab_layer_norm",
                                   "vocab_projector")),
        "AlbertForMaskedLM": (LMHead("albert", _albert_transform, lambda m: m.predictions.decoder,
                                     MaskedLMOutput), ("predictions",)),
    }
    add_norm = "dropout + residual add + LayerNorm"
    blocks = {}
    for prefix in ("Bert", "Roberta", "Electra"):
        blocks[f"{prefix}SelfAttention"] = ("attention", _attention)
        blocks[f"{prefix}SelfOutput"] = (add_norm, _add_norm)
        blocks[f"{prefix}Output"] = (add_norm, _add_norm)
        blocks[f"{prefix}Intermediate"] = ("bias + GELU", _intermediate)
    blocks["DistilBertSelfAttention"] = ("attention", _attention)
    blocks["DistilBert:TransformerBlock"] = (f"{add_norm} twice, bias + GELU", _distilbert_block)
    blocks["AlbertAttention"] = (f"attention, {add_norm}", _albert_attention)
    blocks["AlbertLayer"] = ("bias + GELU, residual add + LayerNorm", _albert_layer)
    blocks["GPT2Attention"] = ("attention", _attention)
    blocks["GPT2MLP"] = ("bias + GELU", _gpt2_mlp)
    return heads, blocks


_FAMILIES = {"Bert": "bert", "Roberta": "roberta", "Electra": "electra", "DistilBert": "distilbert",
             "Albert": "albert", "GPT2": "gpt2"}


def _model_class(name: str):
    """transformers' class ``name``, of the family its prefix names; "Family:Class" for a
    class whose name has no family prefix (DistilBERT's TransformerBlock)."""
    prefix, _, bare = name.rpartition(":")
    family = _FAMILIES[prefix] if prefix else next(
        _FAMILIES[p] for p in sorted(_FAMILIES, key=len, reverse=True) if name.startswith(p))
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, bare)


def _register_all() -> None:
    heads, blocks = _families()
    for name, (what, replace) in blocks.items():
        cls = _model_class(name)
        register(Rule(f"{cls.__name__} -> fusedlm {what}", lambda m, cls=cls: type(m) is cls,
                      replace))
    for name, (head, attrs) in heads.items():
        cls = _model_class(name)
        register(Rule(f"{name} loss -> fusedlm masked_lm_loss", lambda m, cls=cls: type(m) is cls,
                      _head_rule(head, *attrs)))
    register(finish=_switch_configs)
    register(finish=_drop_output_hooks)


_register_all()
