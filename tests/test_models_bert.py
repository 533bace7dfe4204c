"""fusedlm.models.bert against transformers' BERT of the same weights, checkpoints both
ways, training, masking, gradient checkpointing and argument errors."""
import copy

import pytest
import torch

from models_helpers import (MASK, PAD, SPECIALS, Corpus, assert_matches_transformers,  # noqa: F401
                            assert_rel, assert_trains, call, masked, parity_batch,
                            perturb, qa_reference_loss)
from fusedlm.models import (BertConfig, BertForMaskedLM, BertForPreTraining, BertForQuestionAnswering,
                            BertForSequenceClassification, BertForTokenClassification, BertModel,
                            mask_tokens)

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")
pytest.importorskip("safetensors")

VOCAB = 40
LENGTHS = (12, 9, 5)  # padding in two rows: the packed path runs
TINY = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=16, num_labels=3)


def _configs(**changes):
    ours = BertConfig(**{**TINY, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0,
                         **changes})
    fields = {k: v for k, v in ours.to_dict().items() if k not in ("model_type", "gradient_checkpointing")}
    return ours, transformers.BertConfig(**fields, attn_implementation="eager")


def _batch():
    return parity_batch(VOCAB, LENGTHS)


def _hidden_loss(out, batch, weight):
    """A loss of the encoder's outputs at real tokens (padding positions differ by design)."""
    real = batch["attention_mask"].bool()
    return (out.last_hidden_state[real] * weight).sum() + out.pooler_output.sum()


# name: (ours, transformers' class, the batch entries they take as labels, output fields per
# token (compared at real tokens), fields per sequence)
CASES = {
    "model": (BertModel, "BertModel", {}, ("last_hidden_state",), ("pooler_output",)),
    "pretraining": (BertForPreTraining, "BertForPreTraining", {},
                    ("prediction_logits",), ("seq_relationship_logits",)),
    "masked_lm": (BertForMaskedLM, "BertForMaskedLM", {}, ("logits",), ()),
    "sequence": (BertForSequenceClassification, "BertForSequenceClassification",
                 {"labels": "class_labels"}, (), ("logits",)),
    "token": (BertForTokenClassification, "BertForTokenClassification",
              {"labels": "tag_labels"}, ("logits",), ()),
    "qa": (BertForQuestionAnswering, "BertForQuestionAnswering", {},
           ("start_logits", "end_logits"), ()),
}


def _inputs(batch, renames):
    return {**batch, **{k: batch[v] for k, v in renames.items()}}


def _loss(case, out, batch, weight):
    if case == "model":
        return _hidden_loss(out, batch, weight)
    if case == "qa":
        return qa_reference_loss(out.start_logits, out.end_logits, batch)
    return out.loss


@pytest.mark.parametrize("case", list(CASES))
def test_same_weights_as_transformers_give_the_same_outputs_loss_and_gradients(case, tmp_path):
    cls, hf_name, renames, per_token, per_sequence = CASES[case]
    ours_config, hf_config = _configs(**({"num_labels": 2} if case == "qa" else {}))
    batch = _inputs(_batch(), renames)
    weight = torch.randn(int(batch["attention_mask"].sum()), TINY["hidden_size"])
    assert_matches_transformers(cls, getattr(transformers, hf_name), hf_config, batch,
                                lambda out: _loss(case, out, batch, weight), per_token, per_sequence,
                                TINY["num_hidden_layers"], tmp_path)


def test_without_padding_the_unpacked_path_matches_transformers(tmp_path):
    _, hf_config = _configs()
    batch = parity_batch(VOCAB, (12, 12, 12))
    assert_matches_transformers(BertForMaskedLM, transformers.BertForMaskedLM, hf_config, batch,
                                lambda out: out.loss, ("logits",), (), TINY["num_hidden_layers"],
                                tmp_path)


