"""The gates pinned exactly on hand-filled streamed statistics: each gate's statistic, limit, boundary and worst positions.

:func:`parity.judge.verdict.evaluate_summary` judges a scenario from two things: its report entry
(``sc``, the dict :func:`parity.judge.verdict._scenario_report` builds; here built by hand with the
keys the gates read) and its accumulator (a :class:`ScenarioAcc`, filled here through its streams' own
``add``/``offer`` methods, as ``_accumulate`` fills it, no estimator running). So each gate is checked on
its own: the exact :class:`Violation` it returns, that a statistic equal to its limit passes, that NaN
fails, which positions the worst-position list names and how many, the order of the gates, and that a
gate listed under ``not_evaluated`` yields nothing.

Which rows reach a stream is the accumulator's business (``_accumulate`` compares only usable rows:
incomplete ones are counted, never compared); the gates list what the streams hold, each drift
position's bound scaled by ``max_headroom``.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest

from parity.core.gates import (
    _THRESHOLDS_TOML_NOTES,
    THRESHOLD_DTYPES,
    THRESHOLDS_SCHEMA_VERSION,
    Thresholds,
    _toml_number,
    recompute_support_limit,
    thresholds_toml,
)
from parity.core.violation import Position, Violation
from parity.judge.accumulators import FLAGS, ScenarioAcc
from parity.judge.gate_table import CAPTURE_LIMIT_FIX, _scaled, trend_violation
from parity.judge.steps import TREND_GATE
from parity.judge.verdict import GATES, _logprob_entry, _scenario_report, evaluate_summary
from parity.report.blocks import TrendJson

NAN = math.nan
SC = "scen"
T, F = True, False
SIDE = {"replay": "trainer_replay", "recompute": "trainer_recompute", "user": "trainer_under_test"}
SUPPORT_COUNTS = {"replay_support": ("replay_n", "replay_ok"), "recompute_support": ("recompute_n", "recompute_eq")}


def vllm(n: int) -> np.ndarray:
    """The sampler's log-probs of n tokens of one prompt."""
    return np.array([-1.0 - 0.5 * i for i in range(n)])


def pos(i: int, values: dict[str, Any] | None = None, gap: float | None = None, bound: float | None = None,
        note: str = "") -> Position:
    """Position i of prompt 0 (token 10 + i), as the accumulator names it."""
    return Position(0, i, 10 + i, {k: float(v) for k, v in (values or {}).items()}, gap, bound, note)


def acc(tokens: int, n_listed: int = 5) -> ScenarioAcc:
    """An empty accumulator over ``tokens`` tokens that keeps ``n_listed`` worst and first positions."""
    a = ScenarioAcc(SC, {}, (0, 0, 0), n_listed)
    a.tokens = tokens
    return a


def offer(a: ScenarioAcc, stream: str, rows: Sequence[int], d: np.ndarray, bound: np.ndarray,
          values: dict[str, np.ndarray]) -> None:
    """Add ``d`` against ``bound`` at ``rows`` to ``a.bounds[stream]`` and offer those rows as its worst positions."""
    idx = np.asarray(rows, dtype=np.int64)
    s = a.bounds[stream]
    key = s.add(d[idx], bound[idx])
    s.worst.offer(key, lambda i: (0, 0, int(idx[i])), lambda i: pos(
        int(idx[i]), {k: v[idx[i]] for k, v in values.items()}, float(d[idx[i]]), float(bound[idx[i]])))


def feed(a: ScenarioAcc, stream: str, est: np.ndarray, bound: np.ndarray | None = None,
         rows: Sequence[int] | None = None) -> None:
    """Compare an estimator's log-probs with the sampler's at ``rows`` (default all), bound 1e-6 unless given."""
    n = len(est)
    v = vllm(n)
    b = np.full(n, 1e-6) if bound is None else np.asarray(bound, dtype=np.float64)
    offer(a, stream, range(n) if rows is None else rows, est - v, b, {"vllm": v, SIDE[stream]: est})


def flag(a: ScenarioAcc, name: str, mask: Sequence[bool], note: Callable[[int], str] = lambda i: "") -> None:
    """Offer the rows where ``mask`` holds to ``a.first[name]`` and count them as the accumulator does."""
    m = np.asarray(mask, dtype=bool)
    a.first[name].offer(m, lambda i: (0, 0, i), lambda i: pos(i, note=note(i)))
    if name in SUPPORT_COUNTS:
        n_attr, ok_attr = SUPPORT_COUNTS[name]
        setattr(a, n_attr, getattr(a, n_attr) + m.size)
        setattr(a, ok_attr, getattr(a, ok_attr) + int((~m).sum()))
    else:
        setattr(a, name, getattr(a, name) + int(m.sum()))


