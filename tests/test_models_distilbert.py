"""fusedlm.models' DistilBERT against transformers' DistilBERT of the same weights: outputs,
losses and gradients on padded batches for every head, checkpoints both ways (base <-> task
and from a BERT-shaped config), the attention weights and the refused settings."""
import pytest
import torch

from models_helpers import (PAD, VOCAB, assert_attentions_and_outputs_match, assert_rel, encoder_family_tests,
                            file_tensors, head_cases, parity_batch, perturb, same_weights, tiny_batch)
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


# --- positions ---------------------------------------------------------------------------------

def _sines(count: int) -> torch.Tensor:
    """transformers' sinusoidal table of ``count`` positions at TINY's width."""
    from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings
    return create_sinusoidal_embeddings(count, TINY["hidden_size"], torch.empty(count, TINY["hidden_size"]))


def test_sinusoidal_positions_are_transformers_sines_from_a_config_and_where_a_checkpoint_lacks_them(tmp_path):
    from safetensors.torch import save_file
    config = _config(sinusoidal_pos_embds=True)
    theirs, ours = transformers.DistilBertModel(config), DistilBertModel(config)
    table = ours.get_position_embeddings().weight
    assert torch.equal(table, theirs.embeddings.position_embeddings.weight)
    assert torch.equal(table, _sines(TINY["max_position_embeddings"]))
    assert table.requires_grad == theirs.embeddings.position_embeddings.weight.requires_grad

    perturb(theirs)  # learned away from the sines: a checkpoint's table is kept as saved
    theirs.save_pretrained(tmp_path)
    loaded = DistilBertModel.from_pretrained(tmp_path).get_position_embeddings().weight
    assert torch.equal(loaded, theirs.embeddings.position_embeddings.weight)
    state = file_tensors(tmp_path)
    del state["embeddings.position_embeddings.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, info = DistilBertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert set(info["missing_keys"]) == {"embeddings.position_embeddings.weight"}
    expected = transformers.DistilBertModel.from_pretrained(tmp_path).get_position_embeddings().weight
    assert torch.equal(model.get_position_embeddings().weight, expected)
    assert torch.equal(expected, _sines(TINY["max_position_embeddings"]))


@pytest.mark.parametrize("count", [20, 10])
def test_resizing_learned_positions_follows_transformers(count):
    theirs = transformers.DistilBertForSequenceClassification(_config()).eval()
    perturb(theirs)
    ours = DistilBertForSequenceClassification(_config()).eval()  # its own config: resizing changes it
    ours.load_state_dict(theirs.state_dict())
    assert ours.get_position_embeddings() is ours.distilbert.embeddings.position_embeddings
    old = ours.get_position_embeddings().weight.detach().clone()
    ours.resize_position_embeddings(count)
    theirs.resize_position_embeddings(count)
    table, expected = ours.get_position_embeddings().weight, theirs.get_position_embeddings().weight
    kept = min(count, TINY["max_position_embeddings"])
    assert table.shape == expected.shape == (count, TINY["hidden_size"]) and table.requires_grad
    assert torch.equal(table[:kept], old[:kept]) and torch.equal(expected[:kept], old[:kept])
    assert ours.config.max_position_embeddings == theirs.config.max_position_embeddings == count
    with torch.no_grad():
        table.copy_(expected)  # the new rows are random on both sides
    # A batch that fills the new table (transformers keeps the old position_ids: pass them).
    batch = parity_batch(VOCAB, (count, count - 3, 5))
    positions = torch.arange(count).expand(3, count)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        a = ours(batch["input_ids"], batch["attention_mask"], output_hidden_states=True)
        b = theirs(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=positions,
                   output_hidden_states=True)
    assert_rel(a.hidden_states[-1][real], b.hidden_states[-1][real], "last hidden state")
    assert_rel(a.logits, b.logits, "logits")
    with pytest.raises(ValueError, match="max_position_embeddings"):
        ours(torch.randint(5, VOCAB, (1, count + 1)))


def test_resizing_sinusoidal_positions_gives_the_sines_of_the_new_length():
    # (transformers' own resize of a sinusoidal table raises: it writes to a missing attribute)
    model = DistilBertForMaskedLM(_config(sinusoidal_pos_embds=True))
    for count in (24, 8):
        model.resize_position_embeddings(count)
        assert torch.equal(model.get_position_embeddings().weight, _sines(count))
        assert model.config.max_position_embeddings == count
        with torch.no_grad():
            assert model(torch.randint(5, VOCAB, (2, count))).logits.shape == (2, count, VOCAB)


@pytest.mark.parametrize("count", [0, 2.5, True])
def test_a_bad_position_count_is_refused_by_name(count):
    with pytest.raises(ValueError, match="new_num_position_embeddings"):
        DistilBertModel(_config()).resize_position_embeddings(count)
