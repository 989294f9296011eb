"""The nucleus select: recompute's rows without top_k keep vLLM's exact kept set, without a full sort.

``parity.core.nucleus.nucleus_cut`` finds the float32 top_p cut of vLLM's sort path from a histogram of the
float bits of ``m - z'`` and an exact float64 cut over the few candidates near it (top_p alone cost
7-11x the full log-softmax through the full-row sort); rows in the rounding band are cut from their
sorted values with the reference's own float32 ops, and rows whose cut splits a tie are left to the
reference sort. ``parity.core.nucleus.survivor_mass`` serves rows with no cut at all (min_p alone, or no
filter). These tests hold ``estimators.recompute`` to the kept set of vLLM's real ``Sampler`` and of
``reference_filter`` on Hypothesis cases without top_k (top_p alone, with min_p, min_p alone, every
temperature branch, mixed with top_k and greedy rows), and show that each fallback is needed: with the
rounding band, the tie check or the underflow band of p = 1 rows switched off, purpose-built rows leave
the reference's kept set. The bracket cap is a cost guard: counted, and still exact. top_p + min_p rows
with few min_p survivors are cut over the survivor list instead (listed, exact). The opt-in
``band_policy="decide"`` changes only the rows it counts as decided, exactly the default's band rows
that had candidates, and on boundary rows some of them do leave the reference's kept set. Every test
runs twice: on the compiled row passes of ``parity.core.kernels`` and on the torch passes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import event, example, given
from hypothesis import strategies as st
from strategies import example_case, example_logits, row_plans

import parity.core.estimators as E
import parity.core.kernels as K
import parity.core.nucleus as N
from parity.core.filters import min_p_mask, reference_filter
from parity.core.spec import SamplingSpec
from parity.testing.cases import Case, CasePlan, RowPlan, build_case, plant_top_p_tie

pytestmark = pytest.mark.sampler


@pytest.fixture(scope="module", autouse=True, params=[b for b in K.BACKENDS if b != "numba" or K.numba is not None])
def row_passes(request: pytest.FixtureRequest):
    """Every test here runs on both row passes: the compiled kernels (parity.core.kernels) and torch's."""
    patch = pytest.MonkeyPatch()
    patch.setenv(K.ENV, request.param)
    yield request.param
    patch.undo()

S = SamplingSpec
NEG_INF = float("-inf")
U = 2.0**-24

# -- cases without top_k ----------------------------------------------------------------------------

temperatures = st.one_of(
    st.just(0.0),  # greedy rows in a mixed batch run with p = 1 on the sort path
    st.floats(1e-7, 0.0099),  # raised to 0.01 by vLLM
    st.floats(0.01, 0.99),
    st.just(1.0),
    st.floats(1.01, 2.0),
)
top_ps = st.one_of(st.just(1.0), st.floats(0.01, 0.3), st.floats(0.6, 0.99), st.floats(0.999, 0.99999))
min_ps = st.one_of(st.just(0.0), st.just(0.0), st.floats(0.001, 0.3), st.just(1.0))
vocabs = st.one_of(st.integers(2, 64), st.integers(65, 1024), st.sampled_from([2048, 4096, 32000]))


@st.composite
def nucleus_specs(draw: st.DrawFn, vocab: int) -> SamplingSpec:
    top_k = draw(st.sampled_from([0, -1, vocab, vocab + 7]))  # every way of leaving top_k off
    return SamplingSpec(draw(temperatures), top_k, draw(top_ps), draw(min_ps))


@st.composite
def nucleus_cases(draw: st.DrawFn, max_rows: int = 6) -> Case:
    vocab = draw(vocabs)
    n = draw(st.integers(1, max_rows))
    rows = []
    for _ in range(n):
        if draw(st.integers(0, 4)) == 0:  # now and then a top_k row: the batch mixes both fast paths
            spec = SamplingSpec(draw(temperatures), draw(st.integers(1, max(1, vocab - 1))), draw(top_ps), draw(min_ps))
        else:
            spec = draw(nucleus_specs(vocab))
        rows.append(draw(row_plans(vocab, spec)))
    return build_case(CasePlan(vocab, tuple(rows), draw(st.integers(0, 2**31 - 1))))


