"""fusedlm.models' DistilBERT against transformers' DistilBERT of the same weights: outputs,
losses and gradients on padded batches for every head, checkpoints both ways (base <-> task
and from a BERT-shaped config), the attention weights and the refused settings."""
import pytest

from models_helpers import (PAD, VOCAB, assert_attentions_and_outputs_match, encoder_family_tests,
                            head_cases, same_weights, tiny_batch)
from fusedlm.models import (DistilBertForMaskedLM, DistilBertForSequenceClassification,
                            DistilBertForTokenClassification, DistilBertModel)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# transformers' config maps hidden_size, num_hidden_layers and num_attention_heads to
# DistilBERT's dim, n_layers and n_heads.
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, hidden_dim=64,
            max_position_embeddings=16, num_labels=3, pad_token_id=PAD)


def _config(**changes):
    return transformers.DistilBertConfig(**{**TINY, "dropout": 0.0, "attention_dropout": 0.0,
                                            "seq_classif_dropout": 0.0, "qa_dropout": 0.0, **changes},
                                         attn_implementation="eager")


CASES = head_cases(
    "DistilBert",
    model=(DistilBertModel, "DistilBertModel", {}, ("last_hidden_state",), ()),
    masked_lm=(DistilBertForMaskedLM, "DistilBertForMaskedLM", {}, ("logits",), ()),
)


# embeddings: word, position, LayerNorm (2); a layer: 4 projections, 2 norms, 2 FFN products,
# each a weight and a bias.
globals().update(encoder_family_tests(
    CASES, _config, TINY, encoder=("embeddings.", "transformer."),
    encoder_weights=4 + 16 * TINY["num_hidden_layers"],
    checkpoints=[("DistilBertModel", DistilBertForSequenceClassification),
                 ("DistilBertModel", DistilBertForMaskedLM),
                 ("DistilBertForMaskedLM", DistilBertForTokenClassification),
                 ("DistilBertForMaskedLM", DistilBertModel),
                 ("DistilBertForSequenceClassification", DistilBertModel)],
    output_embeddings=lambda model: model.vocab_projector))


def test_output_attentions_and_hidden_states_match_transformers_and_index_like_theirs():
    assert_attentions_and_outputs_match(*same_weights(DistilBertForSequenceClassification, _config()),
                                        tiny_batch(), TINY["num_hidden_layers"])


@pytest.mark.parametrize("changes, name", [({"activation": "relu"}, "activation"),
                                           ({"hidden_size": 30}, "dim")])
def test_settings_the_fused_path_cannot_honour_are_refused_by_name(changes, name):
    with pytest.raises(ValueError, match=name):
        DistilBertModel(_config(**changes))