def report(a: ScenarioAcc, **over: Any) -> dict[str, Any]:
    """The report entry's gate inputs as ``_scenario_report`` derives them from ``a``; ``over`` replaces or
    (for dicts) updates keys. Mean-bias limits 1e-3."""
    b = a.bounds
    sc: dict[str, Any] = {
        "name": SC,
        "tokens": a.tokens,
        "headroom": {"replay": b["replay"].headroom, "recompute": b["recompute"].headroom,
                     "naive_vs_sampler_log_s": b["naive"].headroom if b["naive"].n else None,
                     "trainer_under_test": b["user"].headroom},
        "mean_bias_limit": {"replay": 1e-3, "recompute": 1e-3, "trainer_under_test": 1e-3},
        "mean_bias": {"logprob": _logprob_entry(a)},
        "replay": {"support_equal_frac": a.replay_ok / a.replay_n if a.replay_n else 1.0},
        "recompute": {"support_equal_frac": a.recompute_eq / a.recompute_n if a.recompute_n else 1.0},
        "incomplete_positions": a.incomplete,
        "sampled_outside_support": a.sampled_outside,
        "token_mismatch": a.token_mismatch,
        "sampler_log_s": {"source": "none"},
        "not_evaluated": [],
        "trend": None,
        "per_step": [],
    }
    for k, v in over.items():
        sc[k] = {**sc[k], **v} if isinstance(v, dict) and isinstance(sc.get(k), dict) else v
    return sc


def gates(vs: list[Violation]) -> list[str]:
    return [v.gate for v in vs]


def agreement(n: int = 5) -> ScenarioAcc:
    """Both estimators equal to the sampler, every support equal, nothing flagged."""
    a = acc(n)
    for s in ("replay", "recompute"):
        feed(a, s, vllm(n))
    for f in FLAGS:
        flag(a, f, [F] * n)
    return a


def test_agreement_passes_and_limits_equal_to_the_statistic_pass() -> None:
    a = agreement()
    assert evaluate_summary(report(a), a, Thresholds()) == []
    at_limit = report(a, headroom={"replay": 1.0, "recompute": 1.0, "naive_vs_sampler_log_s": 1.0})
    assert evaluate_summary(at_limit, a, Thresholds()) == []
    assert evaluate_summary(report(a, headroom={"replay": 1.5}), a, Thresholds(max_headroom=1.5)) == []
    # The next float above the limit fails.
    above = float(np.nextafter(1.0, 2.0))
    assert gates(evaluate_summary(report(a, headroom={"replay": above}), a, Thresholds())) == ["replay_drift"]
    assert gates(evaluate_summary(report(a, headroom={"naive_vs_sampler_log_s": above}), a, Thresholds())) == [
        "naive_vs_sampler_log_s"]


def test_the_hand_made_report_reads_what_scenario_report_derives() -> None:
    """The gate inputs :func:`report` builds are those ``_scenario_report`` gives for the same accumulator."""
    a = everything_over()
    real, mine = _scenario_report(a, SC), report(a)
    for k in ("name", "tokens", "incomplete_positions", "sampled_outside_support", "token_mismatch", "trend",
              "per_step"):
        assert mine[k] == real[k], k
    assert mine["headroom"] == real["headroom"]
    for k in ("replay", "recompute"):
        assert mine[k]["support_equal_frac"] == real[k]["support_equal_frac"] == 0.75
    assert mine["sampler_log_s"]["source"] == real["sampler_log_s"]["source"]
    assert real["not_evaluated"] == mine["not_evaluated"] == []


def test_replay_drift_names_the_stream_worst_rows_by_gap_over_bound() -> None:
    """Row 3 has the largest gap but is incomplete: the accumulator never compares it, so the stream's
    headroom is row 1's 3 and the gate lists rows 1 and 5 (ratios 3, 2.5; row 4's 4e-6 is over a bound
    of 2e-6), capped at max_violations_listed, bounds scaled by max_headroom. The statistic is the report
    entry's headroom; the gate lists whatever the stream holds (fed row 3, row 3 leads)."""
    v = vllm(6)
    replay = v.copy()
    replay[1] += 3e-6
    replay[3] -= 8e-6
    replay[4] += 4e-6
    replay[5] += 2.5e-6
    bound = np.full(6, 1e-6)
    bound[4] = 2e-6
    a = acc(6)
    feed(a, "replay", replay, bound, rows=[0, 1, 2, 4, 5])
    feed(a, "recompute", v)
    flag(a, "incomplete", [F, F, F, T, F, F])
    assert a.bounds["replay"].headroom == pytest.approx(3.0)
    th = Thresholds(max_headroom=0.5, max_violations_listed=2, max_incomplete_frac=1.0)
    [got] = evaluate_summary(report(a, headroom={"replay": 3.0}), a, th)
    gap = replay - v
    expected = (
        pos(1, {"vllm": v[1], "trainer_replay": replay[1]}, float(gap[1]), 0.5e-6),
        pos(5, {"vllm": v[5], "trainer_replay": replay[5]}, float(gap[5]), 0.5e-6),
    )
    assert got == Violation("replay_drift", SC, 3.0, 0.5, "replay max |diff| / bound", worst=expected)
    every = acc(6)
    feed(every, "replay", replay, bound)
    feed(every, "recompute", v)
    [got] = evaluate_summary(report(every), every, th)
    assert got.statistic == pytest.approx(8.0) and [w.position for w in got.worst] == [3, 1]
    assert got.worst[0].gap == pytest.approx(-8e-6) and got.worst[0].bound == 0.5e-6