def _moved(case: Case) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    return case.logits + 1e-3 * torch.randn(case.logits.shape, generator=gen)


def _nucleus_rows(logits: torch.Tensor, specs: list[SamplingSpec]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows whose kept set and mass came from the nucleus select, rows a fast path sent to the reference)."""
    b = E._kept_bounded(E.scale(logits, specs), [s.effective() for s in specs])
    return ~torch.isnan(b.log_mass), b.fallback


def _check_logprobs(fast: E.RecomputeResult, ref: E.RecomputeResult, nucleus_rows: torch.Tensor, what: str) -> None:
    finite = torch.isfinite(ref.logprobs)
    assert torch.equal(torch.isfinite(fast.logprobs), finite), f"{what}: -inf rows differ"
    # Both: the same float32 shift z'_y - m, float64 sums, a float32 result (2u|lp| between them). The
    # nucleus rows' kept mass is certified within LOG_MASS_REL_ERROR (float32 exp; float64 histogram sums or float32 sums of 8).
    extra = torch.where(nucleus_rows, N.LOG_MASS_REL_ERROR, 0.0).double()
    gap = (fast.logprobs.double() - ref.logprobs.double()).abs()
    tol = 2 * U * ref.logprobs.double().abs() + 1e-7 + extra
    bad = finite & (gap > tol)
    assert not bool(bad.any()), f"{what}: log-probs differ by {float(gap[bad].max()):.3g} in rows {bad.nonzero().flatten().tolist()}"


@given(case=nucleus_cases())
@example(case=example_case(4096, RowPlan(S(1.0, top_p=0.9), std=2.0), RowPlan(S(0.8, top_p=0.95, min_p=0.05), std=2.0)))
@example(case=example_case(2048, RowPlan(S(0.7, top_p=0.8), std=2.0, top_p_tie=4), RowPlan(S(1.0), std=2.0)))  # tie + p = 1
@example(case=example_case(1000, RowPlan(S(0.05, top_p=0.9), std=20.0), RowPlan(S(1.0, top_p=1.0), std=20.0)))  # underflow
@example(case=example_case(4096, RowPlan(S(1.0, top_p=0.5), std=0.1, quantum=0.25), RowPlan(S(0.0), std=1.0)))  # ties, greedy
@example(case=example_logits([[0.0, 0.0, 0.0, 0.0]], S(1.0, top_p=0.6)))  # the cut inside a full tie
@example(case=example_logits([[1.0, NEG_INF, NEG_INF]], S(0.7, top_p=0.5, min_p=0.3)))  # a single finite value
@example(case=example_case(4096, RowPlan(S(0.8, min_p=0.05), std=2.0), RowPlan(S(1.3), std=2.0)))  # no cut: survivors
def test_nucleus_kept_is_vllms_kept(sampler, case: Case) -> None:
    out = sampler(case.logits, case.specs, seed=case.seed)
    res = E.recompute(case.logits, out.sampled, case.specs)
    mism = (res.kept != out.kept).any(dim=1).nonzero().squeeze(1).tolist()
    assert not mism, f"recompute's kept set differs from vLLM's Sampler in rows {mism} of {case!r}"
    cut, fallback = _nucleus_rows(case.logits, case.specs)
    event(f"nucleus rows: {'none' if not cut.any() else 'all' if cut.all() else 'some'}")
    if bool(fallback.any()):
        event("a row fell back to the reference sort")
    for logits, what in ((case.logits, "sampler logits"), (_moved(case), "moved logits")):
        fast = E.recompute(logits, out.sampled, case.specs)
        ref = E._recompute_reference(logits, out.sampled, case.specs)
        assert torch.equal(fast.kept, reference_filter(logits, case.specs).kept), f"{what}: kept sets differ, {case!r}"
        assert torch.equal(fast.forced, ref.forced), f"{what}: forced flags differ, {case!r}"
        _check_logprobs(fast, ref, _nucleus_rows(logits, case.specs)[0], f"{what}, {case!r}")
        assert torch.equal(fast.fallback, _nucleus_rows(logits, case.specs)[1])
        decide = E.recompute(logits, out.sampled, case.specs, band_policy="decide")
        assert torch.equal(decide.decided | decide.fallback, fast.fallback), f"{what}: decided rows are not band rows, {case!r}"
        same = ~decide.decided
        assert torch.equal(decide.kept[same], fast.kept[same]), f"{what}: band_policy=decide changed an undecided row, {case!r}"


def _lm_rows(n: int, vocab: int, seed: int) -> torch.Tensor:
    """LM-like rows: a heavy head of 20 tokens over a wide tail."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g) * 2
    z[:, :20] += torch.rand(n, 20, generator=g) * 10
    return z


