"""The ``parity`` console script.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``main(args) -> int``;
modules are imported when the parser is built, and none of them imports vLLM at import time, so
``parity --help`` works without vLLM installed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("parity.cli.run", "run a scenario matrix: vLLM rollout vs transformers trainer, report and gates"),
    "matrix": ("parity.cli.matrix", "show the default scenario matrix, or validate a TOML matrix file"),
    "sampler": ("parity.cli.sampler", "check the reference filters against vLLM's own Sampler on random logits"),
    "fixtures": ("parity.cli.fixtures", "list, build or locate the offline fixture models"),
    "repro": ("parity.cli.repro", "reproduce upstream bugs (list | NAME | all)"),
    "ties": ("parity.cli.ties", "characterize how the engine keeps ties at the k-th value, per batch size"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="parity",
        description="Rollout-trainer parity: does the trainer score the distribution vLLM sampled from?",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real missing dependency inside the module
                raise
            continue
        if not hasattr(mod, "add_arguments"):  # a package still being written
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    try:
        return int(args._main(args) or 0)
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as exc:
        # Bad input and unreachable engines end with one readable line, not a traceback.
        print(f"parity {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
