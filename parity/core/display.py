"""Numbers in a sentence, rounded so that the sentence stays true: "the bias -0.106 lies in [-0.105, 0]" must not
be printed for a bias of -0.10551 and a range from -0.10549 (docs/internals.md, section 9)."""

from __future__ import annotations

import math
from itertools import combinations

NA = "n/a"  # how text writes a missing value (None in memory, null in report.json)


def _sign(a: float, b: float) -> int:
    return (a > b) - (a < b)


def ordered(*values: float) -> list[str]:
    """``values`` each written with the fewest significant digits (at least 3, the same for all) that keep
    every pair's order: two numbers print equal only where they are equal, and never in the wrong order."""
    for digits in range(3, 18):
        shown = [f"{v:.{digits}g}" for v in values]
        back = [float(s) for s in shown]
        if all(_sign(back[i], back[j]) == _sign(values[i], values[j])
               for i, j in combinations(range(len(values)), 2)
               if math.isfinite(values[i]) and math.isfinite(values[j])):
            return shown
    return [repr(v) for v in values] if any(math.isfinite(v) for v in values) else [str(v) for v in values]


def apart(x: float, *others: float) -> str:
    """``x`` as :func:`ordered` writes it beside ``others``."""
    return ordered(x, *others)[0]
