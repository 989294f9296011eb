"""The one runner every reproduction goes through.

A script repro is emitted with the registry's settings and run in a child process (timeout, log file), its
table and checks read back; a module repro (trl_grpo_top_p) runs in-process. Either way the result is named,
timed, written (``result.json``, ``table.md``) and printed; an exception becomes a failed result.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from parity.errors import UsageError
from parity.repro import standalone
from parity.repro.common import Check, Context, ReproResult
from parity.repro.registry import SCRIPT_ABOUT, script_config
from parity.repro.standalone_child import ChildRun, run_child

if TYPE_CHECKING:  # pragma: no cover
    from parity.repro.registry import Entry


@dataclass
class Measured:
    """What one repro's ``run`` returns: its table and verdicts, before the runner names and writes them."""

    rows: Sequence[Mapping[str, object]]
    checks: list[Check]
    notes: list[str] = field(default_factory=list)
    data: dict[str, object] = field(default_factory=dict)  # beside the settings, which the runner stores first


def settings_for(entry: Entry, module: ModuleType, ctx: Context) -> dict[str, object]:
    """The repro's settings for this invocation: ``settings(small)``, or ``settings(small, model)`` under ``--model``."""
    if ctx.model is None:
        return dict(module.settings(ctx.small))
    if not entry.takes_model:
        raise UsageError(f"--model is not an option of repro {entry.name!r}: it runs on its own fixture")
    return dict(module.settings(ctx.small, model=ctx.model))


def run_entry(entry: Entry, ctx: Context, out: Path) -> ReproResult:
    """Run one repro (no timing, no result files): its module's measurement, or its emitted script (written
    to ``out``, run in a child process with the context's timeout, its output in ``out/script.log``)."""
    if entry.scripted:
        return run_script(entry, ctx, out)
    module = entry.load()
    cfg = settings_for(entry, module, ctx)
    m: Measured = module.run(ctx, cfg)
    return ReproResult(**asdict(entry), finding=module.FINDING, columns=module.COLUMNS, rows=m.rows,
                       checks=m.checks, notes=m.notes, data={"settings": cfg, **m.data})


def run_script(entry: Entry, ctx: Context, out: Path) -> ReproResult:
    cfg = script_config(entry.name, ctx.small)
    out.mkdir(parents=True, exist_ok=True)
    script, result, log = out / f"{entry.name}.py", out / "script.json", out / "script.log"
    script.write_text(emit_script(entry, ctx.small), encoding="utf-8")
    ctx.progress(f"parity repro: python {script} (timeout {ctx.timeout_s:.0f} s, output in {log})")
    got, p = run_for_json([sys.executable, str(script), "--seed", str(ctx.seed), "--json", str(result)], result,
                          ctx.timeout_s)
    log.write_text(p.text, encoding="utf-8")
    if got is None:
        raise RuntimeError(f"{script.name} wrote no result: {p.error or 'no error printed'} (its output: {log})")
    return ReproResult(**asdict(entry), finding=standalone.finding(entry.name),
                       columns=[tuple(c) for c in got["columns"]], rows=got["rows"],
                       checks=[Check(*c) for c in got["checks"]],
                       data={"settings": cfg, "script": str(script)})


def run_entries(entries: Sequence[Entry], ctx: Context, out_for: Callable[[Entry], Path]) -> list[ReproResult]:
    """Run ``entries`` in order with a shared context; a repro that raises is reported as failed."""
    results = []
    for entry in entries:
        ctx.progress(f"parity repro: [{entry.number}] {entry.name} ...")
        start = time.perf_counter()
        try:
            res = run_entry(entry, ctx, out_for(entry))
        except Exception as exc:  # noqa: BLE001 - one broken repro must not hide the others
            failure = Check("the reproduction runs to completion", False, f"{type(exc).__name__}: {exc}")
            res = ReproResult(**asdict(entry), finding="The reproduction did not run to completion.",
                              columns=[], rows=[], checks=[failure])
        res.seconds = time.perf_counter() - start
        res.write(out_for(entry))
        print(res.markdown(), flush=True)
        results.append(res)
    return results


def emit_script(entry: Entry, small: bool) -> str:
    """The repro's standalone script: its section of the script source, with its settings as ``CONFIG``."""
    config = script_config(entry.name, small) if entry.scripted else entry.load().script_config(small)
    return standalone.emit(entry.name, entry.title, config=config, about=SCRIPT_ABOUT.get(entry.name))


# --------------------------------------------------------------------------------------------------
# child processes

def run_for_json(cmd: list[str], result: Path, timeout_s: float) -> tuple[dict[str, Any] | None, ChildRun]:
    """``cmd`` in a child process (:func:`child_env`, a timeout): the JSON it wrote to ``result`` (None: it wrote
    none), and the child. The JSON stays Any: decoded, whatever the child (a script, trl_run) wrote."""
    result.unlink(missing_ok=True)
    p = run_child(cmd, child_env(), timeout_s)
    return (json.loads(result.read_text(encoding="utf-8")) if result.is_file() else None), p


def child_env() -> dict[str, str]:
    """A child's environment: this process's, with the CPU engine settings defaulted (``CPU_ENV``; a value the
    user set is kept) and this process's parity importable (``python -m parity...``)."""
    from parity.engines.vllm_offline import configure_cpu_env

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    configure_cpu_env(env)
    return env
