"""The fast estimators: recompute over ``topk(k)`` candidates keeps vLLM's exact kept set; replay reads K ids.

``parity.core.estimators.recompute`` no longer sorts whole rows when top_k is set (the target: recompute
<= 2x the full-vocabulary log-softmax). These tests hold it to the exact kept set of vLLM's real
``Sampler`` and of ``reference_filter`` on the same Hypothesis cases the sampler properties draw
(ties at the k-th value, top_p cuts inside tie blocks, -inf entries, mixed batches, both vLLM paths),
and show that each of its two fallbacks (rounding band, tie split by the cut) is needed: with either
switched off, the kept set leaves the reference's on purpose-built rows.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from strategies import cases, example_case

import parity.core.estimators as E
from parity.core import tolerances
from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec
from parity.testing.cases import Case, RowPlan, plant_top_p_tie

pytestmark = pytest.mark.sampler

S = SamplingSpec
NEG_INF = float("-inf")


def _moved(case: Case) -> torch.Tensor:
    gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    return case.penalised_logits() + 1e-3 * torch.randn(case.logits.shape, generator=gen)


@given(case=cases())
@example(case=example_case(4096, RowPlan(S(1.0, top_k=50, top_p=0.9, min_p=0.05), std=0.1, top_k_tie=3, top_p_tie=3)))
@example(case=example_case(2048, RowPlan(S(0.7, top_k=40, top_p=0.8), std=2.0, top_p_tie=4), RowPlan(S(1.0, top_k=40), std=2.0)))
@example(case=example_case(1000, RowPlan(S(0.05, top_k=30), std=20.0), RowPlan(S(1.0, top_p=0.9), std=20.0)))  # p = 1 row, underflow
def test_recompute_kept_is_vllms_kept(sampler, case: Case) -> None:
    prompts, outputs = case.histories
    out = sampler(case.logits, case.specs, seed=case.seed, prompt_ids=prompts, output_ids=outputs)
    same = E.recompute(case.penalised_logits(), out.sampled, case.specs)
    mism = (same.kept != out.kept).any(dim=1).nonzero().squeeze(1).tolist()
    assert not mism, f"recompute's kept set differs from vLLM's Sampler in rows {mism} of {case!r}"
    moved = _moved(case)
    fast = E.recompute(moved, out.sampled, case.specs)
    ref = E._recompute_reference(moved, out.sampled, case.specs)
    bare = [s.without_penalties() for s in case.specs]  # moved logits are already penalised
    assert torch.equal(fast.kept, reference_filter(moved, bare).kept), f"moved logits: kept sets differ, {case!r}"
    assert torch.equal(fast.forced, ref.forced)
    finite = torch.isfinite(ref.logprobs)
    assert torch.equal(torch.isfinite(fast.logprobs), finite)
    # Same float32 shift, float64 sums over the same terms in another order: float32-rounding equal.
    gap = (fast.logprobs[finite].double() - ref.logprobs[finite].double()).abs()
    tol = 2 * tolerances.U32 * ref.logprobs[finite].double().abs() + 1e-7
    assert bool((gap <= tol).all()), f"log-probs differ by {float(gap.max()):.3g} on {case!r}"


def _bounded_rows(z: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    return E._kept_bounded(E.scale(z, specs), [s.effective() for s in specs]).listed


def test_candidate_path_is_taken_on_generic_rows() -> None:
    """Not vacuous: generic LM-like rows with top_k are filtered from candidates, not by the reference."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(32, 5000, generator=g) * 2
    z[:, :20] += torch.rand(32, 20, generator=g) * 10
    for spec in (S(0.8, top_k=50, top_p=0.9), S(0.8, top_k=50), S(1.0, top_k=50, top_p=0.9, min_p=0.05)):
        listed = _bounded_rows(z, [spec] * 32)
        assert int(listed.sum()) == 32, f"{spec.label()}: only {int(listed.sum())} of 32 rows took the candidate path"
        assert torch.equal(E.recompute(z, torch.zeros(32, dtype=torch.long), spec).kept, reference_filter(z, spec).kept)
    assert not bool(_bounded_rows(z, [S(0.8, top_p=0.9)] * 32).any()), "top_p alone has no candidate bound (the reference sort)"