def test_nucleus_path_is_taken_on_generic_rows(monkeypatch) -> None:
    """Not vacuous: LM-like rows under top_p alone (and with min_p when its survivors are too many to
    list, and p = 1 rows beside them) are cut by the histogram select, not by the reference sort; the
    masses at these cuts are far outside any band."""
    z = _lm_rows(32, 5000, 0)
    y = torch.zeros(32, dtype=torch.long)
    monkeypatch.setattr(E, "MIN_P_LIST_MAX", 0)  # no min_p survivor list: top_p + min_p takes the select
    for specs in ([S(0.8, top_p=0.9)] * 32, [S(1.0, top_p=0.9, min_p=0.05)] * 32, [S(0.8, top_p=0.9), S(1.0)] * 16):
        cut, fallback = _nucleus_rows(z, specs)
        label = specs[0].label()
        assert bool(cut.all()), f"{label}: only {int(cut.sum())} of 32 rows took the nucleus select"
        assert not bool(fallback.any())
        assert torch.equal(E.recompute(z, y, specs).kept, reference_filter(z, specs).kept), label


def test_min_p_survivor_lists_under_top_p(monkeypatch) -> None:
    """top_p + min_p rows without top_k whose min_p survivors are few are cut over the survivor list
    (as top_k rows over their candidates): listed, not nucleus rows, and vLLM's kept set; rows with more
    survivors than MIN_P_LIST_MAX take the histogram select in the same batch. Negative control: a list
    path that forgot min_p (every finite value a survivor) keeps a different set."""
    z = _lm_rows(16, 5000, 21)
    g = torch.Generator().manual_seed(4)
    y = torch.randint(0, 5000, (16,), generator=g)
    specs = [S(0.8, top_p=0.9, min_p=0.05)] * 8 + [S(1.0, top_p=0.95, min_p=0.001)] * 4 + [S(0.8, top_p=0.9)] * 4
    zs = E.scale(z, specs)
    count = (~min_p_mask(zs, torch.tensor([s.min_p for s in specs], dtype=torch.float32))).sum(dim=1)
    monkeypatch.setattr(E, "MIN_P_LIST_MAX", int(count[:8].max()))
    assert bool((count[8:12] > E.MIN_P_LIST_MAX).all()), "the min_p=0.001 rows must have too many survivors to list"
    b = E._kept_bounded(zs, specs)
    assert b.listed.tolist() == [True] * 8 + [False] * 8
    assert bool((~torch.isnan(b.log_mass[8:])).all()), "the other rows take the histogram select"
    fast, ref = E.recompute(z, y, specs), E._recompute_reference(z, y, specs)
    assert torch.equal(fast.kept, ref.kept) and torch.equal(fast.forced, ref.forced)
    _check_logprobs(fast, ref, ~b.listed, "min_p lists")
    monkeypatch.setattr(E, "MIN_P_LIST_MAX", 5000)
    monkeypatch.setattr(E, "min_p_mask", lambda sub, mp: torch.zeros_like(sub, dtype=torch.bool))

    def every_value(m: torch.Tensor, mp: torch.Tensor | None):  # the compiled lists' threshold, forgotten
        low = np.full(m.shape[0], np.finfo(np.float32).min, dtype=np.float32)
        return low, low, np.zeros(m.shape[0], dtype=bool), True

    monkeypatch.setattr(N, "_thresholds", every_value)
    planted = E._kept_bounded(zs, specs)
    assert bool(planted.listed[:8].all()) and not torch.equal(planted.kept[:8], ref.kept[:8]), "min_p never mattered here"


