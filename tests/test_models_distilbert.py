"""fusedlm.models' DistilBERT against transformers' DistilBERT of the same weights: outputs,
losses and gradients on padded batches for every head, checkpoints both ways (base <-> task
and from a BERT-shaped config), the attention weights and the refused settings."""
import pytest
import torch

from models_helpers import (PAD, assert_attentions_and_outputs_match, assert_encoder_weights_load,
                            assert_no_logits_in_training_unless_asked, assert_unpadded_masked_lm_matches,
                            assert_untied_head_loads_both_ways, head_cases, parity_batch, parity_test,
                            same_weights)
from fusedlm.models import (DistilBertForMaskedLM, DistilBertForSequenceClassification,
                            DistilBertForTokenClassification, DistilBertModel)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40
LENGTHS = (12, 9, 5)  # padding in two rows: the packed path runs
# transformers' config maps hidden_size, num_hidden_layers and num_attention_heads to
# DistilBERT's dim, n_layers and n_heads.
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dim=64,
            max_position_embeddings=16, num_labels=3, pad_token_id=PAD)


def _config(**changes):
    return transformers.DistilBertConfig(**{**TINY, "dropout": 0.0, "attention_dropout": 0.0,
                                            "seq_classif_dropout": 0.0, "qa_dropout": 0.0, **changes},
                                         attn_implementation="eager")


def _batch():
    return parity_batch(VOCAB, LENGTHS)


CASES = head_cases(
    "DistilBert",
    model=(DistilBertModel, "DistilBertModel", {}, ("last_hidden_state",), ()),
    masked_lm=(DistilBertForMaskedLM, "DistilBertForMaskedLM", {}, ("logits",), ()),
)


test_same_weights_as_transformers_give_the_same_outputs_loss_and_gradients = parity_test(
    CASES, _batch, _config, TINY)


def test_without_padding_the_unpacked_path_matches_transformers(tmp_path):
    assert_unpadded_masked_lm_matches(DistilBertForMaskedLM, transformers.DistilBertForMaskedLM, _config(),
                                      TINY["num_hidden_layers"], tmp_path)


def test_output_attentions_and_hidden_states_match_transformers_and_index_like_theirs():
    assert_attentions_and_outputs_match(*same_weights(DistilBertForSequenceClassification, _config()),
                                        _batch(), TINY["num_hidden_layers"])


@pytest.mark.parametrize("saved, loaded", [
    ("DistilBertModel", DistilBertForSequenceClassification), ("DistilBertModel", DistilBertForMaskedLM),
    ("DistilBertForMaskedLM", DistilBertForTokenClassification), ("DistilBertForMaskedLM", DistilBertModel),
    ("DistilBertForSequenceClassification", DistilBertModel),
])
def test_base_and_task_checkpoints_load_both_ways_with_every_encoder_weight(saved, loaded, tmp_path):
    # embeddings: word, position, LayerNorm (2); a layer: 4 projections, 2 norms, 2 FFN
    # products, each a weight and a bias.
    assert_encoder_weights_load(getattr(transformers, saved), loaded, _config(), ("embeddings.", "transformer."),
                                4 + 16 * TINY["num_hidden_layers"], tmp_path)


def test_untied_decoder_loads_its_own_weight_both_ways(tmp_path):
    ours = assert_untied_head_loads_both_ways(DistilBertForMaskedLM, transformers.DistilBertForMaskedLM,
                                              _config(tie_word_embeddings=False), _batch(), tmp_path)
    assert ours.get_output_embeddings() is ours.vocab_projector


def test_masked_lm_in_training_builds_no_logits_unless_asked():
    assert_no_logits_in_training_unless_asked(DistilBertForMaskedLM(_config()), _batch(),
                                              (len(LENGTHS), max(LENGTHS), VOCAB))


@pytest.mark.parametrize("changes, name", [({"activation": "relu"}, "activation"),
                                           ({"hidden_size": 30}, "dim")])
def test_settings_the_fused_path_cannot_honour_are_refused_by_name(changes, name):
    with pytest.raises(ValueError, match=name):
        DistilBertModel(_config(**changes))
