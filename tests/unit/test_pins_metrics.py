"""Metrics pinned exactly: the comparison rule, the quantile, every DiffStats field, KL/TV and IS ratios."""

from __future__ import annotations

import math

import pytest
import torch

from parity.core.metrics import (
    _quantile,
    abs_difference,
    bias,
    diff_stats,
    difference,
    is_ratios,
    kl_tv_over_support,
    max_abs_difference,
    support_equal,
)

INF, NAN = math.inf, math.nan


def test_difference_rule_and_dtype() -> None:
    a = torch.tensor([2.0, INF, -INF, NAN, 1.0], dtype=torch.float32)
    b = torch.tensor([0.5, -INF, 1.0, 0.0, NAN], dtype=torch.float32)
    d = difference(a, b)
    assert d.dtype == torch.float64 and d.tolist() == [1.5, INF, -INF, INF, INF]
    assert abs_difference(a, b).tolist() == [1.5, INF, INF, INF, INF]
    assert max_abs_difference(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0])) == 3.0
    assert isinstance(max_abs_difference(torch.zeros(1), torch.zeros(1)), float)


@pytest.mark.parametrize(("q", "want"), [(0.0, 1.0), (0.5, 2.5), (0.99, 3.97), (1.0, 4.0), (0.25, 1.75)])
def test_quantile_interpolates_linearly(q: float, want: float) -> None:
    x = torch.tensor([4.0, 1.0, 3.0, 2.0], dtype=torch.float64)
    assert _quantile(x, q) == pytest.approx(want, abs=1e-12)
    assert _quantile(x, q) == pytest.approx(float(torch.quantile(x, q)), abs=1e-12)
    assert _quantile(torch.tensor([[7.0]]), q) == 7.0


def test_diff_stats_every_field() -> None:
    a = torch.tensor([[1.0, 4.0], [-INF, 2.0]])
    b = torch.tensor([[2.0, 1.0], [-INF, 2.5]])
    st = diff_stats(a, b)
    d = [-1.0, 3.0, 0.0, -0.5]
    assert st.max_abs_diff == 3.0 and st.argmax == 1
    assert st.mean_diff == pytest.approx(sum(d) / 4) and st.mean_abs_diff == pytest.approx(4.5 / 4)
    assert st.p99_abs_diff == pytest.approx(float(torch.quantile(torch.tensor(d).abs().double(), 0.99)))
    assert st.to_dict() == {"max_abs_diff": 3.0, "mean_diff": st.mean_diff, "mean_abs_diff": st.mean_abs_diff,
                            "p99_abs_diff": st.p99_abs_diff}
    assert bias(a, b) == st.mean_diff
    empty = diff_stats(torch.zeros(0, 3), torch.zeros(0, 3))
    assert (empty.max_abs_diff, empty.mean_diff, empty.mean_abs_diff, empty.p99_abs_diff, empty.argmax) == (0.0, 0.0, 0.0, 0.0, -1)
    with pytest.raises(ValueError) as info:
        diff_stats(torch.zeros(2, 1), torch.zeros(2))
    assert str(info.value) == "cannot compare shapes (2, 1) and (2,)"


def test_support_equal_message() -> None:
    with pytest.raises(ValueError) as info:
        support_equal(torch.zeros(1, 2, dtype=torch.bool), torch.zeros(1, 3, dtype=torch.bool))
    assert str(info.value) == "kept masks differ in shape: (1, 2) vs (1, 3)"
    a = torch.tensor([[True, False, True]])
    assert support_equal(a, a).tolist() == [True]
    assert support_equal(a, torch.tensor([[True, False, False]])).tolist() == [False]


def test_kl_and_tv_by_hand() -> None:
    logp = torch.tensor([[math.log(0.5), math.log(0.5), -INF], [0.0, -INF, -INF]], dtype=torch.float32)
    logq = torch.tensor([[math.log(0.25), math.log(0.25), math.log(0.5)], [math.log(0.5), math.log(0.5), -INF]],
                        dtype=torch.float32)
    kl, tv = kl_tv_over_support(logp, logq)
    assert kl.dtype == torch.float64 and tv.dtype == torch.float64
    assert kl.tolist() == pytest.approx([math.log(2), math.log(2)], abs=1e-7)
    assert tv.tolist() == pytest.approx([0.5, 0.5], abs=1e-7)


def test_is_ratios_every_field() -> None:
    sampler = torch.tensor([-1.0, -2.0, -1.5], dtype=torch.float64)
    d = torch.tensor([math.log(0.5), math.log(2.0), math.log(0.8)], dtype=torch.float64)
    r = is_ratios(sampler + d, sampler, [1, 2])
    assert r.token_mean == pytest.approx(3.3 / 3) and r.token_min == pytest.approx(0.5) and r.token_max == pytest.approx(2.0)
    assert r.seq_mean == pytest.approx((0.5 + 1.6) / 2) and r.seq_min == pytest.approx(0.5) and r.seq_max == pytest.approx(1.6)
    assert r.seq_identity_max_rel_err == 0.0
    log_s = torch.tensor([math.log(0.4), math.log(1.0), math.log(2.0)], dtype=torch.float64)
    r = is_ratios(sampler + d, sampler, [1, 2], log_s=log_s)
    # sequences: ratio 0.5 vs prod S 0.4 (rel 0.25), ratio 1.6 vs 2.0 (rel 0.2): the max is 0.25
    assert r.seq_identity_max_rel_err == pytest.approx(0.25)
    assert list(r.to_dict()) == ["token_mean", "token_min", "token_max", "seq_mean", "seq_min", "seq_max",
                                 "seq_identity_max_rel_err"]
    empty = is_ratios(torch.zeros(0), torch.zeros(0), [], log_s=torch.zeros(0))
    assert empty.to_dict() == {"token_mean": 1.0, "token_min": 1.0, "token_max": 1.0, "seq_mean": 1.0, "seq_min": 1.0,
                               "seq_max": 1.0, "seq_identity_max_rel_err": 0.0}
