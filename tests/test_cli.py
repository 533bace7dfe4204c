"""The fusedlm command: help, info, the default corpus, and bad input (exit status 2, a
one-line error, no traceback, nothing written over an existing checkpoint)."""
import json
import string
import subprocess
import sys

import pytest
import torch

from cli_helpers import TINY, run_cli, snapshot, write_corpus
from fusedlm.cli import corpus as corpus_module
from fusedlm.cli import COMMANDS, checkpoint
from fusedlm.cli.train import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")




@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A GPT trained for two steps: the checkpoint that bad input must leave alone."""
    root = tmp_path_factory.mktemp("cli")
    corpus = write_corpus(root / "corpus.txt")
    out = root / "gpt"
    from fusedlm.cli import main

    assert main(["pretrain", "--model", "gpt", "--corpus", str(corpus), "--steps", "2",
                 "--out", str(out), *TINY]) == 0
    return corpus, out


def test_module_help_runs_as_a_subprocess():
    done = subprocess.run([sys.executable, "-m", "fusedlm", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for command in COMMANDS:
        assert command in done.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help(capsys, command):
    code, out, _ = run_cli(capsys, command, "--help")
    assert code == 0 and out.startswith("usage: fusedlm " + command)


def test_info_names_versions_backends_and_device(capsys):
    code, out, _ = run_cli(capsys, "info")
    assert code == 0
    import fusedlm

    assert out.splitlines()[0].split() == ["fusedlm", fusedlm.__version__]
    assert torch.__version__ in out
    for name in fusedlm.backends():
        assert f"backend {name}" in out
    assert "CUDA arches" in out and "device" in out
    from fusedlm import switches

    for switch in switches.SWITCHES:
        assert switch.name in out and switch.what in out


def test_default_corpus_is_english_and_deterministic():
    first = corpus_module.default_documents()
    corpus_module.default_documents.cache_clear()
    again = corpus_module.default_documents()
    assert first == again and first is not again
    text = " ".join(first)
    assert len(first) > 1000 and len(text) > 300_000
    words = text.lower().split()
    for common in ("the", "of", "and", "return", "is"):
        assert words.count(common) > 1000, common
    assert ">>>" not in text  # doctest lines are code, not English


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    text, replaced = corpus_module.decode("café ".encode() + b"\xff\xfe" + b" fin\xc3")
    assert text == "café \ufffd\ufffd fin\ufffd" and replaced == 3
    (tmp_path / "a.txt").write_bytes(b"first paragraph\n\n\xffsecond\n")
    (tmp_path / "b.txt").write_text("third")
    (tmp_path / ".hidden").write_text("never read")
    found = corpus_module.read_corpus([str(tmp_path)])
    assert found.documents == ["first paragraph", "\ufffdsecond", "third"]
    assert found.files == 2 and found.replaced_bytes == 1


def test_training_on_undecodable_bytes_warns_and_trains(capsys, tmp_path, trained):
    corpus = tmp_path / "mixed.txt"
    corpus.write_bytes(trained[0].read_bytes() + b"\n\nbroken \x80\x81 bytes\n")
    code, _, err = run_cli(capsys, "pretrain", "--model", "gpt", "--corpus", corpus, "--steps", 1,
                           "--out", tmp_path / "out", *TINY)
    assert code == 0
    assert "warning: 2 undecodable bytes in the corpus were replaced by U+FFFD" in err
    assert "Traceback" not in err


def _bad_input_cases(root, corpus, trained):
    (root / "empty.txt").write_text("  \n\n \n")
    (root / "empty_dir").mkdir()
    (root / "not_a_checkpoint").mkdir()
    (root / "not_a_checkpoint" / "notes.txt").write_text("hello")
    fresh = str(root / "fresh")
    pretrain = ["pretrain", "--model", "gpt", "--steps", "1", *TINY]
    cuda = "cuda:99" if torch.cuda.is_available() else "cuda"
    return {
        "missing corpus": ([*pretrain, "--corpus", root / "nope.txt", "--out", fresh],
                           "no such file or folder"),
        "empty corpus": ([*pretrain, "--corpus", root / "empty.txt", "--out", fresh],
                         "the corpus is empty"),
        "empty corpus folder": ([*pretrain, "--corpus", root / "empty_dir", "--out", fresh],
                                "the folder holds no files"),
        "corpus shorter than a sequence": (
            [*pretrain, "--seq-len", "1000", "--corpus", root / "short.txt", "--out", fresh],
            "too few tokens for one --seq-len 1000 sequence"),
        "seq-len over the positions": (
            [*pretrain, "--seq-len", "2048", "--corpus", corpus, "--out", fresh],
            "--seq-len 2048 is more than the model's 1024 positions"),
        "seq-len with no room for text": (
            ["pretrain", "--model", "bert", "--steps", "1", *TINY, "--seq-len", "2", "--corpus",
             corpus, "--out", fresh], "--seq-len 2 leaves no room for text"),
        "unavailable device": ([*pretrain, "--corpus", corpus, "--out", fresh, "--device", cuda],
                               f"--device {cuda}:"),
        "not a device": ([*pretrain, "--corpus", corpus, "--out", fresh, "--device", "gpu7"],
                         "is not a device name"),
        "output holds a checkpoint": ([*pretrain, "--corpus", corpus, "--out", trained],
                                      "already holds a checkpoint: pass --resume"),
        "resume with other settings": (["pretrain", "--resume", "--out", trained, "--steps", "5",
                                        "--seq-len", "64"], "differs from the checkpoint's 32"),
        "resume with nothing to resume": (["pretrain", "--resume", "--out", fresh],
                                          "holds no checkpoint to continue"),
        "model directory missing": (["generate", "--model", root / "nope", "--prompt", "x"],
                                    "no such directory"),
        "model directory not a checkpoint": (
            ["generate", "--model", root / "not_a_checkpoint", "--prompt", "x"],
            "not a checkpoint (no config.json)"),
        "prompt longer than the context": (
            ["generate", "--model", trained, "--prompt", "word " * 1100, "--max-new-tokens", "5"],
            "more than the model's 1024 positions"),
        "embed over a checkpoint's weights": (
            ["embed", "--model", trained, corpus, "--out", trained / "model.safetensors"],
            "that is a checkpoint's weights file"),
        "generate on an unavailable device": (
            ["generate", "--model", trained, "--prompt", "x", "--device", cuda], f"--device {cuda}:"),
    }


def test_bad_input_is_one_line_exit_2_and_leaves_checkpoints_alone(capsys, tmp_path, trained):
    corpus, out = trained
    (tmp_path / "short.txt").write_text("only a few words here")
    before = snapshot(out)
    for name, (argv, message) in _bad_input_cases(tmp_path, corpus, out).items():
        code, stdout, err = run_cli(capsys, *argv)
        assert code == 2, (name, err)
        assert err.count("\n") == 1 and err.startswith("fusedlm "), (name, err)
        assert message in err, (name, err)
        assert "Traceback" not in err and stdout == "", name
        assert not (tmp_path / "fresh").exists(), name
    assert snapshot(out) == before
    assert checkpoint.latest(out).name == "checkpoint-2"


# Each word of the second corpus is "q" and one more letter: its 26 merges are equally
# frequent, and the tie between them is broken by how the trainer numbered "##a" .. "##z".
TIED_MERGES = [" ".join("q" + c for c in string.ascii_lowercase)]


def _trained_in_a_process_of_its_own(cases) -> list:
    """tokenizer.json of tokenizer.train(kind, documents, vocab_size) for each case, trained
    in a new process: tokenizers' hash maps are seeded afresh by each process."""
    script = ("import json, sys\nfrom fusedlm.cli import tokenizer\n"
              "cases = json.load(sys.stdin)\n"
              "json.dump([tokenizer.train(*case).to_str() for case in cases], sys.stdout)")
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(cases),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_a_corpus_always_trains_the_same_tokenizer():
    documents = list(corpus_module.default_documents()[:150])
    cases = [(kind, documents, 400) for kind in ("wordpiece", "bpe", "roberta-bpe", "words")]
    cases.append(("wordpiece", TIED_MERGES, 5 + 26 + 26 + 3))  # specials, a-z, ##a-##z, 3 merges
    from fusedlm.cli import tokenizer

    first = [tokenizer.train(*case).to_str() for case in cases]
    assert _trained_in_a_process_of_its_own(cases) == first
    bpe = tokenizer.from_json(first[1])
    assert bpe.get_vocab_size() == 400
    assert bpe.decode(bpe.encode("Return the value.").ids) == "Return the value."
    # Ties go to the continuation numbered first, "##a".
    tied = tokenizer.from_json(first[-1]).get_vocab()
    assert {t for t in tied if len(t) == 2 and t.isalpha()} == {"qa", "qb", "qc"}


