"""fusedlm.patch keeps every output of a transformers model: for each supported family and
each of its base and task classes, the patched model returns the unpatched one's
hidden_states, attentions and return_dict=False tuple on a padded batch.

transformers (5.x) records hidden_states and attentions by hooks on the modules of the
classes a model names in ``_can_record_outputs``; a fused block that takes the place of
one must still be found, and a model already hooked before patching must be hooked anew.
The classes come from transformers' own list of each family, so a class it adds, or a
change in how it records outputs, fails here."""
import copy
import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fusedlm  # noqa: E402

VOCAB, SEQ, PAD = 50, 8, 1
LENGTHS = (SEQ, SEQ - 3, 3)  # right-padded rows of mixed lengths
BASES = {"bert": "BertModel", "roberta": "RobertaModel", "electra": "ElectraModel",
         "distilbert": "DistilBertModel", "albert": "AlbertModel", "gpt2": "GPT2Model"}
FAMILIES = tuple(BASES)


def _classes(family):
    """The family's base and task model classes, by name, as transformers exports them."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    exported = [getattr(module, name) for name in module.__all__]
    return [cls.__name__ for cls in exported
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
            and not cls.__name__.endswith("PreTrainedModel")]


CASES = [(family, name) for family in FAMILIES for name in _classes(family)]


def _config(family, name):
    # Eager attention: the unpatched model returns attention weights with no other.
    common = dict(vocab_size=VOCAB, pad_token_id=PAD, attn_implementation="eager")
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=16, **common)
    if family == "distilbert":
        return transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                             max_position_embeddings=16, **common)
    cls = {"bert": transformers.BertConfig, "roberta": transformers.RobertaConfig,
           "electra": transformers.ElectraConfig, "albert": transformers.AlbertConfig}[family]
    if family in ("electra", "albert"):
        common["embedding_size"] = 16
    # An encoder family's causal-LM class is meant to run as a decoder.
    causal = name.endswith(("LMHeadModel", "ForCausalLM"))
    return cls(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=16, is_decoder=causal, **common)


def _batch(name):
    """(input_ids, attention_mask): [batch, choices, seq] for the classes that score
    choices, else [batch, seq]; padded rows hold PAD."""
    choices = "MultipleChoice" in name or "DoubleHeads" in name
    rows = 2 * len(LENGTHS) if choices else len(LENGTHS)
    lengths = torch.tensor(LENGTHS).repeat(rows // len(LENGTHS))
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    ids = torch.randint(PAD + 1, VOCAB, (rows, SEQ)).masked_fill(mask == 0, PAD)
    shape = (len(LENGTHS), 2, SEQ) if choices else (rows, SEQ)
    return ids.view(shape), mask.view(shape)


def _at_real_tokens(tensor, mask):
    """``tensor``'s entries at real tokens, where it has a token axis: [..., seq, ...] laid
    as the inputs, as their rows ([rows, seq, ...]), or per head ([rows, heads, seq, ...]:
    attention weights at real queries, cached keys and values)."""
    real = mask.bool()
    rows = real.view(-1, SEQ)
    if tensor.shape[:real.dim()] == real.shape:
        return tensor[real]
    if tensor.shape[:2] == rows.shape:
        return tensor[rows]
    if tensor.dim() == 4 and (tensor.shape[0], tensor.shape[2]) == rows.shape:
        return tensor.transpose(1, 2)[rows]
    return tensor


def _assert_same(actual, expected, mask, name):
    """The same structure, and the same values at real tokens."""
    if isinstance(expected, transformers.Cache):
        assert isinstance(actual, transformers.Cache), name
        actual, expected = ([(layer.keys, layer.values) for layer in cache.layers]
                            for cache in (actual, expected))
    if isinstance(expected, (tuple, list)):
        assert isinstance(actual, (tuple, list)) and len(actual) == len(expected), \
            f"{name}: {len(actual)} entries, unpatched {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, mask, f"{name}[{i}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and actual.shape == expected.shape, name
        torch.testing.assert_close(_at_real_tokens(actual, mask), _at_real_tokens(expected, mask),
                                   atol=2e-5, rtol=2e-4, msg=lambda m: f"{name}: {m}")
    else:
        assert actual == expected, name


def _pair(family, name):
    """(unpatched, patched), in eval mode, with the same weights."""
    reference = getattr(transformers, name)(_config(family, name)).eval()
    return reference, fusedlm.patch(copy.deepcopy(reference))


@pytest.mark.parametrize("family, name", CASES, ids=[name for _, name in CASES])
def test_patched_model_keeps_every_output(family, name):
    reference, patched = _pair(family, name)
    ids, mask = _batch(name)
    asked = dict(attention_mask=mask, output_hidden_states=True, output_attentions=True)
    with torch.no_grad():
        expected = reference(ids, **asked, return_dict=False)
        out = patched(ids, **asked, return_dict=False)
        recorded = reference(ids, **asked)
        # Without the weights asked for, attention runs fused; the hidden states are the same.
        fused = patched(ids, attention_mask=mask, output_hidden_states=True).hidden_states
    layers = _config(family, name).num_hidden_layers
    assert (len(recorded.hidden_states), len(recorded.attentions)) == (layers + 1, layers)
    _assert_same(out, expected, mask, name)
    _assert_same(fused, recorded.hidden_states, mask, "hidden_states with fused attention")


@pytest.mark.parametrize("family", FAMILIES)
def test_model_that_returned_outputs_before_patching_still_returns_them(family):
    # transformers hooks a model's modules at its first call asking for outputs; patching
    # replaces some of them (DistilBERT's and ALBERT's layers), and the hooks must follow.
    name = BASES[family]
    model = getattr(transformers, name)(_config(family, name)).eval()
    ids, mask = _batch(name)
    asked = dict(attention_mask=mask, output_hidden_states=True, output_attentions=True,
                 return_dict=False)
    with torch.no_grad():
        expected = model(ids, **asked)
        patched = fusedlm.patch(fusedlm.patch(model))  # twice: the hooks are not doubled
        _assert_same(patched(ids, **asked), expected, mask, name)
