"""``parity repro``: minimal, convincing reproductions of upstream bugs (``list``, ``NAME|NUMBER``, ``all``).

The command line, outputs and flags: docs/internals.md, section 6.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from parity.errors import UsageError
from parity.repro.registry import MODEL_REPROS, REPROS, Entry, get
from parity.repro.runner import emit_script, run_entries

if TYPE_CHECKING:  # pragma: no cover
    from parity.repro.common import ReproResult

DEFAULT_ROOT = Path("reports/repro")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("target", metavar="list|NAME|all", help="'list', a reproduction's name or number, or 'all'")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (default reports/repro/NAME; for 'all' the root, default reports/repro)")
    p.add_argument("--emit-script", type=Path, default=None, metavar="PATH",
                   help="write the standalone script instead of running (for 'all': a folder of NAME.py)")
    p.add_argument("--small", action="store_true", help="fewer prompts, tokens and settings (what the tests run)")
    p.add_argument("--seed", type=int, default=0, help="base sampling seed (prompt i uses seed + i)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one engine call or subprocess may take")
    p.add_argument("--model", default=None, metavar="NAME|PATH",
                   help="run the repro on this fixture or checkpoint directory instead of its own fixture "
                        "(one repro that takes it, e.g. trl_grpo_top_p --model smollm2-135m)")


def _list() -> int:
    width = max(len(e.name) for e in REPROS)
    for e in REPROS:
        print(f"{e.number}  {e.name:<{width}}  {e.title}" + ("  [--model]" if e.takes_model else ""))
    print("\nrun one: parity repro NAME [--small]; all: parity repro all; standalone: --emit-script PATH; "
          "[--model]: also runs on another model (parity repro NAME --model NAME|PATH)")
    return 0


def _check_model(args: argparse.Namespace, entries: list[Entry], single: bool) -> None:
    """``--model``: one repro that takes it, a run (not a script), a fixture name or a checkpoint directory."""
    if not single:
        raise UsageError("--model applies to one repro (parity repro NAME --model ...), not to 'all'")
    if args.emit_script is not None:
        raise UsageError("--model applies to a run: the standalone script builds its fixture from code")
    entry = entries[0]
    if not entry.takes_model:
        raise UsageError(f"--model is not an option of repro {entry.name!r} (it runs on its own fixture); "
                         f"repros that take it: {', '.join(MODEL_REPROS)}")
    from parity.fixtures import recipe_names

    path = Path(args.model).expanduser()
    if not ((path / "config.json").is_file() or args.model in recipe_names()):
        raise UsageError(f"--model {args.model!r} is neither a fixture name nor a checkpoint directory with "
                         f"config.json; fixtures: {', '.join(recipe_names())}")


def _emit(entries: list[Entry], path: Path, small: bool, single: bool) -> int:
    if single:
        if not entries[0].has_script:
            raise UsageError(f"repro {entries[0].name!r} has no standalone script: it needs parity at run time; "
                             f"run it with: parity repro {entries[0].name}")
        targets = [(entries[0], path)]
    else:
        path.mkdir(parents=True, exist_ok=True)
        targets = [(e, path / f"{e.name}.py") for e in entries if e.has_script]
    for entry, dest in targets:
        text = emit_script(entry, small)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text, encoding="utf-8")
        dest.chmod(0o755)
        print(f"parity repro: wrote {dest} (standalone: python {dest})")
    return 0


def main(args: argparse.Namespace) -> int:
    target = args.target
    if target == "list":
        return _list()
    single = target != "all"
    entries = [get(target)] if single else list(REPROS)
    if args.model is not None:
        _check_model(args, entries, single)
    if args.emit_script is not None:
        return _emit(sorted(entries, key=lambda e: e.number), args.emit_script, args.small, single)

    from parity.engines.vllm_offline import configure_cpu_env
    from parity.repro.common import Context

    configure_cpu_env()  # before vLLM is imported by any repro
    root = args.out or (DEFAULT_ROOT / entries[0].name if single else DEFAULT_ROOT)

    def out_for(e: Entry) -> Path:
        return root if single else root / e.name

    model = args.model
    if model is not None and (Path(model).expanduser() / "config.json").is_file():
        model = str(Path(model).expanduser().resolve())  # the repro's subprocesses may run elsewhere
    ctx = Context(small=args.small, seed=args.seed, timeout_s=args.timeout, model=model)
    results = run_entries(entries, ctx, out_for)
    results.sort(key=lambda r: r.number)
    if not single:
        _summary(results, args.out or DEFAULT_ROOT, args.small)
    for r in results:
        print(f"parity repro: {r.number} {r.name}: {r.verdict} ({r.seconds:.1f} s)", file=sys.stderr)
    return 0 if all(r.passed for r in results) else 1


def _summary(results: list[ReproResult], root: Path, small: bool) -> None:
    from parity.repro.standalone_report import markdown

    rows = [{"number": r.number, "name": r.name, "verdict": r.verdict, "seconds": r.seconds, "finding": r.finding}
            for r in results]
    cols = [("number", "#", ""), ("name", "repro", ""), ("verdict", "verdict", ""), ("seconds", "seconds", ".1f"),
            ("finding", "finding", "")]
    root.mkdir(parents=True, exist_ok=True)
    md = "# parity repro all\n\n" + markdown(cols, rows) + "\n"
    (root / "summary.md").write_text(md, encoding="utf-8")
    (root / "summary.json").write_text(
        json.dumps({"small": small, "passed": all(r.passed for r in results), "repros": rows}, indent=2) + "\n",
        encoding="utf-8",
    )
    print(md, flush=True)