def test_worst_positions_are_scaled_by_max_headroom_and_an_unknown_bound_stays_unknown() -> None:
    """A position without a bound (None) is listed as it is; the others' bound is multiplied by the factor,
    every other field kept."""
    ps = (pos(0, {"vllm": -1.0}, 0.5, None, "no bound"), pos(1, {"vllm": -1.5}, 0.25, 4e-6))
    assert _scaled(ps, 0.5) == (ps[0], pos(1, {"vllm": -1.5}, 0.25, 2e-6))
    assert _scaled((), 0.5) == ()


def test_recompute_drift_and_nan_statistic() -> None:
    """A NaN difference: the stream ranks it first (its headroom is inf), its mean is NaN, and a NaN
    statistic in the report fails as inf does."""
    v = vllm(3)
    recompute = v.copy()
    recompute[2] = NAN
    a = acc(3)
    feed(a, "replay", v)
    feed(a, "recompute", recompute)
    th = Thresholds(max_violations_listed=1)
    assert a.bounds["recompute"].headroom == math.inf
    drift, mean = evaluate_summary(report(a, headroom={"recompute": NAN}), a, th)
    assert mean.gate == "recompute_mean_bias" and math.isnan(mean.statistic)  # a NaN bias fails too
    assert mean.limit == 1e-3 and mean.detail == "mean(trainer - vllm) = nan over 3 tokens"
    assert drift.gate == "recompute_drift" and drift.label == "recompute max |diff| / bound" and drift.limit == 1.0
    assert math.isnan(drift.statistic) and len(drift.worst) == 1
    w = drift.worst[0]
    assert (w.position, list(w.values)) == (2, ["vllm", "trainer_recompute"]) and math.isnan(w.gap)
    assert math.isnan(w.values["trainer_recompute"]) and w.bound == 1e-6
    inf_drift, _ = evaluate_summary(report(a), a, th)
    assert inf_drift.gate == "recompute_drift" and inf_drift.statistic == math.inf


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_mean_bias_gate_statistic_is_the_absolute_mean_against_headroom_times_limit(sign: float) -> None:
    """The bias is the stream's mean over the tokens it compared (row 3, incomplete, never reaches it)."""
    u = 2.0**-9  # binary fractions: the mean and the limits below are exact
    v = vllm(4)
    a = acc(4)
    feed(a, "replay", v + sign * np.array([u, 2 * u, 3 * u, 50.0]), np.ones(4), rows=[0, 1, 2])
    feed(a, "recompute", v)
    flag(a, "incomplete", [F, F, F, T])
    s = report(a, mean_bias_limit={"replay": u / 2})
    th = Thresholds(mean_bias_headroom=2.0, max_incomplete_frac=1.0)
    [got] = evaluate_summary(s, a, th)
    bias = sign * 2 * u
    assert a.bounds["replay"].mean == bias
    assert got.gate == "replay_mean_bias" and got.label == "replay |mean bias|" and got.comparison == ">"
    assert got.scenario == SC
    assert (got.statistic, got.limit) == (2 * u, u)
    assert got.detail == f"mean(trainer - vllm) = {bias:.3g} over 3 tokens" and got.worst == ()
    # The same bias at exactly the allowance passes, whether the limit or the headroom is raised.
    assert evaluate_summary(report(a, mean_bias_limit={"replay": u}), a, th) == []
    assert evaluate_summary(s, a, Thresholds(mean_bias_headroom=4.0, max_incomplete_frac=1.0)) == []


def test_recompute_mean_bias_gate() -> None:
    v = vllm(2)
    a = acc(2)
    feed(a, "replay", v)
    feed(a, "recompute", v + 0.01, np.ones(2))
    [got] = evaluate_summary(report(a, mean_bias_limit={"recompute": 1e-3}), a, Thresholds())
    assert (got.gate, got.label, got.limit) == ("recompute_mean_bias", "recompute |mean bias|", 1e-3)
    assert got.statistic == pytest.approx(0.01) and got.detail == "mean(trainer - vllm) = 0.01 over 2 tokens"


