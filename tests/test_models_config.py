"""attn_implementation: fusedlm's models take every name transformers takes, run their
own attention whatever it names, and leave the caller's config as it was."""
import copy

import pytest
import torch

from models_helpers import PAD, VOCAB, assert_rel, call, tiny_batch
import fusedlm.models

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

M = fusedlm.models
BERT_TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=16, num_labels=3, pad_token_id=PAD,
                 hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
CONFIGS = {
    "bert": (transformers.BertConfig, BERT_TINY),
    "roberta": (transformers.RobertaConfig, BERT_TINY),
    "electra": (transformers.ElectraConfig, {**BERT_TINY, "embedding_size": 24}),
    "albert": (transformers.AlbertConfig, {**BERT_TINY, "embedding_size": 16, "num_hidden_groups": 2,
                                           "inner_group_num": 2}),
    "distilbert": (transformers.DistilBertConfig,
                   dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=16,
                        num_labels=3, pad_token_id=PAD, dropout=0.0, attention_dropout=0.0)),
}
MASKED_LMS = {"bert": M.BertForMaskedLM, "roberta": M.RobertaForMaskedLM, "electra": M.ElectraForMaskedLM,
              "albert": M.AlbertForMaskedLM, "distilbert": M.DistilBertForMaskedLM}


def _config(family: str, **changes):
    config_class, tiny = CONFIGS[family]
    return config_class(**{**tiny, **changes})


def _inputs() -> dict:
    """tiny_batch's inputs, without its labels."""
    return {k: v for k, v in tiny_batch().items() if k in ("input_ids", "attention_mask", "token_type_ids")}


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
    config = _config(family, attn_implementation=implementation)
    before = _state(config)
    model = cls(config)
    assert _state(config) == before
    assert model.config is config
    # transformers' model built afterwards gets what it would have got from an untouched config
    fresh = _config(family, attn_implementation=implementation)
    assert _built_by_transformers(cls.__name__, config) == _built_by_transformers(cls.__name__, fresh)


@pytest.mark.parametrize("implementation", ["eager", "sdpa", "flash_attention_2"])
def test_from_pretrained_with_attn_implementation_runs_the_fused_path_or_the_weights_path(
        implementation, tmp_path, monkeypatch):
    theirs = transformers.BertForSequenceClassification(_config("bert", attn_implementation="eager"))
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
    model = M.BertForMaskedLM(_config("bert")).eval()
    ids = torch.randint(5, VOCAB, (2, 8))
    with torch.no_grad():
        before = model(ids).logits
        model.set_attn_implementation("sdpa")
        assert model.config._attn_implementation == "sdpa"
        assert torch.equal(model(ids).logits, before)


def test_an_attn_implementation_transformers_does_not_know_is_refused_by_name():
    with pytest.raises(ValueError, match="attn_implementation='fast'"):
        M.BertModel(_config("bert", attn_implementation="fast"))
