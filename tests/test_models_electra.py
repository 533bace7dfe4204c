"""fusedlm.models' ELECTRA against transformers' ELECTRA of the same weights: outputs,
losses and gradients on padded batches with embeddings narrower than the encoder,
checkpoints both ways, the joint generator + discriminator pretraining (its two
checkpoints, its sampling, its training), and errors."""
import pytest
import torch

from models_helpers import (LENGTHS, VOCAB, Corpus, REFUSED_SETTINGS, assert_attentions_and_outputs_match,
                            assert_checkpointing_matches_transformers, assert_embeds_and_positions_match, assert_encoder_weights_load,
                            assert_no_logits_in_training_unless_asked, assert_rel, assert_trains,
                            assert_unpadded_masked_lm_matches, assert_untied_head_loads_both_ways,
                            call, file_tensors, head_cases, masked, parity_test,
                            perturb, same_weights, tiny_batch, tiny_config)
from fusedlm.models import (ElectraForJointPreTraining, ElectraForMaskedLM, ElectraForPreTraining,
                            ElectraForQuestionAnswering, ElectraForSequenceClassification,
                            ElectraForTokenClassification, ElectraModel)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

# embedding_size != hidden_size: embeddings_project runs
TINY = dict(vocab_size=VOCAB, embedding_size=24, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=4, intermediate_size=64, max_position_embeddings=16, num_labels=3)


def _config(**changes):
    return tiny_config(transformers.ElectraConfig, TINY, **changes)


def _batch():
    batch = tiny_batch()
    # the discriminator's labels, at padding too (transformers leaves padding out of the loss)
    return {**batch, "replaced": torch.randint(2, batch["input_ids"].shape)}


CASES = head_cases(
    "Electra",
    model=(ElectraModel, "ElectraModel", {}, ("last_hidden_state",), ()),
    discriminator=(ElectraForPreTraining, "ElectraForPreTraining", {"labels": "replaced"},
                   ("logits",), ()),
    generator=(ElectraForMaskedLM, "ElectraForMaskedLM", {}, ("logits",), ()),
)


test_same_weights_as_transformers_give_the_same_outputs_loss_and_gradients = parity_test(
    CASES, _batch, _config, TINY)


def test_without_padding_and_with_equal_widths_the_generator_matches_transformers(tmp_path):
    assert_unpadded_masked_lm_matches(ElectraForMaskedLM, transformers.ElectraForMaskedLM,
                                      _config(embedding_size=32), TINY["num_hidden_layers"], tmp_path)


def test_the_discriminator_head_follows_hidden_act_and_the_other_heads_keep_erf_gelu():
    config = _config(hidden_act="gelu_new")
    batch = {k: v for k, v in _batch().items() if k != "labels"}
    real = batch["attention_mask"].bool()
    for cls, field in ((ElectraForPreTraining, "logits"), (ElectraForMaskedLM, "logits"),
                       (ElectraForSequenceClassification, "logits")):
        theirs = getattr(transformers, cls.__name__)(config).eval()
        perturb(theirs)
        ours = cls(config).eval()
        ours.load_state_dict(theirs.state_dict())
        with torch.no_grad():
            a, b = getattr(call(ours, batch), field), getattr(call(theirs, batch), field)
        if a.dim() > 1 and a.shape[:2] == real.shape:
            a, b = a[real], b[real]
        assert_rel(a, b, cls.__name__)


# --- every forward argument and output ----------------------------------------------------------

def test_inputs_embeds_position_ids_and_token_types_match_transformers():
    # inputs_embeds [B, T, E]: before embeddings_project
    assert_embeds_and_positions_match(ElectraModel, _config(), _batch(), TINY["embedding_size"])


def test_output_attentions_and_hidden_states_match_transformers_and_index_like_theirs():
    assert_attentions_and_outputs_match(*same_weights(ElectraForPreTraining, _config()), _batch(),
                                        TINY["num_hidden_layers"])


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing_kwargs_are_honoured_with_transformers_gradients(use_reentrant):
    assert_checkpointing_matches_transformers(ElectraForMaskedLM, _config(), _batch(), TINY["num_hidden_layers"],
                                              use_reentrant)


# --- checkpoints -------------------------------------------------------------------------------

@pytest.mark.parametrize("saved, cls", [("ElectraForPreTraining", ElectraForPreTraining),
                                        ("ElectraForMaskedLM", ElectraForMaskedLM)])
def test_a_discriminator_or_generator_saved_by_transformers_loads_with_every_weight(saved, cls, tmp_path):
    theirs = getattr(transformers, saved)(_config())
    perturb(theirs)
    theirs.save_pretrained(tmp_path)
    model, info = cls.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    ours = model.state_dict()
    for name, value in file_tensors(tmp_path).items():
        assert torch.equal(ours[name], value), name
    if cls is ElectraForMaskedLM:  # the head reads the word embeddings
        assert model.generator_lm_head.weight is model.electra.embeddings.word_embeddings.weight