def test_mean_bias_of_a_stream_without_tokens_is_zero() -> None:
    """Every row incomplete: the streams compared nothing and their bias is 0, within even a zero limit;
    one compared token with the same difference fails it."""
    zero = {"replay": 0.0, "recompute": 0.0}
    th = Thresholds(max_incomplete_frac=1.0)
    a = acc(2)
    flag(a, "incomplete", [T, T])
    assert a.bounds["replay"].n == 0
    assert evaluate_summary(report(a, mean_bias_limit=zero), a, th) == []
    b = acc(2)
    flag(b, "incomplete", [F, T])
    feed(b, "replay", vllm(2) + 1.0, np.full(2, 2.0), rows=[0])
    [got] = evaluate_summary(report(b, mean_bias_limit=zero), b, th)
    assert (got.gate, got.statistic, got.limit) == ("replay_mean_bias", 1.0, 0.0)
    assert got.detail == "mean(trainer - vllm) = 1 over 1 tokens"


def test_trainer_under_test_gates_are_labelled_with_its_name_and_diagnosis() -> None:
    """Its stream is ``user``; its gates run only when the report entry has a ``trainer_under_test``."""
    v = vllm(3)
    user = v.copy()
    user[0] += 1.0
    a = acc(3)
    feed(a, "replay", v)
    feed(a, "recompute", v)
    feed(a, "user", user)
    over = {"headroom": {"trainer_under_test": 9.0}, "mean_bias_limit": {"trainer_under_test": 1e-3}}
    s = report(a, **over, trainer_under_test={"name": "mine", "diagnosis": "forgot T"})
    vs = evaluate_summary(s, a, Thresholds(max_violations_listed=1))
    assert gates(vs) == ["trainer_under_test_drift", "trainer_under_test_mean_bias"]
    drift, mean = vs
    label = "trainer 'mine' (forgot T)"
    assert drift == Violation(
        "trainer_under_test_drift", SC, 9.0, 1.0, f"{label} max |diff| / bound",
        worst=(pos(0, {"vllm": v[0], "trainer_under_test": user[0]}, 1.0, 1e-6),),
    )
    assert mean.label == f"{label} |mean bias|" and mean.statistic == pytest.approx(1 / 3) and mean.limit == 1e-3
    assert mean.detail == "mean(trainer - vllm) = 0.333 over 3 tokens"
    # Within both limits: nothing.
    ok = report(a, headroom={"trainer_under_test": 1.0}, mean_bias_limit={"trainer_under_test": 1.0},
                trainer_under_test={"name": "mine", "diagnosis": "-"})
    assert evaluate_summary(ok, a, Thresholds()) == []
    # Without a trainer under test in the entry its stream is not gated, however far over.
    assert evaluate_summary(report(a, **over), a, Thresholds()) == []


def test_naive_bias_outside_the_sampler_log_s() -> None:
    """The ``naive`` stream holds, per row with a sampler log S, the naive bias's distance outside
    [lo, hi] against bound + bound_full (as ``_accumulate`` computes them); row 0 has none, so it is
    not fed. The statistic is the entry's headroom, the detail names the entry's log S source."""
    v = vllm(4)
    s_lo = np.array([NAN, -0.3, -0.3, -0.3])
    s_hi = np.array([NAN, -0.2, -0.26, -0.2])
    full = v - np.array([5.0, 0.25, 0.25, 0.35])
    bound, bound_full = np.full(4, 1e-6), np.full(4, 2e-6)
    bound[2] = bound_full[2] = 1e-8  # row 2's gap is the smaller, its bound smaller still: worst by gap / bound
    x = full - v
    gap = np.zeros(4)
    gap[1:] = np.clip(s_lo[1:] - x[1:], 0.0, None) + np.clip(x[1:] - s_hi[1:], 0.0, None)
    a = acc(4)
    feed(a, "replay", v)
    feed(a, "recompute", v)
    offer(a, "naive", [1, 2, 3], gap, bound + bound_full,
          {"vllm": v, "trainer_full": full, "sampler_log_s_lo": s_lo, "sampler_log_s_hi": s_hi})
    th = Thresholds(max_headroom=0.5, max_violations_listed=1)
    [got] = evaluate_summary(report(a, headroom={"naive_vs_sampler_log_s": 2.0},
                                    sampler_log_s={"source": "top_p_bracket"}), a, th)
    # Rows 1..3 have a sampler log S: the naive bias -0.25 lies inside row 1's bracket and 0.01 above
    # row 2's upper end; row 3's bias -0.35 lies 0.05 below its lower end.
    assert (got.gate, got.scenario, got.statistic, got.limit) == ("naive_vs_sampler_log_s", SC, 2.0, 0.5)
    assert got.label == "naive bias outside the sampler-side log S, max gap / bound"
    assert got.detail == "log S from the sampler's top p bracket"
    [w] = got.worst
    assert (w.prompt, w.position, w.token) == (0, 2, 12)
    assert w.values == {"vllm": float(v[2]), "trainer_full": float(full[2]), "sampler_log_s_lo": -0.3,
                        "sampler_log_s_hi": -0.26}
    assert w.gap == pytest.approx(0.01) and w.bound == pytest.approx(0.5 * 2e-8)
    assert evaluate_summary(report(a, headroom={"naive_vs_sampler_log_s": 0.5}), a, th) == []
    # No sampler-side log S anywhere (headroom None): the gate is not judged, even at a zero limit.
    assert evaluate_summary(report(a, headroom={"naive_vs_sampler_log_s": None}), a, Thresholds(max_headroom=0)) == []


