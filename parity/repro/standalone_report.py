"""How every standalone script prints its result: a Markdown table and the checks with the verdict.

Imports nothing from parity: both script sources (``standalone_src.py`` and
``standalone_trl_src.py``) inline it at emit time, so each emitted script stays one file.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


def markdown(columns: Sequence[tuple[str, str, str]], rows: Iterable[Mapping[str, Any]]) -> str:
    """A Markdown table; ``columns`` are ``(key, title, format)``, floats use the format ("" = "g")."""

    def cell(v: Any, f: str) -> str:
        if isinstance(v, float):
            return "inf" if v == math.inf else "-inf" if v == -math.inf else format(v, f or "g")
        return str(v)

    out = ["| " + " | ".join(t for _, t, _ in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    out += ["| " + " | ".join(cell(r[k], f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(out)


def verdict(checks: Sequence[tuple[str, object]]) -> int:
    """Print the checks; 0 when all hold (REPRODUCED), 1 otherwise."""
    print()
    for statement, ok in checks:
        print(f"- [{'x' if ok else ' '}] {statement}")
    ok = all(ok for _, ok in checks)
    print("\nREPRODUCED" if ok else "\nNOT REPRODUCED")
    return 0 if ok else 1