@pytest.mark.parametrize("saved, loaded", [
    ("ElectraForPreTraining", ElectraModel), ("ElectraForPreTraining", ElectraForSequenceClassification),
    ("ElectraForPreTraining", ElectraForTokenClassification), ("ElectraModel", ElectraForPreTraining),
    ("ElectraModel", ElectraForMaskedLM), ("ElectraForMaskedLM", ElectraModel),
    ("ElectraForSequenceClassification", ElectraModel),
])
def test_base_and_task_checkpoints_load_both_ways_with_every_encoder_weight(saved, loaded, tmp_path):
    assert_encoder_weights_load(getattr(transformers, saved), loaded, _config(),
                                ("embeddings.", "embeddings_project.", "encoder."),
                                5 + 2 + 16 * TINY["num_hidden_layers"], tmp_path)


def test_an_untied_generator_head_loads_its_own_weight_both_ways(tmp_path):
    ours = assert_untied_head_loads_both_ways(ElectraForMaskedLM, transformers.ElectraForMaskedLM,
                                              _config(tie_word_embeddings=False), _batch(), tmp_path)
    assert ours.get_output_embeddings() is ours.generator_lm_head
    assert ours.get_input_embeddings() is ours.electra.embeddings.word_embeddings


# --- the deliberate differences (as BERT's) ------------------------------------------------------

def test_token_labels_at_padding_are_ignored_and_outputs_there_are_zeros():
    ours, theirs = same_weights(ElectraForTokenClassification, _config())
    batch = _batch()
    labels = torch.randint(3, batch["input_ids"].shape)  # labels at padding too, not -100
    padding = batch["attention_mask"] == 0
    with torch.no_grad():
        out = call(ours, {**batch, "labels": labels}, output_hidden_states=True)
        expected = call(theirs, {**batch, "labels": labels.masked_fill(padding, -100)}).loss
    assert_rel(out.loss, expected, "loss over real tokens")
    assert torch.all(out.hidden_states[-1][padding] == 0)


def test_the_generator_in_training_builds_no_logits_unless_asked():
    assert_no_logits_in_training_unless_asked(ElectraForMaskedLM(_config()), _batch(),
                                              (len(LENGTHS), max(LENGTHS), VOCAB))


# --- generator and discriminator trained together ------------------------------------------------

def _pretraining_batch():
    return masked(tiny_batch(), VOCAB, torch.Generator().manual_seed(3))


def test_generator_and_discriminator_share_the_embeddings_and_only_those():
    model = ElectraForJointPreTraining(_config())
    generator, discriminator = model.generator, model.discriminator
    shared = discriminator.electra.embeddings
    assert generator.electra.embeddings is shared
    assert generator.generator_lm_head.weight is shared.word_embeddings.weight
    assert generator.electra.embeddings_project is not discriminator.electra.embeddings_project
    # the paper's rule: a quarter of the heads (of the same size) and of the FFN
    gen = model.generator_config
    assert (gen.hidden_size, gen.num_attention_heads, gen.intermediate_size) == (8, 1, 16)
    assert gen.embedding_size == TINY["embedding_size"] and model.config is discriminator.config
    counts = [sum(p.numel() for p in m.parameters()) for m in (model, generator, discriminator, shared)]
    assert counts[0] == counts[1] + counts[2] - counts[3]

    given = ElectraForJointPreTraining(_config(), _config(hidden_size=16, num_attention_heads=2))
    assert given.generator.config.hidden_size == 16


def test_the_loss_joins_the_generator_and_weighted_discriminator_and_sampling_passes_no_gradient():
    model = ElectraForJointPreTraining(_config(), discriminator_weight=7.0).train()
    batch = _pretraining_batch()
    out = call(model, batch, generator=torch.Generator().manual_seed(0))
    assert_rel(out.loss, out.generator_loss + 7.0 * out.discriminator_loss, "loss")

    masked_positions = batch["labels"] != -100
    originals = torch.where(masked_positions, batch["labels"], batch["input_ids"])
    assert torch.equal(out.replaced_ids[~masked_positions], originals[~masked_positions])
    assert torch.equal(out.replaced_labels, (out.replaced_ids != originals).long())
    assert out.prediction_logits.shape == (int(masked_positions.sum()), VOCAB)
    assert out.logits.shape == batch["input_ids"].shape

    # The discriminator's loss reaches the generator's own weights only through the sampled
    # ids, which carry no gradient; it does reach the shared embeddings.
    out.discriminator_loss.backward()
    assert all(p.grad is None for p in model.generator.electra.encoder.parameters())
    assert all(p.grad is None for p in model.generator.generator_predictions.parameters())
    assert model.discriminator.electra.embeddings.word_embeddings.weight.grad.abs().sum() > 0

    again = call(model, batch, generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.replaced_ids, out.replaced_ids)  # the draws repeat


def test_samples_follow_the_generator_softmax():
    from fusedlm.models.electra import gumbel_sample

    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]]).expand(20000, 4)
    draws = gumbel_sample(logits, torch.Generator().manual_seed(0))
    frequencies = torch.bincount(draws, minlength=4).double() / len(draws)
    torch.testing.assert_close(frequencies, torch.softmax(logits[0].double(), 0), atol=0.01, rtol=0)


