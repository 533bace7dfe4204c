"""fusedlm pretrain end to end: training then inference from the output folder, resume
equality with an uninterrupted run, atomic checkpoints, and two processes under torchrun
against one."""
import json
import os
import subprocess
import sys

import pytest
import torch

from cli_helpers import TINY, run_cli, write_corpus
from fusedlm.cli import checkpoint
from fusedlm.cli import train as train_module
from fusedlm.cli.train import read_metrics
from fusedlm.models import GPTLMHeadModel


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
    model = GPTLMHeadModel.from_pretrained(out)
    assert model.config.n_layer == 2 and model.config.n_embd == 128 and model.config.n_head == 2

    code, text, err = run_cli(capsys, "generate", "--model", out, "--prompt", "Return the",
                              "--max-new-tokens", 12, "--temperature", 0, "--device", "cpu")
    assert code == 0, err
    assert text.startswith("Return the") and len(text) > len("Return the\n")
    # Greedy decoding is the model's own greedy continuation.
    from fusedlm.cli.tokenizer import load

    tokenizer = load(out)
    ids = torch.tensor([tokenizer.encode("Return the").ids])
    expect = model.eval().generate(ids, max_new_tokens=12)
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


def test_resume_gives_the_losses_of_an_uninterrupted_run(capsys, tmp_path, corpus, monkeypatch):
    # Dropout on (GPT's default 0.1) and two micro-batches: the random streams, the
    # optimizer, the schedule and the data position all have to come back.
    argv = ["pretrain", "--model", "gpt", "--corpus", corpus, "--steps", 6, "--save-every", 3,
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
    weights = {k: v for k, v in GPTLMHeadModel.from_pretrained(tmp_path / "straight")
               .state_dict().items()}
    for k, v in GPTLMHeadModel.from_pretrained(tmp_path / "resumed").state_dict().items():
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
    assert {p.name for p in kept.iterdir()} == {"config.json", "model.safetensors",
                                                "tokenizer.json", "trainer_state.pt"}
    assert checkpoint.load_state(kept)["step"] == 2
    GPTLMHeadModel.from_pretrained(kept)
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
         "-m", "fusedlm", *map(str, common), "--batch-size", "2", "--out", str(tmp_path / "two")],
        capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert [s for s, _ in two] == [1, 2, 3]
    for (_, a), (_, b) in zip(one, two):
        assert abs(a - b) <= 1e-5 * abs(a), (one, two)
    state = checkpoint.load_state(checkpoint.latest(tmp_path / "two"))
    assert state["settings"]["global_batch"] == 4 and len(state["rng"]) == 2
    assert json.loads((tmp_path / "two" / "config.json").read_text())["n_layer"] == 2
