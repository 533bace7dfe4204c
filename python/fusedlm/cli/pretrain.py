"""fusedlm pretrain: trains a model from scratch on a corpus (by default the docstrings
of Python's standard library), with checkpoints that --resume continues exactly."""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import sys
import time
from pathlib import Path

import torch

from . import checkpoint, registry, rng
from . import tokenizer as tok
from .common import DTYPES, add_device_argument, positive_int, resolve_device
from .corpus import default_corpus, read_corpus
from .data import BlockOrder, fingerprint
from .distributed import Processes
from .errors import UsageError
from .train import MetricsLog, Progress, Trainer, inputs_to, plot_losses, rows

# Settings a resumed run takes from its checkpoint (a different value given is an error,
# as it would change the losses); None here: no default, derived at the start.
FIXED = {"model": None, "size": "tiny", "corpus": None, "tokenizer": None, "vocab_size": None,
         "seq_len": 128, "grad_accum": 1, "lr": None, "warmup": None, "clip": 1.0,
         "dropout": None, "dtype": "fp32", "seed": 0, "fsdp": False, "embedding_size": None,
         "deterministic": False}


HELP = "train a model from scratch on a corpus"
DESCRIPTION = """Pretrains a model from scratch. Without --corpus it trains on the docstrings of
Python's standard library. Writes checkpoints, metrics.jsonl and loss.png to --out. Under
torchrun, every process trains on its share of each batch (DistributedDataParallel, or with
--fsdp FSDP2)."""


def add_arguments(p) -> None:
    p.add_argument("--model", choices=sorted(registry.SPECS), help="the model to train")
    p.add_argument("--size", choices=list(registry.SIZES),
                   help="tiny: 2 layers, hidden 128; small: 12 layers, hidden 256; base: "
                        "BERT-base / GPT-2 small (default tiny)")
    add_training_arguments(p)
    p.add_argument("--tokenizer", metavar="PATH",
                   help="a tokenizer.json (or a folder with one) to use instead of training one")
    p.add_argument("--vocab-size", type=positive_int,
                   help="the most tokens the trained tokenizer may have (default by --size)")
    p.add_argument("--dropout", type=float, help="dropout probability (default the model's)")
    p.add_argument("--embedding-size", type=positive_int,
                   help="width of the token embeddings, projected up to the hidden size "
                        "(albert, electra; default 128)")
    p.add_argument("--fsdp", action="store_true", default=None,
                   help="shard parameters, gradients and optimizer state between the processes "
                        "(FSDP2), for a model that does not fit on one GPU")


def add_training_arguments(p, lr_default: str = "by --size",
                           out_help: str = "output folder (default <model>-<size>)") -> None:
    """The corpus, schedule, precision, output and checkpoint options pretrain and distill share."""
    p.add_argument("--corpus", nargs="+", metavar="FILE_OR_DIR",
                   help="text files or folders of them (default: Python's docstrings)")
    p.add_argument("--steps", type=positive_int, help="optimizer steps in all (default 1000)")
    p.add_argument("--batch-size", type=positive_int,
                   help="sequences per process per micro-batch (default 8)")
    p.add_argument("--seq-len", type=positive_int, help="tokens per sequence (default 128)")
    p.add_argument("--grad-accum", type=positive_int, help="micro-batches per step (default 1)")
    p.add_argument("--lr", type=float, help=f"peak learning rate (default {lr_default})")
    p.add_argument("--warmup", type=int, help="warm-up steps (default: a tenth of --steps)")
    p.add_argument("--clip", type=float, help="gradient norm clip, 0 for none (default 1.0)")
    p.add_argument("--dtype", choices=list(DTYPES), help="autocast dtype (default fp32)")
    add_device_argument(p)
    p.add_argument("--seed", type=int, help="random seed (default 0)")
    p.add_argument("--deterministic", action="store_true", default=None,
                   help="torch.use_deterministic_algorithms(True): on a GPU, the same losses on "
                        "every run, at some cost in speed (on the CPU they are without it)")
    p.add_argument("--out", help=out_help)
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --out, with its settings")
    p.add_argument("--save-every", type=positive_int,
                   help="steps between checkpoints (default 500; one is always saved at the end)")
    p.add_argument("--log-every", type=positive_int, default=10,
                   help="steps between metrics records (default 10)")


