"""The RL view on hand-built δ with known answers: every framework metric and every correction method."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from parity.core.rl import STATISTICS, Method, Mismatch, Threshold, effective_sample_size, k3
from parity.core.rl_catalogue import METHODS, METRICS, catalogue, summarize, summarize_trainers

LOG09 = math.log(0.9)
INF = math.inf
METRIC = {e.name: e for e in METRICS}
METHOD = {e.name: e for e in METHODS}


def q16() -> torch.Tensor:
    """Sampler probabilities of 16 sampled tokens (varied, so the Pearson correlation is defined)."""
    return torch.linspace(0.2, 0.9, 16, dtype=torch.float64)


def at_09() -> Mismatch:
    """One sequence of 16 tokens where the trainer gives each token 0.9 times the sampler's probability."""
    lq = q16().log()
    return Mismatch.from_logprobs([lq + LOG09], [lq])


def seqs(*deltas: list[float]) -> Mismatch:
    """Sequences of given δ with a sampler probability of 1/2 per token."""
    return Mismatch.from_logprobs(
        [torch.tensor(d, dtype=torch.float64) + math.log(0.5) for d in deltas],
        [torch.full((len(d),), math.log(0.5), dtype=torch.float64) for d in deltas],
    )


def value(name: str, m: Mismatch) -> float | None:
    return METRIC[name].value(m)


def res(name: str, m: Mismatch, sign: str = "any"):
    return METHOD[name].apply(m, sign)


def ess_of(w: list[float]) -> float:
    return sum(w) ** 2 / (len(w) * sum(x * x for x in w))


# ------------------------------------------------------------------------------- metrics: 16 × log 0.9


def test_every_metric_on_sixteen_tokens_at_log_09() -> None:
    m = at_09()
    q = q16().tolist()
    expected = {
        "sampling/sampling_logp_difference/mean": -LOG09,
        "sampling/sampling_logp_difference/max": -LOG09,
        # sequence_mask: exp of the SUM over the 16 tokens, below the 3.0 cap
        "sampling/importance_sampling_ratio/min": 0.9**16,
        "sampling/importance_sampling_ratio/mean": 0.9**16,
        "sampling/importance_sampling_ratio/max": 0.9**16,
        "sampling/importance_sampling_ratio/min [token_truncate]": 0.9,
        "sampling/importance_sampling_ratio/mean [token_truncate]": 0.9,
        "sampling/importance_sampling_ratio/max [token_truncate]": 0.9,
        # verl works in probability space: |0.9 q − q| = 0.1 q
        "training/rollout_probs_diff_max": 0.1 * max(q),
        "training/rollout_probs_diff_mean": 0.1 * statistics.fmean(q),
        "training/rollout_probs_diff_std": 0.1 * statistics.stdev(q),
        "training/rollout_actor_probs_pearson_corr": 1.0,  # p is a linear function of q
        "train_rollout_logprob_abs_diff": -LOG09,
        "token_mult_prob_error": 1 / 0.9,
        "mismatch_kl/mean": 0.9 - LOG09 - 1,
        "mismatch_kl/max": 0.9 - LOG09 - 1,
        "policy/rollout_train_logprobs_abs_diff_mean": -LOG09,
        "policy/rollout_train_logprobs_abs_diff_std": 0.0,
        "policy/rollout_train_logprobs_abs_diff_max": -LOG09,
        "policy/rollout_train_logprobs_abs_diff_min": -LOG09,
    }
    assert set(expected) == set(METRIC), "every metric entry has a known answer here"
    for name, want in expected.items():
        assert value(name, m) == pytest.approx(want, rel=1e-9, abs=1e-12), name


def test_trl_sequence_mask_sums_over_the_sequence_and_zeroes_above_3() -> None:
    # 16 × log 1.1 sums to 1.1^16 = 4.59 > 3: masked to 0 and logged as 0.
    m = seqs([math.log(1.1)] * 16, [LOG09] * 16)
    assert value("sampling/importance_sampling_ratio/min", m) == 0.0
    assert value("sampling/importance_sampling_ratio/max", m) == pytest.approx(0.9**16)
    assert value("sampling/importance_sampling_ratio/mean", m) == pytest.approx(0.9**16 / 2)
    # A mean of δ would have given 1.1 (kept): the sum is what TRL uses.
    assert value("sampling/importance_sampling_ratio/max [token_truncate]", m) == pytest.approx(1.1)


