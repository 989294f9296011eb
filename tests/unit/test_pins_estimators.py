"""The estimators pinned: recompute's bounded kept set against the reference, its fallbacks, every message.

``recompute`` filters rows with top_k from ``topk(k)`` candidates and sends rows it cannot decide
exactly (rounding band, a tie split by the nucleus cut) to the reference filter. The reference itself
(:func:`parity.core.filters.reference_filter`) is checked against vLLM's Sampler in tests/sampler; here
the fast path is held to it on drawn batches, engine-free, and the fallback flags are pinned on rows
whose answer is known by hand.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import parity.core.estimators as E
from parity.core import tolerances
from parity.core.filters import FilterFaults, reference_filter
from parity.core.spec import SamplingSpec as S
from parity.testing.cases import build_case, random_plan

NEG = float("-inf")


def _sampled(kept: torch.Tensor, g: torch.Generator, outside: float = 0.3) -> torch.Tensor:
    """A kept token per row, or (with probability ``outside``) any finite-logit token: forced includes."""
    y = torch.multinomial(kept.float(), 1, generator=g).squeeze(1)
    anyone = torch.randint(0, kept.shape[1], (kept.shape[0],), generator=g)
    pick = torch.rand(kept.shape[0], generator=g) < outside
    return torch.where(pick, anyone, y)


@pytest.mark.parametrize("seed", range(40))
def test_recompute_is_the_reference_on_drawn_batches(seed: int) -> None:
    rng = random.Random(seed)
    case = build_case(random_plan(rng, max_vocab=1000))
    g = torch.Generator().manual_seed(seed)
    z = case.penalised_logits()  # the estimators read the logits after the penalties
    ref = reference_filter(z, [s.without_penalties() for s in case.specs])
    finite = torch.isfinite(z)
    y = _sampled(ref.kept, g)
    y = torch.where(finite.gather(1, y.unsqueeze(1)).squeeze(1), y, ref.kept.float().argmax(dim=1))
    fast = E.recompute(z, y, case.specs)
    slow = E._recompute_reference(z, y, case.specs)
    assert torch.equal(fast.kept, ref.kept), f"kept sets differ on {case!r}"
    assert torch.equal(fast.forced, ~ref.kept.gather(1, y.unsqueeze(1)).squeeze(1))
    assert torch.equal(fast.forced, slow.forced) and int(fast.forced.sum()) == int(fast.forced.sum())
    assert fast.logprobs.dtype == torch.float32
    assert torch.equal(torch.isfinite(fast.logprobs), torch.isfinite(slow.logprobs))
    ok = torch.isfinite(slow.logprobs)
    gap = (fast.logprobs[ok].double() - slow.logprobs[ok].double()).abs()
    assert bool((gap <= 2 * tolerances.U32 * slow.logprobs[ok].double().abs() + 1e-7).all()), f"{case!r}"
    naive = E.recompute(z, y, case.specs, force_include=False)
    assert torch.equal(naive.kept, ref.kept) and torch.equal(naive.forced, fast.forced)
    assert bool((naive.logprobs[fast.forced] == NEG).all())
    assert torch.equal(naive.logprobs[~fast.forced], fast.logprobs[~fast.forced])


def test_recompute_scores_the_sampled_token_over_the_kept_set_plus_itself() -> None:
    """By hand: top_k=2 keeps {0, 1} of probabilities (0.4, 0.3, 0.2, 0.1); y = 3 is forced in."""
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.4, 0.3, 0.2, 0.1]])
    z = p.log()
    for specs in (S(1.0, top_k=2), [S(1.0, top_k=2), S(1.0, top_k=2, top_p=0.99)]):
        res = E.recompute(z, torch.tensor([3, 1]), specs)
        assert res.kept.tolist() == [[True, True, False, False]] * 2
        assert res.forced.tolist() == [True, False] and int(res.forced.sum()) == 1
        want = [math.log(0.1 / 0.8), math.log(0.3 / 0.7)]
        assert res.logprobs.tolist() == pytest.approx(want, abs=1e-6)
        naive = E.recompute(z, torch.tensor([3, 1]), specs, force_include=False)
        assert naive.logprobs[0] == NEG and float(naive.logprobs[1]) == pytest.approx(want[1], abs=1e-6)


def test_rows_without_top_k_are_not_listed_in_a_mixed_batch() -> None:
    p = torch.tensor([[0.4, 0.3, 0.2, 0.1]] * 3)
    specs = [S(1.0, top_p=0.5), S(1.0, top_k=1), S(1.0)]
    res = E.recompute(p.log(), torch.tensor([2, 0, 3]), specs)
    assert res.kept.tolist() == [[True, True, False, False], [True, False, False, False], [True] * 4]
    assert res.forced.tolist() == [True, False, False]
    assert res.logprobs.tolist() == pytest.approx([math.log(0.2 / 0.9), 0.0, math.log(0.1)], abs=1e-6)
    b = E._kept_bounded(E.scale(p.log(), specs), specs)
    ids, listed = b.ids, b.listed
    assert listed.tolist() == [False, True, False]
    assert ids.tolist() == [[-1, -1], [0, -1], [-1, -1]]


def test_all_greedy_batches_score_the_raw_log_softmax() -> None:
    z = torch.tensor([[2.0, 1.0, NEG], [0.0, 0.0, 0.0]])
    res = E.recompute(z, torch.tensor([1, 2]), S(0.0, top_k=1, top_p=0.5))
    assert res.kept.tolist() == [[True, True, False], [True, True, True]]
    assert res.forced.tolist() == [False, False]
    want = torch.log_softmax(z.double(), dim=-1).gather(1, torch.tensor([[1], [2]])).squeeze(1)
    assert res.logprobs.tolist() == pytest.approx(want.tolist(), abs=1e-6)
    forced = E.recompute(z, torch.tensor([2, 0]), S(0.0))
    assert forced.forced.tolist() == [True, False]
    naive = E.recompute(z, torch.tensor([2, 0]), S(0.0), force_include=False)
    assert naive.logprobs[0] == NEG and float(naive.logprobs[1]) == pytest.approx(-math.log(3), abs=1e-6)


def test_planted_filter_faults_reach_the_reference_and_change_the_kept_set() -> None:
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]])  # three tokens tied with the 2nd value
    y = torch.tensor([3])
    honest = E.recompute(z, y, S(1.0, top_k=2))
    assert honest.kept.tolist() == [[True, True, True, True, False]] and honest.forced.tolist() == [False]
    faulty = E.recompute(z, y, S(1.0, top_k=2), faults=FilterFaults(drop_top_k_ties=True))
    assert int(faulty.kept.sum()) == 2 and faulty.forced.tolist() == [not bool(faulty.kept[0, 3])]
    want = E._recompute_reference(z, y, S(1.0, top_k=2), faults=FilterFaults(drop_top_k_ties=True))
    assert torch.equal(faulty.kept, want.kept) and torch.equal(faulty.logprobs, want.logprobs)
    # A no-op FilterFaults() is no fault: the fast path answers.
    assert torch.equal(E.recompute(z, y, S(1.0, top_k=2), faults=FilterFaults()).kept, honest.kept)


def test_the_reference_recompute_force_includes_by_default_and_masks_when_told() -> None:
    z = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    y = torch.tensor([2])
    res = E._recompute_reference(z, y, S(1.0, top_k=1))
    assert res.forced.tolist() == [True] and res.kept.tolist() == [[True, False, False, False]]
    assert float(res.logprobs[0]) == pytest.approx(math.log(0.2 / 0.6), abs=1e-6)
    off = E._recompute_reference(z, y, S(1.0, top_k=1), force_include=False)
    assert off.logprobs.tolist() == [NEG]
    inside = E._recompute_reference(z, torch.tensor([0]), S(1.0, top_k=1), force_include=False)
    assert inside.logprobs.tolist() == [0.0] and inside.forced.tolist() == [False]


# -- the nucleus cut on candidates and its fallback flag -------------------------------------------


def _cut(rows: list[list[float]], p: list[float]) -> tuple[list[list[bool]], list[bool]]:
    keep, fallback = E._top_p_on_candidates(torch.tensor(rows), torch.tensor(p, dtype=torch.float32))
    return keep.tolist(), fallback.tolist()


def test_a_clear_nucleus_cut_is_decided_on_the_candidates() -> None:
    # Probabilities ~ (0.644, 0.237, 0.087, 0.032); 1 - p = 0.5 drops the three smallest.
    keep, fb = _cut([[2.0, 1.0, 0.0, -1.0, NEG]], [0.5])
    assert keep == [[True, False, False, False, False]] and fb == [False]
    # 1 - p = 0.1: drops only the smallest (cumulative 0.032), keeps 0.119 and up.
    keep, fb = _cut([[2.0, 1.0, 0.0, -1.0, NEG]], [0.9])
    assert keep == [[True, True, True, False, False]] and fb == [False]


def test_the_largest_candidate_is_always_kept() -> None:
    keep, fb = _cut([[0.0, -30.0, NEG]], [1e-6])
    assert keep == [[True, False, False]] and fb == [False]
    keep, fb = _cut([[5.0, NEG, NEG]], [0.3])  # a single survivor: kept, nothing decided near a boundary
    assert keep == [[True, False, False]] and fb == [False]


def test_a_cut_at_exactly_the_cumulative_mass_drops_that_position_and_falls_back() -> None:
    """Four equal values: cumulative masses 0.25, 0.5, 0.75, 1 exactly; 1 - p = 0.25 drops one of four
    (``<=``), the cut splits the tie block (fallback) and the decision sits on the boundary."""
    keep, fb = _cut([[0.0, 0.0, 0.0, 0.0]], [0.75])
    assert keep == [[True, True, True, False]] and fb == [True]


def test_a_tie_block_split_by_the_cut_falls_back_and_one_left_whole_does_not() -> None:
    # Values 1, 0, 0, -3 (probabilities ~0.570, 0.210, 0.210, 0.010; ascending cumulative 0.010, 0.220,
    # 0.430, 1): 1 - p = 0.3 drops the smallest and one of the tied pair -> split; 1 - p = 0.02 drops
    # only the smallest -> the pair stays whole.
    keep, fb = _cut([[1.0, 0.0, 0.0, -3.0]], [0.7])
    assert keep == [[True, True, False, False]] and fb == [True]
    keep, fb = _cut([[1.0, 0.0, 0.0, -3.0]], [0.98])
    assert keep == [[True, True, True, False]] and fb == [False]


def test_a_cut_inside_the_rounding_band_falls_back() -> None:
    vals = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    e = torch.exp(vals.double() - 1.0).flip(1)
    first = float(e[0, 0] / e.sum())  # the exact cumulative mass at the smallest value
    p_on = torch.tensor([1 - first], dtype=torch.float32)  # 1 - p lands within float32 rounding of it
    _, fb = E._top_p_on_candidates(vals, p_on)
    assert fb.tolist() == [True]
    p_off = torch.tensor([1 - first - 1e-3], dtype=torch.float32)  # 1 - p above the mass: dropped
    keep, fb = E._top_p_on_candidates(vals, p_off)
    assert fb.tolist() == [False] and keep.tolist() == [[True, True, True, False]]
    p_off = torch.tensor([1 - first + 1e-3], dtype=torch.float32)  # below it: kept
    keep, fb = E._top_p_on_candidates(vals, p_off)
    assert fb.tolist() == [False] and keep.tolist() == [[True, True, True, True]]


def test_the_band_uses_each_rows_own_count_and_span() -> None:
    """Row 0 has 3000 survivors, row 1 three: row 1's band is its own (~4e-7), so a cut 5e-5 from its
    cumulative mass is clear; a band from the batch's count (3003, ~1e-4) would reach it."""
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(3000, generator=g).sort(descending=True).values
    narrow = torch.full((3000,), NEG)
    narrow[:3] = torch.tensor([0.0, -0.1, -0.2])
    e = torch.exp(narrow[:3].double()).flip(0)
    first = float(e[0] / e.sum())
    rows = torch.stack([wide, narrow])
    p = torch.tensor([0.9, 1 - first - 5e-5], dtype=torch.float32)
    keep, fb = E._top_p_on_candidates(rows, p)
    assert fb.tolist()[1] is False and keep[1, :3].tolist() == [True, True, False]
    assert not bool(keep[1, 3:].any())


