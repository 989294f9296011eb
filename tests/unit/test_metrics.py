"""Comparison metrics on hand-computable inputs."""

from __future__ import annotations

import math

import pytest
import torch

from parity.core.metrics import bias, diff_stats, is_ratios, kl_tv_over_support, support_equal

INF = math.inf


def test_support_equal_per_row() -> None:
    a = torch.tensor([[True, False], [True, True]])
    b = torch.tensor([[True, False], [True, False]])
    assert support_equal(a, b).tolist() == [True, False]
    with pytest.raises(ValueError, match="differ in shape"):
        support_equal(a, b[:1])


def test_diff_stats_on_known_differences() -> None:
    a = torch.tensor([1.1, 0.8, 1.3, -INF])
    b = torch.tensor([1.0, 1.0, 1.0, -INF])  # equal infinities count as no difference
    st = diff_stats(a, b)
    diffs = [0.1, -0.2, 0.3, 0.0]
    assert st.max_abs_diff == pytest.approx(0.3, abs=1e-6)
    assert st.mean_diff == pytest.approx(sum(diffs) / 4, abs=1e-6)
    assert st.mean_abs_diff == pytest.approx(sum(abs(d) for d in diffs) / 4, abs=1e-6)
    assert st.argmax == 2
    assert bias(a, b) == pytest.approx(st.mean_diff)
    assert set(st.to_dict()) == {"max_abs_diff", "mean_diff", "mean_abs_diff", "p99_abs_diff"}


def test_diff_stats_p99_interpolates_like_quantile() -> None:
    d = torch.arange(101, dtype=torch.float64)  # |diff| 0..100: the 0.99 quantile is 99
    assert diff_stats(d, torch.zeros(101, dtype=torch.float64)).p99_abs_diff == pytest.approx(99.0)


def test_diff_stats_one_sided_infinity_is_infinite() -> None:
    st = diff_stats(torch.tensor([0.0, -INF]), torch.tensor([0.0, -1.0]))
    assert st.max_abs_diff == INF and st.p99_abs_diff == INF


def test_diff_stats_handles_inputs_beyond_torch_quantile_limit() -> None:
    """torch.quantile refuses >= 2**24 elements; a full-vocabulary comparison gets there."""
    n = 2**24 + 3
    st = diff_stats(torch.zeros(n), torch.full((n,), 0.5))
    assert st.p99_abs_diff == 0.5 and st.max_abs_diff == 0.5


def test_diff_stats_empty_and_shape_mismatch() -> None:
    assert diff_stats(torch.zeros(0), torch.zeros(0)).argmax == -1
    with pytest.raises(ValueError, match="cannot compare shapes"):
        diff_stats(torch.zeros(2), torch.zeros(3))


def test_kl_tv_on_two_point_distributions() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    logq = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    kl, tv = kl_tv_over_support(logp, logq)
    assert float(kl[0]) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75))
    assert float(tv[0]) == pytest.approx(0.25)
    kl0, tv0 = kl_tv_over_support(logp, logp)
    assert float(kl0[0]) == 0.0 and float(tv0[0]) == 0.0


def test_kl_is_infinite_when_q_misses_mass_of_p() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    logq = torch.tensor([[0.0, -INF, -INF]])
    kl, tv = kl_tv_over_support(logp, logq)
    assert float(kl[0]) == INF and float(tv[0]) == pytest.approx(0.5)


def test_is_ratios_of_the_naive_estimator_are_the_kept_mass() -> None:
    """full - processed = log S per token, so token ratios are S and sequence ratios are prod S."""
    s = torch.tensor([0.9, 0.8, 0.5, 0.7, 0.6], dtype=torch.float64)
    sampler = torch.log(torch.tensor([0.3, 0.2, 0.4, 0.1, 0.5], dtype=torch.float64))
    train = sampler + s.log()
    r = is_ratios(train, sampler, [2, 3], log_s=s.log())
    assert r.token_min == pytest.approx(0.5) and r.token_max == pytest.approx(0.9)
    assert r.seq_min == pytest.approx(0.5 * 0.7 * 0.6) and r.seq_max == pytest.approx(0.9 * 0.8)
    assert r.seq_identity_max_rel_err == pytest.approx(0.0, abs=1e-12)


def test_is_ratios_empty() -> None:
    r = is_ratios(torch.zeros(0), torch.zeros(0), [])
    assert r.token_mean == 1.0 and r.seq_mean == 1.0
