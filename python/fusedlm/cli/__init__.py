"""The ``fusedlm`` command: pretrain, distill, finetune, fill-mask, generate, embed, bench, selftest, info
(``fusedlm --help``).

Each command is a module with ``HELP``, ``DESCRIPTION``, ``add_arguments(parser)`` (unless it
takes none) and ``run(args) -> exit code``;
what they know about the models is in :mod:`fusedlm.cli.registry`. Bad input raises
:class:`UsageError`, printed here as one line with exit status 2.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .errors import UsageError

COMMANDS = ("pretrain", "distill", "finetune", "fill-mask", "generate", "embed", "bench", "selftest", "info")


def parser() -> argparse.ArgumentParser:
    import importlib

    from .common import add_command

    p = argparse.ArgumentParser(prog="fusedlm", description="Pretrain, fine-tune and run BERT, "
                                "GPT, ELECTRA and ELMo on fusedlm's fused kernels.")
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        add_command(commands, name, importlib.import_module(f".{name.replace('-', '_')}", __name__))
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs one command: its exit status (0 done, 2 bad input)."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help, or argparse's usage error
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.run(args)
    except UsageError as e:
        print(f"fusedlm {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fusedlm {args.command}: interrupted", file=sys.stderr)
        return 130


__all__ = ["UsageError", "main"]