def test_replay_and_recompute_support_gates_fail_below_their_fraction() -> None:
    """The recompute gate's limit is :func:`recompute_support_limit` over the accumulator's
    ``recompute_n`` positions, not the threshold itself; at that limit exactly it passes."""
    a = acc(4)
    flag(a, "replay_support", [F, T, F, T])
    flag(a, "recompute_support", [T, F, F, F])
    s = report(a)
    assert (s["replay"]["support_equal_frac"], s["recompute"]["support_equal_frac"]) == (0.5, 0.75)
    rep, rec = evaluate_summary(s, a, Thresholds(recompute_support_equal_frac=1.0))
    assert rep == Violation(
        "replay_support", SC, 0.5, 1.0, "replay support equality", "<", worst=(pos(1), pos(3)),
        detail="captured S_q is not the sampler's whole support (mass != 1 or the sampled token missing)",
    )
    assert rec == Violation(
        "recompute_support", SC, 0.75, 1.0, "recompute support equality", "<", worst=(pos(0),),
        detail="trainer-side filters keep a different set",
    )
    th = Thresholds(replay_support_equal_frac=0.5, recompute_support_equal_frac=0.99)
    limit = recompute_support_limit(0.99, 4)
    assert 0.75 < limit < 0.99
    [rec] = evaluate_summary(s, a, th)
    assert (rec.gate, rec.statistic, rec.limit) == ("recompute_support", 0.75, limit)
    # At the fraction exactly: pass.
    assert evaluate_summary(report(a, recompute={"support_equal_frac": limit}), a, th) == []
    listed_none = evaluate_summary(s, a, Thresholds(replay_support_equal_frac=0.5, max_violations_listed=0))
    assert gates(listed_none) == ["recompute_support"] and listed_none[0].worst == ()


def test_recompute_support_allows_the_binomial_spread_of_its_positions() -> None:
    """One moved boundary in 80 positions passes at 0.99, ten do not; the allowance counts the
    accumulator's ``recompute_n`` (with none counted, 79/80 is below 0.99)."""
    one = acc(80)
    flag(one, "recompute_support", [T] + [F] * 79)
    assert evaluate_summary(report(one), one, Thresholds()) == []
    ten = acc(80)
    flag(ten, "recompute_support", [T] * 10 + [F] * 70)
    [got] = evaluate_summary(report(ten), ten, Thresholds())
    assert (got.gate, got.statistic, got.limit) == ("recompute_support", 70 / 80, recompute_support_limit(0.99, 80))
    assert [w.position for w in got.worst] == [0, 1, 2, 3, 4]
    s = report(one)
    one.recompute_n = 0
    [got] = evaluate_summary(s, one, Thresholds())
    assert (got.statistic, got.limit) == (79 / 80, 0.99)


def test_support_gates_list_at_most_the_configured_number() -> None:
    """At most max_violations_listed positions, and no more than the accumulator kept (its n_listed)."""
    a = acc(4)
    flag(a, "replay_support", [T] * 4)
    [got] = evaluate_summary(report(a), a, Thresholds(max_violations_listed=3))
    assert got.statistic == 0.0 and [w.position for w in got.worst] == [0, 1, 2]
    kept_two = acc(4, n_listed=2)
    flag(kept_two, "replay_support", [T] * 4)
    [got] = evaluate_summary(report(kept_two), kept_two, Thresholds(max_violations_listed=3))
    assert [w.position for w in got.worst] == [0, 1]


@pytest.mark.parametrize(("gate", "name"), [
    ("replay_support", "replay_support"), ("recompute_support", "recompute_support"),
    ("incomplete_capture", "incomplete"), ("sampled_outside", "sampled_outside"), ("token_mismatch", "token_mismatch"),
])
def test_every_flag_gate_lists_the_first_max_violations_listed_rows(gate: str, name: str) -> None:
    """The accumulator kept the first 5 flagged rows; each gate lists the first max_violations_listed of them."""
    a = acc(6)
    flag(a, name, [F, T, T, F, T, T])
    for listed, rows in ((2, [1, 2]), (0, []), (9, [1, 2, 4, 5])):
        [got] = evaluate_summary(report(a), a, Thresholds(max_violations_listed=listed, max_incomplete_frac=0.0))
        assert got.gate == gate and [w.position for w in got.worst] == rows, listed


