"""fusedlm.models' ALBERT against transformers' ALBERT of the same weights: outputs, losses
and gradients on padded batches for every head (pretraining with sentence order included),
layers shared across calls and groups, checkpoints both ways, untied heads."""
import pytest
import torch

from models_helpers import (PAD, assert_attentions_and_outputs_match, assert_embeds_and_positions_match,
                            assert_encoder_weights_load, assert_no_logits_in_training_unless_asked,
                            assert_unpadded_masked_lm_matches, assert_untied_head_loads_both_ways,
                            head_cases, parity_batch, parity_test, same_weights, tiny_config)
from fusedlm.models import (AlbertForMaskedLM, AlbertForPreTraining, AlbertForSequenceClassification,
                            AlbertForTokenClassification, AlbertModel)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40
LENGTHS = (12, 9, 5)  # padding in two rows: the packed path runs
# Three layer calls over two groups of two layers: group 0 runs for call 0, group 1 for
# calls 1 and 2 (transformers' rule), each call both of its group's layers.
TINY = dict(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3,
            num_hidden_groups=2, inner_group_num=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=16, num_labels=3, classifier_dropout_prob=0.0, pad_token_id=PAD)
CALLS = 6  # layer calls: hidden states are recorded after each


def _config(**changes):
    return tiny_config(transformers.AlbertConfig, TINY, **changes)


def _batch():
    batch = parity_batch(VOCAB, LENGTHS)
    return {**batch, "sentence_order_label": batch["next_sentence_label"]}


CASES = head_cases(
    "Albert",
    model=(AlbertModel, "AlbertModel", {}, ("last_hidden_state",), ("pooler_output",)),
    # The sentence-order head has num_labels outputs: two, in order or swapped.
    pretraining=(AlbertForPreTraining, "AlbertForPreTraining", {}, ("prediction_logits",),
                 ("sop_logits",), {"num_labels": 2}),
    masked_lm=(AlbertForMaskedLM, "AlbertForMaskedLM", {}, ("logits",), ()),
)


test_same_weights_as_transformers_give_the_same_outputs_loss_and_gradients = parity_test(
    CASES, _batch, _config, {**TINY, "num_hidden_layers": CALLS})


def test_without_padding_the_unpacked_path_matches_transformers(tmp_path):
    assert_unpadded_masked_lm_matches(AlbertForMaskedLM, transformers.AlbertForMaskedLM, _config(), CALLS,
                                      tmp_path)


def test_inputs_embeds_position_ids_and_token_types_match_transformers():
    assert_embeds_and_positions_match(AlbertModel, _config(), _batch(), TINY["embedding_size"])


def test_output_attentions_and_hidden_states_match_transformers_and_index_like_theirs():
    assert_attentions_and_outputs_match(*same_weights(AlbertForSequenceClassification, _config()), _batch(),
                                        CALLS)


def test_one_set_of_weights_serves_every_call():
    model = AlbertModel(_config(num_hidden_groups=1, inner_group_num=1))
    calls = model.encoder.calls()
    assert len(calls) == TINY["num_hidden_layers"] and all(layer is calls[0] for layer in calls)


@pytest.mark.parametrize("saved, loaded", [
    ("AlbertModel", AlbertForSequenceClassification), ("AlbertModel", AlbertForMaskedLM),
    ("AlbertForPreTraining", AlbertForSequenceClassification), ("AlbertForPreTraining", AlbertForMaskedLM),
    ("AlbertForMaskedLM", AlbertForTokenClassification), ("AlbertForMaskedLM", AlbertModel),
])
def test_base_and_task_checkpoints_load_both_ways_with_every_encoder_weight(saved, loaded, tmp_path):
    # embeddings: 3 tables and a LayerNorm (2); the mapping (2); a layer: 4 projections,
    # 2 norms, 2 FFN products, each a weight and a bias; 4 layers in 2 groups.
    assert_encoder_weights_load(getattr(transformers, saved), loaded, _config(), ("embeddings.", "encoder."),
                                5 + 2 + 16 * 4, tmp_path)


def test_untied_decoder_loads_its_own_weight_both_ways(tmp_path):
    ours = assert_untied_head_loads_both_ways(AlbertForMaskedLM, transformers.AlbertForMaskedLM,
                                              _config(tie_word_embeddings=False), _batch(), tmp_path)
    assert ours.get_output_embeddings() is ours.predictions.decoder


def test_masked_lm_in_training_builds_no_logits_unless_asked():
    assert_no_logits_in_training_unless_asked(AlbertForMaskedLM(_config()), _batch(),
                                              (len(LENGTHS), max(LENGTHS), VOCAB))
