"""fusedlm.models' BERT against transformers' BERT of the same weights: outputs, losses
and gradients on padded batches, every forward argument, checkpoints of every layout
both ways, the deliberate differences, training, masking and errors."""
import copy
import inspect

import pytest
import torch

from models_helpers import (VOCAB, Corpus, MASK, PAD, REFUSED_SETTINGS, SPECIALS,
                            assert_attentions_and_outputs_match, assert_embeds_and_positions_match,
                            assert_rel, assert_trains, call, count_attention_runs, encoder_family_tests,
                            file_tensors, head_cases, masked, perturb, qa_reference_loss, same_weights,
                            tiny_batch, tiny_config)
from fusedlm.models import (BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering,
                            BertForSequenceClassification, BertForTokenClassification, BertModel,
                            mask_tokens)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16, num_labels=3)


def _config(**changes):
    return tiny_config(transformers.BertConfig, TINY, **changes)


CASES = head_cases(
    "Bert",
    model=(BertModel, "BertModel", {}, ("last_hidden_state",), ("pooler_output",)),
    pretraining=(BertForPreTraining, "BertForPreTraining", {}, ("prediction_logits",),
                 ("seq_relationship_logits",)),
    masked_lm=(BertForMaskedLM, "BertForMaskedLM", {}, ("logits",), ()),
)


globals().update(encoder_family_tests(
    CASES, _config, TINY, encoder=("embeddings.", "encoder."),
    encoder_weights=5 + 16 * TINY["num_hidden_layers"],
    checkpoints=[("BertModel", BertForSequenceClassification), ("BertModel", BertForMaskedLM),
                 ("BertForPreTraining", BertForSequenceClassification),
                 ("BertForPreTraining", BertForMaskedLM), ("BertForMaskedLM", BertForTokenClassification),
                 ("BertForMaskedLM", BertModel), ("BertForPreTraining", BertModel),
                 ("BertForSequenceClassification", BertModel)],
    output_embeddings=lambda model: model.cls.predictions.decoder))


# --- every forward argument and output ----------------------------------------------------------

def test_inputs_embeds_position_ids_and_token_types_match_transformers():
    assert_embeds_and_positions_match(BertModel, _config(), tiny_batch(), TINY["hidden_size"])


def test_output_attentions_and_hidden_states_match_transformers_and_index_like_theirs():
    assert_attentions_and_outputs_match(*same_weights(BertForSequenceClassification, _config()), tiny_batch(),
                                        TINY["num_hidden_layers"])


def test_config_output_flags_are_defaults():
    ours, _ = same_weights(BertModel, _config(output_hidden_states=True))
    with torch.no_grad():
        out = ours(tiny_batch()["input_ids"])
    assert len(out.hidden_states) == TINY["num_hidden_layers"] + 1


# --- checkpoints of every layout ---------------------------------------------------------------

def test_a_bert_model_saved_without_pooler_loads_and_reports_the_pooler(tmp_path):
    BertModel(_config(), add_pooling_layer=False).save_pretrained(tmp_path)
    model, info = BertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["pooler.dense.bias", "pooler.dense.weight"]
    same = BertModel.from_pretrained(tmp_path, add_pooling_layer=False, output_loading_info=True)[1]
    assert not same["missing_keys"] and not same["unexpected_keys"]


def test_input_embeddings_are_the_word_embeddings():
    model = BertForMaskedLM(_config())
    assert model.get_input_embeddings() is model.bert.embeddings.word_embeddings


def test_sharded_folders_dtype_and_label_overrides(tmp_path):
    ours = BertForSequenceClassification(_config(id2label={0: "neg", 1: "pos", 2: "mixed"}))
    perturb(ours)
    ours.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    theirs = transformers.BertForSequenceClassification.from_pretrained(tmp_path)
    assert theirs.config.id2label == {0: "neg", 1: "pos", 2: "mixed"}
    for name, value in ours.state_dict().items():
        assert torch.equal(theirs.state_dict()[name], value), name
    half = BertForSequenceClassification.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.bert.encoder.layer[0].output.dense.weight.dtype == torch.bfloat16
    five, info = BertForSequenceClassification.from_pretrained(
        tmp_path, num_labels=5, ignore_mismatched_sizes=True, output_loading_info=True)
    assert five.classifier.out_features == 5 and info["mismatched_keys"]


def test_a_checkpoint_of_another_head_is_reported_not_silently_used(tmp_path):
    BertForMaskedLM(_config()).save_pretrained(tmp_path)
    _, info = BertForTokenClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["classifier.bias", "classifier.weight"]
    assert any(k.startswith("cls.predictions") for k in info["unexpected_keys"])


