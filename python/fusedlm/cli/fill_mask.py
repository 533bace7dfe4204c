"""fusedlm fill-mask: the most probable tokens at each [MASK] (RoBERTa: <mask>) of a
text, from a masked LM (a BERT or RoBERTa folder with its masked-LM head, or ELECTRA's
generator)."""
from __future__ import annotations

import argparse

import torch

from . import tokenizer as tok
from .common import add_device_argument, load_model, positive_int, resolve_device
from .errors import UsageError


HELP = "predict the [MASK] (RoBERTa: <mask>) tokens of a text"
DESCRIPTION = """Prints, for each [MASK] in TEXT (<mask> for a RoBERTa), the --top-k most
probable tokens and their probabilities, then TEXT with the best of each filled in."""


def add_arguments(p) -> None:
    p.add_argument("--model", required=True, metavar="DIR",
                   help="a BERT folder with its masked-LM head (BertForMaskedLM, "
                        "BertForPreTraining), a RobertaForMaskedLM folder or an ELECTRA "
                        "generator folder")
    p.add_argument("text", help='e.g. "Paris is the [MASK] of France."')
    p.add_argument("--top-k", type=positive_int, default=5, help="candidates per mask (default 5)")
    add_device_argument(p)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    spec, model, tokenizer = load_model(args.model, "fill-mask", device)
    mask_token = tok.role(tokenizer, "mask")
    mask = tokenizer.token_to_id(mask_token)
    ids = tokenizer.encode(args.text).ids
    positions = spec.positions(model.config)
    if len(ids) > positions:
        raise UsageError(f"the text is {len(ids)} tokens, more than the model's {positions} "
                         "positions")
    where = [i for i, t in enumerate(ids) if t == mask]
    if not where:
        raise UsageError(f"the text has no {mask_token} token")
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0, where]  # [masks, vocab]
    probs, best = logits.float().softmax(-1).topk(min(args.top_k, logits.shape[-1]), dim=-1)
    filled = list(ids)
    for n, (position, p, b) in enumerate(zip(where, probs.tolist(), best.tolist()), 1):
        candidates = ", ".join(f"{tok.shown(tokenizer, t)} ({q:.3f})" for t, q in zip(b, p))
        print(f"{mask_token} {n}: {candidates}")
        filled[position] = b[0]
    print(tokenizer.decode(filled))
    return 0
