"""Rules for Hugging Face transformers models: BERT, RoBERTa, ELECTRA and GPT-2.

- self-attention: the module is unchanged, and the model runs the "fusedlm" attention
  implementation (hf/attention.py). transformers picks the implementation (of the
  attention and of the mask) from ``config._attn_implementation``, and one config
  object may serve several models, so the switch is made on a copy that every module
  of the patched model holding that config gets in its place: models sharing the
  original keep their implementation;
- BERT-style SelfOutput/Output and Intermediate, GPT-2's MLP: fused blocks
  (hf/layers.py) holding the same submodules;
- masked-LM and causal-LM models: the loss runs through the fused head (hf/heads.py).

Each rule matches one exact class of one model family. A module whose layout this
transformers release changed is left alone, with a reason naming the release.
"""
import copy
import importlib
import sys

import transformers
from torch import nn
from transformers import activations

from .. import PATCHED, Rule, register
from . import attention
from .heads import LMHead, bind
from .layers import AddNormOutput, GeluIntermediate, GeluMLP

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


def _add_norm(module: nn.Module):
    return _layout(module, "dense", "LayerNorm", "dropout") or AddNormOutput(
        module.dense, _handled(module.LayerNorm), module.dropout)


def _intermediate(module: nn.Module):
    why = _layout(module, "dense", "intermediate_act_fn")
    if why:
        return why
    approximate = _approximate(module.intermediate_act_fn)
    if approximate is None:
        return f"activation {type(module.intermediate_act_fn).__name__} is not a GELU fusedlm computes"
    return GeluIntermediate(module.dense, approximate)


def _gpt2_mlp(module: nn.Module):
    why = _layout(module, "c_fc", "c_proj", "act", "dropout")
    if why:
        return why
    approximate = _approximate(module.act)
    if approximate is None:
        return f"activation {type(module.act).__name__} is not a GELU fusedlm computes"
    return GeluMLP(module.c_fc, module.c_proj, module.dropout, approximate)


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


def _families():
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, MaskedLMOutput

    mlm_extras = ("hidden_states", "attentions")
    causal_extras = ("past_key_values", "hidden_states", "attentions", "cross_attentions")
    heads = {
        "BertForMaskedLM": (LMHead("bert", _bert_transform, lambda m: m.cls.predictions.decoder,
                                   MaskedLMOutput, mlm_extras), ("cls",)),
        "RobertaForMaskedLM": (LMHead("roberta", _roberta_transform, lambda m: m.lm_head.decoder,
                                      MaskedLMOutput, mlm_extras), ("lm_head",)),
        "ElectraForMaskedLM": (LMHead("electra", _electra_transform, lambda m: m.generator_lm_head,
                                      MaskedLMOutput, mlm_extras),
                               ("generator_predictions", "generator_lm_head")),
        "GPT2LMHeadModel": (LMHead("transformer", _gpt2_transform, lambda m: m.lm_head,
                                   CausalLMOutputWithCrossAttentions, causal_extras, causal=True),
                            ("lm_head",)),
    }
    blocks = {}
    for prefix in ("Bert", "Roberta", "Electra"):
        blocks[f"{prefix}SelfAttention"] = ("attention", _attention)
        blocks[f"{prefix}SelfOutput"] = ("dropout + residual add + LayerNorm", _add_norm)
        blocks[f"{prefix}Output"] = ("dropout + residual add + LayerNorm", _add_norm)
        blocks[f"{prefix}Intermediate"] = ("bias + GELU", _intermediate)
    blocks["GPT2Attention"] = ("attention", _attention)
    blocks["GPT2MLP"] = ("bias + GELU", _gpt2_mlp)
    return heads, blocks


def _model_module(class_name: str):
    family = {"Bert": "bert", "Roberta": "roberta", "Electra": "electra", "GPT2": "gpt2"}
    prefix = next(p for p in sorted(family, key=len, reverse=True) if class_name.startswith(p))
    return importlib.import_module(f"transformers.models.{family[prefix]}.modeling_{family[prefix]}")


def _register_all() -> None:
    heads, blocks = _families()
    for name, (what, replace) in blocks.items():
        cls = getattr(_model_module(name), name)
        register(Rule(f"{name} -> fusedlm {what}", lambda m, cls=cls: type(m) is cls, replace))
    for name, (head, attrs) in heads.items():
        cls = getattr(_model_module(name), name)
        register(Rule(f"{name} loss -> fusedlm masked_lm_loss", lambda m, cls=cls: type(m) is cls,
                      _head_rule(head, *attrs)))
    register(finish=_switch_configs)


_register_all()