def _boundary_rows(seed: int, n: int = 64, vocab: int = 3000) -> tuple[torch.Tensor, list[SamplingSpec]]:
    """Rows whose float32 1 - p is the float32 number nearest the exact cumulative mass at one position:
    there the reference's float32 cumulative sum (a few 1e-9 off the exact one) decides either way."""
    g = torch.Generator().manual_seed(seed)
    t = 0.9
    z = torch.randn(n, vocab, generator=g) * 3
    specs = []
    for r in range(n):
        vals = (z[r] / t).sort().values
        e = torch.exp((vals - vals[-1]).double())
        mass = e.cumsum(0) / e.sum()
        lo = int((mass < 0.05).sum())
        j = int(torch.randint(lo, vocab - 10, (1,), generator=g))
        specs.append(S(t, top_p=float(1 - mass[j])))
    return z, specs


def test_rounding_band_is_needed(monkeypatch) -> None:
    """At the float32 rounding boundary the exact decision is not vLLM's; the band sends those rows to the
    reference (counted). Negative control: with no margin the kept sets differ."""
    z, specs = _boundary_rows(1)
    y = torch.zeros(z.shape[0], dtype=torch.long)
    want = reference_filter(z, specs).kept
    res = E.recompute(z, y, specs)
    assert torch.equal(res.kept, want)
    assert res.fallback_count > 0, "no row fell inside the band: these rows do not reach the rounding boundary"
    cut = N.nucleus_cut(E.scale(z, specs), torch.tensor([s.top_p for s in specs], dtype=torch.float32))
    assert bool(cut.band.any()) and not bool(cut.unresolved.any()), "band rows are cut from their sorted values"
    monkeypatch.setattr(N, "_margin", lambda a_j, cmax, k_ref, v, ours: torch.zeros_like(cmax))
    differ = int((E.recompute(z, y, specs).kept != want).any(dim=1).sum())
    assert differ > 0, "no margin and still equal: the band was never needed on these rows"


def test_decide_policy_counts_every_row_it_decides() -> None:
    """band_policy="decide" cuts the candidate-band rows by the exact float64 mass instead of sorting them.
    Outside its ``decided`` rows the kept set is the reference's; its decided rows plus its remaining
    fallbacks are exactly the default policy's fallbacks. Negative control: on rows built at the float32
    rounding boundary some decided row keeps a different set than vLLM, so the count is not decoration."""
    z, specs = _boundary_rows(1)
    y = torch.zeros(z.shape[0], dtype=torch.long)
    want = reference_filter(z, specs).kept
    default = E.recompute(z, y, specs)
    decide = E.recompute(z, y, specs, band_policy="decide")
    assert default.decided is None and decide.decided is not None
    assert decide.decided_count > 0, "no row was decided: these rows do not reach the band"
    assert torch.equal(decide.decided | decide.fallback, default.fallback)
    assert not bool((decide.decided & decide.fallback).any())
    same = ~decide.decided
    assert torch.equal(decide.kept[same], want[same])
    assert bool((decide.kept != want).any(dim=1)[decide.decided].any()), "every decided row matched: no boundary row"
    # The decided rows keep the float64 cut: the exact cumulative mass at their cut sits on the other side.
    zs = E.scale(z, specs)
    p = torch.tensor([s.top_p for s in specs], dtype=torch.float32)
    res = N.nucleus_cut(zs, p, band_policy="decide")
    assert torch.equal(res.decided, decide.decided) and not bool(res.unresolved[res.decided].any())
    assert N.nucleus_cut(zs, p).decided_count == 0


def test_decide_policy_agrees_outside_the_band(monkeypatch) -> None:
    """On generic LM-like rows and the Hypothesis-style mixes of the bench, "decide" changes nothing but
    the decided rows; with the band switched off (no margin) nothing is decided."""
    z = _lm_rows(48, 8000, 23)
    y = torch.zeros(48, dtype=torch.long)
    for specs in ([S(0.8, top_p=0.9)] * 48, [S(1.0, top_p=0.5), S(0.7, top_p=0.99), S(1.0)] * 16):
        want = reference_filter(z, specs).kept
        res = E.recompute(z, y, specs, band_policy="decide")
        ok = ~res.decided
        assert torch.equal(res.kept[ok], want[ok]), specs[0].label()
        assert res.decided_count + res.fallback_count == E.recompute(z, y, specs).fallback_count
    monkeypatch.setattr(N, "_margin", lambda a_j, cmax, k_ref, v, ours: torch.zeros_like(cmax))
    assert E.recompute(z, y, [S(0.8, top_p=0.9)] * 48, band_policy="decide").decided_count == 0


