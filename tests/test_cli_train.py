"""fusedlm pretrain end to end: training then inference from the output folder, resume
equality with an uninterrupted run, atomic checkpoints, and two processes under torchrun
against one."""
import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import TINY, run_cli, write_corpus
from fusedlm.cli import checkpoint, registry
from fusedlm.cli import tokenizer as tokenizer_module
from fusedlm.cli import train as train_module
from fusedlm.cli.distributed import Processes
from fusedlm.cli.train import read_metrics
from fusedlm.cli.tokenizer import load as load_tokenizer
from fusedlm.models import (AlbertForPreTraining, AWDLSTMForLanguageModeling,
                            AWDLSTMForSequenceClassification, BertForMaskedLM, BertForSequenceClassification,
                            BertForTokenClassification, ElectraForJointPreTraining,
                            ElectraForPreTraining, ELMo, ElmoBiLM, RobertaForMaskedLM,
                            RobertaForSequenceClassification)
from fusedlm.models.gpt import GPT2LMHeadModel

pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt")


def losses(out):
    return [(r["step"], r["loss"]) for r in read_metrics(out / "metrics.jsonl")]


def test_gpt_pretrain_then_generate(capsys, tmp_path, corpus):
    out = tmp_path / "gpt"
    code, stdout, _ = run_cli(capsys, "pretrain", "--model", "gpt", "--corpus", corpus,
                              "--steps", 8, "--lr", "3e-3", "--out", out, *TINY)
    assert code == 0 and str(out) in stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "metrics.jsonl", "loss.png",
            "checkpoint-8"} <= {p.name for p in out.iterdir()}
    record = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in record] == list(range(1, 9))
    assert record[-1]["loss"] < record[0]["loss"] - 0.5
    assert record[-1]["tokens"] == 8 * 4 * 32 and record[0]["lr"] > record[-1]["lr"] > 0
    model = GPT2LMHeadModel.from_pretrained(out)
    assert model.config.n_layer == 2 and model.config.n_embd == 128 and model.config.n_head == 2

    code, text, err = run_cli(capsys, "generate", "--model", out, "--prompt", "Return the",
                              "--max-new-tokens", 12, "--temperature", 0, "--device", "cpu")
    assert code == 0, err
    assert text.startswith("Return the") and len(text) > len("Return the\n")
    # Greedy decoding is the model's own greedy continuation.
    tokenizer = load_tokenizer(out)
    ids = torch.tensor([tokenizer.encode("Return the").ids])
    eos = model.config.eos_token_id
    expect = model.eval().generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=eos)
    assert text == "Return the" + tokenizer.decode(expect[0, ids.shape[1]:].tolist()) + "\n"


def _kill_at_step(monkeypatch, step):
    """Makes the run die inside its step number ``step`` (1-based), as a kill would."""
    real, calls = train_module.Trainer.step, []

    def step_or_die(self, *args):
        calls.append(1)
        if len(calls) == step:
            raise RuntimeError("killed")
        return real(self, *args)

    monkeypatch.setattr(train_module.Trainer, "step", step_or_die)


@pytest.mark.parametrize("model", ["gpt", "bert"])
def test_resume_gives_the_losses_of_an_uninterrupted_run(capsys, tmp_path, corpus, monkeypatch,
                                                         model):
    # Dropout on (the models' default 0.1), BERT's masks, and two micro-batches: the random
    # streams, the optimizer, the schedule and the data position all have to come back.
    argv = ["pretrain", "--model", model, "--corpus", corpus, "--steps", 6, "--save-every", 3,
            "--grad-accum", 2, *TINY]
    assert run_cli(capsys, *argv, "--out", tmp_path / "straight")[0] == 0
    straight = losses(tmp_path / "straight")
    assert [s for s, _ in straight] == list(range(1, 7))

    with monkeypatch.context() as m:
        _kill_at_step(m, 5)
        with pytest.raises(RuntimeError, match="killed"):
            run_cli(capsys, *argv, "--out", tmp_path / "resumed")
    assert checkpoint.latest(tmp_path / "resumed").name == "checkpoint-3"
    assert len(losses(tmp_path / "resumed")) == 4  # step 4 was logged after the checkpoint
    code, _, err = run_cli(capsys, "pretrain", "--resume", "--out", tmp_path / "resumed",
                           "--log-every", 1, "--device", "cpu")
    assert code == 0, err
    assert losses(tmp_path / "resumed") == straight
    spec = registry.SPECS[model]
    weights = spec.load_checkpoint(checkpoint.latest(tmp_path / "straight")).state_dict()
    for k, v in spec.load_checkpoint(checkpoint.latest(tmp_path / "resumed")).state_dict().items():
        assert torch.equal(v, weights[k]), k


