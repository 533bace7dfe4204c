"""fusedlm.models.electra against transformers' ELECTRA of the same weights, the joint
generator/discriminator pretraining, checkpoints and training."""
import pytest
import torch

from models_helpers import (Corpus, assert_matches_transformers, assert_rel, assert_trains,  # noqa: F401
                            call, masked, parity_batch, qa_reference_loss)
from fusedlm.models import (ElectraConfig, ElectraDiscriminator, ElectraForPreTraining,
                            ElectraForQuestionAnswering, ElectraForSequenceClassification,
                            ElectraForTokenClassification, ElectraGenerator, ElectraModel)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("safetensors")

VOCAB = 40
LENGTHS = (12, 9, 5)
# embedding_size != hidden_size: embeddings_project runs
TINY = dict(vocab_size=VOCAB, embedding_size=24, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, max_position_embeddings=16, num_labels=3)


def _configs(**changes):
    ours = ElectraConfig(**{**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                            **changes})
    ours_only = ("model_type", "gradient_checkpointing", "generator_size", "discriminator_weight")
    fields = {k: v for k, v in ours.to_dict().items() if k not in ours_only}
    return ours, transformers.ElectraConfig(**fields, attn_implementation="eager")


def _replaced(batch):
    return {**batch, "labels": torch.randint(2, batch["input_ids"].shape) * batch["attention_mask"]}


