"""The token table pinned column by column, each planted trainer fault where it lands, and the summary's wiring.

Records are made as the engine adapter makes them, from the reference filters on known logits; every
column is checked against its definition (the estimator or bound it comes from, by name), so a column
fed from the wrong source, a dropped shift or a swapped key shows.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from judged import judged

from parity.core import estimators as E
from parity.core.error_model import (
    KERNEL_SIDES,
    SUPPORT_MASS_TOL,
    logprob_bound,
    normalisation_errors,
    unit_roundoff,
)
from parity.core.filters import reference_filter
from parity.core.log_s import top_p_bracket
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec as S
from parity.core.token_table import TrainerFaults, build_table
from parity.judge.scenario import rl_view
from parity.judge.token_columns import token_columns
from parity.records.convert import from_sequence_records
from parity.records.validate import validate_batch

V = 6
NAN = math.nan


def logits(seed: int, n: int = 4, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * scale


def record(z: torch.Tensor, spec: S, y: list[int], i: int = 0, extras: dict | None = None,
           incomplete: torch.Tensor | None = None) -> SequenceRecord:
    ref = reference_filter(z, spec)
    yt = torch.tensor(y)
    kept = lp = None
    if spec.effective().filtered:
        kept = E.mask_to_ids(ref.kept)
        lp = ref.logprobs.gather(1, kept.clamp(min=0)).masked_fill(kept < 0, -math.inf)
    return SequenceRecord("sampler", i, [1], y, spec, i, ref.logprobs.gather(1, yt.unsqueeze(1)).squeeze(1),
                          kept_ids=kept, kept_logprobs=lp, incomplete=incomplete, extras=extras or {})


SPEC = S(0.7, top_k=3)


def one(spec: S = SPEC, seed: int = 0, y: list[int] | None = None, faults: TrainerFaults | None = None, **kw):
    z = logits(seed)
    y = y or reference_filter(z, spec).logprobs.argmax(dim=-1).tolist()
    r = record(z, spec, y, **kw)
    return z, r, build_table([r], [z], spec, faults=faults)


def columns(records, table):
    """What the kept sets give (size, mass, KL / TV, drift, the support flags), as the verdict reads them: from the
    records ``parity run`` writes for ``table`` (parity.judge.token_values, their one derivation)."""
    export = from_sequence_records(records, scenario="pinned", table=table)
    return token_columns(validate_batch(export, source="pinned", signs=False), vocab_size=V)


def test_every_column_of_a_filtered_record() -> None:
    z, r, t = one(y=None)
    y = torch.tensor(r.completion_ids)
    zs = E.scale(z, SPEC)
    mask = E.ids_to_mask(r.kept_ids, V)
    assert t.tokens == 4 and t.seq_lengths == [4] and t.roundoff == 2.0**-24 and t.s_source == "none"
    assert t.prompt_index.tolist() == [0] * 4 and t.position.tolist() == [0, 1, 2, 3]
    assert t.token.tolist() == y.tolist() and t.sampled.tolist() == y.tolist()
    assert torch.equal(t.vllm, r.logprobs.double())
    assert torch.equal(t.full, E.full(z, y, SPEC).double())
    assert torch.equal(t.replay, E.replay(z, y, r.kept_ids, SPEC).logprobs.double())
    assert torch.equal(t.recompute, E.recompute(z, y, SPEC).logprobs.double())
    assert torch.equal(t.log_s, E.predicted_log_s(z, r.kept_ids, SPEC).double())
    assert t.forced.tolist() == [False] * 4 and t.incomplete.tolist() == [False] * 4
    assert t.recompute_support_equal.tolist() == [True] * 4
    c = columns([r], t)
    assert c.captured.tolist() == [True] * 4 and c.sampled_outside.tolist() == [False] * 4
    assert c.replay_support_ok.tolist() == [True] * 4 and c.support_size.tolist() == [3] * 4
    assert torch.equal(t.bound, logprob_bound(zs, y, mask))
    assert torch.equal(t.bound_full, logprob_bound(zs, y, None))
    assert bool((t.bound < t.bound_full).all())
    assert bool(t.s_lo.isnan().all()) and bool(t.s_hi.isnan().all())
    assert abs(c.kl).max() < 1e-6 and abs(c.tv).max() < 1e-6 and abs(c.logit_drift).max() < 1e-5
    assert t.vllm.dtype == t.full.dtype == t.replay.dtype == t.recompute.dtype == t.log_s.dtype == torch.float64
    assert t.user is None and t.user_name is None


def test_kl_tv_and_logit_drift_of_a_trainer_with_other_logits() -> None:
    z = logits(1)
    spec = S(1.0, top_k=3)
    y = reference_filter(z, spec).logprobs.argmax(dim=-1).tolist()
    r = record(z, spec, y)
    moved = z.clone()
    moved[:, :] += torch.arange(V) * 0.01  # logit drift across the kept set
    c = columns([r], build_table([r], [moved], spec))
    # An independent float64 computation, position by position, in plain Python.
    for i in range(4):
        sampler_lp = [float(v) for v in r.kept_logprobs[i].double()]
        vals = [float(moved[i, j]) for j in r.kept_ids[i].tolist()]
        lse = math.log(math.fsum(math.exp(v) for v in vals))
        t_lp = [v - lse for v in vals]
        kl = math.fsum(math.exp(a) * (a - b) for a, b in zip(sampler_lp, t_lp, strict=True))
        tv = 0.5 * math.fsum(abs(math.exp(a) - math.exp(b)) for a, b in zip(sampler_lp, t_lp, strict=True))
        e = [a - b for a, b in zip(sampler_lp, t_lp, strict=True)]
        assert c.kl[i] == pytest.approx(kl, abs=1e-9) and c.tv[i] == pytest.approx(tv, abs=1e-9)
        assert c.logit_drift[i] == pytest.approx(max(e) - min(e), abs=1e-6)
        # Over one support the normalisation cancels: the drift is the spread of the logits' own shift.
        spread = [float(moved[i, j] - z[i, j]) for j in r.kept_ids[i].tolist()]
        assert c.logit_drift[i] == pytest.approx(max(spread) - min(spread), abs=1e-5)


def test_an_unfiltered_record() -> None:
    spec = S(0.7)
    z = logits(2)
    y = [0, 1, 2, 3]
    r = record(z, spec, y)
    t = build_table([r], [z], spec)
    zs = E.scale(z, spec)
    assert torch.equal(t.replay, t.full) and torch.equal(t.full, E.full(z, torch.tensor(y), spec).double())
    assert t.log_s.tolist() == [0.0] * 4 and t.incomplete.tolist() == [False] * 4
    assert t.recompute_support_equal.tolist() == [True] * 4
    c = columns([r], t)
    assert c.captured.tolist() == [False] * 4 and c.sampled_outside.tolist() == [False] * 4
    assert c.replay_support_ok.tolist() == [True] * 4 and c.kl.tolist() == [0.0] * 4 and c.tv.tolist() == [0.0] * 4
    assert bool(np.isnan(c.logit_drift).all())
    assert torch.equal(t.bound, logprob_bound(zs, torch.tensor(y), None)) and torch.equal(t.bound_full, t.bound)
    assert t.s_lo.tolist() == [0.0] * 4 and t.s_hi.tolist() == [0.0] * 4 and t.s_source == "unfiltered"


def test_the_sampler_log_s_sources() -> None:
    z = logits(3)
    topp = S(1.0, top_p=0.8)
    y = reference_filter(z, topp).logprobs.argmax(dim=-1).tolist()
    r = record(z, topp, y)
    t = build_table([r], [z], topp)
    lo, hi = top_p_bracket(r.kept_logprobs, 0.8, V)
    assert t.s_source == "top_p_bracket" and torch.equal(t.s_lo, lo) and torch.equal(t.s_hi, hi)
    given = torch.tensor([-0.1, -0.2, -0.3, -0.4], dtype=torch.float32)
    raw = record(z, topp, y, extras={"sampler_log_s": given})
    t = build_table([raw], [z], topp)
    assert t.s_source == "raw_logits" and torch.equal(t.s_lo, given.double()) and torch.equal(t.s_hi, given.double())
    inc = record(z, topp, y, incomplete=torch.tensor([False, True, False, False]))
    t = build_table([inc], [z], topp)
    assert t.s_source == "none" and bool(t.s_lo.isnan().all())
    assert build_table([r, raw], [z, z], topp).s_source == "mixed"
    # top_k and top_p together: no bracket, no raw logits -> none; raw logits still count.
    both = S(1.0, top_k=3, top_p=0.8)
    yb = reference_filter(z, both).logprobs.argmax(dim=-1).tolist()
    assert build_table([record(z, both, yb)], [z], both).s_source == "none"
    clean = record(z, topp, y, incomplete=torch.zeros(4, dtype=torch.bool))
    assert build_table([clean], [z], topp).s_source == "top_p_bracket"


def test_no_records_give_an_empty_table() -> None:
    t = build_table([], [], SPEC)
    assert t.tokens == 0 and t.seq_lengths == [] and t.s_source == "none" and t.roundoff == 2.0**-24
    assert build_table([], [], SPEC, dtype="bfloat16").roundoff == 2.0**-8


def test_the_looser_dtype_is_the_roundoff_and_the_bound() -> None:
    z, r, t32 = one()
    t = build_table([r], [z], SPEC, dtype=("float32", "bfloat16"))
    assert t.roundoff == unit_roundoff("bfloat16")
    # The rounding terms scale with the roundoff; the float32 normalisation's bound does not.
    zs = E.scale(z, SPEC)
    kept = E.ids_to_mask(r.kept_ids, V)
    off = KERNEL_SIDES * normalisation_errors(zs, kept)["bound"]
    assert (t.bound - off).tolist() == pytest.approx(((t32.bound - off) * 2.0**16).tolist(), rel=1e-9)


def test_build_table_messages() -> None:
    z, r, _ = one()
    with pytest.raises(ValueError) as info:
        build_table([r], [z, z], SPEC)
    assert str(info.value) == "1 sampler records but 2 trainer logit tensors"
    with pytest.raises(ValueError) as info:
        build_table([r], [z[:3]], SPEC)
    assert str(info.value) == f"trainer logits for prompt 0 have shape (3, {V}), allowed (4, {V})"


def test_two_records_are_laid_out_in_order() -> None:
    z0, z1 = logits(4, n=3), logits(5, n=2)
    r0 = record(z0, SPEC, reference_filter(z0, SPEC).logprobs.argmax(-1).tolist(), i=0)
    r1 = record(z1, SPEC, reference_filter(z1, SPEC).logprobs.argmax(-1).tolist(), i=7)
    t = build_table([r0, r1], [z0, z1], SPEC)
    assert t.prompt_index.tolist() == [0, 0, 0, 7, 7] and t.position.tolist() == [0, 1, 2, 0, 1]
    assert t.seq_lengths == [3, 2]
    sub = t.select(torch.tensor([True, False, True, False, True]))
    assert sub.position.tolist() == [0, 2, 1] and sub.seq_lengths == [2, 1] and sub.roundoff == t.roundoff
    none = t.select(torch.zeros(5, dtype=torch.bool))
    assert none.tokens == 0 and none.seq_lengths == []


# -- planted trainer faults -----------------------------------------------------------------------


def test_perturb_logits_moves_the_middle_token_only() -> None:
    z, r, clean = one()
    _, _, t = one(faults=TrainerFaults(perturb_logits=0.5))
    changed = (t.full != clean.full).nonzero().flatten().tolist()
    assert changed == [2]
    assert float(t.full[2]) > float(clean.full[2]) and float(t.replay[2]) > float(clean.replay[2])
    assert torch.equal(t.vllm, clean.vllm)


def test_forget_temperature_scores_at_t_equal_one() -> None:
    z, r, _ = one()
    t = build_table([r], [z], SPEC, faults=TrainerFaults(forget_temperature=True))
    y = torch.tensor(r.completion_ids)
    assert torch.equal(t.full, E.full(z, y, S(1.0, top_k=3)).double())
    greedy = S(0.0)
    rg = record(z, greedy, [0, 1, 2, 3])
    tg = build_table([rg], [z], greedy, faults=TrainerFaults(forget_temperature=True))
    assert torch.equal(tg.full, E.full(z, torch.tensor([0, 1, 2, 3]), greedy).double())


def test_swap_token_changes_the_scored_token_not_the_sampled_one() -> None:
    z, r, _ = one()
    t = build_table([r], [z], SPEC, faults=TrainerFaults(swap_token=True))
    y = r.completion_ids
    assert t.token.tolist() == [y[0], y[1], (y[2] + 1) % V, y[3]] and t.sampled.tolist() == y
    assert judged([r], [z], t)["token_mismatch"] == 1


def test_drop_kept_removes_one_non_sampled_token_at_the_middle() -> None:
    z, r, clean = one()
    t = build_table([r], [z], SPEC, faults=TrainerFaults(drop_kept=True))
    c = columns([r], t)
    assert c.support_size.tolist() == [3, 3, 2, 3]
    assert c.replay_support_ok.tolist() == [True, True, False, True]
    assert float(t.replay[2]) > float(clean.replay[2])  # renormalised over less mass
    assert torch.equal(r.kept_ids, record(z, SPEC, r.completion_ids).kept_ids), "the record is not modified"


def test_drop_kept_mass_drops_the_token_nearest_that_mass() -> None:
    z, r, clean = one()
    p = r.kept_logprobs[2].double().exp()
    y2 = r.completion_ids[2]
    others = [(abs(float(p[j]) - 0.2), int(r.kept_ids[2, j])) for j in range(3) if int(r.kept_ids[2, j]) != y2]
    victim = min(others)[1]
    t = build_table([r], [z], SPEC, faults=TrainerFaults(drop_kept_mass=0.2))
    c = columns([r], t)
    assert c.support_size.tolist() == [3, 3, 2, 3] and c.replay_support_ok.tolist() == [True, True, False, True]
    kept_mass = float(p[(r.kept_ids[2] != victim)].sum())
    assert float(t.replay[2]) == pytest.approx(float(clean.replay[2]) - math.log(kept_mass), abs=1e-5)


def test_shift_bounds_and_bias_logprob_shift_by_what_they_say() -> None:
    z, r, clean = one()
    t = build_table([r], [z], SPEC, faults=TrainerFaults(shift_bounds=3.0))
    d = (t.replay - clean.replay).tolist()
    assert d[:2] == [0.0, 0.0] and d[3] == 0.0 and d[2] == pytest.approx(3.0 * float(clean.bound[2]), rel=1e-9)
    assert float(t.recompute[2] - clean.recompute[2]) == pytest.approx(3.0 * float(clean.bound[2]), rel=1e-9)
    naive = float(clean.bound[2] + clean.bound_full[2])
    assert float(t.full[2] - clean.full[2]) == pytest.approx(3.0 * naive, rel=1e-9)
    b = build_table([r], [z], SPEC, faults=TrainerFaults(bias_logprob=0.125))
    for col in ("full", "replay", "recompute"):
        assert (getattr(b, col) - getattr(clean, col)).tolist() == pytest.approx([0.125] * 4, abs=1e-12)
    spec = S(0.7)
    ru = record(z, spec, [0, 1, 2, 3])
    cu = build_table([ru], [z], spec)
    tu = build_table([ru], [z], spec, faults=TrainerFaults(shift_bounds=2.0))
    assert float(tu.replay[2] - cu.replay[2]) == pytest.approx(2.0 * float(cu.bound[2]), rel=1e-9)
    assert float(tu.full[2] - cu.full[2]) == pytest.approx(2.0 * float(cu.bound[2]), rel=1e-9)


def test_move_boundary_every_counts_positions_across_the_batch() -> None:
    z0, z1 = logits(6, n=3), logits(7, n=3)
    y0 = reference_filter(z0, SPEC).logprobs.argmax(-1).tolist()
    y1 = reference_filter(z1, SPEC).logprobs.argmax(-1).tolist()
    rs = [record(z0, SPEC, y0, i=0), record(z1, SPEC, y1, i=1)]
    t = build_table(rs, [z0, z1], SPEC, faults=TrainerFaults(move_boundary_every=2))
    # positions 0, 2 (record 0) and 4 -> record 1 position 1: the best outside token reaches the row max
    assert t.recompute_support_equal.tolist() == [False, True, False, True, False, True]
    assert t.forced.tolist() == [False] * 6


# -- the pieces ------------------------------------------------------------------------------------


def test_a_capture_missing_mass_fails_replay_support_within_the_tolerance() -> None:
    z, r, _ = one()
    lp = r.kept_logprobs.clone().double()
    lp[1, 0] += math.log1p(-3 * SUPPORT_MASS_TOL / float(lp[1, 0].exp()))  # mass short by 3x the tolerance
    lp[2, 0] += math.log1p(-0.1 * SUPPORT_MASS_TOL / float(lp[2, 0].exp()))  # a tenth: rounding
    r.kept_logprobs = lp.float()
    assert columns([r], build_table([r], [z], SPEC)).replay_support_ok.tolist() == [True, False, True, True]


def test_a_sampled_token_outside_the_kept_ids_is_flagged_off_incomplete_positions_only() -> None:
    z = logits(0)
    y = reference_filter(z, SPEC).logprobs.argmax(dim=-1).tolist()
    r = record(z, SPEC, y, incomplete=torch.tensor([False, True, False, False]))
    for i in (0, 1):  # the engine kept another token in place of the one it sampled
        j = int((r.kept_ids[i] == y[i]).nonzero()[0, 0])
        r.kept_ids[i, j] = next(v for v in range(V) if v not in r.kept_ids[i].tolist())
    t = build_table([r], [z], SPEC)
    c = columns([r], t)
    assert c.sampled_outside.tolist() == [True, False, False, False]
    assert c.replay_support_ok.tolist() == [False, False, True, True]
    assert t.incomplete.tolist() == [False, True, False, False]


# -- the summary ----------------------------------------------------------------------------------


def test_the_error_model_numbers_of_a_judged_table_by_hand() -> None:
    """The table's columns go to the records and come back as the report's headroom, limits and means."""
    from parity.core.error_model import mean_bias_limit

    z, r, t = one()
    t.replay = t.vllm + torch.tensor([1e-7, -4e-7, 0.0, 2e-7], dtype=torch.float64)
    t.recompute = t.vllm + torch.tensor([0.0, 0.0, 3e-7, 0.0], dtype=torch.float64)
    t.bound = torch.tensor([1e-7, 1e-7, 1e-7, 2e-7], dtype=torch.float64)
    s = judged([r], [z], t)
    assert s["headroom"]["replay"] == pytest.approx(4.0) and s["headroom"]["recompute"] == pytest.approx(3.0)
    assert s["bound"] == {"max": 2e-7, "mean": pytest.approx(float(t.bound.mean())), "roundoff": 2.0**-24}
    sys_mean = float(t.systematic.mean())
    assert s["mean_bias_limit"]["replay"] == pytest.approx(mean_bias_limit(4, sys_mean, float((t.replay - t.vllm).std())))
    assert s["mean_bias_limit"]["recompute"] == pytest.approx(
        mean_bias_limit(4, sys_mean, float((t.recompute - t.vllm).std())))
    assert s["mean_bias_limit"]["replay"] != s["mean_bias_limit"]["recompute"]
    assert s["mean_bias"]["replay"]["limit"] == s["mean_bias_limit"]["replay"]
    assert s["mean_bias"]["replay"]["mean"] == pytest.approx(float((t.replay - t.vllm).mean()))
    assert {v.gate for v in s["violations"]} == {"replay_drift", "recompute_drift"}


def test_the_trainer_under_test_in_a_judged_table() -> None:
    from parity.core.error_model import mean_bias_limit

    z, r, t = one()
    t.user = t.vllm + torch.tensor([0.0, -0.5, 0.0, 0.0], dtype=torch.float64)  # a log-prob stays <= 0
    t.user_name = "mine"
    s = judged([r], [z], t)
    d = t.user - t.vllm
    assert s["trainer_under_test"]["name"] == "mine"
    assert s["trainer_under_test"]["max_abs_diff"] == pytest.approx(0.5)
    assert s["trainer_under_test"]["mean_diff"] == pytest.approx(float(d.mean()))
    assert s["headroom"]["trainer_under_test"] == pytest.approx(0.5 / float(t.bound[1]))
    # The trainer is held to replay's spread, not its own: a noisy trainer gets no wider limit.
    want = mean_bias_limit(t.tokens, float(t.systematic.mean()), float((t.replay - t.vllm).std()))
    assert s["mean_bias_limit"]["trainer_under_test"] == pytest.approx(want)
    assert want < mean_bias_limit(t.tokens, float(t.systematic.mean()), float(d.std()))
    assert {v.gate for v in s["violations"]} == {"trainer_under_test_drift", "trainer_under_test_mean_bias"}
    assert list(rl_view(t)) == ["naive", "replay", "recompute", "trainer_under_test"]