def test_failed_save_leaves_the_previous_checkpoint(capsys, tmp_path, corpus, monkeypatch):
    out = tmp_path / "run"
    real = checkpoint._write_tokenizer

    def fail_on_step_4(directory, tokenizer):
        if directory.name.startswith(".checkpoint-4."):
            raise OSError("disk full")
        real(directory, tokenizer)

    monkeypatch.setattr(checkpoint, "_write_tokenizer", fail_on_step_4)
    with pytest.raises(OSError, match="disk full"):
        run_cli(capsys, "pretrain", "--model", "gpt", "--corpus", corpus, "--steps", 4,
                "--save-every", 2, "--out", out, *TINY)
    assert [p.name for p in checkpoint.checkpoints(out)] == ["checkpoint-2"]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temporary left
    kept = out / "checkpoint-2"
    assert {p.name for p in kept.iterdir()} == {"config.json", "generation_config.json",
                                                "model.safetensors", "tokenizer.json",
                                                "trainer_state.pt"}
    assert checkpoint.load_state(kept)["step"] == 2
    GPT2LMHeadModel.from_pretrained(kept)
    monkeypatch.undo()
    code, _, err = run_cli(capsys, "pretrain", "--resume", "--out", out, "--device", "cpu")
    assert code == 0, err
    assert checkpoint.latest(out).name == "checkpoint-4"


def test_two_processes_match_one_on_the_same_global_batch(capsys, tmp_path, corpus):
    common = ["pretrain", "--model", "gpt", "--corpus", corpus, "--steps", 3, "--dropout", 0,
              "--size", "tiny", "--vocab-size", 400, "--seq-len", 32, "--device", "cpu",
              "--log-every", 1]
    assert run_cli(capsys, *common, "--batch-size", 4, "--out", tmp_path / "one")[0] == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "fusedlm", *map(str, common), "--batch-size", "2",
         "--tokenizer", str(tmp_path / "one"), "--out", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in two] == [1, 2, 3]
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)
    state = checkpoint.load_state(checkpoint.latest(tmp_path / "two"))
    assert state["settings"]["global_batch"] == 4 and len(state["rng"]) == 2
    assert json.loads((tmp_path / "two" / "config.json").read_text())["n_layer"] == 2


@pytest.fixture
def fsdp_group():
    """FSDP on a group of one process (in this one), as ``pretrain --fsdp`` without torchrun."""
    processes = Processes(fsdp=True)
    processes.start(torch.device("cpu"))
    yield processes
    processes.stop()


