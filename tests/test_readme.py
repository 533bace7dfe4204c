"""The README's examples run as written."""
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_block(section: str) -> str:
    text = README.read_text()
    body = text.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", body, re.S).group(1)


def test_drop_in_modules_example_runs(capsys):
    exec(compile(_python_block("Drop-in modules"), "README.md", "exec"), {})
    assert "torch.nn.TransformerEncoder -> fusedlm.nn.TransformerEncoder" in capsys.readouterr().out


def test_models_example_runs(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    exec(compile(_python_block("Models"), "README.md", "exec"), {})
    transformers.BertForMaskedLM.from_pretrained(tmp_path / "tiny-bert-trained")


def test_roberta_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(_python_block("RoBERTa"), "README.md", "exec"), scope)
    assert scope["logits"].shape == (1, 4, 100)


def test_albert_example_runs():
    pytest.importorskip("transformers")
    scope = {}
    exec(compile(_python_block("ALBERT"), "README.md", "exec"), scope)
    assert scope["out"].loss.isfinite() and scope["out"].sop_logits.shape == (2, 2)


def test_distilbert_example_runs(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(_python_block("DistilBERT"), "README.md", "exec"), scope)
    assert scope["logits"].shape == (1, 2)


def test_electra_example_runs(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    exec(compile(_python_block("ELECTRA"), "README.md", "exec"), {})
    transformers.ElectraForPreTraining.from_pretrained(tmp_path / "tiny-electra" / "discriminator")
    transformers.ElectraForMaskedLM.from_pretrained(tmp_path / "tiny-electra" / "generator")


def test_gpt2_example_runs(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    exec(compile(_python_block("GPT-2"), "README.md", "exec"), {})
    transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "tiny-gpt2")
