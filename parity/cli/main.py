"""The ``parity`` console script: each subcommand is a module of :mod:`parity.cli` with ``add_arguments(parser)``
and ``main(args) -> int``, imported only when it runs (docs/internals.md, section 6). Exit codes: the README's
table (:func:`parity.cli.verdict_exit_code` for 4, no verdict).
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from collections.abc import Collection, Sequence

import parity
from parity.errors import MissingPackage, ParityError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("parity.cli.run", "run a scenario matrix: vLLM rollout vs transformers trainer, report and gates"),
    "budget": ("parity.cli.budget", "split the sampler–trainer mismatch into its causes, one measured fix at a time"),
    "analyze": ("parity.cli.analyze", "judge records recorded anywhere (Parquet): the gates and report of run, on your data"),
    "matrix": ("parity.cli.matrix", "show the default scenario matrix, or validate a TOML matrix file"),
    "sampler": ("parity.cli.sampler", "check the reference filters against vLLM's own Sampler on random logits"),
    "fixtures": ("parity.cli.fixtures", "list, build or locate the offline fixture models"),
    "repro": ("parity.cli.repro", "reproduce upstream bugs (list | NAME | all)"),
    "ties": ("parity.cli.ties", "characterize how the engine keeps ties at the k-th value, per batch size"),
    "doctor": ("parity.cli.doctor", "check this machine for what would stop or slow `parity run`, each with its fix"),
}
# The three most common invocations, shown under `parity --help`.
EXAMPLES = """\
examples:
  parity doctor
      check the environment first: versions, KV cache, preloads, fixture cache (exit 1 if a run would fail)
  parity run --model qwen2-tiny --matrix default --invariance --out reports/parity
      the main job (what `nox -s parity` runs): vLLM vs transformers over the default matrix
  parity run --model ./my-checkpoint --matrix my.toml --trainer mymodule:my_logprobs
      score your own trainer's log-prob function on your checkpoint and your sampling settings

Engine output goes to engine.log in the report folder (`parity run --verbose` shows it instead).
"""
# Exit statuses (0 and 1 are the commands' own: passed, a gate failed).
USER_ERROR = 2  # a ParityError: one line (the traceback too with --debug)
INTERNAL_ERROR = 3  # any other exception: a bug in parity, with its traceback


def build_parser(
    commands: dict[str, tuple[str, str]] | None = None, *, load: Collection[str] | None = None
) -> argparse.ArgumentParser:
    """The parser of every listed command. ``load`` names the commands whose modules are imported and whose
    arguments are added (default: all); the others get a bare entry, enough for the top-level ``--help``."""
    parser = argparse.ArgumentParser(
        prog="parity",
        description="Rollout-trainer parity: does the trainer score the distribution vLLM sampled from?",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"parity {parity.__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback of any error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in (COMMANDS if commands is None else commands).items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if load is not None and name not in load:
            continue
        mod = importlib.import_module(module)
        missing = [f for f in ("add_arguments", "main") if not callable(getattr(mod, f, None))]
        if missing:
            raise TypeError(f"parity command {name!r}: module {module} has no {' or '.join(f + '()' for f in missing)}")
        mod.add_arguments(p)
        p.set_defaults(_main=mod.main)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command named on the line: the first word that is not an option (the top-level options take no
    value). None for ``parity --help``, ``parity --version`` and a bare ``parity``."""
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = _command(argv)
    parser = build_parser(load=[command] if command in COMMANDS else [])
    args = parser.parse_args(argv)
    if not getattr(args, "_main", None):
        parser.print_help()
        return 2
    try:
        try:
            return int(args._main(args) or 0)
        except ModuleNotFoundError as exc:
            # A package outside parity that a command imports and this install lacks: the user's to fix.
            if not exc.name or exc.name.split(".")[0] == "parity":
                raise
            raise MissingPackage(exc.name, f"`parity {args.command}` imports it") from exc
    except BrokenPipeError:
        return _closed_pipe()
    except ParityError as exc:
        # Something the user can fix: one readable line that names it.
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug else " (--debug: full traceback)"
        print(f"parity {args.command}: error: {exc}{hint}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        if args.debug:
            traceback.print_exc()
        print(f"parity {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception:
        # Not an error parity raises on purpose: a bug, never reduced to one line.
        traceback.print_exc()
        print(_bug_report(argv), file=sys.stderr)
        return INTERNAL_ERROR


def _closed_pipe() -> int:
    """stdout's reader went away (``parity matrix | head``): end quietly, as Unix tools do on SIGPIPE."""
    import os

    try:
        # Python flushes stdout again at exit, which would raise into "Exception ignored" noise.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 128 + 13  # the shell's status for a process ended by SIGPIPE


def _bug_report(argv: Sequence[str]) -> str:
    """What follows the traceback of an unexpected exception: that it is a bug, and what a report needs."""
    import shlex

    line = shlex.join(["parity", *argv])
    return (
        f"parity {_command(argv)}: internal error: this is a bug in parity {parity.__version__}, not a problem with "
        f"your input. Please report it with the command line and the traceback above:\n    {line}"
    )


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