def _ties(model) -> list:
    """The groups of names under which one parameter appears more than once."""
    names = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, param in module.named_parameters(prefix=module_name, recurse=False):
            names.setdefault(id(param), set()).add(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


@pytest.mark.parametrize("name", sorted(registry.SPECS))
def test_fsdp_shards_the_layers_keeps_ties_and_gradients(corpus, fsdp_group, name):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    spec = registry.SPECS[name]
    documents = corpus.read_text().split("\n\n")
    tokenizer = tokenizer_module.train(spec.tokenizer, documents, 400)
    torch.manual_seed(0)
    model = spec.build(registry.SIZES["tiny"], tokenizer, 0.0)
    whole = copy.deepcopy(model)
    ties = _ties(model)
    if name in ("gpt", "electra"):
        assert ties  # the lm head / the embeddings ELECTRA's halves share
    inputs = spec.batch(spec.blocks(documents, tokenizer, 16)[:4], tokenizer,
                        torch.Generator().manual_seed(1))

    layers = spec.layers(model)
    fsdp_group.shard(model, layers, torch.device("cpu"), torch.float32)
    assert layers and all(isinstance(m, FSDPModule) for m in [model, *layers])
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert _ties(model) == ties
    # A loss may come with metrics (ALBERT's sentence-order accuracy).
    losses = [spec.loss(m, inputs, torch.Generator().manual_seed(2)) for m in (model, whole)]
    losses = [loss[0] if isinstance(loss, tuple) else loss for loss in losses]
    for loss in losses:
        loss.backward()
    torch.testing.assert_close(losses[0], losses[1], atol=1e-6, rtol=1e-6)
    reference = dict(whole.named_parameters())
    for key, param in model.named_parameters():
        torch.testing.assert_close(param.grad.full_tensor(), reference[key].grad,
                                   atol=1e-6, rtol=1e-5, msg=key)


def test_fsdp_on_one_process_matches_and_resumes(capsys, tmp_path, corpus, monkeypatch):
    # Without torchrun --fsdp runs on a group of one; killed and resumed, it logs the losses of
    # the same run without --fsdp, and its checkpoint is an ordinary one.
    argv = ["pretrain", "--model", "gpt", "--corpus", corpus, "--steps", 3, "--save-every", 2,
            "--dropout", 0, *TINY]
    assert run_cli(capsys, *argv, "--out", tmp_path / "plain")[0] == 0
    with monkeypatch.context() as m:
        _kill_at_step(m, 3)
        with pytest.raises(RuntimeError, match="killed"):
            run_cli(capsys, *argv, "--fsdp", "--tokenizer", tmp_path / "plain",
                    "--out", tmp_path / "fsdp")
    code, _, err = run_cli(capsys, "pretrain", "--resume", "--out", tmp_path / "fsdp",
                           "--device", "cpu")  # --fsdp comes back with the settings
    assert code == 0, err
    assert checkpoint.load_state(checkpoint.latest(tmp_path / "fsdp"))["settings"]["fsdp"]
    plain, sharded = losses(tmp_path / "plain"), losses(tmp_path / "fsdp")
    assert [s for s, _ in sharded] == [1, 2, 3]
    for (_, a), (_, b) in zip(plain, sharded):
        assert abs(a - b) <= 1e-5 * abs(a), (plain, sharded)
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "fsdp")
    assert model.lm_head.weight is model.transformer.wte.weight
    expect = GPT2LMHeadModel.from_pretrained(tmp_path / "plain").state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expect[key], atol=1e-5, rtol=1e-4, msg=key)
    transformers = pytest.importorskip("transformers")
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "fsdp").eval()
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model.eval()(ids).logits,
                                   atol=1e-4, rtol=1e-4)


def test_fsdp_bad_input(capsys, tmp_path, corpus, monkeypatch):
    monkeypatch.setitem(registry.SPECS, "bert",
                        dataclasses.replace(registry.SPECS["bert"], layers=None))
    code, _, err = run_cli(capsys, "pretrain", "--model", "bert", "--corpus", corpus, "--fsdp",
                           "--out", tmp_path / "out", *TINY)
    assert code == 2 and err.count("\n") == 1 and "--fsdp: bert has no layers to shard" in err
    assert not (tmp_path / "out").exists()


