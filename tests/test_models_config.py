"""Every transformers config setting of every model family, held to one of three fates:
honoured (the fusedlm model gives transformers' result for it), refused by name when set
to a value fusedlm cannot honour, or documented in README's table of differences. A
setting a new transformers adds fails test_every_setting_is_honoured_refused_or_documented
until it is given one. Then the settings that matter most, against transformers' models of
the same weights, and attn_implementation, which fusedlm takes whatever it names without
touching the caller's config."""
import copy
import pathlib
import re

import pytest
import torch

from models_helpers import PAD, VOCAB, assert_rel, call, same_weights, tiny_batch
import fusedlm.models
from fusedlm.models.bert import GELU_APPROXIMATIONS

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# --- each family's settings and their fates ----------------------------------------------------

# PretrainedConfig's own, in every family. Bookkeeping of transformers' loader and saver
# (name_or_path, commit_hash, post_init_done, transformers_version, architectures, dtype),
# the heads' labels, forward's output flags, and what only transformers' generate and
# mixture-of-experts models read (is_encoder_decoder, experts_implementation).
COMMON_HONOURED = {"name_or_path", "commit_hash", "post_init_done", "transformers_version", "architectures",
                   "dtype", "id2label", "label2id", "problem_type", "output_attentions",
                   "output_hidden_states", "return_dict", "is_encoder_decoder", "experts_implementation"}
# Every family runs fusedlm's attention whatever attn_implementation names (README).
COMMON_DOCUMENTED = {"attn_implementation"}

# BERT, RoBERTa and ELECTRA read their configs alike. bos/eos_token_id are the tokenizer's
# and generate's; use_cache is read by transformers' encoders only as decoders (refused).
BERT_HONOURED = COMMON_HONOURED | {
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "initializer_range", "layer_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id",
    "classifier_dropout", "tie_word_embeddings", "use_cache"}
# A value that fusedlm refuses, by the setting's name; hidden_act's GELUs are honoured.
BERT_REFUSED = {"hidden_act": "relu", "is_decoder": True, "add_cross_attention": True,
                "chunk_size_feed_forward": 4, "position_embedding_type": "relative_key"}


class Family:
    def __init__(self, config_class, model_class, honoured: set, refused: dict, tiny: dict):
        self.config_class, self.model_class = config_class, model_class
        self.honoured, self.refused, self.documented = honoured, refused, COMMON_DOCUMENTED
        self.tiny = tiny

    def config(self, **changes):
        return self.config_class(**{**self.tiny, **changes})


BERT_TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=16, num_labels=3, pad_token_id=PAD,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
M = fusedlm.models
FAMILIES = {
    "bert": Family(transformers.BertConfig, M.BertModel, BERT_HONOURED, BERT_REFUSED, BERT_TINY),
    "roberta": Family(transformers.RobertaConfig, M.RobertaModel, BERT_HONOURED, BERT_REFUSED, BERT_TINY),
    # ELECTRA's summary_* are read by transformers' ElectraForMultipleChoice alone, a head
    # fusedlm does not have.
    "electra": Family(transformers.ElectraConfig, M.ElectraModel,
                      BERT_HONOURED | {"embedding_size", "summary_type", "summary_use_proj",
                                       "summary_activation", "summary_last_dropout"},
                      BERT_REFUSED, {**BERT_TINY, "embedding_size": 24}),
    "albert": Family(transformers.AlbertConfig, M.AlbertModel,
                     COMMON_HONOURED | {"vocab_size", "embedding_size", "hidden_size", "num_hidden_layers",
                                        "num_hidden_groups", "inner_group_num", "num_attention_heads",
                                        "intermediate_size", "hidden_dropout_prob",
                                        "attention_probs_dropout_prob", "max_position_embeddings",
                                        "type_vocab_size", "initializer_range", "layer_norm_eps",
                                        "classifier_dropout_prob", "pad_token_id", "bos_token_id",
                                        "eos_token_id", "tie_word_embeddings"},
                     {"hidden_act": "relu", "chunk_size_feed_forward": 4,
                      "position_embedding_type": "relative_key"},
                     {**BERT_TINY, "embedding_size": 16, "num_hidden_groups": 2, "inner_group_num": 2}),
    "distilbert": Family(transformers.DistilBertConfig, M.DistilBertModel,
                         COMMON_HONOURED | {"vocab_size", "dim", "n_layers", "n_heads", "hidden_dim",
                                            "dropout", "attention_dropout", "max_position_embeddings",
                                            "sinusoidal_pos_embds", "initializer_range", "qa_dropout",
                                            "seq_classif_dropout", "pad_token_id", "bos_token_id",
                                            "eos_token_id", "tie_word_embeddings"},
                         {"activation": "relu", "chunk_size_feed_forward": 4},
                         dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=16, num_labels=3, pad_token_id=PAD, dropout=0.0,
                              attention_dropout=0.0)),
    # GPT-2 (fusedlm/models/gpt.py): pad/bos/eos_token_id are generate's; summary_* are read
    # by transformers' GPT2DoubleHeadsModel alone; transformers' GPT-2 never chunks its MLP.
    "gpt2": Family(transformers.GPT2Config, M.GPT2Model,
                   COMMON_HONOURED | {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
                                      "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
                                      "initializer_range", "scale_attn_weights",
                                      "scale_attn_by_inverse_layer_idx", "use_cache", "bos_token_id",
                                      "eos_token_id", "pad_token_id", "tie_word_embeddings",
                                      "chunk_size_feed_forward", "summary_type", "summary_use_proj",
                                      "summary_activation", "summary_proj_to_labels", "summary_first_dropout"},
                   {"activation_function": "relu", "add_cross_attention": True,
                    "reorder_and_upcast_attn": True},
                   dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)),
}