def run(args: argparse.Namespace) -> int:
    processes, device = start_processes(args)
    resumed, settings, state = _settings(args, processes)
    spec, size = registry.SPECS[settings["model"]], registry.SIZES[settings["size"]]
    processes.fsdp = settings["fsdp"]
    if processes.fsdp and spec.layers is None:
        raise UsageError(f"--fsdp: {spec.name} has no layers to shard; train it without --fsdp")
    return train(args, processes, device, resumed, settings, state, spec, size)


def start_processes(args) -> tuple:
    """(the processes of a torchrun launch, or the one; this process's device)."""
    processes = Processes.from_env()
    device = resolve_device(args.device)
    if processes.world > 1 and device.type == "cuda":
        device = torch.device("cuda", processes.local_rank)
    return processes, device


def resumed_settings(args, processes: Processes, fixed: dict) -> tuple:
    """(the latest checkpoint in --out, its settings, its trainer state) for --resume: a
    setting of ``fixed`` given again must equal the checkpoint's."""
    out = args.out or (getattr(args, "model", None) and f"{args.model}-{args.size or 'tiny'}")
    if not out:
        raise UsageError("--resume needs --out, the folder of the run to continue")
    found = checkpoint.latest(out)
    if found is None:
        raise UsageError(f"--resume: {out} holds no checkpoint to continue")
    state = checkpoint.load_state(found)
    settings = dict(state["settings"])
    settings.setdefault("fsdp", False)  # written before --fsdp existed
    settings.setdefault("embedding_size", None)  # and --embedding-size
    settings.setdefault("deterministic", False)  # and --deterministic
    for name, value in _given(args, fixed).items():
        if value is not None and value != settings[name]:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {value} differs from the checkpoint's "
                             f"{settings[name]}: a resumed run keeps its settings")
    if args.batch_size is not None and args.batch_size * processes.world != settings["global_batch"]:
        raise UsageError(f"--batch-size {args.batch_size} x {processes.world} processes differs "
                         f"from the checkpoint's global batch of {settings['global_batch']}")
    if settings["global_batch"] % processes.world:
        raise UsageError(f"the checkpoint's global batch of {settings['global_batch']} does "
                         f"not split between {processes.world} processes")
    settings["steps"] = args.steps or settings["steps"]
    if settings["steps"] <= state["step"]:
        raise UsageError(f"--steps {settings['steps']}: {found} is already at step "
                         f"{state['step']}")
    settings["out"] = str(out)
    return found, settings, state


def _given(args, fixed: dict) -> dict:
    """The settings of ``fixed`` as given on the command line (None: not given), paths
    made absolute."""
    given = {name: getattr(args, name) for name in fixed}
    if given.get("corpus"):
        given["corpus"] = [str(Path(c).resolve()) for c in given["corpus"]]
    for name in ("tokenizer", "teacher"):
        if given.get(name):
            given[name] = str(Path(given[name]).resolve())
    return given


def new_settings(args, processes: Processes, fixed: dict, lr: float, out: str) -> dict:
    """The settings of a new run: ``fixed``'s given or default, and the schedule's."""
    settings = {name: fixed[name] if value is None else value
                for name, value in _given(args, fixed).items()}
    settings["steps"] = args.steps or 1000
    settings["lr"] = lr if settings["lr"] is None else settings["lr"]
    settings["warmup"] = settings["steps"] // 10 if settings["warmup"] is None else settings["warmup"]
    settings["global_batch"] = (args.batch_size or 8) * processes.world
    settings["out"] = args.out or out
    for name in ("warmup", "clip"):
        if settings[name] < 0:
            raise UsageError(f"--{name} must not be negative, got {settings[name]}")
    if not settings["lr"] > 0:
        raise UsageError(f"--lr must be positive, got {settings['lr']}")
    if checkpoint.holds_model(settings["out"]):
        raise UsageError(f"--out {settings['out']} already holds a checkpoint: pass --resume to "
                         "continue it, or choose another --out")
    return settings


