"""fusedlm finetune: trains a pretrained BERT or ELECTRA with a classification head
(--task classify: a label per text) or a tagging head (--task tag: a label per word),
reporting accuracy and F1 on --eval after every epoch. The folder may be any of
transformers' BERT or ELECTRA layouts: the task head starts new (for BERT's classifier,
with the pooler when the folder has none), every other weight is the folder's, and its
pretraining heads are left unread. A ULMFiT language model runs ULMFiT's stages 2 and 3
(:mod:`fusedlm.cli.ulmfit`)."""
from __future__ import annotations

import argparse
from pathlib import Path

from . import checkpoint, rng, ulmfit
from . import tokenizer as tok
from .fine_tuning import encode_examples, flat, save_fine_tuned, train_epoch
from .common import DTYPES, add_device_argument, load_model, positive_int, resolve_device
from .distributed import Processes
from .errors import UsageError
from .labelled import read_examples
from .train import Trainer

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
    names = sorted(set(flat(train.labels, args.task)))
    unseen = sorted(set(flat(test.labels, args.task)) - set(names))
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


def _default_lr(hidden: int) -> float:
    # Narrow encoders fine-tune best at higher rates (ELECTRA-Small's 3e-4, BERT-base's 5e-5).
    return 1e-3 if hidden <= 128 else 3e-4 if hidden <= 256 else 5e-5


