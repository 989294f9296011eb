"""A token table's verdict the way ``parity run`` gets it: the table's records through :func:`parity.judge.scenario.scenario_summary`.

For tests that build a :class:`~parity.core.token_table.TokenTable` from synthetic sampler records and logits.
"""

from __future__ import annotations

from typing import Any

from parity.core.gates import Thresholds
from parity.judge.scenario import scenario_summary
from parity.judge.verdict import judge
from parity.records.convert import from_sequence_records


def judged(records, logits, table, th: Thresholds | None = None, *, name: str = "planted",
           dtypes: tuple[str, str] = ("float32", "float32"), views=None) -> dict[str, Any]:
    """The scenario's report entry (planted kept sets reach the records through ``table.kept_seen``)."""
    export = from_sequence_records(records, scenario=name, table=table)
    vocab = int(logits[0].shape[-1]) if len(logits) else None
    th = th or Thresholds()
    part = scenario_summary(export, dtypes=dtypes, vocab_size=vocab, n_listed=th.max_violations_listed, views=views)
    (verdict,) = judge(part, th, trainer_name=table.user_name)
    # The report entry, its violations kept as Violation objects.
    return {**verdict.entry, "violations": verdict.violations, "reference_violations": verdict.reference_violations}


def failed(entry: dict[str, Any]) -> set[str]:
    """Every gate that failed, deciding or reference."""
    return {v.gate for v in [*entry["violations"], *entry["reference_violations"]]}


def scenario_entry(records, logits, table, name: str, th: Thresholds | None = None) -> dict[str, Any]:
    """A report.json scenario as ``parity run`` writes it (the RL view included, violations as dicts)."""
    from parity.judge.scenario import rl_view

    e = judged(records, logits, table, th, name=name)
    return {**e, "model": "synthetic", "rl_view": rl_view(table),
            "violations": [v.to_dict() for v in e["violations"]],
            "reference_violations": [v.to_dict() for v in e["reference_violations"]]}