def _settings(args, processes: Processes) -> tuple:
    """(checkpoint resumed or None, settings, its trainer state or None)."""
    if args.resume:
        return resumed_settings(args, processes, FIXED)
    if args.model is None:
        raise UsageError("--model is needed (one of " + ", ".join(sorted(registry.SPECS)) + ")")
    size = registry.SIZES[args.size or FIXED["size"]]
    settings = new_settings(args, processes, FIXED, size.lr, f"{args.model}-{args.size or 'tiny'}")
    settings["vocab_size"] = settings["vocab_size"] or size.vocab
    if settings["embedding_size"] is not None and not registry.SPECS[settings["model"]].factorized:
        raise UsageError(f"--embedding-size: {settings['model']}'s embeddings are as wide as its "
                         "hidden size (albert and electra factorize them)")
    if settings["dropout"] is not None and not 0 <= settings["dropout"] < 1:
        raise UsageError(f"--dropout must be in [0, 1), got {settings['dropout']}")
    return None, settings, None


@contextlib.contextmanager
def algorithms(deterministic: bool):
    """torch.use_deterministic_algorithms(True) inside, when ``deterministic``, with the
    cuBLAS workspace setting that torch's CUDA matrix products then need (read when cuBLAS
    starts); the mode before is put back on the way out."""
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def _tokenizer(spec, settings, resumed, corpus, processes: Processes):
    if resumed is not None:
        return tok.load(resumed)
    if settings["tokenizer"]:
        return tok.load(settings["tokenizer"])
    # One process trains it; the others take its JSON, so all share one vocabulary.
    text = tok.train(spec.tokenizer, corpus.documents, settings["vocab_size"]).to_str() \
        if processes.main else None
    return tok.from_json(processes.broadcast(text))


def train(args, processes, device, resumed, settings, state, spec, size) -> int:
    """Trains ``spec``'s model (built at ``size``, or resumed) with ``settings`` on the
    corpus they name, across ``processes``: pretrain's loop, which distill shares."""
    out = Path(settings["out"])
    corpus = read_corpus(settings["corpus"]) if settings["corpus"] else default_corpus()
    if corpus.replaced_bytes and processes.main:
        print(f"fusedlm {args.command}: warning: {corpus.replaced_bytes} undecodable bytes in "
              "the corpus were replaced by U+FFFD", file=sys.stderr)
    processes.start(device)
    try:
        with algorithms(deterministic=settings["deterministic"]):
            status = _train(args, processes, device, resumed, settings, state, spec, size, out,
                            corpus)
    except BaseException:
        processes.stop()
        raise
    processes.stop(wait=True)
    return status


