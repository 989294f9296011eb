"""The reference filters on hand-computable rows (no vLLM: tests/sampler checks them against it).

Expected values come from the definitions (probabilities written down, math.log), not from running
the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from parity.core.filters import FilterFaults, check_logits, reference_filter
from parity.core.spec import SamplingSpec

S = SamplingSpec
NEG_INF = float("-inf")


def log_probs(*p: float) -> torch.Tensor:
    return torch.log(torch.tensor([p], dtype=torch.float32))


def kept_ids(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().squeeze(1).tolist()


P532 = log_probs(0.5, 0.3, 0.2)


@pytest.mark.parametrize(
    "batch",
    [pytest.param([S(1.0, top_k=2)], id="top_k-only path"), pytest.param([S(1.0, top_k=2), S(1.0, top_p=0.9)], id="sort path")],
)
def test_top_k_keeps_every_token_tied_with_the_kth(batch) -> None:
    z = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]]).expand(len(batch), -1)
    res = reference_filter(z, batch)
    assert kept_ids(res.kept[0]) == [0, 1, 2, 3]
    assert int(res.support_size[0]) == 4


def test_top_k_at_or_above_vocab_is_off() -> None:
    z = torch.tensor([[1.0, 0.5, -1.0]]).expand(2, -1)
    res = reference_filter(z, [S(1.0, top_k=3), S(1.0, top_k=100)])
    assert res.kept.all()


@pytest.mark.parametrize(("top_p", "expected"), [(0.6, [0, 1]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.3, [0])])
def test_top_p_drops_the_ascending_prefix_with_cumsum_at_most_1_minus_p(top_p: float, expected: list[int]) -> None:
    """probs (0.5, 0.3, 0.2): ascending cumsum 0.2, 0.5, 1.0 against 1 - p."""
    res = reference_filter(P532, S(1.0, top_p=top_p))
    assert kept_ids(res.kept[0]) == expected
    total = sum((0.5, 0.3, 0.2)[i] for i in expected)
    for i in expected:
        assert float(res.logprobs[0, i]) == pytest.approx(math.log((0.5, 0.3, 0.2)[i] / total), abs=1e-6)


def test_top_p_always_keeps_the_largest_even_when_it_splits_a_tie() -> None:
    """Two tied maxima and a tiny top_p: exactly one of them stays (which one is the sort order's call)."""
    res = reference_filter(torch.tensor([[1.0, 1.0, 0.0]]), S(1.0, top_p=0.01))
    assert int(res.kept[0, :2].sum()) == 1 and not bool(res.kept[0, 2])


def test_top_k_applies_before_top_p() -> None:
    """(0.4, 0.3, 0.2, 0.1), top_k 2 then top_p 0.5 over (4/7, 3/7) keeps only the max; top_p first would keep two."""
    z = log_probs(0.4, 0.3, 0.2, 0.1)
    spec = S(1.0, top_k=2, top_p=0.5)
    assert kept_ids(reference_filter(z, spec).kept[0]) == [0]
    assert kept_ids(reference_filter(z, spec, faults=FilterFaults(top_p_before_top_k=True)).kept[0]) == [0, 1]


@pytest.mark.parametrize(("min_p", "expected"), [(0.5, [0, 1]), (0.3, [0, 1, 2]), (0.7, [0]), (1.0, [0])])
def test_min_p_drops_below_min_p_times_the_max_probability(min_p: float, expected: list[int]) -> None:
    assert kept_ids(reference_filter(P532, S(1.0, min_p=min_p)).kept[0]) == expected


def test_min_p_one_keeps_a_tied_maximum() -> None:
    assert kept_ids(reference_filter(torch.tensor([[1.0, 1.0, 0.5]]), S(1.0, min_p=1.0)).kept[0]) == [0, 1]


def test_temperature_scales_before_the_filters() -> None:
    """z = (0, -log 2, -log 4): at T = 0.5 the probabilities are proportional to (1, 1/4, 1/16)."""
    z = torch.tensor([[0.0, -math.log(2), -math.log(4)]])
    res = reference_filter(z, S(0.5))
    w = [1.0, 0.25, 0.0625]
    for i in range(3):
        assert float(res.logprobs[0, i]) == pytest.approx(math.log(w[i] / sum(w)), abs=1e-6)
    # min_p 0.2 at T = 0.5 drops the 1/16 token (1/16 < 0.2), which it keeps at T = 1 (1/4 >= 0.2).
    assert kept_ids(reference_filter(z, S(0.5, min_p=0.2)).kept[0]) == [0, 1]
    assert kept_ids(reference_filter(z, S(1.0, min_p=0.2)).kept[0]) == [0, 1, 2]


def test_small_temperature_runs_at_0_01_with_filters() -> None:
    z = torch.tensor([[0.0, -0.01 * math.log(2), -1.0]])  # at T = 0.01: probs proportional to (1, 1/2, e^-100)
    res = reference_filter(z, S(5e-6, top_k=2))
    assert kept_ids(res.kept[0]) == [0, 1]
    assert float(res.logprobs[0, 0]) == pytest.approx(math.log(2 / 3), abs=1e-5)


def test_all_greedy_batch_reports_log_softmax_of_raw_logits() -> None:
    z = torch.tensor([[3.0, 1.0, 0.0, NEG_INF]])
    res = reference_filter(z, S(0.0, top_k=1, top_p=0.1))  # filters are dropped for greedy requests
    denom = math.log(math.exp(3) + math.exp(1) + 1)
    assert kept_ids(res.kept[0]) == [0, 1, 2]
    assert [float(v) for v in res.logprobs[0, :3]] == pytest.approx([3 - denom, 1 - denom, -denom], abs=1e-6)


def test_greedy_row_in_a_mixed_batch_matches_the_all_greedy_values() -> None:
    z = torch.tensor([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0]])
    mixed = reference_filter(z, [S(0.0), S(0.5, top_k=1)])
    alone = reference_filter(z[:1], S(0.0))
    assert torch.equal(mixed.kept[0], alone.kept[0])
    assert torch.allclose(mixed.logprobs[0], alone.logprobs[0], atol=1e-7)
    assert kept_ids(mixed.kept[1]) == [0]