def _boundary_rows(seed: int, n: int = 64) -> tuple[torch.Tensor, list[SamplingSpec]]:
    """Rows whose 1 - p sits within ~1e-7 (relative) of the exact cumulative mass at a random position."""
    g = torch.Generator().manual_seed(seed)
    vocab, k, t = 3000, 60, 0.9
    z = torch.randn(n, vocab, generator=g) * 3
    specs = []
    for r in range(n):
        top = (z[r] / t).topk(k).values.double().flip(0)
        e = torch.exp(top - top.max())
        mass = e.cumsum(0) / e.sum()
        j = int(torch.randint(0, k - 1, (1,), generator=g))
        thr = float(mass[j]) * (1 + 1e-7 * float(torch.randn(1, generator=g)))
        specs.append(S(t, top_k=k, top_p=min(max(1 - thr, 1e-6), 1 - 1e-7)))
    return z, specs


def test_rounding_band_is_needed(monkeypatch) -> None:
    """At the float32 rounding boundary the exact decision is not vLLM's; the band sends those rows
    to the reference. Negative control: with no band the kept sets differ."""
    z, specs = _boundary_rows(1)
    y = torch.zeros(z.shape[0], dtype=torch.long)
    want = reference_filter(z, specs).kept
    assert torch.equal(E.recompute(z, y, specs).kept, want)
    monkeypatch.setattr(tolerances, "top_p_band", lambda mass, count, span: torch.full_like(mass, -1.0))
    differ = int((E.recompute(z, y, specs).kept != want).any(dim=1).sum())
    assert differ > 0, "no band and still equal: these rows do not reach the rounding boundary"


def _min_p_boundary_rows(seed: int, n: int = 48) -> tuple[torch.Tensor, list[SamplingSpec]]:
    """Rows with top_k and min_p whose candidates include values at min_p's exact threshold
    ``m + log(min_p)`` and one or two float32 steps either side of it."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, 3000, generator=g) * 3
    mp = (torch.rand(n, generator=g) * 0.3 + 0.02).tolist()
    at = (z.amax(dim=1).double() + torch.log(torch.tensor(mp, dtype=torch.float64))).float()
    for j, steps in enumerate((0, 1, -1, 2, -2)):
        v = at.clone()
        for _ in range(abs(steps)):
            v = torch.nextafter(v, torch.full_like(v, float("inf") if steps > 0 else NEG_INF))
        z[:, 100 + j] = v
    return z, [S(1.0, top_k=200, top_p=0.95 if r % 2 else 1.0, min_p=mp[r]) for r in range(n)]


def test_min_p_on_candidates_keeps_vllms_kept_set_at_the_threshold(sampler, monkeypatch) -> None:
    """top_k rows decide min_p on their candidates (estimators.min_p_decide), not by the full-row softmax.
    At the float32 threshold the exact rule is not vLLM's: those rows take the reference's min_p (and are
    counted in ``fallback``), and the kept set is vLLM's Sampler's. Negative control: with no band the
    exact rule decides them, and the kept set leaves the reference's."""
    z, specs = _min_p_boundary_rows(5)
    out = sampler(z, specs, seed=0)
    res = E.recompute(z, out.sampled, specs)
    mism = (res.kept != out.kept).any(dim=1).nonzero().squeeze(1).tolist()
    assert not mism, f"recompute's kept set differs from vLLM's Sampler in rows {mism}"
    assert int(res.fallback.sum()) > 0, "no row was sent to the reference: the planted values missed the band"
    want = reference_filter(z, specs).kept
    monkeypatch.setattr(tolerances, "min_p_band", lambda log_mp: torch.full_like(log_mp, -1.0))
    differ = int((E.recompute(z, out.sampled, specs).kept != want).any(dim=1).sum())
    assert differ > 0, "no band and still equal: the planted values do not reach min_p's rounding boundary"