def test_trl_token_truncate_caps_each_token_at_3() -> None:
    m = seqs([math.log(5.0), 0.0])
    assert value("sampling/importance_sampling_ratio/max [token_truncate]", m) == pytest.approx(3.0)
    assert value("sampling/importance_sampling_ratio/mean [token_truncate]", m) == pytest.approx(2.0)
    assert value("sampling/importance_sampling_ratio/min [token_truncate]", m) == pytest.approx(1.0)


def test_slime_averages_per_sequence_first_the_token_metrics_do_not() -> None:
    m = seqs([1.0], [0.0, 0.0, 0.0])  # |δ| = 1 in a 1-token sequence, 0 in a 3-token one
    assert value("train_rollout_logprob_abs_diff", m) == pytest.approx((1.0 + 0.0) / 2)
    assert value("policy/rollout_train_logprobs_abs_diff_mean", m) == pytest.approx(1 / 4)
    assert value("sampling/sampling_logp_difference/mean", m) == pytest.approx(1 / 4)
    assert value("token_mult_prob_error", m) == pytest.approx((math.e + 3) / 4)


def test_prime_rl_mismatch_kl_is_a_per_sequence_mean_then_max_over_sequences() -> None:
    m = seqs([LOG09, 0.0], [math.log(0.5)])
    per_seq = [(0.9 - LOG09 - 1) / 2, 0.5 - math.log(0.5) - 1]
    assert value("mismatch_kl/mean", m) == pytest.approx(statistics.fmean(per_seq))
    assert value("mismatch_kl/max", m) == pytest.approx(max(per_seq))


def test_std_metrics_are_unbiased_like_torch_std() -> None:
    m = seqs([0.0, 1.0])
    assert value("policy/rollout_train_logprobs_abs_diff_std", m) == pytest.approx(math.sqrt(0.5))
    assert value("policy/rollout_train_logprobs_abs_diff_min", m) == 0.0
    # probabilities 0.5 and e^1 * 0.5: |p - q| = 0 and 0.5 (e - 1)
    assert value("training/rollout_probs_diff_std", m) == pytest.approx(
        statistics.stdev([0.0, 0.5 * (math.e - 1)])
    )


def test_pearson_is_undefined_on_constant_or_single_tokens() -> None:
    assert value("training/rollout_actor_probs_pearson_corr", seqs([LOG09] * 4)) is None  # q constant
    assert value("training/rollout_actor_probs_pearson_corr", seqs([LOG09])) is None
    lq = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64).log()
    anti = Mismatch.from_logprobs([torch.tensor([0.9, 0.5, 0.1], dtype=torch.float64).log()], [lq])
    assert value("training/rollout_actor_probs_pearson_corr", anti) == pytest.approx(-1.0)


def test_probability_space_entries_need_the_sampler_side() -> None:
    m = Mismatch((torch.full((16,), LOG09),))
    assert value("training/rollout_probs_diff_mean", m) is None
    assert value("sampling/sampling_logp_difference/mean", m) == pytest.approx(-LOG09)
    assert res("DPPO binary-TV 0.2", m, "+").units == 0
    assert res("Token TIS C=2", m).units == 16


# ------------------------------------------------------------------ thresholds: planted faults at 3× / 0.1×


def _k3_inverse(target: float) -> float:
    """δ < 0 with k3(δ) = target (bisection)."""
    lo, hi = -50.0, 0.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if float(k3(torch.tensor(mid, dtype=torch.float64))) > target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


PLANT = {
    # metric name -> δ per token that puts the metric at `factor` times its bound's distance from ideal
    "train_rollout_logprob_abs_diff": lambda f: -f * 0.1,
    "token_mult_prob_error": lambda f: -math.log(1 + f * 0.05),
    "mismatch_kl/mean": lambda f: _k3_inverse(f * 0.015),
}


def test_every_thresholded_metric_has_a_planted_fault() -> None:
    assert {e.name for e in METRICS if e.threshold} == set(PLANT)


@pytest.mark.parametrize("name", sorted(PLANT))
def test_planted_fault_near_the_documented_threshold(name: str) -> None:
    e = METRIC[name]
    assert e.threshold is not None
    bad = seqs([PLANT[name](3.0)] * 16, [PLANT[name](3.0)] * 8)
    good = seqs([PLANT[name](0.1)] * 16, [PLANT[name](0.1)] * 8)
    assert e.threshold.holds(e.value(bad)) is False
    assert e.threshold.holds(e.value(good)) is True
    assert name in summarize(bad)["over_threshold"]
    assert name not in summarize(good)["over_threshold"]


