"""fusedlm generate: continues a prompt with a GPT-2 folder (transformers' generate) or a
ULMFiT language model's (its forward direction)."""
from __future__ import annotations

import argparse

import torch

from . import rng
from .common import add_device_argument, load_model, positive_int, resolve_device
from .errors import UsageError
from .loading import quiet


HELP = "continue a prompt with a GPT or ULMFiT checkpoint"
DESCRIPTION = """Continues --prompt with the model in --model (greedy with --temperature 0, else
sampled) until --max-new-tokens or the end-of-text token, and prints the text."""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a GPT-2 or ULMFiT language model folder")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=positive_int, default=50)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature; 0 picks the most probable token (default 1.0)")
    p.add_argument("--top-k", type=positive_int, help="sample among the k most probable tokens")
    p.add_argument("--top-p", type=float, help="sample among the most probable tokens of total "
                                               "probability p (nucleus sampling)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    add_device_argument(p)


def run(args: argparse.Namespace) -> int:
    if args.temperature < 0:
        raise UsageError(f"--temperature must not be negative, got {args.temperature}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    device = resolve_device(args.device)
    spec, model, tokenizer = load_model(args.model, "generate", device)
    ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    if not ids:
        raise UsageError("--prompt is empty")
    room = spec.positions(model.config)
    if len(ids) + args.max_new_tokens > room:
        raise UsageError(f"--prompt is {len(ids)} tokens: with --max-new-tokens "
                         f"{args.max_new_tokens} that is more than the model's {room} positions")
    sample = args.temperature > 0
    # Every option is given (the folder's generation_config.json may say otherwise):
    # greedy, or sampling with no top-k or top-p cut unless asked for.
    options = dict(do_sample=True, temperature=args.temperature, top_k=args.top_k or 0,
                   top_p=args.top_p or 1.0) if sample else dict(do_sample=False)
    eos = getattr(model.config, "eos_token_id", None)
    prompt = torch.tensor([ids], device=device)
    rng.seed(args.seed)  # transformers' sampling draws from torch's generators
    with quiet():
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                             pad_token_id=eos, **options)
    text = tokenizer.decode(out[0, len(ids):].tolist())
    # A word-level vocabulary (no decoder) decodes words without the space before the first.
    print(args.prompt + (" " if tokenizer.decoder is None and text else "") + text)
    return 0