def test_incomplete_capture_fraction_counts_every_token() -> None:
    a = acc(4)
    flag(a, "incomplete", [F, T, F, T])
    [got] = evaluate_summary(report(a), a, Thresholds(max_incomplete_frac=0.25))
    assert got == Violation(
        "incomplete_capture", SC, 0.5, 0.25, "incomplete capture fraction", worst=(pos(1), pos(3)),
        detail=f"2 of 4 positions: {CAPTURE_LIMIT_FIX}",
    )
    assert evaluate_summary(report(a), a, Thresholds(max_incomplete_frac=0.5)) == []


def test_an_empty_scenario_passes() -> None:
    """No token: the hand-made entry and ``_scenario_report``'s own both pass every gate."""
    a = acc(0)
    assert evaluate_summary(report(a), a, Thresholds()) == []
    real = _scenario_report(a, SC)
    assert real["tokens"] == 0 and evaluate_summary(real, a, Thresholds()) == []


def test_sampled_outside_and_token_mismatch_name_their_rows() -> None:
    a = acc(4)
    flag(a, "sampled_outside", [F, F, T, F])
    flag(a, "token_mismatch", [F, T, F, F], note=lambda i: "sampled 99")
    outside, mismatch = evaluate_summary(report(a), a, Thresholds())
    assert outside == Violation(
        "sampled_outside", SC, 1, 0, "sampled tokens outside the captured S_q", worst=(pos(2),),
        detail="the engine reports a sampled token that its own kept set does not hold",
    )
    assert mismatch == Violation(
        "token_mismatch", SC, 1, 0, "trainer scored other tokens than sampled",
        worst=(pos(1, note="sampled 99"),),
        detail="the trainer's token ids are not the sampler's (an off-by-one or a re-tokenisation)",
    )
    assert evaluate_summary(report(a), a, Thresholds(max_sampled_outside=1, max_token_mismatch=1)) == []


# -- gate order, not_evaluated, drift_trend -----------------------------------------------------------

TREND = TrendJson(
    comparison="replay", steps=8, first_step=0, last_step=7, slope=2e-4, intercept=0.011, slope_se=5e-5,
    slope_se_residual=5e-5, slope_se_tokens=1e-5, z=3.0, limit=1.5e-4, baseline_steps=[0, 1, 2],
    baseline_mean=0.011, noise=1e-3, band_k=3.0, band_lo=0.008, band_hi=0.014, first_step_outside=5,
    evaluated=True, passed=False, reason="",
)
PER_STEP = [{"step": s, "mean_abs_diff": m}
            for s, m in enumerate([0.011, 0.0112, 0.0109, 0.0113, 0.0118, 0.0145, 0.0139, 0.0152])]
ORDER = [
    "replay_drift", "recompute_drift", "replay_mean_bias", "recompute_mean_bias", "trainer_under_test_drift",
    "trainer_under_test_mean_bias", "logprob_mean_bias", "trainer_support", "naive_vs_sampler_log_s", "replay_support", "recompute_support",
    "incomplete_capture", "sampled_outside", TREND_GATE, "token_mismatch",
]


def everything_over() -> ScenarioAcc:
    """Every stream 1.0 off against a bound of 1e-6, every flag raised at row 0 of 4."""
    v = vllm(4)
    a = acc(4)
    for s in ("replay", "recompute", "user"):
        feed(a, s, v + 1.0)
    offer(a, "naive", range(4), np.ones(4), np.full(4, 1e-6), {"vllm": v, "trainer_full": v + 1.0})
    a.s_n = 4  # positions with a sampler-side log S, as _accumulate counts them
    for f in FLAGS:
        flag(a, f, [T, F, F, F])
    # The two log-prob columns: the trainer 1.0 above the sampler at rows 1-3, outside its support at row 0.
    trainer = np.concatenate([[-np.inf], v[1:] + 1.0])
    outside, _ = a.ratio.add(trainer, v, np.zeros(4, dtype=np.int64))
    a.first["trainer_support"].offer(outside, lambda i: (0, 0, i), lambda i: pos(i))
    return a


STRICT = Thresholds(max_incomplete_frac=0.0)  # the opt-in: an unproven capture fails


def failing_everything(a: ScenarioAcc, **over: Any) -> dict[str, Any]:
    return report(a, trainer_under_test={"name": "mine", "diagnosis": "-"}, trend=TREND, per_step=PER_STEP, **over)


def test_gate_order_is_fixed() -> None:
    """``drift_trend`` comes between ``sampled_outside`` and ``token_mismatch``; the rest in ``GATES``' order."""
    a = everything_over()
    assert gates(evaluate_summary(failing_everything(a), a, STRICT)) == ORDER
    # By default an unproven capture is a stated limit (capture_limit), not a FAIL.
    assert "incomplete_capture" not in gates(evaluate_summary(failing_everything(a), a, Thresholds()))
    assert [g for g in ORDER if g != TREND_GATE] == list(GATES)