def test_p_one_rows_drop_only_float32_underflow() -> None:
    # log q of -200 rounds to probability 0 in float32 (dropped, clear); -100 lies in the band (fallback).
    keep, fb = _cut([[0.0, -50.0, -200.0, NEG], [0.0, -50.0, -100.0, NEG]], [1.0, 1.0])
    assert keep[0] == [True, True, False, False] and fb == [False, True]
    keep, fb = _cut([[0.0, -1.0, -2.0, -3.0]], [1.0])
    assert keep == [[True, True, True, True]] and fb == [False]


def test_generic_rows_take_the_candidate_path_and_top_p_alone_does_not() -> None:
    g = torch.Generator().manual_seed(1)
    z = torch.randn(8, 2000, generator=g) * 2
    z[:, :20] += torch.rand(8, 20, generator=g) * 10
    for spec in (S(0.8, top_k=50, top_p=0.9), S(0.8, top_k=50), S(1.0, top_k=50, top_p=0.9, min_p=0.05)):
        b = E._kept_bounded(E.scale(z, spec), [spec] * 8)
        kept, ids, listed = b.kept, b.ids, b.listed
        assert listed.tolist() == [True] * 8, spec.label()
        assert torch.equal(kept, reference_filter(z, spec).kept)
        assert torch.equal(E.ids_to_mask(ids, 2000), kept) and int(ids.max()) < 2000
    b = E._kept_bounded(E.scale(z, S(0.8, top_p=0.9)), [S(0.8, top_p=0.9)] * 8)
    ids, listed = b.ids, b.listed
    assert not bool(listed.any()) and bool((ids == -1).all())