def settings(config_class) -> set:
    """The settings a config class holds by default, with its own and PretrainedConfig's,
    by their public names (``_attn_implementation_internal`` is attn_implementation)."""
    held = set(vars(config_class())) | set(vars(transformers.PretrainedConfig()))
    return {name.strip("_").removesuffix("_internal") for name in held}


def readme_differences() -> str:
    """README's table of where fusedlm's models differ from transformers'."""
    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text()
    section = text.split("### Where fusedlm's models differ from transformers'")[1]
    return section.split("\n### ")[0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_setting_is_honoured_refused_or_documented(family):
    f = FAMILIES[family]
    fates = (f.honoured, set(f.refused), f.documented)
    unplaced = settings(f.config_class) - set().union(*fates)
    assert not unplaced, f"{f.config_class.__name__} settings fusedlm neither honours, refuses nor documents: " \
                         f"{sorted(unplaced)}"
    assert not (f.honoured & set(f.refused)) and not (f.honoured & f.documented) \
        and not (set(f.refused) & f.documented)


@pytest.mark.parametrize("family, name, value", [(family, name, value) for family, f in FAMILIES.items()
                                                 for name, value in f.refused.items()])
def test_refused_settings_are_refused_by_name(family, name, value):
    f = FAMILIES[family]
    with pytest.raises(ValueError, match=name):
        f.model_class(f.config(**{name: value}))


@pytest.mark.parametrize("name", sorted(COMMON_DOCUMENTED))
def test_documented_settings_are_in_the_readme_table(name):
    assert f"`{name}`" in readme_differences()


# --- the settings that matter most, against transformers ---------------------------------------

def _inputs() -> dict:
    """tiny_batch's inputs, without its labels."""
    return {k: v for k, v in tiny_batch().items() if k in ("input_ids", "attention_mask", "token_type_ids")}


def _masked_lm_logits_match(cls, config, batch: dict) -> None:
    ours, theirs = same_weights(cls, config)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        assert_rel(call(ours, batch).logits[real], call(theirs, batch).logits[real], cls.__name__)


MASKED_LMS = {"bert": M.BertForMaskedLM, "roberta": M.RobertaForMaskedLM, "electra": M.ElectraForMaskedLM,
              "albert": M.AlbertForMaskedLM, "distilbert": M.DistilBertForMaskedLM}


@pytest.mark.parametrize("family", list(MASKED_LMS))
@pytest.mark.parametrize("gelu", list(GELU_APPROXIMATIONS))
def test_every_gelu_transformers_names_gives_its_outputs(family, gelu):
    setting = "activation" if family == "distilbert" else "hidden_act"
    batch = _inputs()
    _masked_lm_logits_match(MASKED_LMS[family], FAMILIES[family].config(**{setting: gelu}), batch)


@pytest.mark.parametrize("family", ["bert", "roberta", "electra", "albert"])
def test_layer_norm_eps_position_embedding_type_and_token_types_give_transformers_outputs(family):
    config = FAMILIES[family].config(layer_norm_eps=0.5, type_vocab_size=3, position_embedding_type="absolute")
    batch = _inputs()
    batch["token_type_ids"] = torch.randint(3, batch["input_ids"].shape)
    _masked_lm_logits_match(MASKED_LMS[family], config, batch)


# Each family's classifier dropouts: (class, the config setting).
CLASSIFIER_DROPOUTS = [
    (M.BertForSequenceClassification, "classifier_dropout"), (M.BertForTokenClassification, "classifier_dropout"),
    (M.RobertaForSequenceClassification, "classifier_dropout"),
    (M.RobertaForTokenClassification, "classifier_dropout"),
    (M.ElectraForSequenceClassification, "classifier_dropout"),
    (M.ElectraForTokenClassification, "classifier_dropout"),
    (M.AlbertForSequenceClassification, "classifier_dropout_prob"),
    (M.AlbertForTokenClassification, "classifier_dropout_prob"),
    (M.DistilBertForSequenceClassification, "seq_classif_dropout"),
    (M.DistilBertForQuestionAnswering, "qa_dropout"),
]


@pytest.mark.parametrize("cls, setting", CLASSIFIER_DROPOUTS, ids=[c.__name__ for c, _ in CLASSIFIER_DROPOUTS])
def test_classifier_dropouts_are_read_as_transformers_reads_them(cls, setting):
    # In training a dropout of 1 zeroes the head's input (only its bias is left) and one of
    # 0 keeps it whole: both deterministic, so the two sides can be compared.
    family = cls.__name__.split("For")[0].lower()
    batch = _inputs()
    real = batch["attention_mask"].bool()
    for p in (1.0, 0.0):
        changes = {setting: p, "num_labels": 2 if "QuestionAnswering" in cls.__name__ else 3}
        ours, theirs = same_weights(cls, FAMILIES[family].config(**changes))
        with torch.no_grad():
            a, b = call(ours.train(), batch), call(theirs.train(), batch)
        for field in ("logits", "start_logits"):
            if getattr(b, field, None) is not None:
                x, y = getattr(a, field), getattr(b, field)
                if x.dim() > 2 or x.shape == real.shape:
                    x, y = x[real], y[real]
                assert_rel(x, y, f"{setting}={p}: {field}")


@pytest.mark.parametrize("family", list(MASKED_LMS))
def test_initializer_range_sets_the_weights_spread_as_transformers(family):
    config = FAMILIES[family].config(initializer_range=0.3)
    torch.manual_seed(0)
    ours = MASKED_LMS[family](config)
    theirs = getattr(transformers, MASKED_LMS[family].__name__)(config)
    spreads = []
    for model in (ours, theirs):
        weights = [p for n, p in model.named_parameters() if n.endswith("weight") and p.dim() == 2]
        spreads.append(torch.cat([w.flatten() for w in weights]).std().item())
    assert abs(spreads[0] - 0.3) < 0.02 and abs(spreads[1] - 0.3) < 0.02, spreads


# --- attn_implementation ---------------------------------------------------------------------------

# Names transformers takes, flash_attention_2 among them (fusedlm needs none of their packages).
IMPLEMENTATIONS = [None, "eager", "sdpa", "flex_attention", "flash_attention_2", "paged|eager"]


def _state(config) -> dict:
    return copy.deepcopy(vars(config))


def _built_by_transformers(cls_name: str, config):
    """What transformers makes of the config: its model's attn_implementation, or the
    type of the error it raises."""
    try:
        return getattr(transformers, cls_name)(config).config._attn_implementation
    except Exception as e:  # flash_attention_2 without its package, say
        return type(e)


def test_a_config_a_transformers_model_was_built_from_builds_a_fusedlm_model():
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, intermediate_size=64)
    transformers.BertForMaskedLM(config)
    assert config._attn_implementation == "sdpa"
    M.BertForMaskedLM(config)
    assert config._attn_implementation == "sdpa"