def test_wordpiece_numbers_its_tokens_in_sorted_order():
    # tokenizers' WordPiece trainer numbers its "##" alphabet in hash-map order; the tokens
    # it keeps are renumbered: the specials, then the rest sorted. Of them only the
    # specials are special tokens.
    from fusedlm.cli import tokenizer

    trained = tokenizer.train("wordpiece", list(corpus_module.default_documents()[:150]), 400)
    vocab = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    tokens = [t for t, _ in vocab]
    assert [i for _, i in vocab] == list(range(400))
    assert tokens[:5] == list(tokenizer.WORDPIECE_SPECIALS) and tokens[5:] == sorted(tokens[5:])
    assert trained.encode("Return the [MASK].").tokens == ["[CLS]", "return", "the", "[MASK]",
                                                           ".", "[SEP]"]
    assert {t.content for t in trained.get_added_tokens_decoder().values()} == \
        set(tokenizer.WORDPIECE_SPECIALS)
    assert "##n" in tokens and "##n" not in trained.encode("return##n").tokens


def test_without_tqdm_and_matplotlib_progress_is_plain_lines_and_no_plot(capsys, tmp_path,
                                                                         monkeypatch, trained):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails, as when not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    out = tmp_path / "run"
    code, _, err = run_cli(capsys, "pretrain", "--model", "gpt", "--corpus", trained[0],
                           "--steps", 3, "--out", out, *TINY[:-2], "--log-every", 2)
    assert code == 0, err
    lines = err.splitlines()
    assert [line.split()[:2] for line in lines] == [["step", "2/3"], ["step", "3/3"]]
    assert all("loss" in line and "tok/s" in line and "eta" in line for line in lines)
    assert (out / "metrics.jsonl").is_file() and not (out / "loss.png").exists()
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [2, 3]