def test_candidates_widen_to_every_token_tied_with_the_kth() -> None:
    z = torch.tensor([[5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 1.0, NEG], [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0]])
    vals, ids = E._candidates(z, torch.tensor([3, 3]))
    assert vals.shape[1] == 6
    assert vals[0].tolist() == [5.0, 4.0, 3.0, 3.0, 3.0, 3.0]
    assert vals[1].tolist() == [9.0, 8.0, 7.0, NEG, NEG, NEG]
    assert sorted(ids[0].tolist()) == [0, 1, 2, 3, 4, 5] and ids[1, :3].tolist() == [0, 1, 2]
    # k-th value -inf: no widening, -inf never survives.
    vals, _ = E._candidates(torch.tensor([[1.0, NEG, NEG, NEG]]), torch.tensor([2]))
    assert vals.tolist() == [[1.0, NEG, NEG]]
    # k = V - 1 with a tie at the k-th reaching the end of the row.
    vals, _ = E._candidates(torch.tensor([[2.0, 1.0, 1.0, 1.0]]), torch.tensor([2]))
    assert vals.tolist() == [[2.0, 1.0, 1.0, 1.0]]


# -- the simple estimators and their messages -------------------------------------------------------


def test_full_replay_and_log_s_by_hand() -> None:
    z = torch.tensor([[0.5, 0.3, 0.2]]).log()
    y = torch.tensor([1])
    assert float(E.full(z, y, S(1.0))) == pytest.approx(math.log(0.3), abs=1e-7)
    kept = torch.tensor([[True, True, False]])
    for form in (kept, torch.tensor([[0, 1, -1]]), torch.tensor([[1, -1, 0]])):
        rep = E.replay(z, y, form, S(1.0))
        assert rep.logprobs.dtype == torch.float32
        assert float(rep.logprobs[0]) == pytest.approx(math.log(0.3 / 0.8), abs=1e-7)
        assert rep.outside.tolist() == [False] and int(rep.outside.sum()) == 0
        assert float(E.predicted_log_s(z, form, S(1.0))[0]) == pytest.approx(math.log(0.8), abs=1e-7)
    out = E.replay(z, torch.tensor([2]), torch.tensor([[0, 1, -1]]), S(1.0))
    assert out.outside.tolist() == [True] and int(out.outside.sum()) == 1
    assert E.predicted_log_s(z, kept, S(1.0)).dtype == torch.float32