def test_threshold_rejects_bad_definitions() -> None:
    with pytest.raises(ValueError, match="op="):
        Threshold(0.1, ">", "x")
    with pytest.raises(ValueError, match="limit="):
        Threshold(math.nan, "<", "x")
    assert Threshold(0.1, "<=", "x").holds(None) is None


# --------------------------------------------------------------------- methods: each with a known answer


def test_naive_is_token() -> None:
    r = res("Naive IS (token)", seqs([math.log(0.5), math.log(2.0)]))
    assert (r.units, r.affected) == (2, 0)
    assert r.mean_weight == pytest.approx(1.25)
    assert r.ess == pytest.approx(ess_of([0.5, 2.0]))


def test_naive_is_sequence_is_the_product() -> None:
    r = res("Naive IS (sequence)", seqs([math.log(0.5)] * 2, [math.log(2.0)]))
    assert (r.units, r.affected) == (2, 0)
    assert r.mean_weight == pytest.approx((0.25 + 2.0) / 2)
    assert r.ess == pytest.approx(ess_of([0.25, 2.0]))


def test_token_tis_2_clips_above_2() -> None:
    r = res("Token TIS C=2", seqs([math.log(0.5), math.log(4.0)]))
    assert (r.affected, r.affected_frac) == (1, 0.5)
    assert r.mean_weight == pytest.approx((0.5 + 2.0) / 2)
    assert r.ess == pytest.approx(ess_of([0.5, 2.0]))


def test_token_tis_3_clips_above_3() -> None:
    r = res("Token TIS C=3", seqs([math.log(4.0), math.log(2.5)]))
    assert r.affected == 1
    assert r.mean_weight == pytest.approx((3.0 + 2.5) / 2)


def test_sequence_tis_clips_the_product() -> None:
    r = res("Sequence TIS C=2", seqs([math.log(1.1)] * 16, [LOG09] * 16))
    assert (r.units, r.affected) == (2, 1)
    assert r.mean_weight == pytest.approx((2.0 + 0.9**16) / 2)


def test_trl_sequence_mask_drops_products_above_3() -> None:
    r = res("TRL sequence_mask (default)", seqs([math.log(1.1)] * 16, [LOG09] * 16))
    assert (r.units, r.affected) == (2, 1)
    assert r.mean_weight == pytest.approx(0.9**16 / 2)
    assert r.ess == pytest.approx(0.5)


def test_icepop_masks_outside_half_to_five_boundaries_kept() -> None:
    r = res("Token MIS/IcePop [0.5, 5]", seqs([math.log(x) for x in (0.4, 1.0, 6.0, 5.0)]))
    assert (r.affected, r.affected_frac) == (2, 0.5)
    assert r.mean_weight == pytest.approx((0 + 1 + 0 + 5) / 4)
    assert r.ess == pytest.approx(ess_of([0.0, 1.0, 0.0, 5.0]))


def test_skyrl_token_mask_half_to_two() -> None:
    r = res("Token MIS [0.5, 2]", seqs([math.log(x) for x in (0.5, 2.0, 2.1)]))
    assert r.affected == 1
    assert r.mean_weight == pytest.approx((0.5 + 2.0) / 3)


def test_sequence_mis_masks_small_products() -> None:
    r = res("Sequence MIS [0.5, 2]", seqs([LOG09] * 16, [math.log(1.1)] * 4))
    assert (r.units, r.affected) == (2, 1)  # 0.9^16 = 0.185 < 0.5 dropped, 1.1^4 = 1.46 kept
    assert r.mean_weight == pytest.approx(1.1**4 / 2)


def test_verl_geometric_rs_drops_a_geo_mean_of_09() -> None:
    r = res("Geo-mean RS [0.999, 1.001]", seqs([LOG09] * 16, [math.log(1.0005)] * 16))
    assert (r.units, r.affected) == (2, 1)
    assert r.mean_weight == pytest.approx(0.5)  # rejection only: kept sequences weigh 1
    assert r.ess == pytest.approx(0.5)


def test_skyrl_geometric_rs_band_is_one_percent() -> None:
    r = res("Geo-mean RS [0.99, 1.01]", seqs([math.log(0.995)] * 8, [LOG09] * 8, [math.log(1.02)] * 8))
    assert (r.units, r.affected) == (3, 2)
    assert res("Geo-mean RS [0.999, 1.001]", seqs([math.log(0.995)] * 8)).affected == 1


