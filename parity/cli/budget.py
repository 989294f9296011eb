"""``parity budget``: where the sampler–trainer mismatch comes from, cause by cause, one measured fix at a time."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from parity.cli.run import add_arguments as add_run_arguments
from parity.cli.run import config_from_args
from parity.core.budget import CAUSES
from parity.engines.engine_log import LOG_NAME, EngineOutput
from parity.errors import UsageError

# parity run's options that mean nothing to a budget (it runs no invariance checks, plants nothing, needs no
# sampler-side log S); the rest are shared.
NOT_HERE = {"--invariance", "--plant", "--no-sampler-log-s", "--server", "--capture", "--records"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    scratch = argparse.ArgumentParser(add_help=False)
    add_run_arguments(scratch)
    for action in scratch._actions:
        if any(o in NOT_HERE for o in action.option_strings):
            continue
        kwargs = {k: getattr(action, k) for k in ("default", "help", "metavar", "dest")}
        if action.option_strings == ["--matrix"]:
            kwargs["help"] = "'default' (T=1 top_p=0.9 and T=1 top_p=1) or a TOML matrix file"
        if action.option_strings == ["--out"]:
            kwargs["default"] = Path("reports/budget")
            kwargs["help"] = "report folder (default: reports/budget)"
        if isinstance(action, argparse._AppendAction):
            p.add_argument(*action.option_strings, action="append", **kwargs)
        elif isinstance(action, argparse._StoreTrueAction):
            p.add_argument(*action.option_strings, action="store_true", **{k: kwargs[k] for k in ("help", "dest")})
        else:
            p.add_argument(*action.option_strings, type=action.type or str, choices=action.choices, **kwargs)
    p.add_argument("--order", default=None, metavar="CAUSE,CAUSE,...",
                   help=f"the order the causes are removed in (default: {','.join(CAUSES)}; unnamed ones follow)")


def main(args: argparse.Namespace) -> int:
    from parity.budget import BudgetConfig, budget
    from parity.report.budget_section import terminal

    for name, default in (("invariance", False), ("plant", None), ("no_sampler_log_s", True), ("server", None),
                          ("capture", "topk"), ("records", None)):
        setattr(args, name, default)
    order = tuple(c.strip() for c in args.order.split(",") if c.strip()) if args.order else CAUSES
    run_cfg = config_from_args(args)
    if run_cfg.trainer is not None and not isinstance(run_cfg.trainer, str):
        raise UsageError("--trainer: allowed full, recompute, replay or module:function")
    cfg = BudgetConfig(**{f.name: getattr(run_cfg, f.name) for f in fields(run_cfg)}, order=order)
    with EngineOutput(Path(cfg.out) / LOG_NAME, verbose=args.verbose) as out:
        report = budget(cfg, progress=out.say)
    print()
    block = report.get("budget")
    assert block is not None  # budget() always writes it
    print(terminal(block))
    print(f"parity budget: report in {cfg.out}/report.md" + ("" if args.verbose else f", engine output in {cfg.out}/{LOG_NAME}"))
    return 0
