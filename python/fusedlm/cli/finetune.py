"""fusedlm finetune: trains a pretrained BERT or ELECTRA with a classification head
(--task classify: a label per text) or a tagging head (--task tag: a label per word),
reporting accuracy and F1 on --eval after every epoch. The folder may be any of
transformers' BERT or ELECTRA layouts: the task head starts new (for BERT's classifier,
with the pooler when the folder has none), every other weight is the folder's, and its
pretraining heads are left unread. A ULMFiT language model runs ULMFiT's stages 2 and 3
(:mod:`fusedlm.cli.ulmfit`)."""
from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import torch

from . import checkpoint, rng, ulmfit
from . import tokenizer as tok
from .common import (DTYPES, add_device_argument, atomic_write, load_model, positive_int,
                     resolve_device)
from .distributed import Processes
from .errors import UsageError
from .labelled import accuracy, macro_f1, read_examples, tag_f1
from .loading import quiet
from .train import Trainer

IGNORE_INDEX = -100
LABELS_NAME = "labels.json"
SCORES_NAME = "eval.json"


HELP = "fine-tune a pretrained encoder to classify or tag"
DESCRIPTION = """Fine-tunes a BERT or ELECTRA folder (the task head starts new, every other
weight is the folder's) on --train and reports accuracy and F1 on --eval (macro F1 over the
classes for classify; micro F1 over the tags other than O for tag). Files: CSV, TSV or JSONL
with a text and a label column; for tag, words and labels are lists or space-separated strings
of equal length. A ULMFiT language model folder (fusedlm pretrain --model ulmfit) is
fine-tuned as ULMFiT does: the language model on the training texts (and --unlabelled), then
the classifier with gradual unfreezing, discriminative rates and slanted triangular
schedules."""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a BERT or ELECTRA folder (transformers' layout), or a ULMFiT language model")
    p.add_argument("--task", required=True, choices=("classify", "tag"))
    p.add_argument("--train", required=True, metavar="FILE")
    p.add_argument("--eval", required=True, metavar="FILE")
    p.add_argument("--text-column", default="text")
    p.add_argument("--label-column", default="label")
    p.add_argument("--out", help="output folder (default DIR-<task>)")
    p.add_argument("--epochs", type=positive_int, default=3)
    p.add_argument("--batch-size", type=positive_int, default=16)
    p.add_argument("--seq-len", type=positive_int, default=128,
                   help="tokens per text; longer texts are cut (default 128)")
    p.add_argument("--lr", type=float,
                   help="peak learning rate (default by width: 1e-3 up to hidden 128, 3e-4 up "
                        "to 256, else 5e-5; ULMFiT: 2e-2 for the top layer group)")
    p.add_argument("--warmup", type=float, default=0.1, help="share of the steps (default 0.1)")
    p.add_argument("--clip", type=float, help="gradient norm clip (default 1.0; ULMFiT 0.1)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    add_device_argument(p)
    p.add_argument("--seed", type=int, default=0)
    ulmfit.add_arguments(p.add_argument_group("ULMFiT (a ULMFiT language model folder)"))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out or f"{str(args.model).rstrip('/')}-{args.task}")
    if checkpoint.holds_model(out):
        raise UsageError(f"--out {out} already holds a checkpoint: choose another --out")
    if (args.lr is not None and not args.lr > 0) or not 0 <= args.warmup < 1:
        raise UsageError("--lr must be positive and --warmup in [0, 1)")
    if args.clip is not None and args.clip < 0:
        raise UsageError(f"--clip must not be negative, got {args.clip}")
    train = read_examples(args.train, args.task, args.text_column, args.label_column, "--train")
    test = read_examples(args.eval, args.task, args.text_column, args.label_column, "--eval")
    names = sorted(set(_flat(train.labels, args.task)))
    unseen = sorted(set(_flat(test.labels, args.task)) - set(names))
    if unseen:
        raise UsageError(f"--eval has labels --train lacks: {', '.join(unseen[:5])}")
    device = resolve_device(args.device)
    rng.seed(args.seed)
    if ulmfit.holds_ulmfit(args.model):
        return ulmfit.finetune(args, out, train, test, names, device)
    ulmfit.refuse_arguments(args)
    # The task head starts new; every other weight comes from the folder.
    spec, model, tokenizer = load_model(args.model, args.task, device, num_labels=len(names),
                                        id2label=dict(enumerate(names)),
                                        label2id={name: i for i, name in enumerate(names)})
    if args.seq_len > spec.positions(model.config):
        raise UsageError(f"--seq-len {args.seq_len} is more than the model's "
                         f"{spec.positions(model.config)} positions")
    tokenizer.enable_truncation(args.seq_len)
    lr = args.lr or _default_lr(model.config.hidden_size)
    index = {name: i for i, name in enumerate(names)}
    train_set, test_set = (encode_examples(tokenizer, e, index, args.task) for e in (train, test))
    pad = tok.role_id(tokenizer, "pad")

    batches = -(-len(train_set) // args.batch_size)
    trainer = Trainer(model, lr=lr, warmup=int(args.warmup * batches * args.epochs),
                      steps=batches * args.epochs, clip=1.0 if args.clip is None else args.clip,
                      dtype=DTYPES[args.dtype], device=device, processes=Processes())
    scores = {}
    for epoch in range(1, args.epochs + 1):
        scores = train_epoch(trainer, train_set, test_set, test, names, args, pad, device, epoch)
    save_fine_tuned(out, model, tokenizer, names, scores)
    return 0


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


def _default_lr(hidden: int) -> float:
    # Narrow encoders fine-tune best at higher rates (ELECTRA-Small's 3e-4, BERT-base's 5e-5).
    return 1e-3 if hidden <= 128 else 3e-4 if hidden <= 256 else 5e-5


def _flat(labels: list, task: str) -> list:
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
    gold = _flat(examples.labels, "tag")
    found = [t for tags, words in zip(predicted, examples.labels)
             for t in tags + ["O"] * (len(words) - len(tags))]
    return {"accuracy": accuracy(found, gold), "f1": tag_f1(found, gold)}