def _train(args, processes, device, resumed, settings, state, spec, size, out, corpus) -> int:
    tokenizer = _tokenizer(spec, settings, resumed, corpus, processes)
    rng.seed(settings["seed"])
    if resumed is None:
        model = spec.build(size, tokenizer, settings["dropout"], settings["embedding_size"])
    else:
        model = spec.load_checkpoint(resumed)
    positions = spec.positions(model.config)
    if settings["seq_len"] > positions:
        raise UsageError(f"--seq-len {settings['seq_len']} is more than the model's {positions} "
                         "positions")
    blocks = spec.blocks(corpus.documents, tokenizer, settings["seq_len"])
    if blocks.shape[0] == 0:
        raise UsageError(f"the corpus has too few tokens for one --seq-len {settings['seq_len']} "
                         "sequence")
    if resumed is not None and fingerprint(blocks) != state["data"]:
        raise UsageError(f"--resume: the corpus or tokenizer differs from the one {resumed} "
                         "was trained on")

    dtype = DTYPES[settings["dtype"]]
    if processes.fsdp:
        trained = processes.shard(model, spec.layers(model), device, dtype)
    else:
        trained = processes.wrap(model.to(device), device)
    trainer = Trainer(trained, lr=settings["lr"], warmup=settings["warmup"],
                      steps=settings["steps"], clip=settings["clip"],
                      dtype=dtype, device=device, processes=processes)
    start, unlogged = 0, []
    if resumed is not None:
        trainer.load_state_dict(state["trainer"])
        # Resumed by more processes than saved it, the extra ones take rank 0's streams.
        saved = state["rng"]
        rng.restore(saved[processes.rank] if processes.rank < len(saved) else saved[0], device)
        start, unlogged = state["step"], state.get("unlogged", [])
    order = BlockOrder(blocks, settings["seed"])
    metrics = MetricsLog(out, keep_until=start) if processes.main else None
    global_batch, accum = settings["global_batch"], settings["grad_accum"]
    tokens_per_step = global_batch * accum * settings["seq_len"]
    progress = Progress(settings["steps"], start, args.log_every, enabled=processes.main)
    save_every = args.save_every or 500
    # The steps since the last metrics record, which the next one averages over.
    began, since_log = time.perf_counter(), unlogged
    for step in range(start, settings["steps"]):
        tick = time.perf_counter()
        micro = []
        for m in range(accum):
            # Drawn from the step alone, as the blocks are: the same on every process (which
            # takes its rows) and after a resume. The loss's own draws differ per process.
            draw = torch.Generator().manual_seed(hash((settings["seed"], step, m)) % 2**63)
            inputs = spec.batch(order.take((step * accum + m) * global_batch, global_batch),
                                tokenizer, draw)
            inputs = inputs_to(rows(inputs, processes.rank, processes.world), device)
            draw = torch.Generator(device).manual_seed(
                hash((settings["seed"], step, m, processes.rank)) % 2**63)
            micro.append(functools.partial(spec.loss, inputs=inputs, generator=draw))
        lr = trainer.lr
        loss, measured = trainer.step(micro)
        done = step + 1
        tokens_per_s = tokens_per_step / (time.perf_counter() - tick)
        since_log.append({"loss": loss, **measured})
        progress.update(done, loss, tokens_per_s, measured)
        if metrics is not None and (done % args.log_every == 0 or done == settings["steps"]):
            means = {k: sum(r[k] for r in since_log) / len(since_log) for k in since_log[0]}
            metrics.write({"step": done, **means, "lr": lr, "tokens": done * tokens_per_step,
                           "tokens_per_s": round(tokens_per_s, 1),
                           "elapsed_s": round(time.perf_counter() - began, 3)})
            since_log = []
        if done % save_every == 0 or done == settings["steps"]:
            _save(out, done, spec, model, tokenizer, trainer, settings, blocks, since_log, device,
                  processes, fresh=functools.partial(spec.build, size, tokenizer,
                                                     settings["dropout"], settings["embedding_size"]))
    progress.close()
    if processes.main:
        plot_losses(out)
        params = sum(p.numel() for p in spec.export(model).parameters())
        print(f"{spec.name} ({params / 1e6:.1f}M parameters) trained to step {settings['steps']}, "
              f"loss {loss:.4f}: {out}")
    return 0


def _save(out, step, spec, model, tokenizer, trainer, settings, blocks, unlogged, device,
          processes, fresh) -> None:
    """``fresh()``: a new model like the one trained, for a sharded one to be saved from;
    ``unlogged``: the steps' records since the last metrics record."""
    streams = processes.gather(rng.state(device))  # every process's, so each resumes its own
    # Gathered by every process under FSDP; the whole state is rank 0's.
    weights, trainer_state = processes.model_state(model), trainer.state_dict()
    if processes.main:
        # Saving may draw random numbers (a model built for export): not from the run's.
        with rng.untouched(device):
            if processes.fsdp:  # the sharded model cannot save itself: a whole copy does
                model = fresh()
                model.load_state_dict(weights)
            checkpoint.save(out, step, model, spec.export(model), tokenizer, {
                "step": step, "settings": settings, "trainer": trainer_state, "rng": streams,
                "data": fingerprint(blocks), "unlogged": unlogged})
