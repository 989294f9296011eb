"""``parity analyze``'s records-alone split (docs/budget.md, section 6) on logs written the way a training run
writes them (pyarrow, two log-prob columns): the systematic shift against the symmetric spread, each step's
share of a growing gap, and what needs the model. Each case has its answer by construction."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_logprob_gate import SPECS, simulate, write

from parity.analyze import analyze
from parity.cli.main import main
from parity.core.mismatch_split import NEEDS_THE_MODEL, records_split


def _split(path):
    (sc,) = analyze(path, plots=False)["scenarios"]
    return sc, sc["mismatch_split"]


def test_a_full_vocabulary_trainer_is_a_resolved_systematic_shift(tmp_path) -> None:
    """The seed bug: every token moved down by log S. Nearly all of mean |δ| is the shift, beyond its resolution."""
    spec = SPECS["top_p"]
    sc, sp = _split(write(tmp_path / "full.parquet", simulate(3, spec), spec, trainer="full"))
    assert sp["comparison"] == "trainer_under_test" and sp["tokens"] == sc["tokens"]
    assert sp["mean_delta"] < 0 and sp["systematic_share"] > 0.99 and sp["resolved"] is True, sp
    assert sp["growth"] is None and sp["needs_the_model"] == list(NEEDS_THE_MODEL)


def test_symmetric_noise_is_spread_not_shift(tmp_path) -> None:
    """A correct trainer with noise of either sign: the shift is a small part and within its resolution."""
    spec = SPECS["top_p"]
    seqs = simulate(3, spec)
    rng = np.random.default_rng(0)
    for s in seqs:
        noise = rng.choice([-1e-3, 1e-3], size=len(s["replay"]))
        s["replay"] = s["replay"] + np.where(s["replay"] < -2e-3, noise, 0.0)  # log-probs stay <= 0
    _, sp = _split(write(tmp_path / "noise.parquet", seqs, spec))
    assert sp["systematic_share"] < 0.2 and sp["resolved"] is False, sp
    assert sp["spread"] > 5e-4


def test_a_gap_that_grows_at_one_step_names_that_step(tmp_path) -> None:
    """Steps 0..5, a shift of 1e-3 added from step 4 on: step 4 carries the growth."""
    spec = SPECS["top_p"]
    seqs = simulate(3, spec, seqs=24)
    steps = [i // 4 for i in range(len(seqs))]
    for s, step in zip(seqs, steps, strict=True):
        if step >= 4:
            s["replay"] = s["replay"] - 1e-3
    path = write(tmp_path / "steps.parquet", seqs, spec)
    table = pq.read_table(path)
    pq.write_table(table.append_column("step", [steps]).replace_schema_metadata(table.schema.metadata), path)
    _, sp = _split(path)
    assert [e["step"] for e in sp["per_step"]] == list(range(6))
    grew = max(sp["per_step"][1:], key=lambda e: e["share_of_growth"])
    assert grew["step"] == 4 and grew["share_of_growth"] > 0.8, sp["per_step"]


def test_analyze_prints_the_split_and_what_needs_the_model(tmp_path, capsys) -> None:
    spec = SPECS["top_p"]
    path = write(tmp_path / "full.parquet", simulate(3, spec), spec, trainer="full")
    main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"])
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("SPLIT ")]
    assert "= systematic shift" in line and "beyond its resolution" in line and "needs the model (parity budget" in line
    assert "sampler precision" in line and "MoE routing" in line
    assert "## Where the gap comes from, on records alone" in (tmp_path / "out" / "details.md").read_text()


@pytest.mark.parametrize("mean,mean_abs", [(-0.02, 0.02), (0.0, 0.01), (0.004, 0.01)])
def test_the_split_is_the_shift_and_what_is_left(mean, mean_abs) -> None:
    sp = records_split("replay", 100, mean, mean_abs, 0.005, [])
    assert sp["systematic"] == abs(mean) and sp["spread"] == pytest.approx(mean_abs - abs(mean))
    assert sp["resolved"] is (abs(mean) > 0.005)