def test_k3_rejection_at_001() -> None:
    m = seqs([LOG09] * 16, [math.log(0.8)] * 16)  # k3 = 0.0054 kept, 0.0231 dropped
    assert 0.8 - math.log(0.8) - 1 > 0.01 > 0.9 - LOG09 - 1
    r = res("K3 RS 0.01", m)
    assert (r.units, r.affected) == (2, 1)


def test_token_veto_rejects_a_sequence_with_one_catastrophic_token() -> None:
    m = seqs([0.0] * 15 + [math.log(1e-5)], [0.0] * 16, [0.0] * 3 + [-INF])
    r = res("Token veto 1e-4", m)
    assert (r.units, r.affected) == (3, 2)
    assert r.mean_weight == pytest.approx(1 / 3)


def test_ppo_clip_binds_by_advantage_sign_with_dual_clip() -> None:
    m = seqs([math.log(x) for x in (0.7, 1.3, 1.0, 3.5)])
    pos, neg = res("PPO clip [0.8, 1.2]", m, "+"), res("PPO clip [0.8, 1.2]", m, "-")
    assert (pos.affected, neg.affected) == (2, 2)  # A>0: 1.3 and 3.5; A<0: 0.7 and 3.5 (dual clip at 3)
    assert pos.mean_weight == pytest.approx((0.7 + 0 + 1.0 + 0) / 4)
    assert neg.mean_weight == pytest.approx((0 + 1.3 + 1.0 + 0) / 4)
    assert neg.ess == pytest.approx(ess_of([0.0, 1.3, 1.0, 0.0]))
    with pytest.raises(ValueError, match="sign='any'"):
        res("PPO clip [0.8, 1.2]", m, "any")


def test_dapo_clip_higher_keeps_125() -> None:
    m = seqs([math.log(1.25), math.log(1.3)])
    assert res("DAPO clip [0.8, 1.28]", m, "+").affected == 1
    assert res("PPO clip [0.8, 1.2]", m, "+").affected == 2
    assert res("DAPO clip [0.8, 1.28]", m, "-").affected == 0


def test_gspo_on_the_geometric_mean_by_sign() -> None:
    m = seqs([LOG09] * 16, [math.log(1 + 5e-4)] * 16, [math.log(1 + 1e-4)] * 16)
    pos, neg = res("GSPO [1-3e-4, 1+4e-4]", m, "+"), res("GSPO [1-3e-4, 1+4e-4]", m, "-")
    assert (pos.units, pos.affected, neg.affected) == (3, 1, 1)
    assert pos.mean_weight == pytest.approx((0.9 + 0 + (1 + 1e-4)) / 3)
    assert neg.mean_weight == pytest.approx((0 + (1 + 5e-4) + (1 + 1e-4)) / 3)


def test_cispo_caps_the_weight_at_5() -> None:
    r = res("CISPO cap 5", seqs([math.log(6.0), math.log(0.1)]))
    assert r.affected == 1
    assert r.mean_weight == pytest.approx((5.0 + 0.1) / 2)


def test_topr_corrects_only_negative_advantages() -> None:
    m = seqs([math.log(1.1)] * 16, [LOG09] * 16)
    pos, neg = res("TOPR", m, "+"), res("TOPR", m, "-")
    assert (pos.affected, pos.mean_weight, pos.ess) == (0, 1.0, 1.0)
    assert neg.affected == 1
    assert neg.mean_weight == pytest.approx((1.0 + 0.9**16) / 2)


def test_dppo_binary_tv_in_probability_space_by_sign() -> None:
    q = torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)
    p = torch.tensor([0.35, 0.25, 0.85], dtype=torch.float64)  # p - q = 0.25, -0.25, -0.05
    m = Mismatch.from_logprobs([p.log()], [q.log()])
    pos, neg = res("DPPO binary-TV 0.2", m, "+"), res("DPPO binary-TV 0.2", m, "-")
    assert (pos.affected, neg.affected) == (1, 1)
    r = (p / q).tolist()
    assert pos.mean_weight == pytest.approx((0 + r[1] + r[2]) / 3)
    assert neg.mean_weight == pytest.approx((r[0] + 0 + r[2]) / 3)


# ------------------------------------------------------- methods: planted faults at 3× / 0.1× of the bound