@pytest.mark.parametrize("family", list(MASKED_LMS))
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_attn_implementation_is_taken_and_the_callers_config_is_left_as_it_was(family, implementation):
    cls = MASKED_LMS[family]
    config = FAMILIES[family].config(attn_implementation=implementation)
    before = _state(config)
    model = cls(config)
    assert _state(config) == before
    assert model.config is config
    # transformers' model built afterwards gets what it would have got from an untouched config
    fresh = FAMILIES[family].config(attn_implementation=implementation)
    assert _built_by_transformers(cls.__name__, config) == _built_by_transformers(cls.__name__, fresh)


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flash_attention_2"])
def test_from_pretrained_with_attn_implementation_runs_the_fused_path_or_the_weights_path(
        implementation, tmp_path, monkeypatch):
    theirs = transformers.BertForSequenceClassification(FAMILIES["bert"].config(attn_implementation="eager"))
    theirs.eval()
    theirs.save_pretrained(tmp_path)
    ours = M.BertForSequenceClassification.from_pretrained(tmp_path, attn_implementation=implementation).eval()
    assert ours.config._attn_implementation == implementation
    plain = []  # calls of the plain-PyTorch attention, which computes the weights
    monkeypatch.setattr(fusedlm.models.bert, "attention_with_weights",
                        _recorded(fusedlm.models.bert.attention_with_weights, plain))
    batch = _inputs()
    with torch.no_grad():
        fused = call(ours, batch)
        assert not plain
        weighed = call(ours, batch, output_attentions=True)
        assert len(plain) == BERT_TINY["num_hidden_layers"]
        expected = call(theirs, batch, output_attentions=True)
    assert_rel(fused.logits, expected.logits, "logits")
    assert_rel(weighed.logits, expected.logits, "logits with the weights")
    real = batch["attention_mask"].bool()
    for x, y in zip(weighed.attentions, expected.attentions):
        assert_rel(x.transpose(1, 2)[real], y.transpose(1, 2)[real], "attentions")


def _recorded(function, calls: list):
    def run(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)
    return run


def test_set_attn_implementation_records_the_name_and_changes_nothing_else():
    model = M.BertForMaskedLM(FAMILIES["bert"].config()).eval()
    ids = torch.randint(5, VOCAB, (2, 8))
    with torch.no_grad():
        before = model(ids).logits
        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
        assert torch.equal(model(ids).logits, before)


def test_an_attn_implementation_transformers_does_not_know_is_refused_by_name():
    with pytest.raises(ValueError, match="attn_implementation='fast'"):
        M.BertModel(FAMILIES["bert"].config(attn_implementation="fast"))
