"""Shared pieces of the command line's tests: a small corpus, tiny training settings,
and running the command in this process."""
import hashlib
from pathlib import Path

from fusedlm.cli import main
from fusedlm.cli.corpus import default_documents

# Small enough for a few seconds per run on one thread, large enough to give
# a few hundred sequences.
TINY = ["--size", "tiny", "--vocab-size", "400", "--seq-len", "32", "--batch-size", "4",
        "--device", "cpu", "--log-every", "1"]


def write_corpus(path: Path, documents: int = 150) -> Path:
    """A slice of the default corpus (the standard library's docstrings) as one file."""
    path.write_text("\n\n".join(default_documents()[:documents]) + "\n")
    return path


def run_cli(capsys, *argv) -> tuple:
    """(exit status, stdout, stderr) of ``fusedlm argv`` run in this process."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def snapshot(directory: Path) -> dict:
    """{relative path: sha256} of every file under directory."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}