def test_band_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="band_policy is 'exact': allowed one of 'reference', 'decide'"):
        E.recompute(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), S(1.0, top_p=0.9), band_policy="exact")
    with pytest.raises(ValueError, match="band_policy"):
        N.nucleus_cut(torch.zeros(1, 4), torch.full((1,), 0.9), band_policy="sort")


def test_tie_split_by_the_cut_falls_back(monkeypatch) -> None:
    """Which tied tokens the cut drops follows torch.sort's permutation of the whole row; the candidates
    cannot know it. Every such row is flagged and sent to the reference; unflagged, some rows differ."""
    g = torch.Generator().manual_seed(3)
    rows, specs = [], []
    while len(rows) < 40:
        z = torch.randn(2000, generator=g) * 2
        spec = plant_top_p_tie(z, S(1.0, top_p=0.9), 6, g)
        if spec.top_p != 0.9:
            rows.append(z)
            specs.append(spec)
    z = torch.stack(rows)
    y = torch.zeros(z.shape[0], dtype=torch.long)
    want = reference_filter(z, specs).kept
    res = N.nucleus_cut(E.scale(z, specs), torch.tensor([s.top_p for s in specs], dtype=torch.float32))
    assert int(res.tie_split.sum()) >= 20, f"only {int(res.tie_split.sum())} rows had the cut inside the planted block"
    assert torch.equal(E.recompute(z, y, specs).kept, want)
    monkeypatch.setattr(N, "_tied", lambda lo, hi: torch.zeros_like(lo, dtype=torch.bool))
    differ = int((E.recompute(z, y, specs).kept != want).any(dim=1).sum())
    assert differ > 0, "the candidates' tie order always matched torch.sort's: the check was never needed"


def test_p_one_rows_fall_back_in_the_underflow_band(monkeypatch) -> None:
    """A row without top_p in a sort-path batch keeps every token whose float32 probability is not 0: a
    token 90 nats below the max has probability ~1e-39 (a float32 subnormal) and is kept by vLLM. Tokens
    between 80 and 105 nats below the max send the row to the reference; without that, it is dropped."""
    z = torch.full((2, 600), -300.0)
    z[:, 0] = 0.0
    z[:, 1:500] = -torch.linspace(1.0, 40.0, 499)
    z[1, 500] = -90.0
    specs = [S(1.0, top_p=0.9), S(1.0)]
    y = torch.zeros(2, dtype=torch.long)
    want = reference_filter(z, specs).kept
    assert bool(want[1, 500]), "vLLM keeps the subnormal-probability token"
    res = E.recompute(z, y, specs)
    assert torch.equal(res.kept, want)
    assert res.fallback.tolist() == [False, True]
    monkeypatch.setattr(N, "_DROP_KEY", N._KEEP_KEY - 1)  # no underflow band
    assert not torch.equal(E.recompute(z, y, specs).kept, want)


def test_bracket_cap_is_counted_and_exact(monkeypatch) -> None:
    """The cap on candidates is a cost guard, not a correctness one: over it the row is sorted by the
    reference (counted as bracket), and the kept set is the same."""
    z = _lm_rows(8, 3000, 5)
    specs = [S(1.0, top_p=0.2)] * 8  # the cut among the tail: many candidates per bucket
    want = reference_filter(z, specs).kept
    free = N.nucleus_cut(E.scale(z, specs), torch.full((8,), 0.2))
    assert not bool(free.bracket.any())
    monkeypatch.setattr(N, "MAX_CANDIDATES", int(free.candidates.min()) - 1)
    capped = N.nucleus_cut(E.scale(z, specs), torch.full((8,), 0.2))
    assert bool(capped.bracket.all()) and bool(capped.fallback.all())
    res = E.recompute(z, torch.zeros(8, dtype=torch.long), specs)
    assert torch.equal(res.kept, want) and res.fallback_count == 8