def plant_faults(method: Method, side: str, factor: float) -> Mismatch:
    """One unit whose statistic sits `factor` times the bound's distance from ideal, on ``side``."""
    lo, hi = method.interval
    bound = hi if side == "high" else lo
    st = method.statistic
    if st == "tv":
        q = 0.1 if side == "high" else 0.7
        p = q + factor * bound
        return Mismatch.from_logprobs(
            [torch.tensor([math.log(p)], dtype=torch.float64)],
            [torch.tensor([math.log(q)], dtype=torch.float64)],
        )
    if st == "seq_mean_k3":
        return seqs([_k3_inverse(factor * bound)] * 16)
    d = factor * math.log(bound)
    if st == "seq_ratio":
        return seqs([d / 16] * 16)
    if st == "min_ratio":
        return seqs([0.0] * 15 + [d])
    return seqs([d] * 16 if st == "geo_ratio" else [d])


def _bounds() -> list[tuple[str, str]]:
    """(method, side) for every finite bound away from the ideal point (0 for ratios is no bound)."""
    out = []
    for m in METHODS:
        lo, hi = m.interval
        # A bound at the ideal ratio 1 (TOPR clips every product above 1) has no distance to scale;
        # test_topr_corrects_only_negative_advantages covers it.
        if math.isfinite(hi) and hi != 1.0:
            out.append((m.name, "high"))
        if math.isfinite(lo) and lo != 0.0:
            out.append((m.name, "low"))
    return out


@pytest.mark.parametrize(("name", "side"), _bounds())
def test_planted_fault_near_each_method_bound(name: str, side: str) -> None:
    m = METHOD[name]
    binding = {"both": "any", "ppo": "+" if side == "high" else "-", "neg": "-"}[m.sign]
    assert m.apply(plant_faults(m, side, 3.0), binding).affected_frac == 1.0
    assert m.apply(plant_faults(m, side, 0.1), binding).affected_frac == 0.0
    if m.sign == "ppo":
        # PPO's pessimistic clip never binds on the side that would lower the objective.
        other = "-" if binding == "+" else "+"
        assert m.apply(plant_faults(m, side, 3.0), other).affected_frac == 0.0


def test_every_bounded_method_is_planted() -> None:
    planted = {n for n, _ in _bounds()}
    assert planted == {m.name for m in METHODS if m.action != "none"} - {"TOPR"}


# ----------------------------------------------------------------------------------------- edge cases


def test_no_tokens_gives_undefined_statistics_not_zeros() -> None:
    for m in (Mismatch.from_logprobs([], []), seqs([], [])):
        s = summarize(m)
        assert s["tokens"] == 0
        assert all(v is None for v in s["metrics"].values())
        for per_sign in s["methods"].values():
            for r in per_sign.values():
                assert r == {
                    "units": 0,
                    "affected": None,
                    "affected_frac": None,
                    "mean_weight": None,
                    "ess": None,
                }
        assert s["over_threshold"] == []


def test_empty_sequences_are_counted_and_left_out_of_sequence_statistics() -> None:
    m = seqs([LOG09] * 16, [])
    assert (m.sequences, m.empty_sequences, m.tokens) == (2, 1, 16)
    assert value("train_rollout_logprob_abs_diff", m) == pytest.approx(-LOG09)  # not halved by the empty one
    assert res("Sequence MIS [0.5, 2]", m).units == 1


def test_flat_input_equals_the_list_input() -> None:
    lq = torch.log(torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.6, 0.9]], dtype=torch.float64))
    lp = lq + torch.tensor([[0.1, -0.2, 0.0], [0.3, 0.0, -0.5]], dtype=torch.float64)
    b = summarize(Mismatch.from_logprobs([lp[0, :2], lp[1]], [lq[0, :2], lq[1]]))
    c = summarize(Mismatch.from_flat(torch.cat([lp[0, :2], lp[1]]), torch.cat([lq[0, :2], lq[1]]), [2, 3]))
    assert json.dumps(b, sort_keys=True) == json.dumps(c, sort_keys=True)


def test_minus_inf_trainer_logprob_is_kept_and_acted_on() -> None:
    m = seqs([0.0, -INF, 0.0])
    assert value("sampling/sampling_logp_difference/max", m) == INF
    assert value("token_mult_prob_error", m) == INF
    assert value("mismatch_kl/mean", m) == INF
    assert res("Token MIS/IcePop [0.5, 5]", m).affected == 1
    tis = res("Token TIS C=2", m)
    assert tis.mean_weight == pytest.approx(2 / 3) and tis.affected == 0  # weight 0 is inside [0, 2]
    assert res("Token veto 1e-4", m).affected == 1
    assert res("K3 RS 0.01", m).affected == 1