def test_older_checkpoints_with_position_ids_buffers_load(tmp_path):
    from safetensors.torch import save_file
    theirs = transformers.BertModel(_config())
    theirs.save_pretrained(tmp_path)
    state = file_tensors(tmp_path)
    state["embeddings.position_ids"] = torch.arange(16)[None]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model, info = BertModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"]
    assert torch.equal(model.embeddings.position_ids, torch.arange(16)[None])


# --- the deliberate differences (README: Models) -----------------------------------------------

def test_outputs_at_padding_positions_are_zeros():
    ours, _ = same_weights(BertModel, _config())
    batch = tiny_batch()
    with torch.no_grad():
        hidden = ours(batch["input_ids"], batch["attention_mask"]).last_hidden_state
    assert torch.all(hidden[batch["attention_mask"] == 0] == 0)


def test_question_answering_never_answers_padding():
    ours, theirs = same_weights(BertForQuestionAnswering, _config(num_labels=2))
    batch = tiny_batch()
    with torch.no_grad():
        out = call(ours, batch)
        expected = call(theirs, batch)
    padding = batch["attention_mask"] == 0
    lowest = torch.finfo(out.start_logits.dtype).min
    assert torch.all(out.start_logits[padding] == lowest) and torch.all(out.end_logits[padding] == lowest)
    assert_rel(out.start_logits[~padding], expected.start_logits[~padding], "start_logits")
    assert_rel(out.loss, qa_reference_loss(expected.start_logits, expected.end_logits, batch), "loss")


def test_token_labels_at_padding_are_ignored():
    ours, theirs = same_weights(BertForTokenClassification, _config())
    batch = tiny_batch()
    labels = torch.randint(3, batch["input_ids"].shape)  # labels at padding too, not -100
    with torch.no_grad():
        ours_loss = call(ours, {**batch, "labels": labels}).loss
        real_only = labels.masked_fill(batch["attention_mask"] == 0, -100)
        expected = call(theirs, {**batch, "labels": real_only}).loss
    assert_rel(ours_loss, expected, "loss over real tokens")


# --- training ----------------------------------------------------------------------------------

CORPUS = Corpus()
TRAIN = dict(TINY, vocab_size=CORPUS.vocab_size, hidden_size=64, intermediate_size=128,
             max_position_embeddings=32, num_labels=2,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
KEYWORD = CORPUS.ids["the"]


def _classes(batch, generator):
    """Whether the sentence holds the word "the"."""
    return {**batch, "labels": (batch["input_ids"] == KEYWORD).any(1).long()}


def _tags(batch, generator):
    """Each real token's id modulo 2; special tokens and padding unlabelled."""
    tags = batch["input_ids"] % 2
    return {**batch, "labels": tags.masked_fill(batch["input_ids"] < len(SPECIALS), -100)}


def _spans(batch, generator):
    """The answer is the two tokens after a [MASK] put in at a random place in the sentence."""
    ids = batch["input_ids"].clone()
    lengths = batch["attention_mask"].sum(1)
    where = (torch.rand(len(ids), generator=generator) * (lengths - 4)).long() + 1
    ids[torch.arange(len(ids)), where] = MASK
    return {**batch, "input_ids": ids, "start_positions": where + 1, "end_positions": where + 2}


def _pretraining(batch, generator):
    return masked(batch, CORPUS.vocab_size, generator)


TASKS = {
    "pretraining": (BertForPreTraining, True, _pretraining),
    "masked_lm": (BertForMaskedLM, False, _pretraining),
    "sequence": (BertForSequenceClassification, False, _classes),
    "token": (BertForTokenClassification, False, _tags),
    "qa": (BertForQuestionAnswering, False, _spans),
}


@pytest.mark.parametrize("task", list(TASKS))
def test_every_head_trains_and_the_cpu_backend_follows_the_reference(task):
    cls, pairs, label = TASKS[task]
    torch.manual_seed(0)  # a convergence test: one fixed initialisation, as for ELECTRA's
    model = cls(transformers.BertConfig(**TRAIN))
    assert_trains(model, lambda g: label(CORPUS.batch(16, g, pairs=pairs), g), steps=200)


# --- masking -----------------------------------------------------------------------------------

def assert_fraction(count, total, p, name):
    """count / total within 5 binomial standard deviations of p."""
    tol = 5 * (p * (1 - p) / float(total)) ** 0.5
    assert abs(float(count) / float(total) - p) < tol, f"{name}: {float(count) / float(total):.4f}, not {p}"


def test_masking_follows_the_bert_recipe_and_never_touches_special_tokens_or_padding():
    vocab = 1000
    ids = torch.randint(len(SPECIALS), vocab, (400, 128))
    ids[:, 0], ids[:, 64] = SPECIALS[1], SPECIALS[2]
    attention_mask = (torch.arange(128) < torch.randint(32, 129, (400, 1))).long()
    ids = ids.masked_fill(attention_mask == 0, PAD)
    generator = torch.Generator().manual_seed(1)
    masked_ids, labels = mask_tokens(ids, mask_token_id=MASK, vocab_size=vocab,
                                     special_token_ids=SPECIALS, attention_mask=attention_mask,
                                     generator=generator)
    selected = labels != -100
    candidates = (attention_mask == 1) & (ids >= len(SPECIALS))
    assert not (selected & ~candidates).any()
    assert torch.equal(masked_ids[~selected], ids[~selected])
    assert torch.equal(labels[selected], ids[selected])
    assert_fraction(selected.sum(), candidates.sum(), 0.15, "selected")
    n = selected.sum()
    as_mask = (masked_ids[selected] == MASK).sum()
    kept = (masked_ids[selected] == ids[selected]).sum()  # includes rare random draws of the same id
    assert_fraction(as_mask, n, 0.8, "[MASK]")
    assert_fraction(kept, n, 0.1 + 0.1 / vocab, "kept")
    assert_fraction(n - as_mask - kept, n, 0.1 - 0.1 / vocab, "random")

    again = mask_tokens(ids, mask_token_id=MASK, vocab_size=vocab, special_token_ids=SPECIALS,
                        attention_mask=attention_mask, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again[0], masked_ids) and torch.equal(again[1], labels)


# --- gradient checkpointing, autocast ----------------------------------------------------------

@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_gradient_checkpointing_gives_the_same_gradients_with_dropout(use_reentrant):
    config = transformers.BertConfig(**TINY)  # dropout 0.1 everywhere
    plain = BertForMaskedLM(config).train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
    runs = count_attention_runs(checkpointed)
    batch = tiny_batch()
    grads = []
    for model in (plain, checkpointed):
        torch.manual_seed(7)
        call(model, batch).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert len(runs) == 2 * TINY["num_hidden_layers"]  # each layer ran again in the backward
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)

    torch.manual_seed(8)  # another dropout draw gives other gradients: dropout is on
    plain.zero_grad()
    call(plain, batch).loss.backward()
    assert not torch.allclose(plain.bert.embeddings.word_embeddings.weight.grad,
                              grads[0]["bert.embeddings.word_embeddings.weight"])