# name: (ours, transformers' class, batch entries as labels, per-token fields, per-sequence fields)
CASES = {
    "model": (ElectraModel, "ElectraModel", {}, ("last_hidden_state",), ()),
    "discriminator": (ElectraDiscriminator, "ElectraForPreTraining", None, ("logits",), ()),
    "generator": (ElectraGenerator, "ElectraForMaskedLM", {}, ("logits",), ()),
    "sequence": (ElectraForSequenceClassification, "ElectraForSequenceClassification",
                 {"labels": "class_labels"}, (), ("logits",)),
    "token": (ElectraForTokenClassification, "ElectraForTokenClassification",
              {"labels": "tag_labels"}, ("logits",), ()),
    "qa": (ElectraForQuestionAnswering, "ElectraForQuestionAnswering", {},
           ("start_logits", "end_logits"), ()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_weights_as_transformers_give_the_same_outputs_loss_and_gradients(case, tmp_path):
    cls, hf_name, renames, per_token, per_sequence = CASES[case]
    _, hf_config = _configs(**({"num_labels": 2} if case == "qa" else {}))
    batch = parity_batch(VOCAB, LENGTHS)
    batch = _replaced(batch) if renames is None else {**batch, **{k: batch[v] for k, v in renames.items()}}
    weight = torch.randn(int(batch["attention_mask"].sum()), TINY["hidden_size"])

    def loss_of(out):
        if case == "model":
            return (out.last_hidden_state[batch["attention_mask"].bool()] * weight).sum()
        if case == "qa":
            return qa_reference_loss(out.start_logits, out.end_logits, batch)
        return out.loss

    assert_matches_transformers(cls, getattr(transformers, hf_name), hf_config, batch, loss_of,
                                per_token, per_sequence, TINY["num_hidden_layers"], tmp_path)


# --- joint pretraining -------------------------------------------------------------------------

def _pretraining_batch(config):
    batch = parity_batch(VOCAB, LENGTHS)
    return masked(batch, config.vocab_size, torch.Generator().manual_seed(3))


def test_generator_and_discriminator_share_the_embeddings_and_only_those():
    config, _ = _configs()
    model = ElectraForPreTraining(config)
    generator, discriminator = model.generator.electra, model.discriminator.electra
    assert generator.embeddings is discriminator.embeddings
    assert generator.project is not discriminator.project
    assert generator.config.hidden_size == 8 and generator.config.num_attention_heads == 1
    assert generator.config.embedding_size == config.embedding_size
    shared = {id(p) for p in generator.embeddings.parameters()}
    own = [p for p in model.generator.parameters() if id(p) not in shared]
    assert not shared & {id(p) for p in own}


def test_the_loss_joins_the_generator_and_weighted_discriminator_and_sampling_passes_no_gradient():
    config, _ = _configs(discriminator_weight=7.0)
    model = ElectraForPreTraining(config).train()
    batch = _pretraining_batch(config)
    out = call(model, batch, generator=torch.Generator().manual_seed(0))
    assert_rel(out.loss, out.generator_loss + 7.0 * out.discriminator_loss, "loss")

    masked_positions = batch["labels"] != -100
    originals = torch.where(masked_positions, batch["labels"], batch["input_ids"])
    assert torch.equal(out.replaced_ids[~masked_positions], originals[~masked_positions])
    assert torch.equal(out.replaced_labels, (out.replaced_ids != originals).long())
    assert out.prediction_logits.shape == (int(masked_positions.sum()), VOCAB)

    # The discriminator's loss reaches the generator's own weights only through the sampled
    # ids, which carry no gradient; it does reach the shared embeddings.
    out.discriminator_loss.backward()
    assert all(p.grad is None for p in model.generator.electra.encoder.parameters())
    assert all(p.grad is None for p in model.generator.head.parameters())
    assert model.discriminator.electra.embeddings.word_embeddings.weight.grad.abs().sum() > 0

    again = call(model, batch, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.replaced_ids, out.replaced_ids)  # the generator's draws repeat


def test_samples_follow_the_generator_softmax():
    from fusedlm.models.electra import gumbel_sample

    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, 4)
    draws = gumbel_sample(logits, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=4).double() / len(draws)
    torch.testing.assert_close(frequencies, torch.softmax(logits[0].double(), 0), atol=0.01, rtol=0)


def test_the_parts_save_in_transformers_layout_and_the_whole_round_trips(tmp_path):
    config, _ = _configs()
    model = ElectraForPreTraining(config).eval()
    model.discriminator.save_pretrained(tmp_path / "discriminator")
    model.generator.save_pretrained(tmp_path / "generator")
    hf_disc = transformers.ElectraForPreTraining.from_pretrained(tmp_path / "discriminator",
                                                                 attn_implementation="eager").eval()
    hf_gen = transformers.ElectraForMaskedLM.from_pretrained(tmp_path / "generator",
                                                             attn_implementation="eager").eval()
    assert hf_gen.config.hidden_size == model.generator.config.hidden_size
    batch = parity_batch(VOCAB, LENGTHS)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        assert_rel(call(model.discriminator, batch).logits[real], call(hf_disc, batch).logits[real], "disc")
        assert_rel(call(model.generator, batch).logits[real], call(hf_gen, batch).logits[real], "gen")

    model.save_pretrained(tmp_path / "whole")
    loaded = ElectraForPreTraining.from_pretrained(tmp_path / "whole")
    assert loaded.generator.electra.embeddings is loaded.discriminator.electra.embeddings
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_pretraining_runs_under_bf16_autocast():
    config, _ = _configs()
    model = ElectraForPreTraining(config).train()
    batch = _pretraining_batch(config)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(model, batch, generator=torch.Generator().manual_seed(0))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


# --- training ----------------------------------------------------------------------------------

CORPUS = Corpus()
TRAIN = dict(TINY, vocab_size=CORPUS.vocab_size, embedding_size=32, hidden_size=64,
             intermediate_size=128, max_position_embeddings=32, num_labels=2,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def test_pretraining_trains_and_the_cpu_backend_follows_the_reference():
    model = ElectraForPreTraining(ElectraConfig(**TRAIN))
    assert_trains(model, lambda g: masked(CORPUS.batch(16, g), CORPUS.vocab_size, g), steps=200)


def test_sequence_classification_trains_and_the_cpu_backend_follows_the_reference():
    keyword = CORPUS.ids["the"]

    def batch(g):
        b = CORPUS.batch(16, g)
        return {**b, "labels": (b["input_ids"] == keyword).any(1).long()}

    assert_trains(ElectraForSequenceClassification(ElectraConfig(**TRAIN)), batch, steps=200)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, name", [
    ({"embedding_size": 0}, "embedding_size"),
    ({"generator_size": 0.0}, "generator_size"),
    ({"discriminator_weight": -1.0}, "discriminator_weight"),
    ({"hidden_act": "swish"}, "hidden_act"),
])
def test_bad_configs_name_the_field(changes, name):
    with pytest.raises(ValueError, match=name):
        ElectraConfig(**{**TINY, **changes})


def test_pretraining_without_labels_says_so():
    config, _ = _configs()
    with pytest.raises(ValueError, match="labels"):
        ElectraForPreTraining(config)(torch.randint(VOCAB, (2, 6)))
