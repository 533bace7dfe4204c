"""What fine-tuning on labelled examples shares (fusedlm finetune, and ULMFiT's classifier
stage): the examples as token ids, padded batches, an epoch with the scores after it, and
the folder it leaves."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from . import tokenizer as tok
from .common import atomic_write
from .labelled import accuracy, macro_f1, tag_f1
from .loading import quiet

IGNORE_INDEX = -100
LABELS_NAME = "labels.json"
SCORES_NAME = "eval.json"


def train_epoch(trainer, train_set: list, test_set: list, test, names: list, args, pad: int,
                device, epoch: int) -> dict:
    """One epoch over train_set in a seeded order, then the scores on test_set, printed."""
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(
        args.seed * 1_000_003 + epoch)).tolist()
    losses = []
    for start in range(0, len(order), args.batch_size):
        inputs = collate([train_set[i] for i in order[start:start + args.batch_size]], pad, device)
        losses.append(trainer.step([functools.partial(_loss, inputs=inputs)])[0])
    scores = evaluate(trainer.model, test_set, test, names, args, pad, device)
    scores = {"epoch": epoch, "train_loss": sum(losses) / len(losses), **scores}
    print(" ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in scores.items()))
    return scores


def save_fine_tuned(out: Path, model, tokenizer, names: list, scores: dict) -> None:
    with quiet():
        model.save_pretrained(out)
    atomic_write(out / tok.FILE_NAME, lambda f: f.write(tokenizer.to_str().encode()))
    atomic_write(out / LABELS_NAME, lambda f: f.write(json.dumps(names).encode()))
    atomic_write(out / SCORES_NAME, lambda f: f.write(json.dumps(scores).encode()))
    print(f"saved to {out}")


def flat(labels: list, task: str) -> list:
    return [t for row in labels for t in row] if task == "tag" else labels


def encode_examples(tokenizer, examples, index: dict, task: str) -> list:
    """[(token ids, labels)]: classify, one label id; tag, one per token, on the first
    token of each word (-100 on the others and on [CLS] / [SEP])."""
    if task == "classify":
        encoded = tokenizer.encode_batch(examples.texts)
        return [(e.ids, index[label]) for e, label in zip(encoded, examples.labels)]
    encoded = tokenizer.encode_batch(examples.texts, is_pretokenized=True)
    items = []
    for e, tags in zip(encoded, examples.labels):
        labels, previous = [], None
        for word in e.word_ids:
            labels.append(IGNORE_INDEX if word is None or word == previous else index[tags[word]])
            previous = word
        items.append((e.ids, labels))
    return items


def collate(items: list, pad: int, device) -> dict:
    """Pads a batch on the right: input_ids, attention_mask, labels."""
    width = max(len(ids) for ids, _ in items)
    ids = torch.full((len(items), width), pad, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    tagging = isinstance(items[0][1], list)
    labels = (torch.full((len(items), width), IGNORE_INDEX) if tagging
              else torch.zeros(len(items), dtype=torch.long))
    for row, (tokens, label) in enumerate(items):
        ids[row, :len(tokens)] = torch.tensor(tokens)
        mask[row, :len(tokens)] = 1
        if tagging:
            labels[row, :len(label)] = torch.tensor(label)
        else:
            labels[row] = label
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device),
            "labels": labels.to(device)}


def _loss(model, inputs: dict):
    return model(**inputs).loss


@torch.no_grad()
def evaluate(model, items: list, examples, names: list, args, pad: int, device) -> dict:
    model.eval()
    predicted = []
    for start in range(0, len(items), args.batch_size):
        inputs = collate(items[start:start + args.batch_size], pad, device)
        best = model(inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits.argmax(-1)
        if args.task == "classify":
            predicted.extend(names[i] for i in best.tolist())
        else:
            # A word's tag is its first token's; words cut off by --seq-len count as O.
            for row, labels in zip(best.tolist(), inputs["labels"].tolist()):
                tags = [names[p] for p, g in zip(row, labels) if g != IGNORE_INDEX]
                predicted.append(tags)
    if args.task == "classify":
        return {"accuracy": accuracy(predicted, examples.labels),
                "f1": macro_f1(predicted, examples.labels)}
    gold = flat(examples.labels, "tag")
    found = [t for tags, words in zip(predicted, examples.labels)
             for t in tags + ["O"] * (len(words) - len(tags))]
    return {"accuracy": accuracy(found, gold), "f1": tag_f1(found, gold)}
