"""ULMFiT's stages 2 and 3 for ``fusedlm finetune --task classify`` on a ULMFiT language
model folder (fusedlm pretrain --model ulmfit, stage 1):

2. the language models (forward and backward) are fine-tuned on the training texts and any
   --unlabelled ones, every layer group at its discriminative rate, under one slanted
   triangular schedule; the words of that text seen twice that the vocabulary lacks join it,
   their embeddings starting at the mean of the others (as fastai adapts a pretrained
   model to a task's vocabulary);
3. the classifier (the fine-tuned encoders, concat pooling and new heads, fastai's
   classifier dropout times --drop-mult) trains with gradual unfreezing: the top group in
   the first epoch, one more group each epoch, each epoch under its own slanted triangular
   schedule; accuracy and F1 on --eval after every epoch.

AdamW and the gradient clipping are fastai's (:mod:`fusedlm.models.ulmfit`).
"""
from __future__ import annotations

import copy
import functools
import sys

from . import registry
from . import tokenizer as tok
from .common import DTYPES, load_model, positive_int, read_config
from .corpus import read_corpus
from .data import BlockOrder
from .distributed import Processes
from .errors import UsageError
from .fine_tuning import encode_examples, save_fine_tuned, train_epoch
from .train import Trainer

# The options only ULMFiT takes, and their defaults.
DEFAULTS = {"unlabelled": None, "lm_epochs": 1, "lm_lr": 1e-2, "bptt": 72, "drop_mult": 0.5}
CLASSIFIER_LR = 2e-2


def add_arguments(p) -> None:
    p.add_argument("--unlabelled", nargs="+", metavar="FILE_OR_DIR",
                   help="more text for the language model's fine-tuning (text files or folders)")
    p.add_argument("--lm-epochs", type=positive_int,
                   help=f"epochs of language-model fine-tuning (default {DEFAULTS['lm_epochs']})")
    p.add_argument("--lm-lr", type=float,
                   help=f"its top group's peak learning rate (default {DEFAULTS['lm_lr']})")
    p.add_argument("--bptt", type=positive_int,
                   help=f"tokens per language-model sequence (default {DEFAULTS['bptt']})")
    p.add_argument("--drop-mult", type=float,
                   help="the classifier's dropout: fastai's rates times this "
                        f"(default {DEFAULTS['drop_mult']})")


def holds_ulmfit(folder) -> bool:
    try:
        return read_config(folder).get("model_type") == registry.ULMFIT.model_type
    except UsageError:
        return False


def refuse_arguments(args) -> None:
    """ULMFiT's options given for another model are an error, not ignored."""
    given = [f"--{name.replace('_', '-')}" for name in DEFAULTS if getattr(args, name) is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: only a ULMFiT language model takes "
                         f"{'these' if len(given) > 1 else 'this'}")


def _setting(args, name):
    value = getattr(args, name)
    return DEFAULTS[name] if value is None else value


def finetune(args, out, train, test, names: list, device) -> int:
    from ..models.awd_lstm import CLASSIFIER_DROPOUT, AWDLSTMForSequenceClassification, dropout_rates
    from ..models.ulmfit import CLIP, slanted_triangular, ulmfit_optimizer, unfreeze_top

    if args.task != "classify":
        raise UsageError("--task: a ULMFiT model fine-tunes a classifier (--task classify)")
    if not _setting(args, "lm_lr") > 0:
        raise UsageError(f"--lm-lr must be positive, got {args.lm_lr}")
    if not _setting(args, "drop_mult") >= 0:
        raise UsageError(f"--drop-mult must not be negative, got {args.drop_mult}")
    clip = CLIP if args.clip is None else args.clip
    _, lm, tokenizer = load_model(args.model, "lm-finetune", device)

    # Stage 2: the language models, on the task's text, with its words.
    texts = list(train.texts)
    if args.unlabelled:
        texts += read_corpus(args.unlabelled).documents
    tokenizer, added = tok.add_words(tokenizer, texts)
    if added:
        lm.resize_token_embeddings(tokenizer.get_vocab_size())
        print(f"added {len(added)} words of the task's text to the vocabulary "
              f"({', '.join(added[:5])}{', ...' if len(added) > 5 else ''})")
    blocks = registry.ulmfit_blocks(texts, tokenizer, _setting(args, "bptt"))
    if blocks.shape[0] == 0:
        raise UsageError(f"--train has too few tokens for one --bptt {_setting(args, 'bptt')} "
                         "sequence of language-model fine-tuning")
    order = BlockOrder(blocks, args.seed)
    steps = -(-len(order) // args.batch_size) * _setting(args, "lm_epochs")
    optimizer = ulmfit_optimizer(lm, _setting(args, "lm_lr"))
    trainer = Trainer(lm, lr=_setting(args, "lm_lr"), warmup=0, steps=steps, clip=clip,
                      dtype=DTYPES[args.dtype], device=device, processes=Processes(),
                      optimizer=optimizer, scheduler=slanted_triangular(optimizer, steps))
    per_epoch = steps // _setting(args, "lm_epochs")
    for epoch in range(1, _setting(args, "lm_epochs") + 1):
        losses = []
        for step in range((epoch - 1) * per_epoch, epoch * per_epoch):
            inputs = {"input_ids": order.take(step * args.batch_size, args.batch_size).to(device)}
            losses.append(trainer.step([functools.partial(registry.ULMFIT.loss, inputs=inputs,
                                                          generator=None)])[0])
        print(f"lm_epoch {epoch} lm_train_loss {sum(losses) / len(losses):.4f}")

    # Stage 3: the classifier on the fine-tuned encoders, gradually unfrozen.
    config = copy.deepcopy(lm.config)
    config.id2label = dict(enumerate(names))
    config.label2id = {name: i for i, name in enumerate(names)}
    for name, p in dropout_rates(CLASSIFIER_DROPOUT, _setting(args, "drop_mult")).items():
        if not p < 1:
            raise UsageError(f"--drop-mult {args.drop_mult} makes {name} {p:.2f}: rates must be "
                             "below 1")
        setattr(config, name, p)
    model = AWDLSTMForSequenceClassification(config)
    model.awd_lstm.load_state_dict(lm.awd_lstm.state_dict())
    model.to(device)
    del lm, trainer, optimizer
    tokenizer.enable_truncation(args.seq_len)
    index = {name: i for i, name in enumerate(names)}
    train_set, test_set = (encode_examples(tokenizer, e, index, "classify") for e in (train, test))
    pad = model.config.pad_token_id
    optimizer = ulmfit_optimizer(model, args.lr or CLASSIFIER_LR)
    batches = -(-len(train_set) // args.batch_size)
    trainer = Trainer(model, lr=args.lr or CLASSIFIER_LR, warmup=0, steps=batches, clip=clip,
                      dtype=DTYPES[args.dtype], device=device, processes=Processes(),
                      optimizer=optimizer, scheduler=slanted_triangular(optimizer, batches))
    scores = {}
    for epoch in range(1, args.epochs + 1):
        unfreeze_top(model, epoch)
        trainer.scheduler = slanted_triangular(optimizer, batches)
        scores = train_epoch(trainer, train_set, test_set, test, names, args, pad, device, epoch)
    unfreeze_top(model, None)
    groups = config.n_layers + 2  # the embedding, each LSTM layer, the heads
    if args.epochs < groups:
        print(f"fusedlm finetune: note: {args.epochs} epochs trained the top {args.epochs} of "
              f"{groups} layer groups (one more each epoch)", file=sys.stderr)
    save_fine_tuned(out, model, tokenizer, names, scores)
    return 0
