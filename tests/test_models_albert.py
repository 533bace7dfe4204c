"""fusedlm.models' ALBERT against transformers' ALBERT of the same weights: outputs, losses
and gradients on padded batches for every head (pretraining with sentence order included),
layers shared across calls and groups, checkpoints both ways, untied heads."""
import pytest

from models_helpers import (PAD, VOCAB, assert_attentions_and_outputs_match,
                            assert_embeds_and_positions_match, encoder_family_tests, head_cases,
                            same_weights, tiny_batch, tiny_config)
from fusedlm.models import (AlbertForMaskedLM, AlbertForPreTraining, AlbertForSequenceClassification,
                            AlbertForTokenClassification, AlbertModel)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# Three layer calls over two groups of two layers: group 0 runs for call 0, group 1 for
# calls 1 and 2 (transformers' rule), each call both of its group's layers.
TINY = dict(vocab_size=VOCAB, embedding_size=16, hidden_size=32, num_hidden_layers=3,
            num_hidden_groups=2, inner_group_num=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=16, num_labels=3, classifier_dropout_prob=0.0, pad_token_id=PAD)
CALLS = 6  # layer calls: hidden states are recorded after each


def _config(**changes):
    return tiny_config(transformers.AlbertConfig, TINY, **changes)


def _batch():
    batch = tiny_batch()
    return {**batch, "sentence_order_label": batch["next_sentence_label"]}


CASES = head_cases(
    "Albert",
    model=(AlbertModel, "AlbertModel", {}, ("last_hidden_state",), ("pooler_output",)),
    # The sentence-order head has num_labels outputs: two, in order or swapped.
    pretraining=(AlbertForPreTraining, "AlbertForPreTraining", {}, ("prediction_logits",),
                 ("sop_logits",), {"num_labels": 2}),
    masked_lm=(AlbertForMaskedLM, "AlbertForMaskedLM", {}, ("logits",), ()),
)


# embeddings: 3 tables and a LayerNorm (2); the mapping (2); a layer: 4 projections, 2 norms,
# 2 FFN products, each a weight and a bias; 4 layers in 2 groups.
globals().update(encoder_family_tests(
    CASES, _config, TINY, encoder=("embeddings.", "encoder."), encoder_weights=5 + 2 + 16 * 4,
    checkpoints=[("AlbertModel", AlbertForSequenceClassification), ("AlbertModel", AlbertForMaskedLM),
                 ("AlbertForPreTraining", AlbertForSequenceClassification),
                 ("AlbertForPreTraining", AlbertForMaskedLM),
                 ("AlbertForMaskedLM", AlbertForTokenClassification), ("AlbertForMaskedLM", AlbertModel)],
    output_embeddings=lambda model: model.predictions.decoder, make_batch=_batch, layers=CALLS))


def test_inputs_embeds_position_ids_and_token_types_match_transformers():
    assert_embeds_and_positions_match(AlbertModel, _config(), _batch(), TINY["embedding_size"])


def test_output_attentions_and_hidden_states_match_transformers_and_index_like_theirs():
    assert_attentions_and_outputs_match(*same_weights(AlbertForSequenceClassification, _config()), _batch(),
                                        CALLS)


def test_one_set_of_weights_serves_every_call():
    model = AlbertModel(_config(num_hidden_groups=1, inner_group_num=1))
    calls = model.encoder.calls()
    assert len(calls) == TINY["num_hidden_layers"] and all(layer is calls[0] for layer in calls)