def test_fsdp_two_processes_match_one_and_resume(capsys, tmp_path, corpus):
    # GPT: its loss is a mean over every token, so two processes' mean of their rows' losses is
    # one process's loss of the global batch (BERT's mean over each process's masked tokens
    # is not, with or without --fsdp); its lm head, tied to the token embedding, is sharded.
    # Two steps, then --resume to a third: the optimizer state goes through a checkpoint.
    common = ["--model", "gpt", "--corpus", corpus, "--steps", 2, "--dropout", 0, "--size",
              "tiny", "--vocab-size", 400, "--seq-len", 32, "--device", "cpu", "--log-every", 1]
    resume = ["pretrain", "--resume", "--steps", 3, "--device", "cpu"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_cli(capsys, "pretrain", *common, "--batch-size", 4, "--out", one)[0] == 0
    assert run_cli(capsys, *resume, "--out", one)[0] == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", "-m", "fusedlm"]
    for argv in (["pretrain", *common, "--batch-size", 2, "--fsdp", "--tokenizer", one],
                 resume):
        done = subprocess.run([*torchrun, *map(str, argv), "--out", str(two)],
                              capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    assert [s for s, _ in losses(two)] == [1, 2, 3]
    for (_, a), (_, b) in zip(losses(one), losses(two)):
        assert abs(a - b) <= 1e-5 * abs(a), (losses(one), losses(two))
    state = checkpoint.load_state(checkpoint.latest(two))
    assert state["settings"]["fsdp"] and len(state["rng"]) == 2
    model = GPT2LMHeadModel.from_pretrained(two)
    assert model.lm_head.weight is model.transformer.wte.weight
    expect = GPT2LMHeadModel.from_pretrained(one).state_dict()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, expect[key], atol=1e-5, rtol=1e-4, msg=key)


def _labelled_data(root):
    """Tiny generated fine-tuning sets: sentiment words decide the class; names and
    numbers are tagged PER and NUM, every other word O."""
    import csv
    import random

    draw = random.Random(0)
    good, bad = "good great fine happy lovely nice".split(), "bad awful poor sad ugly nasty".split()
    filler, names = "the a this it was is very and so really".split(), "alice bob carol dave".split()

    def classify_row():
        positive = draw.random() < 0.5
        words = draw.sample(filler, 4) + draw.sample(good if positive else bad, 2)
        draw.shuffle(words)
        return {"text": " ".join(words), "label": "pos" if positive else "neg"}

    def tag_row():
        words, tags = [], []
        for _ in range(6):
            kind = draw.random()
            word, tag = ((draw.choice(names), "PER") if kind < 0.3 else
                         (str(draw.randint(1, 99)), "NUM") if kind < 0.5 else (draw.choice(filler), "O"))
            words.append(word)
            tags.append(tag)
        return {"text": words, "label": tags}

    with open(root / "classify_train.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["text", "label"])
        writer.writeheader()
        writer.writerows(classify_row() for _ in range(160))
    for name, row, count in (("classify_eval.jsonl", classify_row, 40),
                             ("tag_train.jsonl", tag_row, 160), ("tag_eval.jsonl", tag_row, 40)):
        (root / name).write_text("".join(json.dumps(row()) + "\n" for _ in range(count)))
    return root


@pytest.fixture(scope="module")
def bert(tmp_path_factory, corpus):
    out = tmp_path_factory.mktemp("bert") / "bert"
    from fusedlm.cli import main

    assert main(["pretrain", "--model", "bert", "--corpus", str(corpus), "--steps", "6",
                 "--out", str(out), *TINY]) == 0
    return out


def test_bert_pretrain_then_fill_mask(capsys, bert):
    record = read_metrics(bert / "metrics.jsonl")
    assert [r["step"] for r in record] == list(range(1, 7)) and record[-1]["loss"] < record[0]["loss"]
    model = BertForMaskedLM.from_pretrained(bert).eval()
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 128

    code, out, err = run_cli(capsys, "fill-mask", "--model", bert, "--top-k", 3, "--device", "cpu",
                             "Return the [MASK] of the [MASK].")
    assert code == 0, err
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["[MASK] 1", "[MASK] 2"]
    # The candidates are the model's own top 3 at each mask, most probable first.
    tokenizer = load_tokenizer(bert)
    ids = tokenizer.encode("Return the [MASK] of the [MASK].").ids
    where = [i for i, t in enumerate(ids) if t == tokenizer.token_to_id("[MASK]")]
    with torch.no_grad():
        best = model(torch.tensor([ids])).logits[0, where].topk(3).indices
    for line, row in zip(lines, best.tolist()):
        assert [c.rsplit(" (", 1)[0] for c in line.split(": ", 1)[1].split(", ")] == \
            [tokenizer.id_to_token(t) for t in row]
    assert lines[2].startswith("return the")

    code, _, err = run_cli(capsys, "fill-mask", "--model", bert, "no mask here")
    assert code == 2 and err.count("\n") == 1 and "no [MASK] token" in err


@pytest.mark.parametrize("suffix", [".npy", ".safetensors"])
def test_bert_embed_writes_one_vector_per_line(capsys, tmp_path, bert, suffix):
    lines = tmp_path / "lines.txt"
    lines.write_text("Return the value.\n\nRaise an error if the file is missing.\n")
    out = tmp_path / f"vectors{suffix}"
    code, _, err = run_cli(capsys, "embed", "--model", bert, lines, "--out", out, "--device", "cpu")
    assert code == 0, err
    if suffix == ".npy":
        import numpy as np

        vectors = torch.from_numpy(np.load(out))
    else:
        from safetensors.torch import load_file

        vectors = load_file(out)["embeddings"]
    tokenizer = load_tokenizer(bert)
    model = BertForMaskedLM.from_pretrained(bert).eval()
    with torch.no_grad():
        for row, text in zip(vectors, ["Return the value.", "Raise an error if the file is missing."]):
            hidden = model.bert(torch.tensor([tokenizer.encode(text).ids])).last_hidden_state[0]
            torch.testing.assert_close(row, hidden.mean(0), atol=1e-5, rtol=1e-5)
    assert vectors.shape == (2, 128)


@pytest.mark.parametrize("task", ["classify", "tag"])
def test_finetune_learns_a_separable_task(capsys, tmp_path, bert, task):
    data = _labelled_data(tmp_path)
    train = data / ("classify_train.csv" if task == "classify" else "tag_train.jsonl")
    out = tmp_path / task
    code, stdout, err = run_cli(capsys, "finetune", "--model", bert, "--task", task, "--train", train,
                                "--eval", data / f"{task}_eval.jsonl", "--epochs", 3,
                                "--batch-size", 8, "--device", "cpu", "--out", out)
    assert code == 0, err
    scores = json.loads((out / "eval.json").read_text())
    assert scores["epoch"] == 3 and scores["accuracy"] >= 0.9 and scores["f1"] >= 0.9, stdout
    names = json.loads((out / "labels.json").read_text())
    assert names == (["neg", "pos"] if task == "classify" else ["NUM", "O", "PER"])
    model_class = BertForSequenceClassification if task == "classify" else BertForTokenClassification
    config = model_class.from_pretrained(out).config
    assert config.num_labels == len(names) and list(config.id2label.values()) == names


def test_finetune_bad_input(capsys, tmp_path, bert):
    data = _labelled_data(tmp_path)
    (tmp_path / "bad.jsonl").write_text('{"text": "fine", "label": "pos"}\nnot json\n')
    (tmp_path / "unseen.jsonl").write_text('{"text": "fine", "label": "meh"}\n')
    (tmp_path / "short.jsonl").write_text('{"text": ["alice", "is"], "label": ["PER"]}\n')
    base = ["finetune", "--model", bert, "--device", "cpu", "--out", tmp_path / "out"]
    cases = [
        (["--task", "classify", "--train", tmp_path / "bad.jsonl", "--eval", tmp_path / "bad.jsonl"],
         "line 2: not JSON"),
        (["--task", "classify", "--train", data / "classify_train.csv", "--eval",
          tmp_path / "unseen.jsonl"], "labels --train lacks: meh"),
        (["--task", "tag", "--train", tmp_path / "short.jsonl", "--eval", tmp_path / "short.jsonl"],
         "2 words but 1 labels"),
        (["--task", "classify", "--train", data / "classify_train.csv", "--eval",
          data / "classify_eval.jsonl", "--label-column", "sentiment"], "no 'sentiment' value"),
    ]
    for argv, message in cases:
        code, _, err = run_cli(capsys, *base, *argv)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    code, _, err = run_cli(capsys, *base, "--task", "classify", "--train", data / "classify_train.csv",
                           "--eval", data / "classify_eval.jsonl", "--lm-epochs", 2, "--bptt", 9)
    assert code == 2 and "--lm-epochs, --bptt: only a ULMFiT language model takes these" in err
    assert not (tmp_path / "out").exists()
    code, _, err = run_cli(capsys, "finetune", "--model", bert, "--task", "classify", "--train",
                           data / "classify_train.csv", "--eval", data / "classify_eval.jsonl",
                           "--out", bert)
    assert code == 2 and "already holds a checkpoint" in err


def _pretrained(capsys, model: str, corpus, out, steps: int):
    """``fusedlm pretrain --model model`` for ``steps`` steps into out, its loss falling."""
    code, _, err = run_cli(capsys, "pretrain", "--model", model, "--corpus", corpus,
                           "--steps", steps, "--out", out, *TINY)
    assert code == 0, err
    record = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in record] == list(range(1, steps + 1))
    assert record[-1]["loss"] < record[0]["loss"]


def test_roberta_pretrain_then_fill_mask_embed_and_finetune(capsys, tmp_path, corpus):
    out = tmp_path / "roberta"
    _pretrained(capsys, "roberta", corpus, out, 6)
    model = RobertaForMaskedLM.from_pretrained(out).eval()
    config = model.config
    assert config.type_vocab_size == 1 and config.max_position_embeddings == config.pad_token_id + 513
    tokenizer = load_tokenizer(out)
    ids = tokenizer.encode("Return the <mask> of the list.").ids
    # Byte-level BPE framed as RoBERTa's: <s> text </s>, the mask one token.
    assert ids[0] == tokenizer.token_to_id("<s>") and ids[-1] == tokenizer.token_to_id("</s>")
    mask = tokenizer.token_to_id("<mask>")
    assert ids.count(mask) == 1

    code, text, err = run_cli(capsys, "fill-mask", "--model", out, "--top-k", 2, "--device", "cpu",
                              "Return the <mask> of the list.")
    assert code == 0, err
    with torch.no_grad():
        best = model(torch.tensor([ids])).logits[0, ids.index(mask)].topk(2).indices.tolist()
    first = text.splitlines()[0]
    assert first.startswith("<mask> 1: ")
    assert [c.rsplit(" (", 1)[0] for c in first.split(": ", 1)[1].split(", ")] == \
        [tokenizer.decode([t]) for t in best]
    _serves_every_command(capsys, tmp_path, out, "<mask>", RobertaForSequenceClassification)


def _serves_every_command(capsys, tmp_path, out, mask: str, classifier_class):
    """fill-mask, embed and finetune (classify) all take the folder ``out``."""
    code, text, err = run_cli(capsys, "fill-mask", "--model", out, "--device", "cpu",
                              f"Return the {mask} of the list.")
    assert code == 0 and text.startswith(f"{mask} 1: "), err
    lines = tmp_path / "lines.txt"
    lines.write_text("Return the value.\n")
    code, _, err = run_cli(capsys, "embed", "--model", out, lines, "--out", tmp_path / "v.npy",
                           "--device", "cpu")
    assert code == 0, err
    data = _labelled_data(tmp_path)
    code, _, err = run_cli(capsys, "finetune", "--model", out, "--task", "classify", "--train",
                           data / "classify_train.csv", "--eval", data / "classify_eval.jsonl",
                           "--epochs", 1, "--batch-size", 8, "--device", "cpu",
                           "--out", tmp_path / "classify")
    assert code == 0, err
    assert classifier_class.from_pretrained(tmp_path / "classify").config.num_labels == 2


def test_albert_pretrain_with_sentence_order_then_every_command(capsys, tmp_path, corpus):
    import transformers

    out = tmp_path / "albert"
    code, _, err = run_cli(capsys, "pretrain", "--model", "albert", "--corpus", corpus,
                           "--steps", 20, "--lr", "5e-3", "--embedding-size", 32, "--out", out,
                           *TINY)
    assert code == 0, err
    record = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in record] == list(range(1, 21))
    # The loss on one fixed batch of 64 rows, of the model as pretrain built it (seed 0)
    # and as trained: a step's own loss, of 4 rows, is too noisy to fall step by step.
    tokenizer = load_tokenizer(out)
    blocks = registry.ALBERT.blocks(corpus.read_text().split("\n\n"), tokenizer, 32)[:64]
    batch = registry.ALBERT.batch(blocks, tokenizer, torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    start = registry.ALBERT.build(registry.SIZES["tiny"], tokenizer, None, 32)
    with torch.no_grad():
        before, after = (float(registry.ALBERT.loss(m.eval(), batch, None)[0])
                         for m in (start, AlbertForPreTraining.from_pretrained(out)))
    assert after < before - 0.05, (before, after)
    # Each record's accuracy is of its step's 4 sentence-order predictions.
    assert all(r["sop_accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0) for r in record)
    # transformers' own class reads the folder: one shared layer, embeddings of 32.
    model = transformers.AlbertForPreTraining.from_pretrained(out)
    assert model.config.embedding_size == 32 and model.config.num_hidden_groups == 1
    assert model.config.hidden_size == 128
    code, _, err = run_cli(capsys, "pretrain", "--resume", "--out", out, "--steps", 21,
                           "--device", "cpu")
    assert code == 0, err
    assert "sop_accuracy" in read_metrics(out / "metrics.jsonl")[-1]
    from fusedlm.models import AlbertForSequenceClassification

    _serves_every_command(capsys, tmp_path, out, "[MASK]", AlbertForSequenceClassification)
    code, _, err = run_cli(capsys, "pretrain", "--model", "bert", "--corpus", corpus,
                           "--embedding-size", 32, "--out", tmp_path / "bert", *TINY)
    assert code == 2 and "--embedding-size: bert's embeddings are as wide" in err


def test_sentence_order_rows_are_two_consecutive_segments(tmp_path, corpus):
    tokenizer = tokenizer_module.train("wordpiece", [open(corpus).read()], 400)
    cls, sep = (tokenizer_module.role_id(tokenizer, r) for r in ("cls", "sep"))
    blocks = torch.arange(1000, 1000 + 64 * 13).view(64, 13)  # ids no tokenizer role has
    batch = registry.ALBERT.batch(blocks, tokenizer, torch.Generator().manual_seed(0))
    labels, order = batch["labels"], batch["sentence_order_label"]
    assert 10 < order.sum() < 54  # about half swapped
    ids = torch.where(labels >= 0, labels, batch["input_ids"])  # unmasked
    for row, block, swapped, types in zip(ids, blocks, order, batch["token_type_ids"]):
        assert row[0] == cls and row[-1] == sep and (row == sep).sum() == 2
        middle = int((row[1:-1] == sep).nonzero()) + 1
        first, second = row[1:middle], row[middle + 1:-1]
        assert len(first) and len(second)
        a, b = (second, first) if swapped else (first, second)
        assert torch.equal(torch.cat([a, b]), block)
        assert types.tolist() == [0] * (middle + 1) + [1] * (len(row) - middle - 1)


def test_distilbert_pretrain_then_every_command(capsys, tmp_path, corpus):
    import transformers

    out = tmp_path / "distilbert"
    _pretrained(capsys, "distilbert", corpus, out, 6)
    model = transformers.DistilBertForMaskedLM.from_pretrained(out)
    assert model.config.n_layers == 2 and model.config.dim == 128
    from fusedlm.models import DistilBertForSequenceClassification

    _serves_every_command(capsys, tmp_path, out, "[MASK]", DistilBertForSequenceClassification)


def test_electra_pretrain_exports_the_discriminator(capsys, tmp_path, corpus):
    out = tmp_path / "electra"
    _pretrained(capsys, "electra", corpus, out, 4)
    whole = ElectraForJointPreTraining.from_pretrained(checkpoint.latest(out))
    exported = ElectraForPreTraining.from_pretrained(out)  # the discriminator
    for name, value in exported.state_dict().items():
        assert torch.equal(value, whole.discriminator.state_dict()[name]), name
    lines = tmp_path / "lines.txt"
    lines.write_text("Return the value.\n")
    code, _, err = run_cli(capsys, "embed", "--model", out, lines, "--pool", "first", "--device", "cpu")
    assert code == 0, err
    # The checkpoint's generator fills masks, with the checkpoint's tokenizer.
    code, _, err = run_cli(capsys, "fill-mask", "--model", checkpoint.latest(out), "the [MASK]")
    assert code == 2 and "holds two models; pass" in err
    code, text, err = run_cli(capsys, "fill-mask", "--model", checkpoint.latest(out) / "generator",
                              "the [MASK]", "--device", "cpu")
    assert code == 0 and text.startswith("[MASK] 1: "), err
    code, _, err = run_cli(capsys, "pretrain", "--resume", "--out", out, "--steps", 5,
                           "--device", "cpu")
    assert code == 0, err
    assert checkpoint.latest(out).name == "checkpoint-5"


def test_elmo_pretrain_then_embed(capsys, tmp_path, corpus):
    out = tmp_path / "elmo"
    code, _, err = run_cli(capsys, "pretrain", "--model", "elmo", "--corpus", corpus, "--steps", 4,
                           "--lr", "3e-3", "--out", out, *TINY)
    assert code == 0, err
    record = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in record] == [1, 2, 3, 4] and record[-1]["loss"] < record[0]["loss"]
    bilm = ElmoBiLM.from_pretrained(checkpoint.latest(out))
    assert bilm.config.vocab_size == 400 and bilm.config.projection_dim == 128
    elmo = ELMo.from_pretrained(out).eval()  # the export: the biLM's encoder and LSTMs
    for name, value in elmo.state_dict().items():
        if not name.startswith("mixes."):
            assert torch.equal(value, bilm.state_dict()[name]), name

    lines = tmp_path / "lines.txt"
    lines.write_text("Return the value.\nRaise ValueError\n")
    code, _, err = run_cli(capsys, "embed", "--model", out, lines, "--device", "cpu")
    assert code == 0, err
    import numpy as np

    vectors = torch.from_numpy(np.load(tmp_path / "lines.npy"))
    with torch.no_grad():
        expect = [elmo.embed([words])[0].mean(0) for words in
                  (["Return", "the", "value", "."], ["Raise", "ValueError"])]
    torch.testing.assert_close(vectors, torch.stack(expect), atol=1e-5, rtol=1e-5)
    code, _, err = run_cli(capsys, "fill-mask", "--model", out, "a [MASK]")
    assert code == 2 and "fill-mask needs a model of one of albert, bert, distilbert, electra, roberta, not elmo" in err


def test_ulmfit_three_stages_then_generate_and_embed(capsys, tmp_path, corpus):
    """Stage 1 (pretrain), stages 2 and 3 (finetune: the language models on the task's text
    with its words added, then the classifier, scored every epoch), and the folders'
    generate and embed."""
    out = tmp_path / "ulmfit"
    _pretrained(capsys, "ulmfit", corpus, out, steps=4)
    lm = AWDLSTMForLanguageModeling.from_pretrained(out).eval()
    assert lm.config.directions == "both" and lm.config.emb_size == 128
    data = _labelled_data(tmp_path)
    classifier_dir = tmp_path / "classifier"
    code, stdout, err = run_cli(capsys, "finetune", "--model", out, "--task", "classify",
                                "--train", data / "classify_train.csv", "--eval",
                                data / "classify_eval.jsonl", "--epochs", 2, "--lm-epochs", 2,
                                "--batch-size", 16, "--device", "cpu", "--out", classifier_dir)
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[0].startswith("added ") and "awful" in lines[0]
    assert [line.split()[:2] for line in lines[1:5]] == [["lm_epoch", "1"], ["lm_epoch", "2"],
                                                         ["epoch", "1"], ["epoch", "2"]]
    assert "accuracy" in lines[3] and "f1" in lines[3]
    scores = json.loads((classifier_dir / "eval.json").read_text())
    assert scores["epoch"] == 2 and 0 <= scores["accuracy"] <= 1
    classifier = AWDLSTMForSequenceClassification.from_pretrained(classifier_dir)
    tokenizer = load_tokenizer(classifier_dir)
    assert classifier.config.vocab_size == tokenizer.get_vocab_size() > lm.config.vocab_size
    assert tokenizer.token_to_id("awful") is not None
    assert list(classifier.config.id2label.values()) == ["neg", "pos"]
    # Fine-tuned: the encoder moved from the language model's.
    assert not torch.equal(classifier.awd_lstm.lstms[0].rnns[0].weight_hh,
                           lm.awd_lstm.lstms[0].rnns[0].weight_hh)

    code, text, err = run_cli(capsys, "generate", "--model", out, "--prompt", "Return the",
                              "--max-new-tokens", 5, "--temperature", 0, "--device", "cpu")
    assert code == 0, err
    ids = load_tokenizer(out).encode("Return the", add_special_tokens=False).ids
    expect = lm.generate(torch.tensor([ids]), max_new_tokens=5)[0, len(ids):]
    assert text.strip() == ("Return the " + load_tokenizer(out).decode(expect.tolist())).strip()

    lines_file = tmp_path / "lines.txt"
    lines_file.write_text("Return the value.\nRaise an error\n")
    code, _, err = run_cli(capsys, "embed", "--model", classifier_dir, lines_file, "--device", "cpu")
    assert code == 0, err
    import numpy as np

    vectors = torch.from_numpy(np.load(tmp_path / "lines.npy"))
    with torch.no_grad():
        expect = [classifier.awd_lstm(torch.tensor([tokenizer.encode(t).ids])).last_hidden_state[0].mean(0)
                  for t in ("Return the value.", "Raise an error")]
    torch.testing.assert_close(vectors, torch.stack(expect), atol=1e-5, rtol=1e-5)
    assert vectors.shape == (2, 256)  # both directions

    code, _, err = run_cli(capsys, "finetune", "--model", out, "--task", "tag", "--train",
                           data / "tag_train.jsonl", "--eval", data / "tag_eval.jsonl",
                           "--device", "cpu", "--out", tmp_path / "tagger")
    assert code == 2 and "ULMFiT model fine-tunes a classifier" in err
