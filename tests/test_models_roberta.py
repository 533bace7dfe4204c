"""fusedlm.models' RoBERTa against transformers' RoBERTa of the same weights: outputs, losses
and gradients on padded batches for every head, RoBERTa's positions from inputs and from
embeddings, checkpoints both ways, untied heads, and the positions the table cannot hold."""
import pytest
import torch

from models_helpers import (PAD, assert_embeds_and_positions_match, assert_encoder_weights_load,
                            assert_no_logits_in_training_unless_asked, assert_rel,
                            assert_unpadded_masked_lm_matches, assert_untied_head_loads_both_ways,
                            call, head_cases, parity_batch, parity_test, same_weights, tiny_config)
from fusedlm.models import (RobertaForMaskedLM, RobertaForSequenceClassification,
                            RobertaForTokenClassification, RobertaModel)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 40
LENGTHS = (12, 9, 5)  # padding in two rows: the packed path runs
# Positions start at pad_token_id + 1: 12 tokens reach position 12 of a table of 16.
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
            pad_token_id=PAD)


def _config(**changes):
    return tiny_config(transformers.RobertaConfig, TINY, **changes)


def _batch():
    return parity_batch(VOCAB, LENGTHS)


CASES = head_cases(
    "Roberta",
    model=(RobertaModel, "RobertaModel", {}, ("last_hidden_state",), ("pooler_output",)),
    masked_lm=(RobertaForMaskedLM, "RobertaForMaskedLM", {}, ("logits",), ()),
)


test_same_weights_as_transformers_give_the_same_outputs_loss_and_gradients = parity_test(
    CASES, _batch, _config, TINY)


def test_without_padding_the_unpacked_path_matches_transformers(tmp_path):
    assert_unpadded_masked_lm_matches(RobertaForMaskedLM, transformers.RobertaForMaskedLM, _config(),
                                      TINY["num_hidden_layers"], tmp_path)


def test_inputs_embeds_and_position_ids_match_transformers():
    # From inputs_embeds RoBERTa numbers every position (it cannot see the padding).
    assert_embeds_and_positions_match(RobertaModel, _config(), _batch(), TINY["hidden_size"])


def test_left_padding_gets_roberta_positions():
    # Positions count real tokens only: a left-padded row gives its tokens the positions
    # they have unpadded, as transformers' do.
    ours, theirs = same_weights(RobertaModel, _config())
    ids = torch.randint(5, VOCAB, (2, 10))
    ids[1, :4] = PAD
    mask = (ids != PAD).long()
    with torch.no_grad():
        a, b = ours(ids, mask), theirs(input_ids=ids, attention_mask=mask)
    real = mask.bool()
    assert_rel(a.last_hidden_state[real], b.last_hidden_state[real], "last_hidden_state")
    assert_rel(a.pooler_output[0], b.pooler_output[0], "pooler_output of the unpadded row")


@pytest.mark.parametrize("saved, loaded", [
    ("RobertaModel", RobertaForSequenceClassification), ("RobertaModel", RobertaForMaskedLM),
    ("RobertaForMaskedLM", RobertaForTokenClassification), ("RobertaForMaskedLM", RobertaModel),
    ("RobertaForSequenceClassification", RobertaModel),
])
def test_base_and_task_checkpoints_load_both_ways_with_every_encoder_weight(saved, loaded, tmp_path):
    assert_encoder_weights_load(getattr(transformers, saved), loaded, _config(), ("embeddings.", "encoder."),
                                5 + 16 * TINY["num_hidden_layers"], tmp_path)


def test_untied_decoder_loads_its_own_weight_both_ways(tmp_path):
    ours = assert_untied_head_loads_both_ways(RobertaForMaskedLM, transformers.RobertaForMaskedLM,
                                              _config(tie_word_embeddings=False), _batch(), tmp_path)
    assert ours.get_output_embeddings() is ours.lm_head.decoder


def test_masked_lm_in_training_builds_no_logits_unless_asked():
    assert_no_logits_in_training_unless_asked(RobertaForMaskedLM(_config()), _batch(),
                                              (len(LENGTHS), max(LENGTHS), VOCAB))


def test_positions_past_the_table_are_refused_by_name():
    model = RobertaModel(_config())
    ids = torch.randint(5, VOCAB, (1, 16))  # positions 1 .. 16 of a 16-row table
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(ids)
    with torch.no_grad():
        assert call(model, {"input_ids": ids[:, :15]}).last_hidden_state.shape == (1, 15, 32)
