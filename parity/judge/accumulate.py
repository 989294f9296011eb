"""One batch's per-token columns added into a scenario's mergeable accumulator (the map step's sums)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from parity.core.error_model import SUPPORT_MASS_TOL
from parity.core.spec import SamplingSpec
from parity.core.violation import Position
from parity.judge.accumulators import INPUTS, ScenarioAcc
from parity.judge.steps import COMPARISONS, StepAcc, grouped_headroom, grouped_streams
from parity.judge.streams import ViewMatch, finite_pair
from parity.judge.token_values import TokenColumns
from parity.records.arrays import RecordsBatch

Pairs = dict[str, tuple[np.ndarray, np.ndarray]]
# The two support equalities: input, TokenColumns flag, ScenarioAcc/StepAcc counts, first-positions key.
_SUPPORTS = (("kept", "replay_support_ok", "replay_ok", "replay_n", "replay_support"),
             ("recompute_support", "recompute_support_equal", "recompute_eq", "recompute_n",
              "recompute_support"))


@dataclass
class _Where:
    """Where a token of the batch is: its order key across files, and the :class:`Position` a violation names."""

    c: TokenColumns
    file_index: int
    row_in_file: np.ndarray
    prompt: np.ndarray
    note: str

    @classmethod
    def of(cls, rb: RecordsBatch, c: TokenColumns, file_index: int) -> _Where:
        if rb.prompt_index is not None:
            prompt = np.where(rb.prompt_index >= 0, rb.prompt_index, rb.first_row + np.arange(rb.n_rows))
            return cls(c, file_index, rb.first_row + c.row, prompt, "")
        return cls(c, file_index, rb.first_row + c.row, rb.first_row + np.arange(rb.n_rows), f"{rb.source}: prompt = row")

    def order(self, idx: np.ndarray) -> Callable[[int], tuple[int, int, int]]:
        return lambda i: (self.file_index, int(self.row_in_file[idx[i]]), int(self.c.position[idx[i]]))

    def position(self, j: int, values: Mapping[str, np.ndarray] | None = None, gap: np.ndarray | None = None,
                 bound: np.ndarray | None = None, extra: str = "") -> Position:
        c = self.c
        return Position(
            prompt=int(self.prompt[c.row[j]]), position=int(c.position[j]), token=int(c.trainer_token[j]),
            values={k: float(v[j]) for k, v in (values or {}).items()},
            gap=None if gap is None else float(gap[j]), bound=None if bound is None else float(bound[j]),
            note=extra or self.note,
        )

    def at(self, idx: np.ndarray, values: Mapping[str, np.ndarray] | None = None, gap: np.ndarray | None = None,
           bound: np.ndarray | None = None, extra: str = "") -> Callable[[int], Position]:
        return lambda i: self.position(int(idx[i]), values, gap, bound, extra)


def accumulate(acc: ScenarioAcc, rb: RecordsBatch, c: TokenColumns, rows: np.ndarray, file_index: int) -> None:
    """Add the tokens of ``rows`` (one scenario's rows of ``rb``) to ``acc``."""
    if rows.size == rb.n_rows:  # the batch is one scenario
        g = np.ones(c.row.size, dtype=bool)
    else:
        in_rows = np.zeros(rb.n_rows, dtype=bool)
        in_rows[rows] = True
        g = in_rows[c.row] if c.row.size else np.zeros(0, dtype=bool)
    acc.sequences += int(rows.size)
    acc.tokens += int(g.sum())
    # Sequences lacking each input (a row lacks it when any of its tokens does): tokens are in row order,
    # so the rows are the runs of equal row numbers.
    for k in INPUTS:
        lack = c.row[g & ~c.have[k]]
        acc.lacking[k] += int(np.count_nonzero(lack[1:] != lack[:-1])) + 1 if lack.size else 0
    usable = g & ~c.incomplete  # incomplete positions are counted, never compared
    acc.compared += int(usable.sum())
    where = _Where.of(rb, c, file_index)
    diffs, heads = _add_streams(acc, c, usable, where)
    _add_naive_bracket(acc, c, usable, where)
    acc.s_sources = sorted(set(acc.s_sources) | {c.s_source[i] or "none" for i in rows})
    _add_sums(acc, c, usable, where)
    _accumulate_steps(acc, rb, c, rows, g, usable, diffs, heads)
    _add_ratios(acc, c, usable, rb.n_rows)
    _add_flags(acc, c, g, usable, where)


def _add_streams(acc: ScenarioAcc, c: TokenColumns, usable: np.ndarray, where: _Where) -> tuple[Pairs, Pairs]:
    """The difference streams, the two-column gate and the per-token bound comparisons; returns, per
    comparison, its tokens and differences and its bounded tokens and their headroom (the per-step view)."""
    h = c.have
    diffs: Pairs = {}
    heads: Pairs = {}
    for name, sel, a, b in (
        ("naive", usable & h["full"], c.full, c.vllm),
        ("gap", usable & h["full"] & h["log_s"], c.full - c.vllm, c.log_s),
        ("replay", usable & h["replay"], c.replay, c.vllm),
        ("recompute", usable & h["recompute"], c.recompute, c.vllm),
        ("user", usable & h["user"], c.user, c.vllm),
        ("user_gap", usable & h["user"] & h["log_s"], c.user - c.vllm, c.log_s),
        # The penalties' part of the naive bias (a stream of values: b = 0).
        ("penalty", usable & h["penalty"], c.penalty, np.zeros_like(c.vllm)),
    ):
        idx = np.flatnonzero(sel)
        diffs[name] = (idx, finite_pair(a[idx], b[idx]))
        acc.streams[name].add(diffs[name][1])

    # The two log-prob columns' mean-bias gate, and the sampled tokens outside the trainer's support.
    idx = np.flatnonzero(usable & h["user"])
    outside, other = acc.ratio.add(c.user[idx], c.vllm[idx], c.row[idx], acc.facts()["allowance"])
    bad = idx[outside | other]
    acc.first["trainer_support"].offer(np.ones(bad.size, dtype=bool), where.order(bad),
                                       where.at(bad, values={"vllm": c.vllm, "trainer_under_test": c.user}))

    # The gated comparisons against the per-token bound (evaluate_summary).
    bsel = usable & h["bound"]
    # Recompute's bound adds the boundary tokens' shift where its set differs from S_q only at the cutoff: the
    # drift gate then agrees with the support gate, which counts those sets as the same filter.
    rec_bound = c.bound + c.recompute_boundary
    for name, est, side, bound in (("replay", c.replay, "trainer_replay", c.bound),
                                   ("recompute", c.recompute, "trainer_recompute", rec_bound),
                                   ("user", c.user, "trainer_under_test", c.bound)):
        idx = np.flatnonzero(bsel & h[name])
        with np.errstate(invalid="ignore"):
            d = est - c.vllm
        s = acc.bounds[name]
        key = s.add(d[idx], bound[idx], c.systematic[idx],
                    c.log_s[idx] if name == "user" and bool(h["log_s"][idx].all()) else None)
        heads[name] = (idx, key)
        s.worst.offer(key, where.order(idx), where.at(idx, values={"vllm": c.vllm, side: est}, gap=d,
                                                      bound=bound * 1.0))
    if bsel.any():
        acc.bound_n += int(bsel.sum())
        acc.bound_sum += float(c.bound[bsel].sum())
        acc.bound_max = max(acc.bound_max, float(c.bound[bsel].max()))
    return diffs, heads


def _add_naive_bracket(acc: ScenarioAcc, c: TokenColumns, usable: np.ndarray, where: _Where) -> None:
    """The naive gap against the sampler-side log S interval [s_lo, s_hi], within the two bounds."""
    h = c.have
    idx = np.flatnonzero(usable & h["full"] & h["bound"] & h["bound_full"] & h["sampler_log_s"])
    if not idx.size:
        return
    v = (c.full - c.vllm)[idx]
    gap = np.clip(c.s_lo[idx] - v, 0.0, None) + np.clip(v - c.s_hi[idx], 0.0, None)  # the distance outside [s_lo, s_hi]
    nb = c.bound_full[idx] + c.bound[idx]
    s = acc.bounds["naive"]
    key = s.add(gap, nb)
    gap_all, nb_all = np.zeros(c.row.size), np.zeros(c.row.size)
    gap_all[idx], nb_all[idx] = gap, nb
    s.worst.offer(key, where.order(idx), where.at(idx, values={"vllm": c.vllm, "trainer_full": c.full,
                                                               "sampler_log_s_lo": c.s_lo, "sampler_log_s_hi": c.s_hi},
                                                  gap=gap_all, bound=nb_all))
    acc.s_n += int(idx.size)
    acc.s_lo_sum += float(c.s_lo[idx].sum())
    acc.s_hi_sum += float(c.s_hi[idx].sum())
    acc.naive_gap_max = max(acc.naive_gap_max, float(gap.max()))


def _add_sums(acc: ScenarioAcc, c: TokenColumns, usable: np.ndarray, where: _Where) -> None:
    """The trainer-under-test diagnosis, the logit drift, log S and the support counts."""
    h = c.have
    # The diagnosis of a trainer under test: which reference view it matches within the bound.
    usel = usable & h["user"] & h["bound"]
    if usel.any():
        for bugs, view in c.views.items():
            known = usel & ~np.isnan(view)
            d = np.abs(finite_pair(c.user[known], view[known]))
            m = acc.views.setdefault("+".join(sorted(bugs)), ViewMatch())
            m.known += int(known.sum())
            m.over += int((~(d <= c.bound[known])).sum())
            with np.errstate(invalid="ignore"):
                diff = c.user[known] - view[known]
            m.diff_sum += float(np.where(np.isfinite(diff), diff, 0.0).sum())
    dsel = usable & c.captured & ~np.isnan(c.logit_drift) & h["replay"]
    if dsel.any():
        acc.drift_n += int(dsel.sum())
        acc.drift_sum += float(c.logit_drift[dsel].sum())
        acc.drift_max = max(acc.drift_max, float(c.logit_drift[dsel].max()))
        acc.drift_replay_max = max(acc.drift_replay_max, float(np.abs(c.replay[dsel] - c.vllm[dsel]).max()))
    ls_sel = usable & h["log_s"]
    if ls_sel.any():
        v = c.log_s[ls_sel]
        acc.log_s_n += int(v.size)
        acc.log_s_sum += float(v.sum())
        acc.log_s_min = min(acc.log_s_min, float(v.min()))
        acc.log_s_sum_exp += float(np.exp(v).sum())
    for sel, flag, ok_field, n_field, gate in _SUPPORTS:
        idx = np.flatnonzero(usable & h[sel])
        ok = getattr(c, flag)
        setattr(acc, ok_field, getattr(acc, ok_field) + int(ok[idx].sum()))
        setattr(acc, n_field, getattr(acc, n_field) + int(idx.size))
        acc.first[gate].offer(~ok[idx], where.order(idx), where.at(idx))
    acc.forced += int(c.forced[usable & h["forced"]].sum())
    _add_support_sides(acc, c, usable)


def _add_support_sides(acc: ScenarioAcc, c: TokenColumns, usable: np.ndarray) -> None:
    """Where S_q holds ties at the k-th value (|S_q| > top_k: vLLM keeps every token tied with the k-th), and where
    recompute's set is smaller or larger than S_q while not equal to it (a one-sided difference, not a moved cutoff)."""
    spec = SamplingSpec.from_dict(acc.spec).effective()
    proven = usable & c.captured & ~c.incomplete
    ties = proven & (c.support_size > spec.top_k) if spec.uses_top_k else np.zeros_like(proven)
    acc.ties_at_k += int(ties.sum())
    known = usable & c.have["recompute_support"] & (c.recompute_support_size >= 0) & c.captured & ~c.incomplete
    acc.recompute_sized += int(known.sum())
    differ = known & ~c.recompute_support_equal
    smaller = differ & (c.recompute_support_size < c.support_size)
    acc.recompute_smaller += int(smaller.sum())
    acc.recompute_larger += int((differ & (c.recompute_support_size > c.support_size)).sum())
    acc.ties_dropped += int((ties & known & (c.recompute_support_size < c.support_size)).sum())


def _add_ratios(acc: ScenarioAcc, c: TokenColumns, usable: np.ndarray, n_rows: int) -> None:
    """IS ratios: per token, and per sequence over its compared tokens."""
    h = c.have
    for name, est, inp in (("naive", c.full, "full"), ("replay", c.replay, "replay"),
                           ("recompute", c.recompute, "recompute"), ("user", c.user, "user")):
        sel = usable & h[inp]
        d = est[sel] - c.vllm[sel]
        r = c.row[sel]
        n_r = np.bincount(r, minlength=n_rows)
        seq = np.bincount(r, weights=d, minlength=n_rows)
        keep = n_r > 0
        seq_ls = None
        if name == "naive" and bool((sel & ~h["log_s"]).sum() == 0):  # the naive ratio's log S identity
            seq_ls = np.bincount(r, weights=c.log_s[sel], minlength=n_rows)[keep]
        acc.ratios[name].add(d, seq[keep], seq_ls)


def _add_flags(acc: ScenarioAcc, c: TokenColumns, g: np.ndarray, usable: np.ndarray, where: _Where) -> None:
    """KL/TV over S_q, the flagged positions (incomplete, sampled outside, token mismatch), the kept sets."""
    kls = usable & c.captured & c.have["kl"]
    if kls.any():
        acc.kl_n += int(kls.sum())
        acc.kl_sum += float(c.kl[kls].sum())
        acc.kl_max = max(acc.kl_max, float(c.kl[kls].max()))
        acc.tv_sum += float(c.tv[kls].sum())
        acc.tv_max = max(acc.tv_max, float(c.tv[kls].max()))
    gi = np.flatnonzero(g)
    for flag in ("incomplete", "sampled_outside"):
        setattr(acc, flag, getattr(acc, flag) + int(getattr(c, flag)[g].sum()))
        acc.first[flag].offer(getattr(c, flag)[gi], where.order(gi), where.at(gi))
    mism = c.trainer_token != c.token
    acc.token_mismatch += int(mism[g].sum())
    first = acc.first["token_mismatch"]
    for j in gi[mism[gi]][: acc.n_listed]:
        first.items.append(((where.file_index, int(where.row_in_file[j]), int(c.position[j])),
                            where.position(int(j), extra=f"sampled {int(c.token[j])}")))
    first.merge(type(first)(acc.n_listed))
    cap = g & c.captured
    acc.captured += int(cap.sum())
    if cap.any():
        acc.support_sum += int(c.support_size[cap].sum())
        acc.support_max = max(acc.support_max, int(c.support_size[cap].max()))
    off = cap & ~c.incomplete & (np.abs(c.mass - 1.0) > SUPPORT_MASS_TOL)
    if off.any():
        acc.mass_off += int(off.sum())
        worst = c.mass[off][int(np.argmax(np.abs(c.mass[off] - 1.0)))]
        if abs(worst - 1.0) > abs(acc.mass_off_worst - 1.0):
            acc.mass_off_worst = float(worst)


def _accumulate_steps(
    acc: ScenarioAcc, rb: RecordsBatch, c: TokenColumns, rows: np.ndarray, g: np.ndarray, usable: np.ndarray,
    diffs: Mapping[str, tuple[np.ndarray, np.ndarray]], heads: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """The training-log view of one scenario's rows: per step (``rb.step``), the comparisons' sums and
    headroom over the same tokens as the scenario's streams, and the support counts."""
    step_of_row = rb.step if rb.step is not None else np.full(rb.n_rows, -1, dtype=np.int64)
    stepped = rows[step_of_row[rows] >= 0]  # a null step reads as -1; a negative step is no step
    acc.unstepped += int(rows.size - stepped.size)
    if not stepped.size:
        return
    steps, row_slot = np.unique(step_of_row[stepped], return_inverse=True)
    ns = int(steps.size)
    slot_of_row = np.full(rb.n_rows, -1, dtype=np.int64)
    slot_of_row[stepped] = row_slot.reshape(-1)
    tok_slot = slot_of_row[c.row] if c.row.size else np.zeros(0, dtype=np.int64)

    def slots(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sl = tok_slot[idx]
        keep = sl >= 0
        return sl[keep], keep

    seqs = np.bincount(row_slot.reshape(-1), minlength=ns)
    toks = np.bincount(tok_slot[g & (tok_slot >= 0)], minlength=ns)
    parts = [StepAcc(sequences=int(seqs[i]), tokens=int(toks[i])) for i in range(ns)]
    for name in COMPARISONS:
        idx, d = diffs[name]
        sl, keep = slots(idx)
        for i, s in enumerate(grouped_streams(sl, ns, d[keep])):
            parts[i].streams[name] = s
        hidx, key = heads[name]
        sl, keep = slots(hidx)
        count, top = grouped_headroom(sl, ns, key[keep])
        for i in range(ns):
            parts[i].streams[name].head_n, parts[i].streams[name].headroom = int(count[i]), float(top[i])
    for sel, flag, ok_field, n_field, _ in _SUPPORTS:
        idx = np.flatnonzero(usable & c.have[sel])
        sl, keep = slots(idx)
        ok = np.bincount(sl, weights=getattr(c, flag)[idx][keep].astype(np.float64), minlength=ns)
        n = np.bincount(sl, minlength=ns)
        for i in range(ns):
            setattr(parts[i], ok_field, int(round(ok[i])))
            setattr(parts[i], n_field, int(n[i]))
    for i, step in enumerate(steps):
        acc.steps.setdefault(int(step), StepAcc()).merge(parts[i])