def test_replay_scales_by_each_rows_temperature() -> None:
    z = torch.tensor([[2.0, 1.0, 0.0], [2.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    specs = [S(0.5), S(1.0), S(0.0)]
    ids = torch.tensor([[0, 1], [0, 1], [0, 1]])
    lp = E.replay(z, torch.tensor([1, 1, 1]), ids, specs).logprobs
    want = [-2.0 - math.log1p(math.exp(-2.0)), -1.0 - math.log1p(math.exp(-1.0)), -1.0 - math.log1p(math.exp(-1.0))]
    assert lp.tolist() == pytest.approx(want, abs=1e-6)
    assert torch.equal(lp, E.replay(z, torch.tensor([1, 1, 1]), E.ids_to_mask(ids, 3), specs).logprobs)


def test_an_empty_kept_set_gives_infinities_not_nan() -> None:
    """No real sampler keeps nothing; if a capture says so, replay reads +inf (a one-sided infinity that
    every drift gate fails) and log S is log 0."""
    z = torch.tensor([[1.0, 2.0]])
    lp = E.replay(z, torch.tensor([0]), torch.tensor([[False, False]]), S(1.0)).logprobs
    assert lp.tolist() == [math.inf]
    assert E.predicted_log_s(z, torch.tensor([[-1]]), S(1.0)).tolist() == [NEG]


def test_messages_in_full() -> None:
    z = torch.zeros(2, 3)
    cases = [
        (lambda: E.full(z, torch.tensor([[0], [1]]), S()), "sampled has shape (2, 1): allowed a 1-D tensor of 2 token ids"),
        (lambda: E.full(z, torch.tensor([0, 3]), S()), "sampled ids must lie in [0, 3): got min 0, max 3"),
        (lambda: E.full(z, torch.tensor([-1, 2]), S()), "sampled ids must lie in [0, 3): got min -1, max 2"),
        (lambda: E.replay(z, torch.tensor([0, 1]), torch.zeros(2, 2, dtype=torch.bool), S()),
         "kept mask has shape (2, 2): allowed the logits' shape (2, 3)"),
        (lambda: E.replay(z, torch.tensor([0, 1]), torch.zeros(3, 2, dtype=torch.long), S()),
         "kept ids have shape (3, 2): allowed [2, K]"),
        (lambda: E.replay(z, torch.tensor([0, 1]), torch.zeros(2, dtype=torch.long), S()),
         "kept ids have shape (2,): allowed [2, K]"),
        (lambda: E.replay(torch.zeros(3), torch.tensor([0]), torch.zeros(1, 1, dtype=torch.long), S()),
         "logits has shape (3,): allowed a 2-D [N, V] tensor"),
        (lambda: E.predicted_log_s(z, torch.zeros(3, 2, dtype=torch.long), S()), "kept ids have shape (3, 2): allowed [2, K]"),
        (lambda: E.predicted_log_s(z, torch.zeros(2, 2, 1, dtype=torch.long), S()),
         "kept ids have shape (2, 2, 1): allowed [2, K]"),
        (lambda: E.ids_to_mask(torch.tensor([[0, 5]]), 5), "kept ids must lie in [0, 5): got 5"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == message


@pytest.mark.parametrize(("bad", "row"), [(float("nan"), 1), (float("inf"), 0)])
def test_replay_refuses_nan_or_plus_inf_at_the_ids_it_reads(bad: float, row: int) -> None:
    z = torch.zeros(2, 4)
    z[row, 2] = bad
    ids = torch.tensor([[0, 2], [2, -1]])
    with pytest.raises(ValueError) as info:
        E.replay(z, torch.tensor([0, 2]), ids, S())
    assert str(info.value) == (
        f"logits at the kept ids or the sampled id of row {row} contain NaN or +inf: allowed finite values or -inf"
    )
    z[row, 2] = 0.0
    z[row, 3] = bad  # not read: no error
    E.replay(z, torch.tensor([0, 2]), ids, S())


def test_mask_and_ids_conversions() -> None:
    kept = torch.tensor([[False, True, True, False], [False, False, False, False]])
    ids = E.mask_to_ids(kept)
    assert ids.dtype == torch.long and ids.tolist() == [[1, 2], [-1, -1]]
    assert E.mask_to_ids(torch.zeros(2, 3, dtype=torch.bool)).tolist() == [[-1], [-1]]
    assert tuple(E.mask_to_ids(torch.zeros(0, 3, dtype=torch.bool)).shape) == (0, 1)
    mask = E.ids_to_mask(torch.tensor([[3, -1, 0], [-1, -1, -1]]), 4)
    assert mask.tolist() == [[True, False, False, True], [False] * 4]
    assert tuple(E.ids_to_mask(torch.zeros(0, 2, dtype=torch.long), 4).shape) == (0, 4)


def test_scale_divides_in_float32_and_leaves_greedy_rows() -> None:
    z = torch.tensor([[1.0, 3.0], [1.0, 3.0]], dtype=torch.float64)
    out = E.scale(z, [S(0.5), S(0.0)])
    assert out.dtype == torch.float32 and out.tolist() == [[2.0, 6.0], [1.0, 3.0]]
    assert E.scale(z, S(5e-6)).tolist() == [[100.0, 300.0]] * 2  # (0, 0.01) is raised to 0.01


def test_mask_to_ids_lists_ids_ascending_on_long_rows() -> None:
    """torch's default sort is not stable on long rows; the stable sort is what keeps kept ids ascending."""
    kept = torch.rand(3, 50_000, generator=torch.Generator().manual_seed(0)) < 0.5
    ids = E.mask_to_ids(kept)
    for r in range(3):
        c = int(kept[r].sum())
        assert ids.shape[1] == int(kept.sum(-1).max())
        assert torch.equal(ids[r, :c], kept[r].nonzero().squeeze(1)) and bool((ids[r, c:] == -1).all())


def test_replay_on_ids_divides_in_float32_for_any_logit_dtype() -> None:
    z = torch.randn(3, 50, generator=torch.Generator().manual_seed(2), dtype=torch.float64) * 3
    ids = torch.tensor([[0, 5, 7], [1, 2, -1], [9, -1, -1]])
    y = torch.tensor([5, 2, 9])
    spec = S(0.7, top_k=3)
    got = E.replay(z, y, ids, spec).logprobs
    assert got.dtype == torch.float32
    assert torch.equal(got, E.replay(z.float(), y, ids, spec).logprobs)


def test_planted_faults_with_force_include_off_score_minus_infinity() -> None:
    z = torch.tensor([[3.0, 2.0, 2.0, 2.0, 0.0]])
    res = E.recompute(z, torch.tensor([4]), S(1.0, top_k=2), faults=FilterFaults(drop_top_k_ties=True),
                      force_include=False)
    assert res.forced.tolist() == [True] and res.logprobs.tolist() == [NEG]


def test_the_underflow_decision_reads_the_normalised_log_probability() -> None:
    """3000 tokens at the max: log q = x - m - log(3000). At x - m = -125 that is -133, a clear float32 zero;
    without the normaliser it would read -125 + 8 and fall in the band."""
    row = torch.full((3001,), 0.0)
    row[-1] = -125.0
    keep, fb = E._top_p_on_candidates(row.unsqueeze(0), torch.tensor([1.0]))
    assert fb.tolist() == [False] and keep[0, :3000].all() and not bool(keep[0, -1])


def test_the_tie_split_check_is_per_row() -> None:
    """Row 0 drops a token, row 1 (no -inf, nothing dropped) must not be flagged by row 0's drop."""
    keep, fb = _cut([[2.0, 1.0, 0.0, -1.0], [0.5, 0.4, 0.3, 0.2]], [0.5, 0.999])
    assert keep == [[True, False, False, False], [True, True, True, True]] and fb == [False, False]