def test_masked_lm_in_training_builds_no_logits_unless_asked():
    ours_config, _ = _configs()
    model = BertForMaskedLM(ours_config).train()
    batch = _batch()
    fused = call(model, batch)
    assert fused.logits is None
    full = call(model, batch, return_logits=True)
    assert full.logits.shape == (len(LENGTHS), max(LENGTHS), VOCAB)
    assert_rel(fused.loss, full.loss, "loss")


def test_regression_and_multi_label_losses_match_transformers(tmp_path):
    for num_labels, labels in ((1, torch.randn(3)), (3, torch.randint(2, (3, 3)).float())):
        ours_config, hf_config = _configs(num_labels=num_labels)
        theirs = transformers.BertForSequenceClassification(hf_config).eval()
        theirs.save_pretrained(tmp_path / str(num_labels))
        ours = BertForSequenceClassification.from_pretrained(tmp_path / str(num_labels)).eval()
        batch = {**_batch(), "labels": labels}
        assert_rel(call(ours, batch).loss, call(theirs, batch).loss, f"loss ({num_labels} labels)")


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


TASKS = {
    "pretraining": (BertForPreTraining, True, lambda b, g: masked(b, CORPUS.vocab_size, g)),
    "masked_lm": (BertForMaskedLM, False, lambda b, g: masked(b, CORPUS.vocab_size, g)),
    "sequence": (BertForSequenceClassification, False, _classes),
    "token": (BertForTokenClassification, False, _tags),
    "qa": (BertForQuestionAnswering, False, _spans),
}


@pytest.mark.parametrize("task", list(TASKS))
def test_every_head_trains_and_the_cpu_backend_follows_the_reference(task):
    cls, pairs, label = TASKS[task]
    model = cls(BertConfig(**TRAIN))
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

def test_gradient_checkpointing_gives_the_same_gradients_with_dropout():
    config = BertConfig(**TINY)  # dropout 0.1 everywhere
    plain = BertForMaskedLM(config).train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.gradient_checkpointing_enable()
    calls = []
    for layer in checkpointed.bert.encoder.layers:
        layer.forward = _counted(layer.forward, calls)
    batch = _batch()
    grads = []
    for model in (plain, checkpointed):
        torch.manual_seed(7)
        call(model, batch).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert len(calls) == 2 * TINY["num_hidden_layers"]  # each layer ran again in the backward
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)

    torch.manual_seed(8)  # another dropout draw gives other gradients: dropout is on
    plain.zero_grad()
    call(plain, batch).loss.backward()
    assert not torch.allclose(plain.bert.embeddings.word_embeddings.weight.grad,
                              grads[0]["bert.embeddings.word_embeddings.weight"])


def _counted(forward, calls):
    def run(*args):
        calls.append(1)
        return forward(*args)
    return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_autocast_runs_in_half_precision_close_to_float32(dtype):
    config, _ = _configs()
    model = BertForPreTraining(config).train()
    perturb(model, 0.05)
    batch = _batch()
    expected = call(model, batch).loss
    with torch.autocast("cpu", dtype=dtype):
        out = call(model, batch, return_logits=True)
    assert out.prediction_logits.dtype == dtype
    assert_rel(out.loss, expected, "loss", tol=3e-2)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- errors ------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, name", [
    ({"hidden_size": 30}, "hidden_size"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"hidden_dropout_prob": 1.5}, "hidden_dropout_prob"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"problem_type": "ranking"}, "problem_type"),
])
def test_bad_configs_name_the_field(changes, name):
    with pytest.raises(ValueError, match=name):
        BertConfig(**{**TINY, **changes})


def test_bad_inputs_name_the_argument():
    model = BertModel(BertConfig(**TINY))
    ids = torch.randint(VOCAB, (2, 8))
    with pytest.raises(ValueError, match="input_ids"):
        model(ids.float())
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


def test_a_checkpoint_of_another_head_names_what_it_lacks(tmp_path):
    BertForMaskedLM(BertConfig(**TINY)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="missing: classifier.weight, classifier.bias"):
        BertForTokenClassification.from_pretrained(tmp_path)