def test_values_cut_is_the_references_cut() -> None:
    """The fallback for band rows: the reference's float32 softmax and cumulative sum run on the row's
    sorted values (no permutation) give its cut value; kept = z' >= v* unless the cut splits a tie."""
    from parity.core.filters import top_k_top_p_sorted

    g = torch.Generator().manual_seed(13)
    z = torch.randn(24, 3000, generator=g) * 2
    z[8:16] = torch.round(z[8:16] * 2) / 2  # many ties
    z[16:20, ::3] = NEG_INF  # min_p-style -inf entries
    p = torch.rand(24, generator=g) * 0.98 + 0.01
    p[20:] = 1.0  # p = 1 rows: only float32 underflow drops
    z[20:, :50] = -150.0
    want = top_k_top_p_sorted(z, torch.full((24,), 3000), p) > NEG_INF
    v_star, split = N._values_cut(z, 1 - p)
    mine = z >= v_star.unsqueeze(1)
    assert torch.equal(mine[~split], want[~split])
    assert bool(split.any()), "no quantised row split a tie: the check is not exercised"
    # Split rows: the reference keeps every value above v*, drops every value below, and part of the tie.
    assert bool((want[split] <= mine[split]).all()) and bool((want[split] >= (z[split] > v_star[split].unsqueeze(1))).all())
    assert bool((want[split] != mine[split]).any(dim=1).any()), "a split row where z' >= v* is right is no split"


def test_survivor_rows_take_the_kept_mass_path() -> None:
    """min_p alone and no filter (vLLM skips its top-k/top-p step): kept = the finite z' left by min_p,
    the kept mass from the same blocked sums as the nucleus select."""
    z = _lm_rows(16, 4000, 17)
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 4000, (16,), generator=g)
    for specs in ([S(0.8, min_p=0.05)] * 16, [S(1.3)] * 16, [S(0.8, min_p=0.1), S(1.0)] * 8):
        cut, fallback = _nucleus_rows(z, specs)
        assert bool(cut.all()) and not bool(fallback.any())
        fast, ref = E.recompute(z, y, specs), E._recompute_reference(z, y, specs)
        assert torch.equal(fast.kept, ref.kept) and torch.equal(fast.forced, ref.forced)
        _check_logprobs(fast, ref, cut, specs[0].label())


def test_any_order_bound_without_a_known_lane_count() -> None:
    """Where torch's vector width is not known the denominator gets the any-order bound: more rows may
    fall back, none is decided differently."""
    z = _lm_rows(16, 4000, 9)
    p = torch.full((16,), 0.95)
    zs = E.scale(z, S(1.0, top_p=0.95))
    want = reference_filter(z, S(1.0, top_p=0.95)).kept
    for lanes in (None, 1, N.softmax_lanes(z.device)):
        res = N.nucleus_cut(zs, p, lanes=lanes)
        ok = ~res.fallback
        assert torch.equal(res.kept[ok], want[ok]), f"lanes={lanes}"
    assert int(N.nucleus_cut(zs, p, lanes=None).fallback.sum()) >= int(N.nucleus_cut(zs, p).fallback.sum())


def test_rows_and_out() -> None:
    """``rows`` cuts a subset of a batch into the same rows of ``out``; the rest of ``out`` is untouched."""
    z = E.scale(_lm_rows(6, 2000, 11), S(1.0))
    rows = torch.tensor([4, 1])
    out = torch.ones(6, 2000, dtype=torch.bool)
    res = N.nucleus_cut(z, torch.tensor([0.9, 0.7]), rows=rows, out=out)
    assert res.kept is out
    k = torch.full((2,), 2000)
    from parity.core.filters import top_k_top_p_sorted

    want = top_k_top_p_sorted(z[rows], k, torch.tensor([0.9, 0.7])) > NEG_INF
    assert torch.equal(out[rows], want)
    assert bool(out[[0, 2, 3, 5]].all())


