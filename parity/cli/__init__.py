"""The ``parity`` command line: :mod:`parity.cli.main` builds the parser; one module per command. What more
than one command reads from its flags lives here, free of torch and of any engine, so that
``parity analyze`` without ``--model`` starts without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from parity.errors import UsageError

if TYPE_CHECKING:
    from parity.core.gates import Thresholds
    from parity.report.blocks import ReportJson


def thresholds_from_args(path: Path | None, gates: list[str], dtype: str) -> Thresholds:
    """``--thresholds FILE`` (or the dtype's defaults) with ``--gate NAME=VALUE`` overrides."""
    # Imported on use: `parity --help` imports no command's dependencies.
    from parity.core.gates import Thresholds

    th = Thresholds.from_toml(path, dtype) if path else Thresholds.for_dtype(dtype)
    changes: dict[str, float] = {}
    for item in gates:
        name, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"--gate {item!r} is invalid: allowed NAME=VALUE")
        try:
            changes[name.strip()] = float(value)
        except ValueError:
            raise UsageError(f"--gate {item!r}: value {value!r} is not a number") from None
    if changes:
        th = th.override(**changes)
    return th


# The exit code of a report that neither passes nor fails (README's exit-code table).
NO_VERDICT = 4


def verdict_exit_code(report: ReportJson, *, accept_partial: bool = False) -> int:
    """0 pass, 1 a gate failed, :data:`NO_VERDICT` when no gate, or no mean-bias gate, could be evaluated in
    a scenario. ``accept_partial``: 0 where every scenario judged some gate and none failed."""
    if report["verdict"] == "fail":
        return 1
    if report["verdict"] == "none":
        judged = bool(report["scenarios"]) and all(s["verdict"] == "pass" for s in report["scenarios"])
        return 0 if accept_partial and judged else NO_VERDICT
    return 0


def verdict_line(report: ReportJson, code: int) -> str:
    """The one line a run ends with: PASS, FAIL or NO VERDICT, the scenarios behind it and the exit code."""
    sc = report["scenarios"]
    n = {v: sum(s["verdict"] == v for s in sc) for v in ("pass", "fail", "none")}
    counts = f"{n['pass']} pass, {n['fail']} fail, {n['none']} without a verdict, of {len(sc)} scenario(s)"
    word = "FAIL" if code == 1 else "PASS" if code == 0 else "NO VERDICT"
    if code == 0 and report["verdict"] == "none":
        word = "PASS (partial: --accept-partial)"
    return f"verdict: {word} (exit {code}): {counts}"