@pytest.mark.parametrize("gate", [g for g in ORDER if g != "token_mismatch"])
def test_a_gate_not_evaluated_yields_no_violation(gate: str) -> None:
    a = everything_over()
    sc = failing_everything(a, not_evaluated=[{"gate": gate, "reason": "the records lack its input"}])
    assert gates(evaluate_summary(sc, a, STRICT)) == [g for g in ORDER if g != gate]


def test_token_mismatch_is_judged_whatever_not_evaluated_lists() -> None:
    """The token check reads no input (``_scenario_report`` never lists it), and evaluate_summary does not
    consult ``not_evaluated`` for it: with every gate listed, it alone remains."""
    a = everything_over()
    sc = failing_everything(a, not_evaluated=[{"gate": g, "reason": "-"} for g in ORDER])
    assert gates(evaluate_summary(sc, a, Thresholds())) == ["token_mismatch"]


def test_trend_violation_names_the_slope_and_the_first_step_above_the_band() -> None:
    before = Violation("replay_drift", SC, 2.0, 1.0, "replay max |diff| / bound")
    out = [before]
    trend_violation(report(acc(0), trend=TREND, per_step=PER_STEP), out, set())
    assert out == [before, Violation(
        TREND_GATE, SC, 2e-4, 1.5e-4, "replay slope of mean |diff| per step",
        detail="mean |diff| 0.011 at step 0 -> 0.0152 at step 7 over 8 steps, slope 0.0002 ± 5e-05 per step "
               "(limit 3 standard errors); first left the band 0.011 ± 3 × 0.001 of steps 0, 1, 2 at step 5 "
               "(mean |diff| 0.0145)",
    )]
    # A trainer under test's trend is labelled with its name.
    out = []
    sc = report(acc(0), trend={**TREND, "comparison": "trainer_under_test"}, per_step=PER_STEP,
                trainer_under_test={"name": "mine", "diagnosis": "-"})
    trend_violation(sc, out, set())
    [got] = out
    assert got.label == "trainer 'mine' slope of mean |diff| per step" and got.statistic == 2e-4


def test_trend_violation_with_a_non_finite_step() -> None:
    """No slope (a step's mean |diff| is not finite): statistic inf against 0, the reason in the detail."""
    tr = {**TREND, "slope": None, "reason": "step 5's mean |diff| is not finite"}
    out: list[Violation] = []
    trend_violation(report(acc(0), trend=tr, per_step=PER_STEP), out, set())
    assert out == [Violation(TREND_GATE, SC, math.inf, 0.0, "replay mean |diff| per step",
                             detail="step 5's mean |diff| is not finite: drift left every band at step 5")]


@pytest.mark.parametrize(("trend", "skip"), [
    (None, set()),
    ({**TREND, "passed": True}, set()),
    ({**TREND, "evaluated": False, "passed": None}, set()),
    (TREND, {TREND_GATE}),
])
def test_trend_violation_adds_nothing_unless_an_evaluated_trend_failed(trend: dict | None, skip: set[str]) -> None:
    out: list[Violation] = []
    trend_violation(report(acc(0), trend=trend, per_step=PER_STEP), out, skip)
    assert out == []
    # The same entry otherwise fails, so the case above is what keeps it out.
    trend_violation(report(acc(0), trend=TREND, per_step=PER_STEP), out, set())
    assert gates(out) == [TREND_GATE]


# -- Thresholds -------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1e-9, NAN, True, "1", None])
def test_threshold_values_are_refused_with_the_field_and_value(value: object) -> None:
    with pytest.raises(ValueError) as info:
        Thresholds(max_sampled_outside=value)
    assert str(info.value) == f"Thresholds.max_sampled_outside={value!r} is invalid: allowed a number >= 0"


@pytest.mark.parametrize("name", ["replay_support_equal_frac", "recompute_support_equal_frac", "max_incomplete_frac"])
def test_fractions_above_one_are_refused_and_the_edges_accepted(name: str) -> None:
    with pytest.raises(ValueError) as info:
        Thresholds(**{name: 1.0000001})
    assert str(info.value) == f"Thresholds.{name}=1.0000001 is invalid: allowed a fraction in [0, 1]"
    assert getattr(Thresholds(**{name: 1}), name) == 1 and getattr(Thresholds(**{name: 0}), name) == 0
    Thresholds(max_headroom=0, max_token_mismatch=7, mean_bias_headroom=1e9)


def test_defaults_per_dtype() -> None:
    assert Thresholds() == Thresholds(1.0, 1.0, 1.0, 0.99, 1.0, 0, 0, 5)
    assert Thresholds.for_dtype("float32") == Thresholds()
    for d in ("bfloat16", "float16"):
        assert Thresholds.for_dtype(d) == Thresholds(recompute_support_equal_frac=0.0)
    with pytest.raises(ValueError) as info:
        Thresholds.for_dtype("float64")
    assert str(info.value) == "dtype='float64' has no default thresholds: allowed float32, bfloat16, float16"


