"""Shared pieces of the command line's tests: a small corpus, tiny training settings,
and running the command in this process or in a process of its own."""
import hashlib
import os
import subprocess
import sys
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


def start_cli(*argv) -> subprocess.Popen:
    """``python -m fusedlm argv`` in a process of its own (its own hash seeds and
    generators), on one thread as the tests run; its output is captured."""
    return subprocess.Popen([sys.executable, "-m", "fusedlm", *map(str, argv)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def run_cli_process(*argv, timeout: float = 300) -> tuple:
    """(exit status, stdout, stderr) of ``fusedlm argv`` run as start_cli runs it."""
    process = start_cli(*argv)
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


def snapshot(directory: Path) -> dict:
    """{relative path: sha256} of every file under directory."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}
