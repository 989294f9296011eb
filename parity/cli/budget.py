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


def add_arguments(p: argparse.ArgumentParser) -> None:
    # parity run's options, less those that mean nothing to a budget: it runs no invariance checks, plants nothing,
    # needs no sampler-side log S, samples offline with the top-K capture and writes no records.
    add_run_arguments(p, out="reports/budget", matrix="'default' (T=1 top_p=0.9 and T=1 top_p=1) or a TOML matrix file",
                      run_only=False)
    p.set_defaults(invariance=False, plant=None, no_sampler_log_s=True, server=None, capture="topk", records=None)
    p.add_argument("--order", default=None, metavar="CAUSE,CAUSE,...",
                   help=f"the order the causes are removed in (default: {','.join(CAUSES)}; unnamed ones follow)")


def main(args: argparse.Namespace) -> int:
    from parity.budget import BudgetConfig, budget
    from parity.report.budget_section import terminal

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