def test_the_two_folders_load_in_transformers_and_give_the_joint_models_outputs(tmp_path):
    model = ElectraForJointPreTraining(_config()).eval()
    perturb(model)
    batch = _pretraining_batch()
    with torch.no_grad():
        out = call(model, batch, generator=torch.Generator().manual_seed(0))
    model.save_pretrained(tmp_path)
    loaded = {}
    for folder, hf_cls in (("generator", transformers.ElectraForMaskedLM),
                           ("discriminator", transformers.ElectraForPreTraining)):
        loaded[folder], info = hf_cls.from_pretrained(tmp_path / folder, output_loading_info=True,
                                                      attn_implementation="eager")
        assert not any(info.values()), (folder, info)
    hf_gen, hf_disc = loaded["generator"].eval(), loaded["discriminator"].eval()
    assert hf_gen.config.hidden_size == model.generator_config.hidden_size

    args = {k: batch[k] for k in ("attention_mask", "token_type_ids")}
    masked_positions = batch["labels"] != -100
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        gen = hf_gen(batch["input_ids"], labels=batch["labels"], **args)
        disc = hf_disc(out.replaced_ids, labels=out.replaced_labels, **args)
    assert_rel(out.prediction_logits, gen.logits[masked_positions], "generator logits")
    assert_rel(out.generator_loss, gen.loss, "generator loss")
    assert_rel(out.logits[real], disc.logits[real], "discriminator logits")
    assert_rel(out.discriminator_loss, disc.loss, "discriminator loss")


def test_from_pretrained_reads_both_folders_back_and_shares_the_embeddings_again(tmp_path):
    model = ElectraForJointPreTraining(_config(), _config(hidden_size=16, num_attention_heads=2)).eval()
    perturb(model)
    model.save_pretrained(tmp_path)
    loaded = ElectraForJointPreTraining.from_pretrained(tmp_path, discriminator_weight=3.0).eval()
    shared = loaded.discriminator.electra.embeddings
    assert loaded.generator.electra.embeddings is shared
    assert loaded.generator.generator_lm_head.weight is shared.word_embeddings.weight
    assert loaded.generator_config.hidden_size == 16 and loaded.discriminator_weight == 3.0
    expected = model.state_dict()
    assert expected.keys() == loaded.state_dict().keys()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
    # the discriminator's checkpoint alone serves as transformers' and fusedlm's ElectraForPreTraining
    alone = ElectraForPreTraining.from_pretrained(tmp_path / "discriminator")
    assert torch.equal(alone.discriminator_predictions.dense.weight,
                       model.discriminator.discriminator_predictions.dense.weight)


def test_joint_pretraining_runs_under_bf16_autocast():
    model = ElectraForJointPreTraining(_config()).train()
    batch = _pretraining_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = call(model, batch, generator=torch.Generator().manual_seed(0))
    assert out.logits.dtype == torch.bfloat16 and torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


# --- training ----------------------------------------------------------------------------------

CORPUS = Corpus()
TRAIN = dict(TINY, vocab_size=CORPUS.vocab_size, embedding_size=32, hidden_size=64, intermediate_size=128,
             max_position_embeddings=32, num_labels=2, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0)


def test_joint_pretraining_trains_and_the_cpu_backend_follows_the_reference():
    torch.manual_seed(0)  # a convergence test: one fixed initialisation
    model = ElectraForJointPreTraining(transformers.ElectraConfig(**TRAIN))
    assert_trains(model, lambda g: masked(CORPUS.batch(16, g), CORPUS.vocab_size, g), steps=200)


def test_sequence_classification_trains_and_the_cpu_backend_follows_the_reference():
    keyword = CORPUS.ids["the"]

    def batch(g):
        b = CORPUS.batch(16, g)
        return {**b, "labels": (b["input_ids"] == keyword).any(1).long()}

    # A convergence test: one fixed initialisation (some draws need more than 200 steps to
    # learn the keyword).
    torch.manual_seed(0)
    assert_trains(ElectraForSequenceClassification(transformers.ElectraConfig(**TRAIN)), batch, steps=200)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, name", REFUSED_SETTINGS)
def test_settings_the_fused_path_cannot_honour_are_refused_by_name(changes, name):
    with pytest.raises(ValueError, match=name):
        ElectraModel(transformers.ElectraConfig(**{**TINY, **changes}))


def test_question_answering_needs_two_labels():
    with pytest.raises(ValueError, match="num_labels"):
        ElectraForQuestionAnswering(_config(num_labels=3))


def test_joint_pretraining_refuses_what_it_cannot_do_by_name():
    with pytest.raises(ValueError, match="embedding_size"):
        ElectraForJointPreTraining(_config(), _config(embedding_size=16))
    with pytest.raises(ValueError, match="size"):
        ElectraForJointPreTraining.generator_config_for(_config(), 0.0)
    with pytest.raises(ValueError, match="discriminator_weight"):
        ElectraForJointPreTraining(_config(), discriminator_weight=-1.0)
    with pytest.raises(ValueError, match="labels"):
        ElectraForJointPreTraining(_config())(torch.randint(VOCAB, (2, 6)))
