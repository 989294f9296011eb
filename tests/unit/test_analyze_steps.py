"""The training-log view of ``parity analyze``: drift per step, its trend and the ``drift_trend`` gate.

Records carry a ``step`` per sequence. Planted drift near the gate's limit: growth at 3x the slope the
gate detects fails and names the first step above the band (recomputed here from the documented rule,
docs/error_model.md section 5), a tenth of it passes, flat drift with noise passes. The per-step
numbers equal the analysis of that step's records alone, and the summary's merge order does not
change them.
"""

from __future__ import annotations

import functools
import json
import math
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from test_analyze import FILTERED, rows_of, run_side

from parity.analyze import analyze
from parity.core.gates import Thresholds
from parity.judge.accumulators import SUMMARY_VERSION, Summary
from parity.judge.steps import (
    BAND_K,
    BASELINE_STEPS,
    MIN_STEPS,
    TREND_GATE,
    TREND_Z,
    drift_trend,
)
from parity.judge.token_columns import summarize_batch
from parity.judge.verdict import judge
from parity.records.write import records_table, write_records

TOL = Thresholds()
N_SEQ, LENGTH = 8, 16
# |d| at a position is the step's target plus this zero-mean pattern (the same at every step, so the
# per-token spread, and with it the slope's per-token standard error, does not depend on the plant).
PATTERN = np.linspace(-0.004, 0.004, LENGTH // 2)


def log_rows(means, *, scenario: str | None = None, seed: int = 0, pattern=PATTERN) -> list[dict]:
    """Records of a training log: step ``s`` holds N_SEQ sequences whose |trainer - sampler| averages
    ``means[s]`` exactly, in +/- pairs (so every step's mean bias is 0). Unfiltered, with a bound of 1."""
    rng = np.random.default_rng(seed)
    rows = []
    for step, m in enumerate(means):
        for i in range(N_SEQ):
            lp = (-0.2 - 3 * rng.random(LENGTH)).astype(np.float32)
            a = m + pattern
            d = np.stack([a, -a], 1).reshape(-1)
            row = dict(prompt_ids=[1, 2], completion_ids=rng.integers(0, 500, LENGTH).tolist(), temperature=1.0, top_k=0,
                       top_p=1.0, min_p=0.0, sampler_logprobs=lp.tolist(),
                       trainer_logprobs=(lp.astype(np.float64) + d).tolist(), trainer_bound=[1.0] * LENGTH, step=step,
                       prompt_index=step * N_SEQ + i)
            if scenario:
                row["scenario"] = scenario
            rows.append(row)
    return rows


def analysed(rows, tmp_path: Path, name: str = "log.parquet", **kw) -> list[dict]:
    return analyze(write_records(tmp_path / name, rows), thresholds=TOL, **kw)["scenarios"]


def noise(n: int, sd: float, seed: int = 1, *, alternating: bool = False) -> np.ndarray:
    """Step noise with residual sd ``sd`` about a line and no linear part of its own (the planted slope is the slope);
    Gaussian, or +/- alternating (bounded: no step strays far)."""
    x = np.arange(n, dtype=np.float64)
    e = (-1.0) ** np.arange(n) if alternating else np.random.default_rng(seed).standard_normal(n)
    basis = np.stack([np.ones(n), x - x.mean()], 1)
    e -= basis @ np.linalg.lstsq(basis, e, rcond=None)[0]
    return e * sd / math.sqrt(float(e @ e) / (n - 2))


def measured(rows) -> dict[int, tuple[float, float]]:
    """Per step, the mean and the per-token standard error of |trainer - sampler|, from the rows' own values."""
    by: dict[int, list[float]] = {}
    for r in rows:
        d = np.asarray(r["trainer_logprobs"]) - np.asarray(r["sampler_logprobs"], dtype=np.float32).astype(np.float64)
        by.setdefault(r["step"], []).extend(np.abs(d).tolist())
    return {s: (float(np.mean(v)), float(np.std(v, ddof=1) / math.sqrt(len(v)))) for s, v in sorted(by.items())}


def expected_first_step(rows) -> int | None:
    """The documented rule, written out: baseline mean of the first steps plus BAND_K times the noise (the larger
    of the residual sd about the least-squares line and the rms per-token standard error); the first later step above."""
    m = measured(rows)
    steps = np.array(list(m), dtype=np.float64)
    y = np.array([v[0] for v in m.values()])
    se = np.array([v[1] for v in m.values()])
    slope, icpt = np.polyfit(steps, y, 1)
    s_res = math.sqrt(float(np.sum((y - (icpt + slope * steps)) ** 2)) / (len(y) - 2))
    hi = y[:BASELINE_STEPS].mean() + BAND_K * max(s_res, math.sqrt(float(np.mean(se**2))))
    return next((int(s) for s, v in zip(steps[BASELINE_STEPS:], y[BASELINE_STEPS:], strict=True) if v > hi), None)


# -- planted drift near the gate's limit -------------------------------------------------------------

STEPS, M0, TAU = 12, 0.011, 1e-3


@pytest.fixture(scope="module")
def flat(tmp_path_factory):
    """The flat log the plants start from: its trend's limit is the slope the gate detects on this noise."""
    base = M0 + noise(STEPS, TAU)
    (sc,) = analysed(log_rows(base), tmp_path_factory.mktemp("flat"))
    assert sc["verdict"] == "pass", sc["violations"]
    return base, sc


def test_flat_log_passes_and_states_its_resolution(flat) -> None:
    _, sc = flat
    tr = sc["trend"]
    assert tr["evaluated"] and tr["passed"] and TREND_GATE in sc["gates_evaluated"]
    assert tr["slope"] == pytest.approx(0.0, abs=1e-12)
    # The residual sd about the line is TAU by construction: the slope's standard error is TAU / sqrt(Sxx).
    sxx = float(np.sum((np.arange(STEPS) - (STEPS - 1) / 2) ** 2))
    assert tr["slope_se_residual"] == pytest.approx(TAU / math.sqrt(sxx), rel=1e-6)
    assert tr["slope_se"] == max(tr["slope_se_residual"], tr["slope_se_tokens"])
    assert tr["limit"] == pytest.approx(TREND_Z * tr["slope_se"], rel=1e-12)
    assert [e["step"] for e in sc["per_step"]] == list(range(STEPS))
    assert all(e["mean_bias"] == pytest.approx(0.0, abs=1e-15) for e in sc["per_step"])
    # Typed: the step view is what the schema generated from its report types accepts, key for key.
    import jsonschema

    from parity.report.blocks import StepJson, TrendJson, schema_of

    assert set(tr) == set(TrendJson.__annotations__)
    jsonschema.validate(tr, schema_of(TrendJson))
    for e in sc["per_step"]:
        assert set(e) == set(StepJson.__annotations__)
        jsonschema.validate(e, schema_of(StepJson))


@pytest.mark.parametrize("times", [3.0, 0.1])
def test_growth_near_the_detectable_slope(times, flat, tmp_path: Path) -> None:
    """3x the slope the flat log's analysis detects fails and names the first step above the band; 0.1x passes."""
    base, sc0 = flat
    limit = sc0["trend"]["limit"]
    rows = log_rows(base + times * limit * np.arange(STEPS))
    (sc,) = analysed(rows, tmp_path)
    tr = sc["trend"]
    assert tr["slope"] == pytest.approx(times * limit, rel=1e-6)
    assert tr["limit"] == pytest.approx(limit, rel=1e-6)  # the plant does not move the noise
    hit = [v for v in sc["violations"] if v["gate"] == TREND_GATE]
    if times < 1:
        assert hit == [] and tr["passed"] and sc["verdict"] == "pass"
        return
    first = expected_first_step(rows)
    assert first is not None and BASELINE_STEPS <= first < STEPS
    assert tr["first_step_outside"] == first and not tr["passed"] and sc["verdict"] == "fail"
    (v,) = hit
    assert v["statistic"] == pytest.approx(tr["slope"]) and v["limit"] == pytest.approx(limit, rel=1e-6)
    assert f"at step {first} (mean |diff|" in v["message"] and "trainer 'trainer'" in v["message"]
    # Only the trend fails: every token stays within its bound and the mean bias is 0.
    assert [x["gate"] for x in sc["violations"]] == [TREND_GATE]


def test_significant_growth_inside_the_band_passes(tmp_path: Path) -> None:
    """A slope above its limit whose steps never leave the baseline's band grows by less than its noise: it passes."""
    n = 200
    base = M0 + noise(n, TAU, alternating=True)
    sxx = float(np.sum((np.arange(n) - (n - 1) / 2) ** 2))
    slope = 1.5 * TREND_Z * TAU / math.sqrt(sxx)  # 6 standard errors, yet 1.5 TAU over the whole log
    rows = log_rows(base + slope * np.arange(n))
    (sc,) = analysed(rows, tmp_path)
    tr = sc["trend"]
    assert tr["slope"] == pytest.approx(slope, rel=1e-6) and tr["slope"] > tr["limit"]
    assert tr["first_step_outside"] is None and expected_first_step(rows) is None
    assert tr["passed"] and sc["verdict"] == "pass"


@pytest.mark.parametrize("seed", range(4))
def test_flat_drift_with_random_noise_passes(seed, tmp_path: Path) -> None:
    """Gaussian differences per token at about 0.011 nats, their scale wandering 5 % from step to step."""
    rng = np.random.default_rng(100 + seed)
    rows = log_rows([0.0] * 20, seed=seed, pattern=np.zeros(LENGTH // 2))
    scale = {s: 0.011 * (1 + 0.05 * rng.standard_normal()) for s in range(20)}
    for r in rows:
        lp = np.asarray(r["sampler_logprobs"], dtype=np.float32).astype(np.float64)
        r["trainer_logprobs"] = (lp + rng.standard_normal(LENGTH) * scale[r["step"]] * math.sqrt(math.pi / 2)).tolist()
    (sc,) = analysed(rows, tmp_path)
    tr = sc["trend"]
    assert tr["evaluated"] and tr["passed"], tr
    assert abs(tr["slope"]) < TREND_Z * tr["slope_se"]


def test_a_weight_sync_drift_fails_where_a_flat_engine_passes(tmp_path: Path) -> None:
    """The shape users chase: one engine flat at 0.011, the other climbing from 0.011 to 0.036 over 30 steps."""
    flat_means = 0.011 + noise(30, 5e-4, seed=5)
    climbing = 0.011 + (0.036 - 0.011) * np.arange(30) / 29 + noise(30, 5e-4, seed=6)
    rows = log_rows(flat_means, scenario="engine-a") + log_rows(climbing, scenario="engine-b", seed=1)
    a, b = analysed(rows, tmp_path)
    assert (a["name"], a["verdict"], b["name"], b["verdict"]) == ("engine-a", "pass", "engine-b", "fail")
    assert b["trend"]["slope"] == pytest.approx(0.025 / 29, rel=1e-6)
    assert b["trend"]["first_step_outside"] == expected_first_step(rows[len(rows) // 2 :])


# -- what the gate needs -------------------------------------------------------------------------------


def test_too_few_steps_are_reported_not_gated(tmp_path: Path) -> None:
    rows = log_rows(M0 + 5e-3 * np.arange(MIN_STEPS - 1))
    (sc,) = analysed(rows, tmp_path)
    reasons = {g["gate"]: g["reason"] for g in sc["not_evaluated"]}
    assert f"needs at least {MIN_STEPS}" in reasons[TREND_GATE] and TREND_GATE not in sc["gates_evaluated"]
    assert sc["trend"]["slope"] == pytest.approx(5e-3, rel=1e-9) and sc["trend"]["passed"] is None
    assert len(sc["per_step"]) == MIN_STEPS - 1 and sc["verdict"] == "pass"


def test_records_without_steps_have_no_per_step_view(tmp_path: Path) -> None:
    rows = log_rows([M0] * 3)
    for r in rows:
        del r["step"]
    (sc,) = analysed(rows, tmp_path)
    assert sc["per_step"] == [] and sc["trend"] is None
    assert TREND_GATE not in sc["gates_evaluated"] and TREND_GATE not in {g["gate"] for g in sc["not_evaluated"]}


def test_sequences_without_a_step_are_left_out_and_said(tmp_path: Path) -> None:
    rows = log_rows(M0 + np.zeros(MIN_STEPS))
    rows[0]["step"] = None
    rows[1]["step"] = -1
    (sc,) = analysed(rows, tmp_path)
    assert sc["per_step"][0]["sequences"] == N_SEQ - 2
    assert any("2 of" in n and "carry no step" in n for n in sc["input_notes"])


def test_drift_trend_edge_cases() -> None:
    steps = list(range(8))
    assert drift_trend(steps, [0.01] * 8, [0.0] * 8, "replay")["passed"]  # exactly flat, no spread
    bad = drift_trend(steps, [0.01] * 5 + [math.inf] * 3, [0.0] * 8, "replay")
    assert bad["evaluated"] and bad["passed"] is False and bad["first_step_outside"] == 5
    with pytest.raises(ValueError, match="ascending"):
        drift_trend([0, 2, 1, 3, 4, 5], [0.01] * 6, [0.0] * 6, "replay")
    # Sparse step numbers: the slope is per training step, not per logged step.
    tr = drift_trend([0, 10, 20, 30, 40, 50], [0.01 + 1e-4 * s for s in range(0, 60, 10)], [1e-6] * 6, "replay")
    assert tr["slope"] == pytest.approx(1e-4)
    assert json.loads(json.dumps(tr))["baseline_steps"] == [0, 10, 20]


# -- the per-step numbers are the analysis of that step's records ---------------------------------------


def test_per_step_numbers_equal_the_analysis_of_one_step(tmp_path: Path) -> None:
    """Replay, recompute and a trainer under test, kept sets and bounds: every per-step statistic is the
    scenario's own statistic on that step's rows alone."""
    side = run_side(FILTERED[:2], n_seq=8, length=6)
    rows = rows_of(side, tmp_path)
    rng = np.random.default_rng(7)
    for i, r in enumerate(rows):
        r["step"] = 10 * (i % 4)
        r["trainer_logprobs"] = [v + 1e-6 * rng.standard_normal() for v in r["sampler_logprobs"]]
    whole = analysed(rows, tmp_path, "whole.parquet")
    names = {"replay": "replay", "recompute": "recompute", "trainer_under_test": "trainer_under_test"}
    for step in (0, 10, 20, 30):
        alone = analysed([r for r in rows if r["step"] == step], tmp_path, f"step{step}.parquet")
        for w, a in zip(whole, alone, strict=True):
            (e,) = [e for e in w["per_step"] if e["step"] == step]
            assert (e["tokens"], e["sequences"], e["comparison"]) == (a["tokens"], a["sequences"], "trainer_under_test")
            assert set(e["by_comparison"]) == set(names)
            for key, c in e["by_comparison"].items():
                stats = a[key]
                assert c["mean_bias"] == pytest.approx(stats["mean_diff"], rel=1e-12, abs=1e-300), (step, key)
                assert c["mean_abs_diff"] == pytest.approx(stats["mean_abs_diff"], rel=1e-12), (step, key)
                assert c["max_headroom"] == a["headroom"][key], (step, key)  # a maximum: exact
                support = a["recompute" if key == "recompute" else "replay"]["support_equal_frac"]
                assert c["support_equal_frac"] == support, (step, key)
                assert c["tokens"] == a["compared_tokens"]
            assert e["mean_abs_diff"] == e["by_comparison"]["trainer_under_test"]["mean_abs_diff"]


# -- merging ---------------------------------------------------------------------------------------------


def test_merge_order_does_not_matter(flat, tmp_path: Path) -> None:
    base, sc0 = flat
    rows = log_rows(base + 3 * sc0["trend"]["limit"] * np.arange(STEPS))
    random.Random(0).shuffle(rows)  # steps spread over every batch
    table = records_table(rows)
    cuts = [0, 13, 30, 31, 60, table.num_rows]
    parts = [summarize_batch(table.slice(a, b - a), first_row=a).to_json() for a, b in zip(cuts, cuts[1:], strict=False)]
    assert json.loads(parts[0])["summary_version"] == SUMMARY_VERSION

    def result(order: list[int], tree: bool = False) -> dict:
        got = [Summary.from_json(parts[i]) for i in order]
        while tree and len(got) > 1:
            got = [got[i].merge(got[i + 1]) if i + 1 < len(got) else got[i] for i in range(0, len(got), 2)]
        (sc,) = judge(got[0] if tree else functools.reduce(Summary.merge, got, Summary()), TOL)
        e = sc.entry
        return {"per_step": e["per_step"], "trend": e["trend"], "gates": [v.gate for v in sc.violations],
                "first": e["trend"]["first_step_outside"] if e["trend"] else None}

    want = result(list(range(len(parts))))
    assert want["gates"] == [TREND_GATE] and want["first"] is not None
    orders = [list(reversed(range(len(parts)))), [3, 0, 4, 2, 1], [2, 4, 1, 0, 3]]
    for got in [result(o) for o in orders] + [result([4, 1, 3, 0, 2], tree=True)]:
        assert (got["gates"], got["first"]) == (want["gates"], want["first"])
        assert json.dumps(got["per_step"]) == json.dumps(want["per_step"]) or _close(got, want)
        assert _close(got["trend"], want["trend"])


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return a == b or math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300)
    return a == b


# -- the report -----------------------------------------------------------------------------------------


def test_report_has_the_per_step_table_plot_and_schema(flat, tmp_path: Path) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from parity.report.schema import report_schema

    base, sc0 = flat
    path = write_records(tmp_path / "g.parquet", log_rows(base + 3 * sc0["trend"]["limit"] * np.arange(STEPS)))
    out = tmp_path / "out"
    analyze(path, thresholds=TOL, out=out)
    data = json.loads((out / "report.json").read_text())
    jsonschema.validate(data, report_schema())
    (sc,) = data["scenarios"]
    assert {"step", "tokens", "mean_bias", "mean_abs_diff", "max_headroom", "support_equal_frac"} <= set(sc["per_step"][0])
    assert {"slope", "slope_se", "limit", "first_step_outside"} <= set(sc["trend"])
    md = (out / "report.md").read_text()
    assert "## Drift per step (training log)" in md and "| FAIL |" in md.split("## Drift per step")[1]
    assert f"| {STEPS - 1} | {N_SEQ} |" in md
    if "drift_steps.png" in data["plots"]:
        assert (out / "drift_steps.png").stat().st_size > 1000
        assert "](drift_steps.png)" in md
    else:
        pytest.importorskip("matplotlib")
        raise AssertionError("matplotlib is installed but drift_steps.png was not written")


def test_columns_are_what_the_format_documents() -> None:
    from parity.records.schema import BY_NAME

    assert BY_NAME["step"].type == pa.int64() and not BY_NAME["step"].required and BY_NAME["step"].per == "sequence"
