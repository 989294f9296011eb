"""The gates pinned exactly on hand-made token tables: each gate's statistic, limit, boundary and worst positions.

A table is built field by field (no estimator runs), the summary by hand, so each gate is checked on
its own: the exact :class:`Violation` it returns, that a statistic equal to its limit passes, that NaN
fails, and which rows the worst-position list names (incomplete rows never among the drift gates').
"""

from __future__ import annotations

import math
import tomllib

import pytest
import torch

from parity.core.gates import (
    _THRESHOLDS_TOML_NOTES,
    THRESHOLD_DTYPES,
    THRESHOLDS_SCHEMA_VERSION,
    Thresholds,
    _toml_number,
    evaluate,
    thresholds_toml,
)
from parity.core.table import TokenTable
from parity.core.violation import Position, Violation

NAN = math.nan
SC = "scen"


def table(n: int = 5, **over) -> TokenTable:
    """n tokens of one prompt where both sides agree; ``over`` replaces columns."""
    f64 = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    vllm = f64([-1.0 - 0.5 * i for i in range(n)])
    cols = dict(
        prompt_index=torch.zeros(n, dtype=torch.long),
        position=torch.arange(n),
        token=torch.arange(10, 10 + n),
        vllm=vllm,
        full=vllm - 0.25,
        replay=vllm.clone(),
        recompute=vllm.clone(),
        log_s=torch.full((n,), -0.25, dtype=torch.float64),
        forced=torch.zeros(n, dtype=torch.bool),
        captured=torch.ones(n, dtype=torch.bool),
        incomplete=torch.zeros(n, dtype=torch.bool),
        sampled_outside=torch.zeros(n, dtype=torch.bool),
        replay_support_ok=torch.ones(n, dtype=torch.bool),
        recompute_support_equal=torch.ones(n, dtype=torch.bool),
        support_size=torch.full((n,), 4, dtype=torch.long),
        kl=torch.zeros(n, dtype=torch.float64),
        tv=torch.zeros(n, dtype=torch.float64),
        bound=torch.full((n,), 1e-6, dtype=torch.float64),
        bound_full=torch.full((n,), 2e-6, dtype=torch.float64),
        systematic=torch.full((n,), 1e-7, dtype=torch.float64),
        sampled=torch.arange(10, 10 + n),
        s_lo=torch.full((n,), NAN, dtype=torch.float64),
        s_hi=torch.full((n,), NAN, dtype=torch.float64),
        logit_drift=torch.zeros(n, dtype=torch.float64),
        seq_lengths=[n],
    )
    cols.update(over)
    return TokenTable(**cols)