def test_select_brackets_the_references_kept_set() -> None:
    """``select`` (the part before the cut) marks only tokens the reference keeps, and every token it
    keeps on a row that does not fall back is marked or a candidate; the cut then keeps exactly the
    reference's set. Negative control: a range one bucket lower (``b_top`` + 1) marks a token the
    reference drops on some row."""
    z = E.scale(_lm_rows(24, 3000, 5), S(0.8))
    p = torch.full((24,), 0.9)
    want = reference_filter(z, S(1.0, top_p=0.9)).kept
    sel = N.select(z, p)
    assert not bool((sel.kept & ~want).any())
    cand = torch.zeros_like(want).view(-1)
    cand[sel.pos] = True
    ok = ~(sel.ranges.band | sel.ranges.bracket)
    assert bool(ok.any())
    assert not bool((want & ~(sel.kept | cand.view_as(want)))[ok].any())
    assert sel.candidates == int(sel.ranges.n_cand.sum())
    assert torch.equal(N.nucleus_cut(z, p).kept, want)
    # Negative control: the kept mask one bucket further down the row.
    key = torch.bitwise_right_shift((z.amax(1, keepdim=True) - z).clamp(2.0**N.LOW_EXP, 2.0**N.HIGH_EXP).view(torch.int32), N.SHIFT) - N.BASE
    lower = key < (sel.ranges.b_top + 1).unsqueeze(1)
    assert bool((lower & ~want)[ok].any()), "one bucket lower marks a dropped token"


def test_cut_groups_keep_every_row_result(monkeypatch) -> None:
    """The exact cut in groups of rows by candidate count gives each row the result of one group of all
    rows (the padding carries no mass): the same kept sets and log-masses within the float64 sums."""
    z = E.scale(_lm_rows(200, 2000, 9), S(0.8))
    p = torch.linspace(0.5, 0.99, 200)
    assert N._group_size(torch.tensor([1] * 192 + [5000] * 64)) == 64, "a skewed batch is grouped"
    assert N._group_size(torch.full((256,), 300)) == 256, "an even one is not"
    monkeypatch.setattr(N, "CUT_GROUP_COST", 0)  # a group costs nothing: as many groups as allowed
    assert N._group_size(torch.arange(200)) == 25
    grouped = N.nucleus_cut(z, p)
    monkeypatch.setattr(N, "CUT_GROUPS", 1)
    single = N.nucleus_cut(z, p)
    assert torch.equal(grouped.kept, single.kept)
    assert torch.equal(grouped.fallback, single.fallback)
    ok = ~grouped.fallback
    assert torch.allclose(grouped.log_mass[ok], single.log_mass[ok], rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"work": torch.zeros(2, 5, dtype=torch.float64)}, "float32"),
        ({"p": torch.full((3,), 0.9)}, r"p has torch.float32 \(3,\): allowed float32 \[2\]"),
        ({"p": torch.full((2,), 0.9, dtype=torch.float64)}, r"p has torch.float64 \(2,\): allowed float32 \[2\]"),
        ({"min_p": torch.zeros(1)}, r"min_p has torch.float32 \(1,\): allowed float32 \[2\]"),
        ({"out": torch.zeros(2, 4, dtype=torch.bool)}, r"out has torch.bool \(2, 4\): allowed bool \[2, 5\]"),
    ],
)
def test_bad_input_is_refused(kwargs: dict, match: str) -> None:
    args = {"work": torch.zeros(2, 5), "p": torch.full((2,), 0.9)} | kwargs
    work, p = args.pop("work"), args.pop("p")
    with pytest.raises(ValueError, match=match):
        N.nucleus_cut(work, p, **args)


def test_sorted_rows_split_over_threads_is_numpys_sort() -> None:
    """The band rows' sort runs on torch's thread count (the sampler tests pin one thread: this one sets
    three, with fewer rows than threads and with a remainder)."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for rows in (1, 2, 7):
            a = torch.randn(rows, 1001, generator=torch.Generator().manual_seed(rows)).numpy()
            a[0, :3] = [0.0, -0.0, float("-inf")]
            assert np.array_equal(N._sorted_rows(a), np.sort(a, axis=1))
    finally:
        torch.set_num_threads(before)


def test_histogram_counts_beside_the_masses_give_the_one_thread_result() -> None:
    """With two torch threads the bucket counts are taken in a worker thread beside the masses: the cut
    is the same, bit for bit, as with one (the sampler tests pin one thread)."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(40, 20000, generator=g) * 2.5
    z[:, :20] += torch.rand(40, 20, generator=g) * 10
    p = torch.full((40,), 0.9)
    one = N.nucleus_cut(z, p)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = N.nucleus_cut(z, p)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one.kept, two.kept) and torch.equal(one.log_mass.nan_to_num(), two.log_mass.nan_to_num())
    assert torch.equal(one.band, two.band) and torch.equal(one.candidates, two.candidates)
