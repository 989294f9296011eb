"""Vocabulary-parallel estimators against the unsharded reference, over real gloo process groups.

Process groups are expensive to start on a 2-core machine, so the module spawns one 3-rank pool (2-rank
jobs run on a subgroup of its first two ranks) and every Hypothesis example is one job on it. Two more
short-lived groups test the spawn-run-teardown driver and a rank that dies. Every pool is closed with a deadline
and must report clean exits (each rank destroyed its process group).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from parity.core.estimators import mask_to_ids
from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec
from parity.distributed.pool import RankFailure, VocabParallelPool, run_vocab_parallel
from parity.distributed.sharded import (
    Comm,
    ParallelFaults,
    VocabShard,
    check_parity,
    sharded_kept,
    split_vocab,
)

# Hypothesis examples per property: the active profile's count, capped so the module stays well under
# a minute on two cores (each example is one multi-row job on a live process group).
EXAMPLES = min(settings().max_examples, 40)
FAULT_EXAMPLES = min(settings().max_examples, 12)
PROP = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FAULT = settings(
    max_examples=FAULT_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _close_clean(pool: VocabParallelPool) -> None:
    codes = pool.close()
    assert codes == [0] * pool.shards, f"ranks did not exit cleanly: {codes}"


@pytest.fixture(scope="module")
def pool3():
    pool = VocabParallelPool(3, timeout_s=60)
    yield pool
    _close_clean(pool)


class _FirstRanks:
    """Jobs on the first ``shards`` ranks of a bigger pool (their own subgroup): no second spawn."""

    def __init__(self, pool: VocabParallelPool, shards: int) -> None:
        self.pool, self.shards = pool, shards

    def run(self, *args, **kwargs):
        return self.pool.run(*args, shards=self.shards, **kwargs)


@pytest.fixture(scope="module")
def pool2(pool3):
    return _FirstRanks(pool3, 2)


# ---------------------------------------------------------------------------------------------
# Generated cases
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    logits: torch.Tensor
    sampled: torch.Tensor
    specs: list[SamplingSpec]
    split: list[int]
    kinds: list[str]

    @property
    def kept_ids(self) -> torch.Tensor:
        return mask_to_ids(reference_filter(self.logits, self.specs).kept)


TEMPS = [0.0, 0.3, 0.7, 1.0, 1.5]


@st.composite
def rows(draw, vocab: int, sizes: list[int], kind: str | None, scale: float | None, fault_rank: int | None):
    """One row of logits, its spec and its sampled id, with one planted structure.

    kth_tie: the k-th largest value is tied across a shard boundary (last token of one rank, first of
    the next), and the k - 1 larger values go round-robin over the ranks so every rank holds a kept
    token. top_p_tie: a group of equal maxima across a boundary with top_p < 1 cutting inside it.
    min_p_edge: a token sits at the min_p boundary up to float32 rounding. plain: grid logits (ties).
    The sampled token is then planted alone on a rank: kept and the only kept token there, or forced
    (its rank's other tokens pushed far down).
    """
    world = len(sizes)
    offsets = [sum(sizes[:r]) for r in range(world)]
    kind = kind or draw(st.sampled_from(["kth_tie", "top_p_tie", "min_p_edge", "plain"]))
    scale = scale if scale is not None else draw(st.sampled_from([0.5, 1.0, 4.0, 40.0]))
    grid = draw(st.lists(st.integers(-6, 6), min_size=vocab, max_size=vocab))
    z = torch.tensor(grid, dtype=torch.float32) * (scale / 2)
    temp = draw(st.sampled_from(TEMPS))
    top_k, top_p, min_p = 0, 1.0, 0.0
    rank_of = [r for r in range(world) for _ in range(sizes[r])]
    bounds = offsets[1:]
    planted: set[int] = set()
    if kind == "kth_tie":
        temp = temp or 1.0
        b = draw(st.sampled_from(bounds)) if fault_rank is None else offsets[fault_rank]
        if fault_rank == 0:
            b = offsets[1]
        k = draw(st.integers(world, min(world + 3, vocab - 2)))
        t = 0.0
        z = torch.clamp(z, max=t - scale / 2)
        z[b - 1] = z[b] = t
        planted |= {b - 1, b}
        for j in range(k - 1):
            r = j % world
            free = [i for i in range(offsets[r], offsets[r] + sizes[r]) if i not in planted]
            free = free or [i for i in range(vocab) if i not in planted]
            i = draw(st.sampled_from(free))
            z[i] = t + scale * (1 + draw(st.integers(0, 3))) / 2
            planted.add(i)
        top_k = k
        if fault_rank is None:
            top_p = draw(st.sampled_from([1.0, 1.0, 0.95, 0.8]))
            min_p = draw(st.sampled_from([0.0, 0.0, 0.01]))
    elif kind == "top_p_tie":
        temp = temp or 1.0
        b = draw(st.sampled_from(bounds))
        m = draw(st.integers(2, 6))
        others = draw(st.lists(st.integers(0, vocab - 1), min_size=m - 2, max_size=m - 2, unique=True))
        group = {b - 1, b, *others}
        top = float(z.max()) + scale
        z = torch.clamp(z, max=top - 3 * scale)
        for i in group:
            z[i] = top
        planted |= group
        top_p = draw(st.sampled_from([0.3, 0.5, 0.7]))
        top_k = draw(st.sampled_from([0, len(group) + 2]))
    elif kind == "min_p_edge":
        temp = temp or 1.0
        min_p = draw(st.sampled_from([0.05, 0.2]))
        z = z / max(scale, 1.0)  # keep magnitudes small so float32 lands within the band
        top = int(z.argmax())
        i = draw(st.integers(0, vocab - 1).filter(lambda j: j != top))
        z[i] = float(z[top]) + temp * math.log(min_p)
        planted |= {top, i}
        top_k = draw(st.sampled_from([0, 0, 5]))
        top_p = draw(st.sampled_from([1.0, 0.9]))
    else:
        top_k = draw(st.sampled_from([0, 0, 1, 2, 5, vocab + 3]))
        top_p = draw(st.sampled_from([1.0, 1.0, 0.9, 0.6, 0.2]))
        min_p = draw(st.sampled_from([0.0, 0.0, 0.1]))
    ykind = draw(st.sampled_from(["any", "alone_kept", "alone_forced"]))
    free_ranks = [r for r in range(world) if not any(rank_of[i] == r for i in planted)]
    if ykind != "any" and free_ranks and fault_rank is None:
        r = draw(st.sampled_from(free_ranks))
        lo, hi = offsets[r], offsets[r] + sizes[r]
        y = draw(st.integers(lo, hi - 1))
        z[lo:hi] = float(z.min()) - 8 * scale
        if ykind == "alone_kept":
            z[y] = float(z.max()) + scale  # the strict maximum: kept by every filter
    else:
        ykind = "any"
        y = draw(st.integers(0, vocab - 1))
    event(f"row kind {kind}, sampled {ykind}")
    return z, SamplingSpec(temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p), y, kind


@st.composite
def cases(
    draw,
    world: int,
    kind: str | None = None,
    scale: float | None = None,
    fault_rank: int | None = None,
    min_vocab: int = 8,
):
    vocab = draw(st.integers(max(3 * world, min_vocab), 40))
    cuts = sorted(
        draw(st.lists(st.integers(1, vocab - 1), min_size=world - 1, max_size=world - 1, unique=True))
    )
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, vocab], strict=True)]
    n = draw(st.integers(1, 4))
    out = [draw(rows(vocab, sizes, kind, scale, fault_rank)) for _ in range(n)]
    logits = torch.stack([o[0] for o in out])
    return Case(logits, torch.tensor([o[2] for o in out]), [o[1] for o in out], sizes, [o[3] for o in out])


def run_and_check(pool, case: Case, **kw):
    ids = case.kept_ids
    res = pool.run(case.logits, case.sampled, case.specs, ids, split=case.split, **kw)
    return res, check_parity(res, case.logits, case.sampled, case.specs, ids)


# ---------------------------------------------------------------------------------------------
# Parity properties
# ---------------------------------------------------------------------------------------------


@PROP
@given(case=cases(2))
def test_two_ranks_match_the_unsharded_reference(pool2, case):
    res, rep = run_and_check(pool2, case)
    assert rep.passed, rep.violations
    assert res["ranks_agree"]


@PROP
@given(case=cases(3))
def test_three_ranks_match_the_unsharded_reference(pool3, case):
    res, rep = run_and_check(pool3, case)
    assert rep.passed, rep.violations
    if bool(res["recompute_fallback"].any()):
        event("exact fallback used")


def _ranks_with_kept(kept_row: torch.Tensor, split: list[int]) -> set[int]:
    offs = [0, *torch.tensor(split).cumsum(0).tolist()]
    return {r for r in range(len(split)) if bool(kept_row[offs[r] : offs[r + 1]].any())}


def test_named_scenarios_hold_and_match(pool3):
    """Hand-built rows where each scenario is asserted on the reference before parity is checked."""
    split = [5, 4, 5]  # rank 0: ids 0-4, rank 1: 5-8, rank 2: 9-13
    low = torch.linspace(-3.0, -1.0, 14)
    r0 = low.clone()  # top_k=4: maxima on every rank, the 4th value tied across the 4|5 boundary
    r0[1], r0[7], r0[11], r0[4], r0[5] = 3.0, 2.5, 2.0, 1.0, 1.0
    r1 = low.clone()  # y=6 is kept and the only kept token of rank 1
    r1[2], r1[6], r1[12] = 3.0, 2.5, 2.0
    r2 = low.clone()  # rank 1 holds no kept token; y=7 lives there and must be force-included
    r2[2], r2[12] = 3.0, 2.0
    logits = torch.stack([r0, r1, r2])
    specs = [SamplingSpec(1.0, top_k=4), SamplingSpec(0.7, top_k=3), SamplingSpec(1.0, top_k=2)]
    y = torch.tensor([9, 6, 7])
    ref = reference_filter(logits, specs).kept
    assert ref[0, 4] and ref[0, 5] and int(ref[0].sum()) == 5, "the k-th tie across the boundary is kept"
    assert _ranks_with_kept(ref[0], split) == {0, 1, 2}
    assert _ranks_with_kept(ref[1], split) == {0, 1, 2} and ref[1, 5:9].nonzero().squeeze(1).tolist() == [1]
    assert 1 not in _ranks_with_kept(ref[2], split) and not ref[2, 7]
    ids = mask_to_ids(ref)
    res = pool3.run(logits, y, specs, ids, split=split)
    rep = check_parity(res, logits, y, specs, ids)
    assert rep.passed, rep.violations
    assert res["recompute_forced"].tolist() == [True, False, True]
    assert not bool(res["recompute_fallback"].any()), "no rounding-sensitive decision here"


def test_top_p_tie_split_takes_the_exact_fallback(pool2):
    """Equal maxima across the shard boundary, top_p cuts inside them (V > 16: the CPU sort is not
    stable, so which tied ids survive depends on the whole row)."""
    vocab, split = 24, [11, 13]
    z = torch.linspace(-6.0, -4.0, vocab)
    group = [3, 10, 11, 15, 20]
    z[group] = 2.0
    specs = [SamplingSpec(1.0, top_p=0.5)]
    ref = reference_filter(z.unsqueeze(0), specs).kept[0]
    kept_group = ref[group]
    assert 0 < int(kept_group.sum()) < len(group), "the cut falls inside the tie group"
    y = torch.tensor([0])
    ids = mask_to_ids(ref.unsqueeze(0))
    res = pool2.run(z.unsqueeze(0), y, specs, ids, split=split)
    rep = check_parity(res, z.unsqueeze(0), y, specs, ids)
    assert rep.passed, rep.violations
    assert bool(res["recompute_tie_split"][0]) and bool(res["recompute_fallback"][0])
    assert "recompute/fallback" in res["bytes_detail"], "the fallback gathered the row (and counted it)"


def test_tie_order_is_not_index_order_so_the_index_policy_fails(pool2):
    """Planted fault: resolving a split tie by id (a stable sort's answer) instead of gathering the row.

    Searches deterministic rows for one where torch's unstable sort keeps different tied ids than the
    id rule would, proving the difference is real on this build, then shows the check catches it.
    """
    g = torch.Generator().manual_seed(0)
    found = None
    for _ in range(200):
        z = torch.randint(-5, 0, (40,), generator=g).float()
        group = torch.randperm(40, generator=g)[:7]
        z[group] = 3.0
        spec = SamplingSpec(1.0, top_p=0.4)
        kept = reference_filter(z.unsqueeze(0), [spec]).kept[0]
        gk = sorted(int(i) for i in group if kept[i])
        by_index = sorted(int(i) for i in group)[len(group) - len(gk) :]  # stable: lower ids dropped first
        if 0 < len(gk) < len(group) and gk != by_index:
            found = (z, spec)
            break
    assert found is not None, "no row whose unstable tie order differs from id order (sort became stable?)"
    z, spec = found
    logits, y = z.unsqueeze(0), torch.tensor([0])
    ids = mask_to_ids(reference_filter(logits, [spec]).kept)
    res = pool2.run(logits, y, [spec], ids, split=[17, 23], tie_policy="index")
    assert bool(res["recompute_tie_split"][0]) and not bool(res["recompute_fallback"][0])
    assert not bool((res["recompute_kept"] == reference_filter(logits, [spec]).kept).all())
    rep = check_parity(res, logits, y, [spec], ids)
    assert rep.passed, "index policy: tie-split rows are exempt, and only they differ"
    res["tie_policy"] = "gather"  # judged strictly, the index answer must fail
    assert not check_parity(res, logits, y, [spec], ids).passed
    res = pool2.run(logits, y, [spec], ids, split=[17, 23])
    assert check_parity(res, logits, y, [spec], ids).passed


def test_rounding_band_rows_take_the_exact_fallback(pool2):
    """min_p boundary up to float32 rounding, and an underflow-to-zero token in a p == 1 row of a top_p
    batch: both are decided by the gathered-row reference, and both match."""
    z = torch.tensor(
        [
            [0.0, -1.0, -2.0, math.log(0.1), -4.0, -5.0, -0.5, -3.0],
            [0.0, -100.0, -200.0, -1.0, -2.0, -3.0, -150.0, -0.5],
            [0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0],
        ]
    )
    specs = [SamplingSpec(1.0, min_p=0.1), SamplingSpec(1.0), SamplingSpec(1.0, top_p=0.8)]
    ref = reference_filter(z, specs).kept
    assert not ref[1, 2], "a float32 probability of exactly 0 is dropped by cumsum <= 0"
    y = torch.tensor([3, 1, 0])
    ids = mask_to_ids(ref)
    res = pool2.run(z, y, specs, ids, split=[3, 5])
    rep = check_parity(res, z, y, specs, ids)
    assert rep.passed, rep.violations
    assert res["recompute_ambiguous"].tolist() == [True, True, False]


def test_band_policy_flag_skips_the_gather_and_flags_the_rows(pool2):
    """A min_p token at float32 log(0.3): exact arithmetic drops it, the float32 reference keeps it, so
    the rounding band is load-bearing. band_policy="flag" keeps the exact decision, moves no row and
    flags it (the check exempts it; judged strictly it fails); "gather" matches the reference."""
    edge = float(torch.tensor(math.log(0.3), dtype=torch.float32))
    z = torch.tensor(
        [[0.0, -1.0, -2.0, edge, -4.0, -5.0, -0.5, -3.0], [0.0, -1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0]]
    )
    specs = [SamplingSpec(1.0, min_p=0.3), SamplingSpec(1.0, top_k=3)]
    ref = reference_filter(z, specs).kept
    exact_keeps = edge >= math.log(float(torch.tensor(0.3, dtype=torch.float32)))
    assert bool(ref[0, 3]) and not exact_keeps, "premise: float32 and exact arithmetic disagree here"
    y = torch.tensor([3, 0])
    ids = mask_to_ids(ref)
    res = pool2.run(z, y, specs, ids, split=[3, 5], band_policy="flag")
    assert res["recompute_ambiguous"].tolist() == [True, False]
    assert not bool(res["recompute_fallback"].any()) and "recompute/fallback" not in res["bytes_detail"]
    assert not bool(res["recompute_kept"][0, 3])
    rep = check_parity(res, z, y, specs, ids)
    assert rep.passed and rep.exempt_rows == 1, rep.violations
    res["band_policy"] = "gather"
    assert not check_parity(res, z, y, specs, ids).passed
    res = pool2.run(z, y, specs, ids, split=[3, 5])
    assert bool(res["recompute_fallback"][0]) and check_parity(res, z, y, specs, ids).passed


def test_top_p_alone_widens_the_candidate_search(pool2):
    """top_p without top_k: the candidate gather starts at 64 per rank and grows until the nucleus
    boundary is provably inside it; the result still matches and moves less than the whole row."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(3, 600, generator=g) * torch.tensor([[0.5], [4.0], [4.0]])
    specs = [SamplingSpec(1.0, top_p=0.9), SamplingSpec(0.5, top_p=0.99), SamplingSpec(1.0, top_p=0.3)]
    y = torch.tensor([0, 1, 2])
    ids = mask_to_ids(reference_filter(z, specs).kept)
    res = pool2.run(z, y, specs, ids, split=[250, 350])
    rep = check_parity(res, z, y, specs, ids)
    assert rep.passed, rep.violations


# ---------------------------------------------------------------------------------------------
# Planted faults: each must make the parity check fail
# ---------------------------------------------------------------------------------------------


@FAULT
@given(case=cases(3, kind="plain", scale=40.0))
def test_planted_lse_without_max_shift_fails(pool3, case):
    """Summing exp(z') per shard with no max shift overflows float32 once z' > 88.7 (the grid reaches
    +120; one token is set to 200): full and recompute must both leave their bounds."""
    case.logits[:, 0] = 200.0  # z' >= 133 for every T <= 1.5: exp overflows float32
    res, rep = run_and_check(pool3, case, faults=ParallelFaults(lse_without_max_shift=True))
    assert not rep.passed
    assert any(v.startswith("full") for v in rep.violations), rep.violations
    assert any(v.startswith("recompute") for v in rep.violations), rep.violations


@FAULT
@given(case=cases(2, kind="kth_tie", fault_rank=1))
def test_planted_tie_drop_on_one_shard_fails(pool2, case):
    """Rank 1 keeps ``z' > kth`` instead of ``>=``: the boundary tie it owns disappears."""
    res, rep = run_and_check(pool2, case, faults=ParallelFaults(drop_kth_ties_rank=1))
    assert not rep.passed
    assert any("kept set differs" in v for v in rep.violations), rep.violations


def test_planted_drift_beyond_the_bounds_fails():
    """The checker itself: one ulp on replay, or twice the bound elsewhere, is reported."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(4, 30, generator=g) * 3
    specs = [SamplingSpec(0.8, top_k=6, top_p=0.9)] * 4
    y = torch.tensor([0, 5, 9, 29])
    ids = mask_to_ids(reference_filter(z, specs).kept)
    shard, comm = VocabShard(0, (30,)), Comm()
    from parity.distributed import sharded as P

    r = P.sharded_recompute(z, y, specs, shard, comm)
    rp = P.sharded_replay(z, y, ids, specs, shard, comm)
    res = {
        "full": P.sharded_full(z, y, specs, shard, comm),
        "replay": rp.logprobs,
        "replay_outside": rp.outside,
        "predicted_log_s": P.sharded_predicted_log_s(z, ids, specs, shard, comm),
        "recompute": r.logprobs,
        "recompute_kept": r.kept,
        "recompute_forced": r.forced,
        "recompute_fallback": r.fallback,
        "recompute_tie_split": r.tie_split,
        "tie_policy": "gather",
        "ranks_agree": True,
    }
    rep = check_parity(res, z, y, specs, ids)
    assert rep.passed, rep.violations
    for name in ("full", "recompute", "predicted_log_s"):
        bad = dict(res)
        bad[name] = res[name] + (2 * rep.max_bound[name] + 1e-5)
        assert not check_parity(bad, z, y, specs, ids).passed, name
    bad = dict(res, replay=torch.nextafter(res["replay"], torch.full_like(res["replay"], math.inf)))
    assert not check_parity(bad, z, y, specs, ids).passed
    bad = dict(res, ranks_agree=False, ranks_disagree=["full"])
    assert not check_parity(bad, z, y, specs, ids).passed


# ---------------------------------------------------------------------------------------------
# Driver, teardown, a dying rank
# ---------------------------------------------------------------------------------------------


def test_driver_spawns_runs_and_tears_down():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(6, 50, generator=g) * 3
    specs = [
        SamplingSpec(1.0, top_k=8),
        SamplingSpec(0.7, top_k=5, top_p=0.9),
        SamplingSpec(1.0, min_p=0.1),
        SamplingSpec(0.0),
        SamplingSpec(1.2, top_p=0.8),
        SamplingSpec(1.0),
    ]
    y = torch.tensor([0, 10, 20, 30, 40, 49])
    ids = mask_to_ids(reference_filter(z, specs).kept)
    res = run_vocab_parallel(z, y, specs, ids, shards=2, split=[17, 33])
    assert res["exitcodes"] == [0, 0], "every rank destroyed its process group and exited"
    rep = check_parity(res, z, y, specs, ids)
    assert rep.passed, rep.violations
    assert not bool(res["recompute_fallback"].any()), "generic logits never need the O(V) fallback"
    assert set(res["bytes_per_token"]) == {"full", "replay", "recompute", "predicted_log_s"}
    # replay moves the K kept logits plus y, one all-reduce, independent of V
    assert res["bytes_per_token"]["replay"] == {
        "payload": 4.0 * (ids.shape[1] + 1),
        "wire": 4.0 * (ids.shape[1] + 1),
        "collectives": 1,
    }


def test_a_dying_rank_raises_instead_of_hanging():
    pool = VocabParallelPool(2, timeout_s=30)
    z = torch.randn(2, 10)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died with exit code 13"):
        pool.run(z, torch.tensor([0, 1]), SamplingSpec(1.0, top_k=3), faults=ParallelFaults(die_rank=1))
    assert time.monotonic() - t0 < 25, "the parent noticed the death, not a collective timeout"
    assert pool.closed and all(c is not None for c in pool.exitcodes), "no rank left running"
    assert pool.exitcodes[1] == 13
    with pytest.raises(RankFailure, match="closed"):
        pool.run(z, torch.tensor([0, 1]), SamplingSpec(1.0))


# ---------------------------------------------------------------------------------------------
# In-process pieces (no process group)
# ---------------------------------------------------------------------------------------------


def test_split_vocab_validates():
    assert split_vocab(10, 3) == [4, 3, 3]
    assert split_vocab(10, 2, [1, 9]) == [1, 9]
    for bad in ([0, 10], [5, 4], [5, 5, 0]):
        with pytest.raises(ValueError):
            split_vocab(10, len(bad), bad)
    with pytest.raises(ValueError):
        split_vocab(2, 3)


def test_one_shard_in_process_matches_reference():
    """With no process group, Comm is a one-rank identity: the same code path, exact kept sets."""
    g = torch.Generator().manual_seed(11)
    z = (torch.randint(-6, 7, (8, 33), generator=g).float() / 2) * 3
    specs = [
        SamplingSpec(t, top_k=k, top_p=p, min_p=m)
        for t, k, p, m in [
            (1.0, 3, 1.0, 0.0),
            (0.5, 0, 0.7, 0.0),
            (1.0, 5, 0.9, 0.05),
            (0.0, 0, 1.0, 0.0),
            (1.5, 0, 1.0, 0.2),
            (0.7, 2, 0.5, 0.0),
            (1.0, 40, 1.0, 0.0),
            (1.0, 0, 1.0, 0.0),
        ]
    ]
    kept, *_ = sharded_kept(z, specs, VocabShard(0, (33,)), Comm())
    assert torch.equal(kept, reference_filter(z, specs).kept)