def test_gradient_checkpointing_every_n_layers_recomputes_those_layers_only():
    plain = BertForMaskedLM(_config(num_hidden_layers=4)).train()
    if "every_n_layers" not in inspect.signature(plain._set_gradient_checkpointing).parameters:
        pytest.skip("this transformers checkpoints every layer or none")
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable(every_n_layers=2)
    runs = count_attention_runs(checkpointed)
    batch = tiny_batch()
    for model in (plain, checkpointed):
        call(model, batch).loss.backward()
    assert len(runs) == 4 + 2  # layers 0 and 2 ran again in the backward
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_runs_in_half_precision_close_to_float32(dtype):
    model = BertForPreTraining(_config()).train()
    perturb(model, 0.05)
    batch = tiny_batch()
    expected = call(model, batch).loss
    with torch.autocast("cpu", dtype=dtype):
        out = call(model, batch, return_logits=True)
    assert out.prediction_logits.dtype == dtype
    assert_rel(out.loss, expected, "loss", tol=3e-2)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, name", REFUSED_SETTINGS)
def test_settings_the_fused_path_cannot_honour_are_refused_by_name(changes, name):
    with pytest.raises(ValueError, match=name):
        BertModel(transformers.BertConfig(**{**TINY, **changes}))


def test_bad_inputs_name_the_argument():
    model = BertModel(_config())
    ids = torch.randint(VOCAB, (2, 8))
    with pytest.raises(ValueError, match="input_ids"):
        model(ids.float())
    with pytest.raises(ValueError, match="input_ids and inputs_embeds"):
        model(ids, inputs_embeds=torch.randn(2, 8, 32))
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, attention_mask=torch.ones(2, 7))
    with pytest.raises(ValueError, match="token_type_ids"):
        model(ids, token_type_ids=torch.zeros(3, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(VOCAB, (1, 17)))
    with pytest.raises(ValueError, match="mask_token_id"):
        mask_tokens(ids, mask_token_id=VOCAB, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="probability"):
        mask_tokens(ids, mask_token_id=MASK, vocab_size=VOCAB, probability=1.5)


def test_a_masked_lm_loss_over_no_labelled_token_is_zero():
    model = BertForMaskedLM(_config())
    batch = tiny_batch()
    labels = torch.full_like(batch["input_ids"], -100)
    for mode in (model.train(), model.eval()):
        loss = call(mode, {**batch, "labels": labels}).loss
        assert loss.item() == 0.0