def test_min_p_decide_drops_what_min_p_mask_drops_away_from_the_threshold() -> None:
    """Generic rows (no planted values): min_p_decide agrees with min_p_mask on every row it does not flag,
    and flags few (a row is flagged only when a value lies within ~1e-4 nats of the threshold)."""
    from parity.core.estimators import min_p_decide
    from parity.core.filters import min_p_mask

    g = torch.Generator().manual_seed(2)
    z = torch.randn(64, 5000, generator=g) * 2
    z[:, :5] = NEG_INF
    mp = torch.rand(64, generator=g) * 0.5
    mp[::9] = 0.0
    dropped, near = min_p_decide(z, z.amax(dim=1), mp)
    assert int(near.sum()) <= 4, f"{int(near.sum())} of 64 generic rows flagged: the band is too wide"
    assert torch.equal(dropped[~near], min_p_mask(z, mp)[~near])
    _, tiny = min_p_decide(z[:2], z[:2].amax(dim=1), torch.tensor([2.0**-100, 0.0]))
    assert tiny.tolist() == [True, False], "a min_p whose threshold may be subnormal goes to the reference"


def test_tie_split_by_the_cut_falls_back() -> None:
    """Which tied tokens the cut drops follows torch.sort's permutation of the whole row; the candidates
    cannot know it. Every such row is flagged, and the unflagged candidate answer is wrong on some."""
    g = torch.Generator().manual_seed(3)
    flagged = wrong = 0
    for _ in range(40):
        z = torch.randn(2000, generator=g) * 2
        spec = plant_top_p_tie(z, S(1.0, top_k=200, top_p=0.9), 6, g)
        if spec.top_p == 0.9:
            continue
        zs = E.scale(z.unsqueeze(0), spec)
        vals, cand = E._candidates(zs, torch.tensor([200]))
        keep, fallback = E._top_p_on_candidates(vals, torch.tensor([spec.top_p], dtype=torch.float32))
        flagged += int(fallback[0])
        naive = torch.zeros(1, 2000, dtype=torch.bool).scatter_(1, torch.where(keep, cand, cand[:, :1]), True)
        want = reference_filter(z.unsqueeze(0), spec).kept
        wrong += int(not torch.equal(naive, want))
        assert torch.equal(E.recompute(z.unsqueeze(0), torch.zeros(1, dtype=torch.long), spec).kept, want)
    assert flagged >= 20, f"only {flagged} rows had their top_p cut inside the planted tie block"
    assert wrong > 0, "the candidate order always matched torch.sort's: the fallback was never needed"


def test_wide_tie_at_the_kth_value_widens_the_candidates() -> None:
    """500 tokens tied with the 10th value: all of them survive top_k, in both paths."""
    z = torch.randn(2, 4096, generator=torch.Generator().manual_seed(5))
    z[:, :9] = 10.0 + torch.arange(9.0)
    z[:, 9:509] = 5.0
    for specs in ([S(1.0, top_k=10)] * 2, [S(1.0, top_k=10), S(1.0, top_k=10, top_p=0.999)]):
        res = E.recompute(z, torch.zeros(2, dtype=torch.long), specs)
        assert torch.equal(res.kept, reference_filter(z, specs).kept)
        assert int(res.kept[0].sum()) == 509


def test_replay_with_ids_reads_only_the_kept_ids() -> None:
    """replay on padded ids gathers K + 1 logits per row and never scales or checks the rest (the
    whole-row scale made replay cost 0.7x of the full log-softmax). A NaN off the kept set is
    therefore not read; one on it is refused. Values are bitwise those of the dense-mask form."""
    g = torch.Generator().manual_seed(7)
    z = torch.randn(4, 1000, generator=g) * 3
    spec = S(0.7, top_k=20, top_p=0.9)
    kept = reference_filter(z, spec).kept
    ids = E.mask_to_ids(kept)
    y = torch.multinomial(kept.float(), 1, generator=g).squeeze(1)
    want = E.replay(z, y, kept, spec).logprobs
    assert torch.equal(E.replay(z, y, ids, spec).logprobs, want)
    off = (~kept[0]).nonzero()[0, 0]
    z[0, off] = float("nan")
    assert torch.equal(E.replay(z, y, ids, spec).logprobs, want)
    z[0, ids[0, 0]] = float("nan")
    with pytest.raises(ValueError, match="row 0 contain NaN"):
        E.replay(z, y, ids, spec)
