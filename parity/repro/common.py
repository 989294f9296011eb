"""What every reproduction reads and writes: the result type, the settings of one invocation, Markdown/JSON output.

A reproduction computes two things from two independent sources and states whether they agree:
*predicted* values come from the trainer's logits run through the reference filters; *measured* values
come from the vLLM run (the sampler's processed log-probs, its top-K head). Nothing a repro checks is typed in.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from parity.report.schema import json_safe
from parity.repro.standalone_report import markdown


@dataclass
class Check:
    """One stated relation and whether the measured table shows it."""

    statement: str
    passed: bool
    detail: str = ""


@dataclass
class ReproResult:
    name: str
    number: int
    title: str
    finding: str  # one sentence: what the table shows when the checks hold
    columns: list[tuple[str, str, str]]  # (key, title, format spec for floats)
    rows: Sequence[Mapping[str, object]]
    checks: list[Check]
    notes: list[str] = field(default_factory=list)
    data: dict[str, object] = field(default_factory=dict)  # everything else worth keeping (JSON only)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def verdict(self) -> str:
        return "REPRODUCED" if self.passed else "NOT REPRODUCED"

    def markdown(self) -> str:
        lines = [f"## Repro {self.number}: {self.title} (`{self.name}`)", "", self.finding, "",
                 markdown(self.columns, self.rows), "",
                 "Checks (measured from the vLLM run vs predicted from trainer logits):", ""]
        lines += [f"- [{'x' if c.passed else ' '}] {c.statement}" + (f" — {c.detail}" if c.detail else "")
                  for c in self.checks]
        failed = [c.statement for c in self.checks if not c.passed]
        lines += ["", f"**{self.verdict}**" + (f": {len(failed)} check(s) failed" if failed else "")
                  + f" ({self.seconds:.1f} s)"]
        if self.notes:
            lines += ["", *(f"> {n}" for n in self.notes)]
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, object]:
        data: dict[str, object] = json_safe(
            {
                "schema_version": 1,
                "name": self.name,
                "number": self.number,
                "title": self.title,
                "finding": self.finding,
                "verdict": self.verdict,
                "passed": self.passed,
                "columns": [{"key": k, "title": t} for k, t, _ in self.columns],
                "rows": self.rows,
                "checks": [asdict(c) for c in self.checks],
                "notes": self.notes,
                "data": self.data,
                "seconds": round(self.seconds, 3),
            }
        )
        return data

    def write(self, out: Path) -> list[Path]:
        """result.json and table.md under ``out`` (created)."""
        out.mkdir(parents=True, exist_ok=True)
        j, md = out / "result.json", out / "table.md"
        j.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n", encoding="utf-8")
        md.write_text(self.markdown(), encoding="utf-8")
        return [j, md]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass(kw_only=True)
class Context:
    """Settings of one ``parity repro`` invocation."""

    small: bool = False
    seed: int = 0
    timeout_s: float = 900.0
    # ``--model``: a fixture name or checkpoint directory in place of the repro's own fixture (only repros
    # in ``registry.MODEL_REPROS``; None: each repro's own).
    model: str | None = None
    progress: Callable[[str], None] = _stderr
