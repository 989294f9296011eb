"""How every standalone script reports its result: a Markdown table, the checks and the verdict.

Imports nothing from parity: both script sources (``standalone_src.py`` and
``standalone_trl_src.py``) inline it at emit time, so each emitted script stays one file. ``parity repro``
runs the emitted script and reads the same result from its ``--json`` file.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence

# What a repro section returns: its table's columns ``(key, title, format)``, its rows (values printed by
# ``markdown``, written as JSON), and its checks ``(statement, holds[, detail])``, each read with str and bool.
Outcome = tuple[Sequence[tuple[str, str, str]], Sequence[Mapping[str, object]], Sequence[tuple[object, ...]]]


def markdown(columns: Sequence[tuple[str, str, str]], rows: Iterable[Mapping[str, object]]) -> str:
    """A Markdown table; ``columns`` are ``(key, title, format)``, floats use the format ("" = "g"), a missing
    value or None shows as "–" and a bool as yes/no."""

    def cell(v: object, f: str) -> str:
        if isinstance(v, float):
            return str(v) if not math.isfinite(v) else format(v, f or "g")
        return "–" if v is None else ("yes" if v else "no") if isinstance(v, bool) else str(v)

    out = ["| " + " | ".join(t for _, t, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(cell(r.get(k), f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(out)


def report(outcome: Outcome, json_path: str | None = None) -> int:
    """Print the table and the checks (and write them to ``json_path``); 0 when all hold (REPRODUCED), 1 otherwise."""
    columns, rows, stated = outcome
    checks = [(str(c[0]), bool(c[1]), *map(str, c[2:])) for c in stated]
    print(markdown(columns, rows) + "\n")
    for statement, holds, *detail in checks:
        print(f"- [{'x' if holds else ' '}] {statement}" + (f" ({detail[0]})" if detail else ""))
    ok = bool(checks) and all(c[1] for c in checks)
    print("\nREPRODUCED" if ok else "\nNOT REPRODUCED")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump({"columns": [list(c) for c in columns], "rows": rows, "checks": checks}, f)
    return 0 if ok else 1
