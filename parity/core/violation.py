"""One type for every failed gate (engine-free): a :class:`Violation` names the gate, the scenario, the
failing statistic and its limit, and the worst positions with both sides' values; the message is rendered
from it. report.json carries it as an object (:meth:`Violation.to_dict`): read its fields, never the message.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from parity.core.json_types import JsonObject


def _num(x: float | None) -> float | str | None:
    """JSON-safe number: non-finite floats become strings ("inf", "-inf", "nan")."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else str(x)


@dataclass(frozen=True)
class Position:
    """One offending token: where it is and what each side said."""

    prompt: int | None = None
    position: int | None = None
    token: int | None = None
    values: dict[str, float] = field(default_factory=dict)  # side name -> value, sampler first
    gap: float | None = None
    bound: float | None = None
    note: str = ""

    def where(self) -> str:
        parts = [f"{k} {v}" for k, v in (("prompt", self.prompt), ("position", self.position), ("token", self.token))
                 if v is not None]
        return ", ".join(parts)

    def render(self) -> str:
        text = self.where()
        if self.values:
            text += (": " if text else "") + " ".join(f"{k}={v:.7g}" for k, v in self.values.items())
        if self.gap is not None:
            text += f" gap={self.gap:.3g}"
        if self.bound is not None:
            text += f" bound={self.bound:.3g}"
        if self.note:
            text += f" ({self.note})"
        return text

    @classmethod
    def from_dict(cls, d: Mapping[str, object]) -> Position:
        """A position as :meth:`to_dict` wrote it (a non-finite number written as a string comes back a float)."""
        def index(x: object) -> int | None:
            return x if isinstance(x, int) and not isinstance(x, bool) else None

        def num(x: object) -> float | None:
            return float(x) if isinstance(x, int | float | str) and not isinstance(x, bool) else None

        vals = d.get("values")
        values = {str(k): float(v) for k, v in vals.items() if num(v) is not None} if isinstance(vals, dict) else {}
        return cls(index(d.get("prompt")), index(d.get("position")), index(d.get("token")), values, num(d.get("gap")),
                   num(d.get("bound")), str(d.get("note") or ""))

    def to_dict(self) -> JsonObject:
        return {**asdict(self), "values": {k: _num(v) for k, v in self.values.items()}, "gap": _num(self.gap),
                "bound": _num(self.bound)}


@dataclass(frozen=True)
class Violation:
    """A gate that failed. ``statistic`` failed ``comparison`` against ``limit``."""

    gate: str
    scenario: str
    statistic: float
    limit: float
    label: str  # what the statistic is, for the message ("replay max |diff| / bound")
    comparison: str = ">"  # how the statistic broke the limit: ">" (too large) or "<" (too small)
    worst: tuple[Position, ...] = ()
    detail: str = ""

    def message(self) -> str:
        text = f"[{self.scenario}] {self.label} {self.statistic:.4g} {self.comparison} {self.limit:.4g}"
        if self.detail:
            text += f": {self.detail}"
        if self.worst:
            text += "; worst: " + "; ".join(p.render() for p in self.worst)
        return text

    def __str__(self) -> str:
        return self.message()

    def to_dict(self) -> JsonObject:
        return {**asdict(self), "statistic": _num(self.statistic), "limit": _num(self.limit),
                "worst": [p.to_dict() for p in self.worst], "message": self.message()}