def test_override_messages() -> None:
    assert Thresholds().override(max_headroom=2.0) == Thresholds(max_headroom=2.0)
    with pytest.raises(ValueError) as info:
        Thresholds().override(zz=1, aa=2)
    names = [
        "max_headroom", "mean_bias_headroom", "replay_support_equal_frac", "recompute_support_equal_frac",
        "max_incomplete_frac", "max_sampled_outside", "max_token_mismatch", "max_violations_listed",
        "max_trainer_support_failures",
    ]
    assert str(info.value) == f"unknown threshold(s) ['aa', 'zz']: allowed {names}"
    assert list(Thresholds().to_dict()) == names


def test_from_toml_forms(tmp_path) -> None:
    missing = tmp_path / "none.toml"
    with pytest.raises(FileNotFoundError) as info:
        Thresholds.from_toml(missing)
    assert str(info.value) == f"thresholds file {str(missing)!r} does not exist"
    flat = tmp_path / "flat.toml"  # no [thresholds] table: the top level is the table
    flat.write_text("schema_version = 2\nmax_headroom = 3.0\n[bfloat16]\nmax_token_mismatch = 4\n[float16]\nmax_headroom = 9.0\n")
    assert Thresholds.from_toml(flat) == Thresholds(max_headroom=3.0)
    assert Thresholds.from_toml(flat, "bfloat16") == Thresholds(3.0, recompute_support_equal_frac=0.0, max_token_mismatch=4)
    nested = tmp_path / "nested.toml"
    nested.write_text("[thresholds]\nschema_version = 2\nmean_bias_headroom = 2.0\n[thresholds.float32]\nmax_headroom = 0.5\n")
    assert Thresholds.from_toml(str(nested)) == Thresholds(max_headroom=0.5, mean_bias_headroom=2.0)
    scalar = tmp_path / "scalar.toml"  # a key named like the dtype that is not a table is an unknown threshold
    scalar.write_text("[thresholds]\nfloat32 = 1.0\n")
    with pytest.raises(ValueError, match=r"unknown threshold\(s\) \['float32'\]"):
        Thresholds.from_toml(scalar)


def test_the_generated_thresholds_file_round_trips_for_every_dtype(tmp_path) -> None:
    text = thresholds_toml()
    lines = text.splitlines()
    assert lines[0] == "# Generated from parity.core.gates.Thresholds.for_dtype; do not edit. Change the code, then run"
    assert lines[1] == (
        "#   python -c \"from parity.core.gates import thresholds_toml; print(thresholds_toml(), end='')\" > ci/thresholds.toml"
    )
    notes = _THRESHOLDS_TOML_NOTES.splitlines()
    end = 2 + len(notes)
    assert lines[2:end + 3] == [*notes, "schema_version = 2", "", "[thresholds]"]
    assert text.endswith("recompute_support_equal_frac = 0.0\n")
    data = tomllib.loads(text)
    assert data["schema_version"] == THRESHOLDS_SCHEMA_VERSION == 2
    assert data["thresholds"]["max_headroom"] == 1.0 and "max_violations_listed" not in data["thresholds"]
    assert {d: data["thresholds"][d] for d in THRESHOLD_DTYPES} == {
        "float32": {"recompute_support_equal_frac": 0.99},
        "bfloat16": {"recompute_support_equal_frac": 0.0},
        "float16": {"recompute_support_equal_frac": 0.0},
    }
    assert "max_sampled_outside = 0\n" in text and "replay_support_equal_frac = 1.0\n" in text
    f = tmp_path / "t.toml"
    f.write_text(text)
    for d in THRESHOLD_DTYPES:
        assert Thresholds.from_toml(f, d) == Thresholds.for_dtype(d)


@pytest.mark.parametrize(("v", "text"), [(0, "0"), (7, "7"), (0.5, "0.5"), (1.0, "1.0"), (1e-05, "1e-5"),
                                         (2.5e-12, "2.5e-12"), (1e20, "1e20")])
def test_toml_numbers(v: float, text: str) -> None:
    assert _toml_number(v) == text
    assert tomllib.loads(f"x = {text}")["x"] == v


def test_recompute_support_limit_allows_the_thresholds_rate_with_its_binomial_spread() -> None:
    from parity.core.gates import recompute_support_limit

    assert recompute_support_limit(1.0, 80) == 1.0  # strict: no allowance
    assert recompute_support_limit(0.99, 80) == pytest.approx(0.99 - 3 * math.sqrt(0.99 * 0.01 / 80))
    assert recompute_support_limit(0.99, 0) == 0.99
    # One position already has its allowance (three standard errors of one Bernoulli draw).
    assert recompute_support_limit(0.99, 1) == pytest.approx(0.99 - 3 * math.sqrt(0.99 * 0.01))
    assert recompute_support_limit(0.0, 80) == 0.0
    # One moved boundary in 80 positions passes at 0.99; ten do not.
    assert 79 / 80 >= recompute_support_limit(0.99, 80) > 70 / 80
