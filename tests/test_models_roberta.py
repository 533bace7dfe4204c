"""fusedlm.models' RoBERTa against transformers' RoBERTa of the same weights: outputs, losses
and gradients on padded batches for every head, RoBERTa's positions from inputs and from
embeddings, checkpoints both ways, untied heads, and the positions the table cannot hold."""
import pytest
import torch

from models_helpers import (PAD, VOCAB, assert_embeds_and_positions_match, assert_rel, call,
                            encoder_family_tests, head_cases, same_weights, tiny_batch, tiny_config)
from fusedlm.models import (RobertaForMaskedLM, RobertaForSequenceClassification,
                            RobertaForTokenClassification, RobertaModel)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Positions start at pad_token_id + 1: 12 tokens reach position 12 of a table of 16.
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16, type_vocab_size=2, num_labels=3,
            pad_token_id=PAD)


def _config(**changes):
    return tiny_config(transformers.RobertaConfig, TINY, **changes)


CASES = head_cases(
    "Roberta",
    model=(RobertaModel, "RobertaModel", {}, ("last_hidden_state",), ("pooler_output",)),
    masked_lm=(RobertaForMaskedLM, "RobertaForMaskedLM", {}, ("logits",), ()),
)


globals().update(encoder_family_tests(
    CASES, _config, TINY, encoder=("embeddings.", "encoder."),
    encoder_weights=5 + 16 * TINY["num_hidden_layers"],
    checkpoints=[("RobertaModel", RobertaForSequenceClassification), ("RobertaModel", RobertaForMaskedLM),
                 ("RobertaForMaskedLM", RobertaForTokenClassification), ("RobertaForMaskedLM", RobertaModel),
                 ("RobertaForSequenceClassification", RobertaModel)],
    output_embeddings=lambda model: model.lm_head.decoder))


def test_inputs_embeds_and_position_ids_match_transformers():
    # From inputs_embeds RoBERTa numbers every position (it cannot see the padding).
    assert_embeds_and_positions_match(RobertaModel, _config(), tiny_batch(), TINY["hidden_size"])


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


def test_positions_past_the_table_are_refused_by_name():
    model = RobertaModel(_config())
    ids = torch.randint(5, VOCAB, (1, 16))  # positions 1 .. 16 of a 16-row table
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(ids)
    with torch.no_grad():
        assert call(model, {"input_ids": ids[:, :15]}).last_hidden_state.shape == (1, 15, 32)
