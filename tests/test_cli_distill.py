"""fusedlm distill end to end: a pretrained tiny BERT distilled into a DistilBERT that
transformers loads, its loss lower after training (and each term when trained alone),
resume, and bad input."""
import pytest
import torch
import transformers

from cli_helpers import run_cli, write_corpus
from fusedlm.cli import registry
from fusedlm.cli import tokenizer as tokenizer_module
from fusedlm.cli.train import read_metrics
from fusedlm.models import BertForMaskedLM, DistilBertForMaskedLM, Distiller, student_from_teacher

pytestmark = pytest.mark.usefixtures("one_thread")

DATA = ["--seq-len", "32", "--batch-size", "8", "--device", "cpu"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny BERT trained far enough that its first layer alone, under the head trained
    on the second's output, predicts away from it: the student then starts away from its
    teacher, as DistilBERT's does, and every term has room to fall."""
    root = tmp_path_factory.mktemp("distill")
    corpus = write_corpus(root / "corpus.txt")
    out = root / "teacher"
    from fusedlm.cli import main

    code = main([str(a) for a in ("pretrain", "--model", "bert", "--size", "tiny", "--vocab-size",
                                  400, "--corpus", corpus, "--steps", 600, "--lr", "1e-3",
                                  "--out", out, *DATA)])
    assert code == 0
    return corpus, out


def _losses(distiller, batch) -> dict:
    with torch.no_grad():
        _, terms = distiller(batch["input_ids"], batch["labels"])
    return {name: float(value) for name, value in terms.items()}


def _distill(capsys, out, teacher, *options):
    corpus, teacher_dir = teacher
    code, stdout, err = run_cli(capsys, "distill", "--teacher", teacher_dir, "--layers", 1,
                                "--corpus", corpus, "--out", out, *options, *DATA)
    assert code == 0, err
    return stdout


def _before_and_after(teacher, out) -> tuple:
    """Each term on one fixed batch of the corpus, for the student as the teacher started it
    and as trained into ``out``."""
    corpus, teacher_dir = teacher
    teacher_model = BertForMaskedLM.from_pretrained(teacher_dir).eval()
    tokenizer = tokenizer_module.load(teacher_dir)
    blocks = registry.BERT.blocks(corpus.read_text().split("\n\n"), tokenizer, 32)[:64]
    batch = registry.BERT.batch(blocks, tokenizer, torch.Generator().manual_seed(5))
    before = Distiller(student_from_teacher(teacher_model, 1), teacher_model).eval()
    after = Distiller(DistilBertForMaskedLM.from_pretrained(out), teacher_model).eval()
    return before.alphas, _losses(before, batch), _losses(after, batch)


def test_distill_trains_a_distilbert_its_loss_falling(capsys, tmp_path, teacher):
    out = tmp_path / "student"
    stdout = _distill(capsys, out, teacher, "--steps", 100, "--lr", "1e-3", "--log-every", 1)
    assert "distilled bert" in stdout
    record = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in record] == list(range(1, 101))
    assert all({"loss", "loss_ce", "loss_mlm", "loss_cos"} <= set(r) for r in record)
    # transformers' own class reads the student: one layer, the teacher's width and vocabulary.
    student = transformers.DistilBertForMaskedLM.from_pretrained(out)
    assert student.config.n_layers == 1 and student.config.dim == 128

    # The weighted sum falls. Its terms pull against one another (the masked-LM term away
    # from the teacher), so one alone may not: each is trained alone below.
    alphas, before, after = _before_and_after(teacher, out)
    total = {name: sum(alphas[t] * losses[t] for t in alphas)
             for name, losses in (("before", before), ("after", after))}
    assert total["after"] < total["before"], (before, after)

    code, _, err = run_cli(capsys, "distill", "--resume", "--out", out, "--steps", 102,
                           "--log-every", 1, "--device", "cpu")
    assert code == 0, err
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")][-2:] == [101, 102]
    code, _, err = run_cli(capsys, "distill", "--resume", "--out", out, "--steps", 110,
                           "--temperature", 3.0, "--device", "cpu")
    assert code == 2 and "--temperature 3.0 differs from the checkpoint's 2.0" in err


@pytest.mark.parametrize("term", ["ce", "mlm", "cos"])
def test_distill_trains_each_loss_term_alone(capsys, tmp_path, teacher, term):
    alphas = {name: ("1" if name == term else "0") for name in ("ce", "mlm", "cos")}
    _distill(capsys, tmp_path / "student", teacher, "--steps", 100,
             *(a for name, value in alphas.items() for a in (f"--alpha-{name}", value)))
    _, before, after = _before_and_after(teacher, tmp_path / "student")
    assert after[f"loss_{term}"] < before[f"loss_{term}"], (term, before, after)


def test_distill_rejects_bad_input(capsys, tmp_path, teacher):
    corpus, teacher_dir = teacher
    cases = [(["--out", tmp_path / "a"], "--teacher is needed"),
             (["--teacher", teacher_dir], "--out is needed"),
             (["--teacher", teacher_dir, "--layers", 3, "--out", tmp_path / "b"],
              "--layers 3: the teacher has only 2"),
             (["--teacher", teacher_dir, "--temperature", 0, "--out", tmp_path / "c"],
              "--temperature must be positive"),
             (["--teacher", teacher_dir, "--alpha-cos", -1, "--out", tmp_path / "d"],
              "--alpha-cos must not be negative"),
             (["--resume", "--out", tmp_path / "e"], "holds no checkpoint")]
    for argv, message in cases:
        code, _, err = run_cli(capsys, "distill", "--corpus", corpus, *argv, *DATA)
        assert code == 2 and message in err, err