def summary(t: TokenTable, **over) -> dict:
    s = {
        "headroom": {"replay": 0.5, "recompute": 0.5, "naive_vs_sampler_log_s": None},
        "mean_bias_limit": {"replay": 1e-3, "recompute": 1e-3},
        "replay": {"support_equal_frac": 1.0},
        "recompute": {"support_equal_frac": 1.0},
        "incomplete_positions": int(t.incomplete.sum()),
        "sampled_outside_support": int(t.sampled_outside.sum()),
        "token_mismatch": int((t.token != t.sampled).sum()),
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(s.get(k), dict):
            s[k] = {**s[k], **v}
        else:
            s[k] = v
    return s


def pos(t: TokenTable, i: int, values: dict, gap=None, bound=None, note: str = "") -> Position:
    return Position(int(t.prompt_index[i]), int(t.position[i]), int(t.token[i]),
                    {k: float(v) for k, v in values.items()}, gap, bound, note)


def test_agreement_passes_and_limits_equal_to_the_statistic_pass() -> None:
    t = table()
    assert evaluate(SC, t, summary(t), Thresholds()) == []
    at_limit = summary(t, headroom={"replay": 1.0, "recompute": 1.0, "naive_vs_sampler_log_s": 1.0})
    assert evaluate(SC, t, at_limit, Thresholds()) == []
    assert evaluate(SC, t, summary(t, headroom={"replay": 1.5}), Thresholds(max_headroom=1.5)) == []


def test_replay_drift_names_the_worst_rows_by_gap_over_bound_skipping_incomplete_ones() -> None:
    t = table(6)
    replay = t.vllm.clone()
    replay[1] += 3e-6  # gap 3e-6 over bound 1e-6
    replay[3] -= 8e-6  # the largest gap, but on an incomplete row
    replay[4] += 4e-6  # gap 4e-6 over bound 2e-6: ratio 2
    replay[5] += 2.5e-6  # ratio 2.5
    bound = t.bound.clone()
    bound[4] = 2e-6
    incomplete = torch.zeros(6, dtype=torch.bool)
    incomplete[3] = True
    t = table(6, replay=replay, bound=bound, incomplete=incomplete)
    th = Thresholds(max_headroom=0.5, max_violations_listed=2, max_incomplete_frac=1.0)
    [v] = evaluate(SC, t, summary(t, headroom={"replay": 3.0}), th)
    gap = (replay - t.vllm)
    expected = (
        pos(t, 1, {"vllm": t.vllm[1], "trainer_replay": replay[1]}, float(gap[1]), 0.5e-6),
        pos(t, 5, {"vllm": t.vllm[5], "trainer_replay": replay[5]}, float(gap[5]), 0.5e-6),
    )
    assert v == Violation("replay_drift", SC, 3.0, 0.5, "replay max |diff| / bound", worst=expected)


def test_recompute_drift_and_nan_statistic() -> None:
    t = table(3)
    recompute = t.vllm.clone()
    recompute[2] = NAN  # NaN ranks first
    t = table(3, recompute=recompute)
    th = Thresholds(max_violations_listed=1)
    v, mean = evaluate(SC, t, summary(t, headroom={"recompute": NAN}), th)
    assert mean.gate == "recompute_mean_bias" and math.isnan(mean.statistic)  # a NaN bias fails too
    assert v.gate == "recompute_drift" and v.label == "recompute max |diff| / bound" and v.limit == 1.0
    assert math.isnan(v.statistic) and len(v.worst) == 1
    w = v.worst[0]
    assert (w.position, list(w.values)) == (2, ["vllm", "trainer_recompute"]) and math.isnan(w.gap)
    assert w.bound == 1e-6


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_mean_bias_gate_statistic_is_the_absolute_mean_against_headroom_times_limit(sign: float) -> None:
    u = 2.0**-9  # binary fractions: the mean and the limits below are exact
    t = table(4, incomplete=torch.tensor([False, False, False, True]), replay=table(4).vllm + sign * torch.tensor(
        [u, 2 * u, 3 * u, 50.0], dtype=torch.float64))
    s = summary(t, mean_bias_limit={"replay": u / 2}, incomplete_positions=0)
    th = Thresholds(mean_bias_headroom=2.0, max_incomplete_frac=1.0)
    [v] = evaluate(SC, t, s, th)
    bias = sign * 2 * u
    assert v.gate == "replay_mean_bias" and v.label == "replay |mean bias|" and v.comparison == ">"
    assert v.scenario == SC
    assert (v.statistic, v.limit) == (2 * u, u)
    assert v.detail == f"mean(trainer - vllm) = {bias:.3g} over 3 tokens" and v.worst == ()
    # The same bias at exactly the allowance passes, whether the limit or the headroom is raised.
    assert evaluate(SC, t, summary(t, mean_bias_limit={"replay": u}, incomplete_positions=0), th) == []
    assert evaluate(SC, t, s, Thresholds(mean_bias_headroom=4.0, max_incomplete_frac=1.0)) == []


def test_recompute_mean_bias_gate() -> None:
    t = table(2, recompute=table(2).vllm + 0.01)
    [v] = evaluate(SC, t, summary(t, mean_bias_limit={"recompute": 1e-3}), Thresholds())
    assert (v.gate, v.label, v.limit) == ("recompute_mean_bias", "recompute |mean bias|", 1e-3)
    assert v.statistic == pytest.approx(0.01) and v.detail == "mean(trainer - vllm) = 0.01 over 2 tokens"


def test_mean_bias_of_an_empty_usable_table_is_zero() -> None:
    t = table(2, incomplete=torch.ones(2, dtype=torch.bool), replay=table(2).vllm + 1.0)
    s = summary(t, mean_bias_limit={"replay": 0.0, "recompute": 0.0})
    assert [v.gate for v in evaluate(SC, t, s, Thresholds(max_incomplete_frac=1.0))] == []


def test_trainer_under_test_gates_are_labelled_with_its_name_and_diagnosis() -> None:
    t = table(3)
    user = t.vllm.clone()
    user[0] += 1.0
    t = table(3, user=user, user_name="mine", user_diagnosis="forgot T")
    s = summary(t, headroom={"trainer_under_test": 9.0}, mean_bias_limit={"trainer_under_test": 1e-3},
                trainer_under_test={"name": "mine", "diagnosis": "forgot T"})
    vs = evaluate(SC, t, s, Thresholds(max_violations_listed=1))
    assert [v.gate for v in vs] == ["trainer_under_test_drift", "trainer_under_test_mean_bias"]
    drift, mean = vs
    label = "trainer 'mine' (forgot T)"
    assert drift == Violation(
        "trainer_under_test_drift", SC, 9.0, 1.0, f"{label} max |diff| / bound",
        worst=(pos(t, 0, {"vllm": t.vllm[0], "trainer_under_test": user[0]}, 1.0, 1e-6),),
    )
    assert mean.label == f"{label} |mean bias|" and mean.statistic == pytest.approx(1 / 3)
    # Within both limits: nothing.
    ok = summary(t, headroom={"trainer_under_test": 1.0}, mean_bias_limit={"trainer_under_test": 1.0},
                 trainer_under_test={"name": "mine", "diagnosis": "-"})
    assert evaluate(SC, t, ok, Thresholds()) == []


def test_naive_bias_outside_the_sampler_log_s() -> None:
    t = table(4)
    s_lo = torch.tensor([NAN, -0.3, -0.3, -0.3], dtype=torch.float64)
    s_hi = torch.tensor([NAN, -0.2, -0.26, -0.2], dtype=torch.float64)
    full = t.vllm - torch.tensor([5.0, 0.25, 0.25, 0.35], dtype=torch.float64)  # row 0 has no sampler log S
    bound, bound_full = t.bound.clone(), t.bound_full.clone()
    bound[2] = bound_full[2] = 1e-8  # row 2's gap is the smaller, its bound smaller still: worst by gap / bound
    t = table(4, s_lo=s_lo, s_hi=s_hi, full=full, bound=bound, bound_full=bound_full, s_source="top_p_bracket")
    th = Thresholds(max_headroom=0.5, max_violations_listed=1)
    [v] = evaluate(SC, t, summary(t, headroom={"naive_vs_sampler_log_s": 2.0}), th)
    # Rows 1..3 have a sampler log S: the naive bias -0.25 lies inside row 1's bracket and 0.01 above
    # row 2's upper end; row 3's bias -0.35 lies 0.05 below its lower end.
    assert (v.gate, v.scenario, v.statistic, v.limit) == ("naive_vs_sampler_log_s", SC, 2.0, 0.5)
    assert v.label == "naive bias outside the sampler-side log S, max gap / bound"
    assert v.detail == "log S from the sampler's top p bracket"
    [w] = v.worst
    assert (w.prompt, w.position, w.token) == (0, 2, 12)
    assert w.values == {"vllm": float(t.vllm[2]), "trainer_full": float(full[2]), "sampler_log_s_lo": -0.3,
                        "sampler_log_s_hi": -0.26}
    assert w.gap == pytest.approx(0.01) and w.bound == pytest.approx(0.5 * 2e-8)
    assert evaluate(SC, t, summary(t, headroom={"naive_vs_sampler_log_s": 0.5}), th) == []


def test_replay_and_recompute_support_gates_fail_below_their_fraction() -> None:
    t = table(4, replay_support_ok=torch.tensor([True, False, True, False]),
              recompute_support_equal=torch.tensor([False, True, True, True]))
    s = summary(t, replay={"support_equal_frac": 0.5}, recompute={"support_equal_frac": 0.75})
    rep, rec = evaluate(SC, t, s, Thresholds(recompute_support_equal_frac=1.0))
    assert rep == Violation(
        "replay_support", SC, 0.5, 1.0, "replay support equality", "<", worst=(pos(t, 1, {}), pos(t, 3, {})),
        detail="captured S_q is not the sampler's whole support (mass != 1 or the sampled token missing)",
    )
    assert rec == Violation(
        "recompute_support", SC, 0.75, 1.0, "recompute support equality", "<", worst=(pos(t, 0, {}),),
        detail="trainer-side filters keep a different set",
    )
    # At the fraction exactly: pass.
    assert evaluate(SC, t, s, Thresholds(replay_support_equal_frac=0.5, recompute_support_equal_frac=0.75)) == []
    assert [v.gate for v in evaluate(SC, t, s, Thresholds(replay_support_equal_frac=0.5,
                                                         max_violations_listed=0))] == ["recompute_support"]


def test_support_gates_list_at_most_the_configured_number() -> None:
    t = table(4, replay_support_ok=torch.zeros(4, dtype=torch.bool))
    [v] = evaluate(SC, t, summary(t, replay={"support_equal_frac": 0.0}), Thresholds(max_violations_listed=3))
    assert [w.position for w in v.worst] == [0, 1, 2]


def test_incomplete_capture_fraction_counts_every_table_row() -> None:
    t = table(4, incomplete=torch.tensor([False, True, False, True]))
    th = Thresholds(max_incomplete_frac=0.25)
    [v] = evaluate(SC, t, summary(t), th)
    assert v == Violation(
        "incomplete_capture", SC, 0.5, 0.25, "incomplete capture fraction", worst=(pos(t, 1, {}), pos(t, 3, {})),
        detail="2 of 4 positions: the head is full and the support may extend past it; raise --max-capture-head (or the scenario's max_capture_head)",
    )
    assert evaluate(SC, t, summary(t), Thresholds(max_incomplete_frac=0.5)) == []


def test_an_empty_table_passes() -> None:
    t = table(0, seq_lengths=[])
    assert evaluate(SC, t, summary(t, replay={"support_equal_frac": 1.0}), Thresholds()) == []


def test_sampled_outside_and_token_mismatch_name_their_rows() -> None:
    t = table(4, sampled_outside=torch.tensor([False, False, True, False]),
              sampled=torch.tensor([10, 99, 12, 13]))
    outside, mismatch = evaluate(SC, t, summary(t), Thresholds())
    assert outside == Violation(
        "sampled_outside", SC, 1, 0, "sampled tokens outside the captured S_q", worst=(pos(t, 2, {}),),
        detail="the engine reports a sampled token that its own kept set does not hold",
    )
    assert mismatch == Violation(
        "token_mismatch", SC, 1, 0, "trainer scored other tokens than sampled",
        worst=(pos(t, 1, {}, note="sampled 99"),),
        detail="the trainer's token ids are not the sampler's (an off-by-one or a re-tokenisation)",
    )
    assert evaluate(SC, t, summary(t), Thresholds(max_sampled_outside=1, max_token_mismatch=1)) == []


def test_gate_order_is_fixed() -> None:
    t = table(4, sampled_outside=torch.tensor([True, False, False, False]), sampled=torch.tensor([0, 11, 12, 13]),
              incomplete=torch.tensor([False, False, False, True]), replay=table(4).vllm + 1.0,
              recompute=table(4).vllm + 1.0, full=table(4).vllm + 1.0, replay_support_ok=torch.zeros(4, dtype=torch.bool),
              recompute_support_equal=torch.zeros(4, dtype=torch.bool), s_lo=torch.zeros(4, dtype=torch.float64),
              s_hi=torch.zeros(4, dtype=torch.float64))
    s = summary(t, headroom={"replay": 9.0, "recompute": 9.0, "naive_vs_sampler_log_s": 9.0},
                replay={"support_equal_frac": 0.0}, recompute={"support_equal_frac": 0.0})
    assert [v.gate for v in evaluate(SC, t, s, Thresholds())] == [
        "replay_drift", "recompute_drift", "replay_mean_bias", "recompute_mean_bias", "naive_vs_sampler_log_s",
        "replay_support", "recompute_support", "incomplete_capture", "sampled_outside", "token_mismatch",
    ]


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
    assert Thresholds() == Thresholds(1.0, 1.0, 1.0, 0.99, 0.0, 0, 0, 5)
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
    assert recompute_support_limit(0.0, 80) == 0.0
    # One moved boundary in 80 positions passes at 0.99; ten do not.
    assert 79 / 80 >= recompute_support_limit(0.99, 80) > 70 / 80
