"""The one table of gates: every gate parity applies is an entry, with its inputs, rule and limit."""

from __future__ import annotations

import re
from pathlib import Path

from parity.determinism.knobs import UNAVAILABLE
from parity.judge import gate_table
from parity.judge.gate_table import GATE_TABLE, REFERENCE_GATES
from parity.judge.verdict import GATE_INPUTS, REASONS

TESTS = Path(__file__).resolve().parents[1]


def test_every_gate_is_one_entry_with_known_inputs_and_a_stated_limit() -> None:
    names = [g.name for g in GATE_TABLE]
    assert len(names) == len(set(names))
    for g in GATE_TABLE:
        assert set(g.needs) <= set(REASONS), (g.name, g.needs)
        assert g.limit.strip() and g.scope in ("records", "native", "run", "routing"), g.name
    assert set(GATE_INPUTS) | {"drift_trend"} == {g.name for g in GATE_TABLE if g.scope == "records"}
    assert set(REFERENCE_GATES) < set(GATE_INPUTS)


def test_every_gate_has_a_test_that_makes_it_fail() -> None:
    """Each entry's name appears beside a failing expectation in some test (its planted-fault test)."""
    text = "\n".join(p.read_text() for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name)
    spelled = {"drift_trend": "TREND_GATE"}  # named by its constant in tests/unit/test_pins_gates.py
    missing = [g.name for g in GATE_TABLE if not re.search(rf"[\"']{re.escape(g.name)}[\"']", text)
               and spelled.get(g.name, "\0") not in text]
    assert not missing, f"gates no test names: {missing}"


def test_the_invariance_entry_skips_a_check_by_the_status_word_the_knobs_write() -> None:
    assert gate_table.UNAVAILABLE == UNAVAILABLE


def test_the_generated_schema_refuses_a_block_that_lacks_a_key() -> None:
    import jsonschema
    import pytest

    from parity.report.blocks import Diff, schema_of

    ok = {"max_abs_diff": 0.1, "mean_diff": 0.0, "mean_abs_diff": 0.01, "p99_abs_diff": 0.05, "support_equal_frac": None}
    jsonschema.validate(ok, schema_of(Diff))
    with pytest.raises(jsonschema.ValidationError, match="p99_abs_diff"):
        jsonschema.validate({k: v for k, v in ok.items() if k != "p99_abs_diff"}, schema_of(Diff))

