"""Text to train on: the user's files, or the docstrings of Python's standard library.

Files are read as bytes and decoded as UTF-8; bytes that are not UTF-8 become U+FFFD
and are counted, so a stray binary file costs a warning, never the run. A document is
a paragraph (text between blank lines) of a file, or one docstring.
"""
from __future__ import annotations

import ast
import functools
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, List, Sequence

from .errors import UsageError

# surrogateescape turns each undecodable byte into one of these lone surrogates, which
# valid UTF-8 never decodes to: counting and replacing them is one linear pass.
_ESCAPED = re.compile("[\udc80-\udcff]")
_PARAGRAPH = re.compile(r"\n\s*\n")
# Doctest lines and their continuations: Python, not English.
_DOCTEST = re.compile(r"^\s*(>>>|\.\.\.).*$", re.M)


@dataclass
class Corpus:
    documents: List[str]
    files: int
    replaced_bytes: int  # undecodable bytes replaced by U+FFFD

    @property
    def characters(self) -> int:
        return sum(len(d) for d in self.documents)


def decode(data: bytes) -> tuple:
    """(text, number of undecodable bytes, each replaced by U+FFFD)."""
    text = data.decode("utf-8", errors="surrogateescape")
    text, replaced = _ESCAPED.subn("\ufffd", text)
    return text, replaced


def paragraphs(text: str) -> List[str]:
    return [p.strip() for p in _PARAGRAPH.split(text) if p.strip()]


def read_corpus(paths: Sequence[str]) -> Corpus:
    """The paragraphs of every file under ``paths`` (files, or folders read recursively in
    sorted order, hidden entries skipped)."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(p for p in path.rglob("*") if p.is_file()
                           and not any(part.startswith(".") for part in p.relative_to(path).parts))
            if not found:
                raise UsageError(f"--corpus {path}: the folder holds no files")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        else:
            raise UsageError(f"--corpus {path}: no such file or folder")
    documents, replaced = [], 0
    for file in files:
        try:
            text, bad = decode(file.read_bytes())
        except OSError as e:
            raise UsageError(f"--corpus {file}: cannot be read ({e.strerror})") from None
        documents.extend(paragraphs(text))
        replaced += bad
    if not documents:
        raise UsageError(f"--corpus {' '.join(map(str, paths))}: the corpus is empty (no text)")
    return Corpus(documents, len(files), replaced)


@functools.lru_cache(maxsize=1)
def default_documents() -> tuple:
    """The docstrings (modules, classes, functions) of the standard library's top-level
    modules, in sorted file order, doctest lines removed. Read from the sources with
    ``ast``: nothing is imported or downloaded, and every Python install has them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for file in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(file.read_bytes())
        except (SyntaxError, ValueError, OSError):
            continue
        documents.extend(_docstrings(tree))
    return tuple(documents)


def default_corpus() -> Corpus:
    documents = list(default_documents())
    if not documents:
        raise UsageError("the default corpus is empty: this Python has no standard library "
                         "sources; pass --corpus")
    return Corpus(documents, files=0, replaced_bytes=0)


def _docstrings(tree: ast.Module) -> Iterable[str]:
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, kinds):
            doc = ast.get_docstring(node)
            if doc:
                doc = _DOCTEST.sub("", doc).strip()
                if doc:
                    yield doc
