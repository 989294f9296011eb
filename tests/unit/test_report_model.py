"""The typed report (parity.report.model): what a producer may write, and report.json read back as types."""

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
from parity.report.model import Report, load_report, violation_from_json
from parity.report.schema import SCHEMA_VERSION, write_report


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("model")
    rows = user_rows(4, naive=-0.3)
    analyze(pyarrow_file(tmp / "r.parquet", rows, {"schema_version": 1, "vocab_size": 64}), out=tmp / "out",
            plots=False)
    return json.loads((tmp / "out" / "report.json").read_text()), tmp


def test_a_written_report_reads_back_as_types(written) -> None:
    data, tmp = written
    rep = load_report(tmp / "out")
    assert [s.name for s in rep.scenarios] == [s["name"] for s in data["scenarios"]]
    sc = rep.scenario(data["scenarios"][0]["name"])
    assert sc.spec.temperature == data["scenarios"][0]["spec"]["temperature"]
    assert sc.verdict == data["scenarios"][0]["verdict"]
    assert all(isinstance(v, Violation) for v in sc.violations)
    assert rep.environment.python == data["environment"]["python"]
    with pytest.raises(UsageError, match="no scenario 'nope'"):
        rep.scenario("nope")


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
        Report.from_json(bad)
    old = {**data, "schema_version": 1}
    with pytest.raises(UsageError, match=f"schema_version 1: this parity reads {SCHEMA_VERSION}"):
        Report.from_json(old)


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


def test_the_json_typeddicts_name_the_report_types_fields() -> None:
    """ScenarioVerdict/Report/Environment.to_json are typed as ScenarioJson/ReportJson/EnvironmentJson: same keys."""
    import dataclasses

    from parity.report import blocks, model

    for cls, td in ((model.ScenarioVerdict, blocks.ScenarioJson), (model.Report, blocks.ReportJson),
                    (model.Environment, blocks.EnvironmentJson)):
        assert sorted(f.name for f in dataclasses.fields(cls)) == sorted(td.__annotations__), cls.__name__
