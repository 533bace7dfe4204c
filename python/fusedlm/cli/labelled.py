"""Labelled examples for fine-tuning (CSV, TSV or JSONL with a text and a label column)
and the scores of predictions against them.

classify: a text and its label per row. tag: words and one label per word per row,
each a JSON list or a string of space-separated items.
"""
from __future__ import annotations

import csv
import dataclasses
import json
import sys
from pathlib import Path
from typing import List

from .corpus import decode
from .errors import UsageError

OUTSIDE = "O"  # the tag of words outside every entity, left out of the tag F1


@dataclasses.dataclass
class Examples:
    texts: list  # classify: str; tag: list of words
    labels: list  # classify: str; tag: list of str, one per word


def read_examples(path, task: str, text_column: str, label_column: str, flag: str) -> Examples:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{flag} {path}: no such file")
    text, replaced = decode(path.read_bytes())
    if replaced:
        print(f"fusedlm finetune: warning: {replaced} undecodable bytes in {path} were replaced "
              "by U+FFFD", file=sys.stderr)
    rows = _rows(path, text, flag)
    texts, labels = [], []
    for n, row in rows:
        for column in (text_column, label_column):
            if not isinstance(row, dict) or row.get(column) in (None, ""):
                raise UsageError(f"{flag} {path} row {n}: no {column!r} value")
        value, label = row[text_column], row[label_column]
        if task == "tag":
            value, label = _items(value), _items(label)
            if len(value) != len(label):
                raise UsageError(f"{flag} {path} row {n}: {len(value)} words but {len(label)} "
                                 "labels")
        else:
            value, label = str(value), str(label)
        texts.append(value)
        labels.append(label)
    if not texts:
        raise UsageError(f"{flag} {path}: no examples")
    return Examples(texts, labels)


def _rows(path: Path, text: str, flag: str) -> list:
    """[(row number, row)] of a CSV/TSV (by the header) or JSONL file."""
    if path.suffix in (".csv", ".tsv"):
        reader = csv.DictReader(text.splitlines(), delimiter="\t" if path.suffix == ".tsv" else ",")
        return list(enumerate(reader, 2))
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append((n, json.loads(line)))
                except ValueError:
                    raise UsageError(f"{flag} {path} line {n}: not JSON") from None
        return rows
    raise UsageError(f"{flag} {path}: the name must end in .csv, .tsv or .jsonl")


def _items(value) -> List[str]:
    return [str(v) for v in value] if isinstance(value, list) else str(value).split()


def accuracy(predicted: list, gold: list) -> float:
    return sum(p == g for p, g in zip(predicted, gold)) / len(gold)


def macro_f1(predicted: list, gold: list) -> float:
    """The mean over the gold labels of each label's F1."""
    scores = []
    for label in sorted(set(gold)):
        tp = sum(p == g == label for p, g in zip(predicted, gold))
        fp = sum(p == label != g for p, g in zip(predicted, gold))
        fn = sum(g == label != p for p, g in zip(predicted, gold))
        scores.append(2 * tp / (2 * tp + fp + fn))
    return sum(scores) / len(scores)


def tag_f1(predicted: list, gold: list) -> float:
    """Micro F1 of the word tags other than "O": a word counts as found when its
    predicted tag is its gold tag."""
    tp = sum(p == g != OUTSIDE for p, g in zip(predicted, gold))
    found = sum(p != OUTSIDE for p in predicted)
    real = sum(g != OUTSIDE for g in gold)
    return 2 * tp / (found + real) if found + real else 1.0
