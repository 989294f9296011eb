"""Judging logs (``parity analyze`` on two log-prob columns): bad values and misspelt columns are refused or named,
numbers in a sentence keep it true, and the output ends with one verdict line.

Each case is one a user met: a trainer log-prob of +0.3 was accepted with exit 0; a column spelt
``trainer_logps`` got "the records lack trainer_logprobs" without naming the column present; "the bias -0.106 lies
in the log S range [-0.105, 0]"; a biased log said both that the trainer was not gated and FAIL; eleven NOT
EVALUATED lines buried the one verdict that matters, and no line gave it.
"""

from __future__ import annotations

import re

import pytest
from test_logprob_gate import SPECS, simulate, write

from parity.analyze import analyze
from parity.cli.main import main
from parity.core.display import ordered
from parity.judge.diagnosis import logprob_bias_class
from parity.records.validate import LOGPROB_ROUNDING


def _poke(column: str, value: float, row: int = 2, position: int = 5):
    def edit(rows: list[dict]) -> None:
        vals = list(rows[row][column])
        vals[position] = value
        rows[row][column] = vals
    return edit


@pytest.mark.parametrize("column", ["trainer_logprobs", "sampler_logprobs"])
def test_a_logprob_above_zero_is_refused_naming_column_row_value_and_what_is_allowed(tmp_path, capsys, column) -> None:
    spec = SPECS["top_p"]
    path = write(tmp_path / "plus.parquet", simulate(3, spec), spec, edit=_poke(column, 0.3))
    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"row 2 column {column} position 5: value +0.3 is above 0" in err, err
    assert "a log-probability is <= 0" in err and f"{LOGPROB_ROUNDING:.3g} above 0" in err


def test_a_file_parity_run_wrote_with_planted_faults_is_judged_not_refused(tmp_path) -> None:
    """``parity run --plant-*`` moves trainer log-probs on purpose (a few may pass 0): the gates judge them. The
    sampler's column is still checked."""
    from parity.records.write import RecordsWriter

    spec = SPECS["top_p"]
    meta = {"planted_faults": {"trainer_logprob_offset": 0.3}}
    path = write(tmp_path / "planted.parquet", simulate(3, spec), spec, edit=_poke("trainer_logprobs", 0.3), meta=meta)
    (sc,) = analyze(path, plots=False)["scenarios"]
    assert sc["compared_tokens"] == sc["tokens"] > 0  # every token judged, the planted one included
    import pyarrow.parquet as pq

    rows = pq.read_table(path).to_pylist()
    with RecordsWriter(tmp_path / "again.parquet", metadata={"vocab_size": 1000, **meta}) as w:
        w.write(rows)  # accepted: the metadata names the planted fault
    with pytest.raises(Exception, match="value \\+0.3 is above 0"), RecordsWriter(tmp_path / "plain.parquet") as w:
        w.write(rows)
    sampler = write(tmp_path / "sampler.parquet", simulate(3, spec), spec, edit=_poke("sampler_logprobs", 0.3), meta=meta)
    with pytest.raises(Exception, match="column sampler_logprobs position 5: value \\+0.3 is above 0"):
        analyze(sampler, plots=False)


def test_a_logprob_above_zero_within_rounding_is_accepted(tmp_path) -> None:
    spec = SPECS["top_p"]
    path = write(tmp_path / "round.parquet", simulate(3, spec), spec, edit=_poke("trainer_logprobs", LOGPROB_ROUNDING / 2))
    (sc,) = analyze(path, plots=False)["scenarios"]
    assert sc["verdict"] == "pass", sc["violations"]


def test_a_misspelt_trainer_column_is_named_beside_the_one_missing(tmp_path, capsys) -> None:
    spec = SPECS["top_p"]

    def rename(rows: list[dict]) -> None:
        for r in rows:
            r["trainer_logps"] = r.pop("trainer_logprobs")

    path = write(tmp_path / "typo.parquet", simulate(3, spec), spec, edit=rename)
    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"]) == 4
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("NO VERDICT")]
    assert "the records lack trainer_logprobs (the records have a column 'trainer_logps'" in line, line


def test_a_misspelt_required_column_is_named_in_the_refusal(tmp_path, capsys) -> None:
    spec = SPECS["top_p"]

    def rename(rows: list[dict]) -> None:
        for r in rows:
            r["sampler_logprob"] = r.pop("sampler_logprobs")

    path = write(tmp_path / "typo.parquet", simulate(3, spec), spec, edit=rename)
    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "missing required column(s) sampler_logprobs (the records have a column 'sampler_logprob'" in err, err


def test_a_bias_just_outside_the_log_s_range_is_not_said_to_lie_in_it() -> None:
    m = {"mean": -0.10551, "negative_frac": 0.97, "log_s_range": [-0.10549, 0.0], "log_s_range_from": "the spec"}
    text = logprob_bias_class(m, 0.01)  # type: ignore[arg-type]
    assert "lies in the" not in text and "lies within the resolution" in text
    found = re.search(r"the bias (\S+) lies within the resolution \S+ of the log S range \[(\S+), (\S+)\]", text)
    assert found, text
    bias, lo, hi = (float(x) for x in found.groups())
    assert bias < lo <= hi  # the numbers as printed say what the sentence says
    inside = logprob_bias_class({**m, "mean": -0.10541}, 0.01)  # type: ignore[arg-type]
    assert "lies in the log S range" in inside


def test_ordered_numbers_keep_their_order_once_printed() -> None:
    assert ordered(-0.10551, -0.10549, 0.0) == ["-0.1055", "-0.1055", "0"] or ordered(-0.10551, -0.10549)[0] != \
        ordered(-0.10551, -0.10549)[1]
    a, b = ordered(0.0421, 0.04214)
    assert float(a) < float(b)
    assert ordered(1.0, 1.0) == ["1", "1"]


def test_a_biased_log_fails_without_saying_the_trainer_was_not_gated_and_ends_with_one_verdict(tmp_path, capsys) -> None:
    spec = SPECS["top_k"]
    path = write(tmp_path / "full.parquet", simulate(1, spec, dtype="bfloat16"), spec, trainer="full",
                 meta={"dtype": "bfloat16"})
    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"]) == 1
    out = capsys.readouterr().out
    md = (tmp_path / "out" / "report.md").read_text()
    assert "was not gated" not in md and "fails in 1 of 1 scenario(s)" in md
    # The mean-bias gate decided: the gates the records could not feed fold into one line.
    assert len([x for x in out.splitlines() if x.startswith("NOT EVALUATED")]) == 1
    assert out.splitlines()[-1] == "verdict: FAIL (exit 1): 0 pass, 1 fail, 0 without a verdict, of 1 scenario(s)"


def test_an_honest_log_ends_with_a_pass_line(tmp_path, capsys) -> None:
    spec = SPECS["top_p"]
    path = write(tmp_path / "ok.parquet", simulate(2, spec), spec)
    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "verdict: PASS (exit 0): 1 pass, 0 fail, 0 without a verdict, of 1 scenario(s)"
