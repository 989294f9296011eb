"""The typed report (parity.report.model): what a producer may write, and report.json read back, checked."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
from test_records_byo import pyarrow_file, user_rows

from parity.analyze import analyze
from parity.core.violation import Position, Violation
from parity.errors import UsageError
from parity.report.model import checked_report, load_report, violation_from_json
from parity.report.schema import SCHEMA_VERSION, write_report


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("model")
    rows = user_rows(4, naive=-0.3)
    analyze(pyarrow_file(tmp / "r.parquet", rows, {"schema_version": 1, "vocab_size": 64}), out=tmp / "out",
            plots=False)
    return json.loads((tmp / "out" / "report.json").read_text()), tmp


def test_a_written_report_reads_back_key_for_key(written) -> None:
    data, tmp = written
    rep = load_report(tmp / "out")
    assert rep == data  # the same keys, in the same order, and the same values
    assert list(rep) == list(data) and [list(s) for s in rep["scenarios"]] == [list(s) for s in data["scenarios"]]
    sc = rep["scenarios"][0]
    assert sc["verdict"] == "fail" and sc["violations"]
    assert [violation_from_json(v).to_dict() for v in sc["violations"]] == sc["violations"]


def test_writing_leaves_out_an_optional_block_given_as_none_and_orders_the_keys(written) -> None:
    data, _ = written
    given = copy.deepcopy(data)
    given["budget"] = None  # a report builder's optional block, not produced
    given["scenarios"][0]["model"] = None
    given["scenarios"][0] = dict(reversed(list(given["scenarios"][0].items())))
    out = checked_report(given)
    assert "budget" not in out and "model" not in out["scenarios"][0]
    assert list(out["scenarios"][0]) == list(data["scenarios"][0])


@pytest.mark.parametrize("where", ["top", "scenario", "environment"])
def test_a_key_the_types_do_not_name_is_refused_by_name(written, where: str, tmp_path: Path) -> None:
    data, _ = written
    bad = copy.deepcopy(data)
    target = {"top": bad, "scenario": bad["scenarios"][0], "environment": bad["environment"]}[where]
    target["_hidden"] = 1
    with pytest.raises(UsageError, match=r"unknown key\(s\) _hidden: allowed [a-z_]+, "):
        write_report(bad, tmp_path / "out", plots=False)
    assert not (tmp_path / "out" / "report.json").exists()  # nothing half written


def test_a_missing_key_and_another_schema_version_are_refused(written) -> None:
    data, _ = written
    bad = copy.deepcopy(data)
    del bad["scenarios"][0]["verdict"]
    with pytest.raises(UsageError, match=r"missing key\(s\) verdict"):
        checked_report(bad)
    old = {**data, "schema_version": 1}
    with pytest.raises(UsageError, match=f"schema_version 1: this parity reads {SCHEMA_VERSION}"):
        checked_report(old)
    bad = copy.deepcopy(data)
    bad["scenarios"][0]["spec"]["top_q"] = 0.5
    with pytest.raises(UsageError, match=r"unknown field\(s\) \['top_q'\]"):
        checked_report(bad)


def test_a_violation_reads_back_as_it_was_written() -> None:
    v = Violation("replay_drift", "s", math.inf, 1.0, "replay max |diff| / bound",
                  worst=(Position(1, 2, 3, {"vllm": -1.5, "trainer": -1.25}, 0.25, 1e-6, "n"),), detail="d")
    back = violation_from_json(json.loads(json.dumps(v.to_dict())))
    assert back == v
    assert back.to_dict()["message"] == v.message()


def test_load_report_names_a_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no report.json there"):
        load_report(tmp_path)
    (tmp_path / "report.json").write_text("{")
    with pytest.raises(UsageError, match="not JSON"):
        load_report(tmp_path)