def test_p1_row_on_the_sort_path_drops_underflowed_tokens() -> None:
    """exp(-200) underflows float32: a top_p = 1 row drops it when another row sends the batch down the sort path."""
    z = torch.tensor([[0.0, -200.0], [0.0, -200.0]])
    sort_path = reference_filter(z, [S(1.0), S(1.0, top_p=0.9)])
    no_top_p = reference_filter(z, [S(1.0), S(1.0)])
    assert kept_ids(sort_path.kept[0]) == [0]
    assert kept_ids(no_top_p.kept[0]) == [0, 1]
    assert float(no_top_p.logprobs[0, 1]) == pytest.approx(-200.0, abs=1e-4)


def test_neg_inf_entries_stay_dropped_and_single_finite_row_is_certain() -> None:
    z = torch.tensor([[NEG_INF, 1.0, NEG_INF], [2.0, NEG_INF, 0.0]])
    res = reference_filter(z, S(0.7, top_k=2, top_p=0.5, min_p=0.1))
    assert kept_ids(res.kept[0]) == [1] and float(res.logprobs[0, 1]) == 0.0
    assert not bool(res.kept[1, 1])


def test_drop_ties_fault_keeps_exactly_k() -> None:
    z = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0]])
    assert int(reference_filter(z, S(1.0, top_k=2), faults=FilterFaults(drop_top_k_ties=True)).support_size[0]) == 2


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.tensor([1.0, 2.0]), r"shape \(2,\): allowed a 2-D \[N, V\] tensor"),
        (torch.tensor([[1.0, math.nan]]), r"NaN \(first at row 0, token 1\)"),
        (torch.tensor([[math.inf, 0.0]]), r"\+inf \(first at row 0, token 0\)"),
        (torch.tensor([[0.0, 1.0], [NEG_INF, NEG_INF]]), r"row 1 is all -inf"),
    ],
    ids=["1-D", "NaN", "+inf", "all -inf row"],
)
def test_bad_logits_are_refused_with_the_place(logits: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_logits(logits)


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
@pytest.mark.parametrize("col", [0, 517, 999])  # a vector lane, the middle, the tail
def test_the_one_reduction_check_finds_a_bad_value_anywhere_in_a_long_row(bad: str, col: int) -> None:
    """check_logits decides validity from the row max alone: a single bad value in a 1000-wide row of an
    otherwise valid batch must still be refused, with its place."""
    z = torch.randn(3, 1000, generator=torch.Generator().manual_seed(col))
    if bad == "all -inf":
        z[2] = NEG_INF
        message = r"row 2 is all -inf"
    else:
        z[1, col] = math.nan if bad == "nan" else math.inf
        what = "NaN" if bad == "nan" else r"\+inf"
        message = what + rf" \(first at row 1, token {col}\)"
    with pytest.raises(ValueError, match=message):
        check_logits(z)
    if bad != "all -inf":
        z[1, col] = NEG_INF
        assert check_logits(z) is z  # -inf alone is allowed


def test_spec_count_must_match_rows() -> None:
    with pytest.raises(ValueError, match=r"specs has 3 entries for 2 logit rows"):
        reference_filter(torch.zeros(2, 4), [S(1.0)] * 3)