def test_plus_inf_is_not_nan() -> None:
    m = seqs([INF, 0.0])
    assert float(k3(torch.tensor([INF]))[0]) == INF
    assert value("mismatch_kl/mean", m) == INF
    cispo = res("CISPO cap 5", m)
    assert cispo.mean_weight == pytest.approx(3.0)
    naive = res("Naive IS (token)", m)
    assert naive.mean_weight == INF and naive.ess == pytest.approx(0.5)


def test_nan_positions_are_excluded_and_counted() -> None:
    lq = torch.tensor([-INF, math.log(0.5), math.log(0.5)], dtype=torch.float64)
    lp = torch.tensor([-INF, math.log(0.45), math.log(0.45)], dtype=torch.float64)  # -inf - -inf = NaN
    m = Mismatch.from_logprobs([lp], [lq])
    assert (m.tokens, m.excluded_nan) == (2, 1)
    assert value("sampling/sampling_logp_difference/mean", m) == pytest.approx(-LOG09)
    assert summarize(m)["excluded_nan"] == 1


def test_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match=r"trainer\[0\] has 2 tokens but sampler\[0\] has 3"):
        Mismatch.from_logprobs([torch.zeros(2)], [torch.zeros(3)])
    with pytest.raises(ValueError, match="trainer has 1 sequences but sampler has 2"):
        Mismatch.from_logprobs([torch.zeros(2)], [torch.zeros(2), torch.zeros(1)])
    with pytest.raises(ValueError, match=r"deltas\[0\] has shape \(2, 2\)"):
        Mismatch((torch.zeros(2, 2),))
    with pytest.raises(ValueError, match="seq_lengths sum to 4"):
        Mismatch.from_flat(torch.zeros(3), torch.zeros(3), [2, 2])


def test_bad_method_definitions_name_the_field() -> None:
    base = dict(
        name="x",
        frameworks=("f",),
        statistic="ratio",
        interval=(0.5, 2.0),
        action="mask",
        source="s",
        level="token",
    )
    for change, field in [
        ({"statistic": "nope"}, "statistic"),
        ({"level": "sequence"}, "level"),
        ({"action": "zap"}, "action"),
        ({"sign": "pos"}, "sign"),
        ({"interval": (2.0, 0.5)}, "interval"),
        ({"action": "clip", "weight": "one"}, "weight"),
        ({"dual_clip": 3.0}, "dual_clip"),
    ]:
        with pytest.raises(ValueError, match=f"Method 'x': {field}="):
            Method(**{**base, **change})


def test_effective_sample_size() -> None:
    assert effective_sample_size(torch.ones(7)) == pytest.approx(1.0)
    assert effective_sample_size(torch.tensor([0.0, 0.0, 3.0, 0.0])) == pytest.approx(1 / 4)
    assert effective_sample_size(torch.zeros(3)) == 0.0
    assert effective_sample_size(torch.tensor([INF, INF, 1.0, 0.0])) == pytest.approx(0.5)
    assert effective_sample_size(torch.tensor([1e300, 1e300])) == pytest.approx(1.0)  # no overflow
    with pytest.raises(ValueError, match=">= 0"):
        effective_sample_size(torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="no weights"):
        effective_sample_size(torch.zeros(0))


def test_catalogue_describes_every_entry_with_a_source() -> None:
    cat = catalogue()
    assert cat["assumption"]
    assert [m["name"] for m in cat["metrics"]] == [e.name for e in METRICS]
    assert [m["name"] for m in cat["methods"]] == [e.name for e in METHODS]
    assert all(e["source"] and e["framework"] for e in cat["metrics"])
    assert all(e["source"] and e["frameworks"] for e in cat["methods"])
    assert set(STATISTICS) >= {m.statistic for m in METHODS}
    json.dumps(cat)


def test_summarize_trainers_on_the_flat_layout() -> None:
    sampler = torch.full((5,), math.log(0.5), dtype=torch.float64)
    out = summarize_trainers(sampler, {"naive": sampler + LOG09, "replay": sampler.clone()}, [3, 2])
    assert out["naive"]["metrics"]["sampling/importance_sampling_ratio/max"] == pytest.approx(0.9**2)
    assert out["replay"]["metrics"]["sampling/sampling_logp_difference/max"] == 0.0
    assert all(r["affected"] == 0 for per in out["replay"]["methods"].values() for r in per.values())
    assert out["naive"]["methods"]["Geo-mean RS [0.999, 1.001]"]["any"]["affected"] == 2
