"""Trainer-side log-prob estimators on ``[N, V]`` logits and the sampled ids ``[N]``.

* ``full``: ``log_softmax(z / T)[y]`` over the whole vocabulary. This is the biased baseline most RL
  trainers use; under top_k/top_p/min_p it differs from the sampler's processed log-prob by log S.
* ``recompute``: run the reference filters on the trainer's own logits, force-include the sampled
  token (numerics can move the boundary), renormalise over that set.
* ``replay``: renormalise the trainer's logits over the kept set S_q captured from the sampler.
* ``predicted_log_s``: ``logsumexp(z'_{S_q}) - logsumexp(z')``, the bias the trainer should expect.

All functions are pure torch. Kept sets come either as a dense bool mask ``[N, V]`` or as padded id
lists ``[N, K]`` (``-1`` = padding); the id form is what capture produces and lets ``replay`` read K
values per row instead of V.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from parity.core import kernels, nucleus, tolerances
from parity.core.filters import (
    FilterFaults,
    apply_temperature,
    check_logits,
    min_p_decide,
    min_p_mask,
    reference_filter,
    temperatures,
    top_k_top_p_sorted,
)
from parity.core.spec import SamplingSpec, per_row

NEG_INF = float("-inf")



def _check_ids(sampled: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    if sampled.dim() != 1 or sampled.shape[0] != logits.shape[0]:
        raise ValueError(
            f"sampled has shape {tuple(sampled.shape)}: allowed a 1-D tensor of {logits.shape[0]} token ids"
        )
    if sampled.numel() and (int(sampled.min()) < 0 or int(sampled.max()) >= logits.shape[1]):
        raise ValueError(f"sampled ids must lie in [0, {logits.shape[1]}): got min {int(sampled.min())}, max {int(sampled.max())}")
    return sampled.long()


def scale(logits: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec]) -> torch.Tensor:
    """z / T as the sampler computes it (greedy rows use T = 1)."""
    logits = check_logits(logits).to(torch.float32)
    return apply_temperature(logits, per_row(specs, logits.shape[0]))


def full(logits: torch.Tensor, sampled: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec]) -> torch.Tensor:
    """Full-vocabulary ``log_softmax(z / T)[y]``: the biased baseline."""
    z = scale(logits, specs)
    y = _check_ids(sampled, z)
    return torch.log_softmax(z, dim=-1).gather(1, y.unsqueeze(1)).squeeze(1)


@dataclass
class RecomputeResult:
    logprobs: torch.Tensor  # [N] log-prob of the sampled token over S_p ∪ {y}
    kept: torch.Tensor  # bool [N, V]: the recomputed support S_p (before force-include)
    forced: torch.Tensor  # bool [N]: y was outside S_p and had to be force-included
    # bool [N]: a fast path (top_k candidates, the nucleus select) could not decide the row exactly
    # (rounding band, split tie, too wide a bracket), so it was sorted: by the reference sort, or on the
    # nucleus path by the reference's float32 ops on its sorted values; or a top_k row whose min_p had a
    # candidate in the min_p band took the reference's min_p softmax; all False where no fast path ran
    fallback: torch.Tensor | None = None
    # bool [N]: band_policy="decide" only: nucleus rows cut by the exact float64 cumulative mass inside the
    # rounding band, without the reference's float32 rounding (so possibly not its kept set); None otherwise
    decided: torch.Tensor | None = None

    @property
    def decided_count(self) -> int:
        return 0 if self.decided is None else int(self.decided.sum())

    @property
    def forced_count(self) -> int:
        return int(self.forced.sum())

    @property
    def fallback_count(self) -> int:
        return 0 if self.fallback is None else int(self.fallback.sum())


def recompute(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
    *,
    force_include: bool = True,
    faults: FilterFaults | None = None,
    band_policy: str = "reference",
) -> RecomputeResult:
    """Reference filters on trainer logits → S_p; ``z'_y - logsumexp(z'_{S_p ∪ {y}})``.

    S_p is exactly the kept set of :func:`parity.core.filters.reference_filter` (ties included), but rows
    with top_k set are filtered over their ``topk(k)`` candidates instead of a full-row sort (see
    :func:`_kept_bounded`); the renormalisation then reads the kept ids, not the whole row. Rows
    without top_k take the histogram select of :func:`parity.core.nucleus.nucleus_cut` (CPU) under top_p, and
    the kept mass either way (:mod:`parity.core.nucleus`). Rows a fast path cannot decide exactly run the
    reference sort (counted in ``fallback``); so do planted ``faults``.

    ``band_policy`` is :func:`parity.core.nucleus.nucleus_cut`'s: ``"reference"`` (default) keeps the
    reference's kept set on every row; ``"decide"`` cuts the nucleus rows whose boundary lies in the
    rounding band by the exact float64 mass instead of sorting them, and counts them in ``decided``.

    With ``force_include=False`` (only for negative controls) a sampled token outside S_p scores
    ``-inf``, which is what a trainer that recomputes filters naively gets.
    """
    if band_policy not in nucleus.BAND_POLICIES:
        raise ValueError(f"band_policy is {band_policy!r}: allowed one of {', '.join(map(repr, nucleus.BAND_POLICIES))}")
    if faults is not None and faults != FilterFaults():
        return _undecided(_recompute_reference(logits, sampled, specs, force_include=force_include, faults=faults), band_policy)
    logits = check_logits(logits)
    row_specs = per_row(specs, logits.shape[0])
    z: torch.Tensor | nucleus.Scaled
    if _reads_scaled(logits, row_specs):  # z' read where needed (parity.core.nucleus.Scaled): no [N, V] z / T
        z = nucleus.Scaled(logits, temperatures(row_specs, torch.float32, logits.device))
    else:
        z = apply_temperature(logits.to(torch.float32), row_specs)
    y = _check_ids(sampled, logits)
    if all(s.greedy for s in row_specs):  # reference_filter's all-greedy path: nothing to bound
        return _undecided(_recompute_reference(logits, sampled, specs, force_include=force_include), band_policy)
    kept, ids, listed, log_mass, row_max, fallback, decided = _kept_bounded(z, row_specs, band_policy)
    forced = ~kept.gather(1, y.unsqueeze(1)).squeeze(1)
    lp = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    if bool(listed.any()):
        extra = torch.where(forced, y, -1) if force_include else torch.full_like(y, -1)
        lp_ids = _log_renormalised(z, y, torch.cat([ids, extra.unsqueeze(1)], dim=1))
        lp = torch.where(listed, lp_ids, lp)
    massed = ~torch.isnan(log_mass)  # nucleus rows: their kept mass is known
    if bool(massed.any()):
        zy = z.gather(1, y.unsqueeze(1)).squeeze(1)
        lp_mass = nucleus.log_renormalised(zy, row_max, log_mass, forced & force_include)
        lp = torch.where(massed, lp_mass, lp)
        listed = listed | massed
    rest = (~listed).nonzero().squeeze(1)
    if rest.numel():
        sub_kept = kept[rest]
        if force_include:
            sub_kept = sub_kept.scatter(1, y[rest].unsqueeze(1), True)
        lp[rest] = _log_renormalised(z[rest], y[rest], sub_kept)
    if not force_include:  # y outside S_p scores -inf, as a naive trainer would get
        lp = lp.masked_fill(forced, NEG_INF)
    return RecomputeResult(lp, kept, forced, fallback, decided if band_policy == "decide" else None)


def _reads_scaled(logits: torch.Tensor, specs: list[SamplingSpec]) -> bool:
    """Whether recompute reads z' through :class:`parity.core.nucleus.Scaled`: no row has top_k, so every
    row goes through the compiled passes (CPU float32, numba: the nucleus select, the survivor mass, the
    min_p survivor lists), which divide as they read; the lists' renormalisation gathers K values of z'.
    Every other batch materialises z / T first."""
    if kernels.backend() != "numba" or logits.dtype != torch.float32 or not nucleus.supported(logits):
        return False
    vocab = logits.shape[1]
    return not any(s.top_k_for_vocab(vocab) < vocab for s in specs)


def _undecided(res: RecomputeResult, band_policy: str) -> RecomputeResult:
    """A result from the reference path: under band_policy="decide", no row was decided."""
    if band_policy == "decide":
        res.decided = torch.zeros_like(res.forced)
    return res


def _recompute_reference(
    logits: torch.Tensor, sampled: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec], *,
    force_include: bool = True, faults: FilterFaults | None = None,
) -> RecomputeResult:
    """recompute straight from :func:`reference_filter` (full-row sort, dense renormalisation)."""
    res = reference_filter(logits, specs, faults=faults)
    y = _check_ids(sampled, res.scaled)
    kept = res.kept
    forced = ~kept.gather(1, y.unsqueeze(1)).squeeze(1)
    if force_include:
        lp = _log_renormalised(res.scaled, y, kept.scatter(1, y.unsqueeze(1), True))
    else:  # y outside S_p scores -inf, as a naive trainer would get
        lp = _log_renormalised(res.scaled, y, kept).masked_fill(forced, NEG_INF)
    return RecomputeResult(lp, kept, forced, torch.zeros_like(forced))


# -- the kept set of reference_filter from topk(k) candidates ---------------------------------------
#
# Why this is exact. reference_filter (and vLLM's Sampler) choose the top-k/top-p algorithm per batch:
# * top-k-only path (no row sets top_p; ``apply_top_k_only``): S = {finite z' >= k-th largest z'}.
#   That set is exactly the top ``c`` values for c = |S|, so ``topk`` widened until it holds every
#   token tied with the k-th value lists S: no sort of the row, no approximation.
# * sort path (some row sets top_p; ``apply_top_k_top_p``): the row is sorted ascending, top_k masks
#   values below the k-th largest, then float32 ``cumsum(softmax) <= 1 - p`` is dropped (the largest
#   kept). Masked tokens add exactly 0 to that softmax and cumsum, so the decision at each surviving
#   position depends only on the survivors' values, which the widened candidate list holds in the same
#   ascending order. Two things the candidates cannot reproduce, and the row then runs the reference
#   sort itself (``top_k_top_p_sorted`` on that row alone: per-row arithmetic, the batch-level path
#   choice kept):
#   - rounding: the reference's float32 softmax sums in its kernel's order (which depends on the
#     survivors' positions in the full row). The exact cumulative mass is computed here in float64
#     and the decision taken from it; a position whose mass lies within the reference's float32
#     error of ``1 - p`` (:func:`parity.core.tolerances.top_p_band`; for rows with p = 1 the underflow band) could go
#     either way there, so the row falls back.
#   - ties split by the cut: when the nucleus boundary falls inside a group of equal values, which of
#     them the reference drops is decided by torch.sort's permutation of the *whole* row (not stable
#     for long rows), which no candidate list knows. Such a row falls back.
# min_p runs first, as in vLLM: on top_k rows it is decided on the candidates (min_p_decide, the
# reference's min_p_mask where a candidate lies in its band), on other rows by min_p_mask itself.

def _candidates(work: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k survivors of each row, descending: values (-inf past the survivors) and ids.

    Survivors are the finite values >= the k-th largest (ties with it kept, as ``apply_top_k_only``
    and ``apply_top_k_top_p`` keep them). The list is ``topk(k + 1)``, widened to every token tied
    with the k-th value when the extra entry shows a tie may continue past it.
    """
    vocab = work.shape[1]
    width = min(int(k.max()) + 1, vocab)
    vals, ids = work.topk(width, dim=1)
    kth = vals.gather(1, (k - 1).unsqueeze(1))
    more = (vals[:, -1:] >= kth).squeeze(1) & torch.isfinite(kth).squeeze(1)
    if width < vocab and bool(more.any()):
        rows = more.nonzero().squeeze(1)
        wider = int((work[rows] >= kth[rows]).sum(dim=1).max())
        vals, ids = work.topk(max(wider, width), dim=1)
    surv = (vals >= kth) & (vals > NEG_INF)
    return vals.masked_fill(~surv, NEG_INF), ids


def _top_k_candidates(
    z: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, mp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_candidates` of ``rows`` of ``z`` after min_p (``mp``, or None), without min_p's full-row softmax.

    min_p drops exactly the values below a threshold (outside :func:`parity.core.filters.min_p_decide`'s
    band), so the top_k survivors of the masked row are the top_k candidates of the raw row that min_p
    keeps: fewer than k survive only when min_p cuts into the candidates, and then every survivor is one.
    min_p is decided on the candidates alone (the row max is the first); a row with a candidate inside
    the band takes the reference's :func:`min_p_mask` on its whole row, then :func:`_candidates`.
    Returns (values, ids, redo [R]: the rows min_p was decided for by the reference).
    """
    every = rows.numel() == z.shape[0]
    sub = z[rows] if isinstance(z, nucleus.Scaled) or not every else z
    vals, ids = _candidates(sub, k)
    if mp is None or not bool((mp > 0).any()):
        return vals, ids, torch.zeros(rows.numel(), dtype=torch.bool, device=z.device)
    dropped, near = min_p_decide(vals, vals[:, 0], mp)
    vals = vals.masked_fill(dropped, NEG_INF)
    redo = near.nonzero().squeeze(1)
    if redo.numel():
        w = sub[redo]
        rv, ri = _candidates(w.masked_fill(min_p_mask(w, mp[redo]), NEG_INF), k[redo])
        width = max(vals.shape[1], rv.shape[1])
        vals = torch.nn.functional.pad(vals, (0, width - vals.shape[1]), value=NEG_INF)
        ids = torch.nn.functional.pad(ids, (0, width - ids.shape[1]))
        vals[redo] = torch.nn.functional.pad(rv, (0, width - rv.shape[1]), value=NEG_INF)
        ids[redo] = torch.nn.functional.pad(ri, (0, width - ri.shape[1]))
    return vals, ids, near


def _top_p_on_candidates(vals: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The nucleus cut of ``apply_top_k_top_p`` over descending survivor values ``[n, W]``.

    Returns (keep ``[n, W]`` in the same descending order, fallback ``[n]``): fallback rows had a
    decision inside the rounding band or a tie group split by the cut (see the note above).
    """
    thr = 1 - p  # float32, as the reference computes it
    asc = vals.flip(1)
    surv = asc > NEG_INF
    m = vals[:, :1].double()
    x = asc.double() - m
    e = torch.exp(x)
    total = e.sum(dim=1, keepdim=True)
    mass = e.cumsum(dim=1) / total
    count = surv.sum(dim=1, keepdim=True).double()
    span = m - asc.masked_fill(~surv, float("inf")).amin(dim=1, keepdim=True).double()
    thr64 = thr.double().unsqueeze(1)
    drop = mass <= thr64
    near = (mass - thr64).abs() <= tolerances.top_p_band(torch.maximum(mass, thr64), count, span)
    one = (thr == 0).unsqueeze(1)  # p = 1 on the sort path: only float32 underflow drops
    zero, underflow_near = tolerances.underflow_decision(x - torch.log(total))
    drop = torch.where(one, zero, drop) & surv
    near = torch.where(one, underflow_near, near) & surv
    drop[:, -1] = False  # the largest token is always kept
    near[:, -1] = False
    first_kept = (~surv).sum(dim=1) + drop.sum(dim=1)  # survivors are a suffix, drops a prefix of it
    last_dropped = (first_kept - 1).clamp(min=0)
    split = drop.any(dim=1) & (asc.gather(1, last_dropped.unsqueeze(1)) == asc.gather(1, first_kept.unsqueeze(1))).squeeze(1)
    keep = (surv & ~drop).flip(1)
    return keep, near.any(dim=1) | split


class _Bounded(NamedTuple):
    kept: torch.Tensor  # bool [N, V]
    ids: torch.Tensor  # long [N, W]: the whole kept set on listed rows (-1 = padding)
    listed: torch.Tensor  # bool [N]: rows filtered from top_k candidates
    log_mass: torch.Tensor  # float64 [N]: nucleus rows' log sum_{kept} exp(z' - m); NaN elsewhere
    row_max: torch.Tensor  # float32 [N]: m on nucleus rows
    fallback: torch.Tensor  # bool [N]: a fast path could not decide the row exactly (it was sorted)
    decided: torch.Tensor  # bool [N]: nucleus rows decided in float64 inside the band (band_policy="decide")


# Rows without top_k under min_p and top_p whose min_p survivors number at most this are cut over the
# survivor list (as top_k rows over their candidates), not by the nucleus select over the whole row.
MIN_P_LIST_MAX = 1024


def _min_p_lists(z: torch.Tensor | nucleus.Scaled, rows: torch.Tensor, mp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The min_p survivors of ``rows`` (those with at most MIN_P_LIST_MAX), descending: (rows, values, ids).

    min_p runs on the whole row with the reference's own function (:func:`min_p_mask`), then the
    survivors are listed: for top_p on the sort path they are exactly what ``_candidates`` lists for a
    top_k row (the tokens min_p drops add exactly 0 to the reference's softmax and cumulative sum), so
    :func:`_top_p_on_candidates` cuts them. Values past a row's survivors are -inf, their ids 0; the rows
    come back in the order of ``rows``.
    """
    if nucleus.supported(z) and kernels.backend() == "numba" and rows.numel():
        return _min_p_lists_kernel(z, rows, mp)
    every = rows.numel() == z.shape[0]
    sub = z[rows] if isinstance(z, nucleus.Scaled) or not every else z
    # min_p drops every -inf (probability 0 < min_p * max) unless that product underflows to 0; an -inf
    # listed then is padding to _top_p_on_candidates (never kept, no mass).
    surv = ~min_p_mask(sub, mp)
    count = surv.sum(dim=1)
    short = (count <= MIN_P_LIST_MAX).nonzero().squeeze(1)
    if not short.numel():
        return short, torch.empty(0, 1, dtype=z.dtype, device=z.device), short.new_empty(0, 1)
    r_i, col = (surv if short.numel() == surv.shape[0] else surv[short]).nonzero(as_tuple=True)
    cnt = count[short]
    width = int(cnt.max())
    start = torch.cat([cnt.new_zeros(1), cnt.cumsum(0)[:-1]])
    slot = torch.arange(r_i.numel(), device=z.device) - start[r_i]
    vals = torch.full((short.numel(), width), NEG_INF, dtype=z.dtype, device=z.device)
    ids = torch.zeros(short.numel(), width, dtype=torch.long, device=z.device)
    vals[r_i, slot] = sub[short[r_i], col]
    ids[r_i, slot] = col
    vals, order = vals.sort(dim=1, descending=True)
    return rows[short], vals, ids.gather(1, order)


def _min_p_lists_kernel(
    z: torch.Tensor | nucleus.Scaled, rows: torch.Tensor, mp: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_min_p_lists` through the compiled pass of :func:`parity.core.nucleus.min_p_survivors`: the
    survivors listed in one pass, without the row's softmax. Rows with a value in min_p's rounding band
    take the reference's min_p_mask (:func:`_min_p_lists` on the torch path); the same lists come back,
    in the order of ``rows``."""
    count, vals, ids, redo = nucleus.min_p_survivors(z, rows, mp, MIN_P_LIST_MAX)
    short = ((count <= MIN_P_LIST_MAX) & ~redo).nonzero().squeeze(1)
    width = int(count[short].max()) if short.numel() else 1
    parts = [(short, vals[short, :width], ids[short, :width])]
    again = redo.nonzero().squeeze(1)
    if again.numel():
        with kernels.forced("torch"):
            r_rows, r_vals, r_ids = _min_p_lists(z, rows[again], mp[again])
        pos = {int(r): i for i, r in enumerate(rows.tolist())}
        parts.append((torch.tensor([pos[int(r)] for r in r_rows.tolist()], dtype=torch.long), r_vals, r_ids))
    if not any(pt[0].numel() for pt in parts):
        return rows[:0], torch.empty(0, 1, dtype=z.dtype, device=z.device), rows.new_empty(0, 1)
    width = max(pt[1].shape[1] for pt in parts if pt[0].numel())
    at = torch.cat([pt[0] for pt in parts])
    vals = torch.cat([torch.nn.functional.pad(pt[1][:, :width], (0, width - pt[1][:, :width].shape[1]), value=NEG_INF) for pt in parts])
    ids = torch.cat([torch.nn.functional.pad(pt[2][:, :width], (0, width - pt[2][:, :width].shape[1])) for pt in parts])
    order = at.argsort()
    at, vals, ids = at[order], vals[order], ids[order]
    head = ~redo[at]  # the kernel's lists are in column order: sorted here as _min_p_lists sorts its own
    if bool(head.any()):
        sv, so = vals[head].sort(dim=1, descending=True)
        vals[head], ids[head] = sv, ids[head].gather(1, so)
    return rows[at], vals, ids


def _kept_bounded(z: torch.Tensor | nucleus.Scaled, specs: list[SamplingSpec], band_policy: str = "reference") -> _Bounded:
    """reference_filter's kept mask for a not-all-greedy batch of scaled logits ``z`` (a :class:`parity.core.nucleus.Scaled`
    only where :func:`_reads_scaled`: then no row has top_k).

    Rows with top_k are filtered from their candidates (the ids are the whole kept set on those listed
    rows), and so are rows without top_k under min_p and top_p with few min_p survivors
    (:func:`_min_p_lists`); other rows without top_k go through :func:`parity.core.nucleus.nucleus_cut` on the sort path, else
    :func:`parity.core.nucleus.survivor_mass` (CPU); other rows, and the rows a fast path cannot decide
    exactly (``fallback``), run the reference.
    """
    n, vocab = z.shape
    dev = z.device
    use_min_p = any(s.uses_min_p for s in specs)
    mp = torch.tensor([s.min_p if s.uses_min_p else 0.0 for s in specs], dtype=torch.float32, device=dev)

    def work(rows: torch.Tensor | None) -> torch.Tensor:  # z' after min_p (row-wise: exact per row)
        sub = z[rows if rows is not None else slice(None)] if isinstance(z, nucleus.Scaled) else z if rows is None else z[rows]
        if not use_min_p:
            return sub
        return sub.masked_fill(min_p_mask(sub, mp if rows is None else mp[rows]), NEG_INF)

    any_p = any(s.uses_top_p for s in specs)
    k = torch.tensor([s.top_k_for_vocab(vocab) for s in specs], dtype=torch.long, device=dev)
    p = torch.tensor([s.top_p if s.uses_top_p else 1.0 for s in specs], dtype=torch.float32, device=dev)
    bounded = k < vocab
    fallback = torch.zeros(n, dtype=torch.bool, device=dev)
    decided = torch.zeros(n, dtype=torch.bool, device=dev)
    log_mass = torch.full((n,), float("nan"), dtype=torch.float64, device=dev)
    row_max = torch.full((n,), float("nan"), dtype=torch.float32, device=dev)
    free = (~bounded).nonzero().squeeze(1)
    lists: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (rows, values desc, ids)
    if any_p and use_min_p and free.numel():
        mrows = free[mp[free] > 0]
        if mrows.numel():
            short, mvals, mids = _min_p_lists(z, mrows, mp[mrows])
            if short.numel():
                lists.append((short, mvals, mids))
                bounded[short] = True
                free = (~bounded).nonzero().squeeze(1)
    listed = bounded.clone()
    cut = free.numel() > 0 and nucleus.supported(z)
    every_cut = cut and free.numel() == n
    kept = (torch.empty if every_cut else torch.zeros)(n, vocab, dtype=torch.bool, device=dev)
    ids = torch.full((n, 1), -1, dtype=torch.long, device=dev)
    krows = (k < vocab).nonzero().squeeze(1)
    if krows.numel():
        assert isinstance(z, torch.Tensor), "top_k batches materialise z' (_reads_scaled)"
        kvals, kids, redo = _top_k_candidates(z, krows, k[krows], mp[krows] if use_min_p else None)
        lists.insert(0, (krows, kvals, kids))
        fallback[krows[redo]] = True  # min_p decided by the reference's softmax on the whole row
    if lists:
        width = max(vl.shape[1] for _, vl, _ in lists)
        rows = torch.cat([r for r, _, _ in lists])
        vals = torch.cat([torch.nn.functional.pad(vl, (0, width - vl.shape[1]), value=NEG_INF) for _, vl, _ in lists])
        cand = torch.cat([torch.nn.functional.pad(c, (0, width - c.shape[1])) for _, _, c in lists])
        every = rows.numel() == n
        if every and len(lists) > 1:  # rows in order, so the scatter below fills row i from vals[i]
            rows, order = rows.sort()
            vals, cand = vals[order], cand[order]
        keep = vals > NEG_INF
        if any_p:
            keep, fb = _top_p_on_candidates(vals, p[rows])
            listed[rows[fb]] = False
            fallback[rows[fb]] = True
            keep &= ~fb.unsqueeze(1)
        # Every row keeps its largest candidate (column 0): padding scatters onto it, harmlessly.
        filled = torch.where(keep, cand, cand[:, :1])
        if every:
            kept.scatter_(1, filled, True)
        else:
            kept[rows] = torch.zeros(rows.numel(), vocab, dtype=torch.bool, device=dev).scatter_(1, filled, True)
        ids = torch.full((n, cand.shape[1]), -1, dtype=torch.long, device=dev)
        ids[rows] = torch.where(keep, cand, torch.full_like(cand, -1))
    done = listed.clone()
    if cut:  # no top_k: the histogram select of the top_p cut, or no cut (parity.core.nucleus)
        sel, mps = None if every_cut else free, mp[free] if use_min_p else None
        if any_p:  # exact, or counted fallback
            res = nucleus.nucleus_cut(z, p[free], rows=sel, min_p=mps, out=kept, band_policy=band_policy)
            if res.decided is not None:
                decided[free[res.decided]] = True
        else:
            res = nucleus.survivor_mass(z, rows=sel, min_p=mps, out=kept)
        ok = ~res.unresolved  # the rest (split ties) need the reference's permutation
        fallback[free[res.fallback]] = True
        log_mass[free[ok]] = res.log_mass[ok]
        row_max[free[ok]] = res.row_max.squeeze(1)[ok]
        done[free[ok]] = True
    rest = (~done).nonzero().squeeze(1)
    if rest.numel():  # rows without top_k off CPU, and the fallback rows left unresolved: the reference
        sub = work(rest)
        if any_p:
            sub = top_k_top_p_sorted(sub, k[rest], p[rest])
        kept[rest] = sub > NEG_INF
        ids[rest] = -1
    return _Bounded(kept, ids, listed, log_mass, row_max, fallback, decided)


def mask_to_ids(kept: torch.Tensor) -> torch.Tensor:
    """Dense bool mask ``[N, V]`` → padded ids ``[N, K]`` (K = largest support, ``-1`` padding)."""
    counts = kept.sum(dim=-1)
    width = max(int(counts.max()), 1) if counts.numel() else 1
    # Sorting the mask descending with a stable sort puts kept ids first, in ascending id order.
    order = torch.sort(kept.to(torch.int8), dim=-1, descending=True, stable=True).indices[:, :width]
    pos = torch.arange(width, device=kept.device).unsqueeze(0)
    return torch.where(pos < counts.unsqueeze(1), order, torch.full_like(order, -1))


def ids_to_mask(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """Padded ids ``[N, K]`` (``-1`` padding) → dense bool mask ``[N, V]``."""
    if ids.numel() and int(ids.max()) >= vocab:
        raise ValueError(f"kept ids must lie in [0, {vocab}): got {int(ids.max())}")
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(ids < 0, vocab, ids).long(), True)
    return mask[:, :vocab]


def _support_values(z: torch.Tensor | nucleus.Scaled, kept: torch.Tensor) -> torch.Tensor:
    """z on the kept set: ``[N, V]`` with -inf off a mask, or ``[N, K]`` gathered from padded ids."""
    if kept.dtype == torch.bool:
        if kept.shape != z.shape:
            raise ValueError(f"kept mask has shape {tuple(kept.shape)}: allowed the logits' shape {tuple(z.shape)}")
        return (z[:] if isinstance(z, nucleus.Scaled) else z).masked_fill(~kept, NEG_INF)
    if kept.dim() != 2 or kept.shape[0] != z.shape[0]:
        raise ValueError(f"kept ids have shape {tuple(kept.shape)}: allowed [{z.shape[0]}, K]")
    # Gather K values per row: never touches the other V - K logits.
    return z.gather(1, kept.clamp(min=0).long()).masked_fill(kept < 0, NEG_INF)


def _row_max(vals: torch.Tensor) -> torch.Tensor:
    """Row max ``[N, 1]``; 0 where a row has no finite value, so an empty set gives +-inf, not NaN."""
    m = vals.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _log_sum_exp_shifted(vals: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(vals - m)))`` per row, in float64 after the float32 shift.

    Why the shift comes first: at small temperatures z' = z / T reaches thousands, where one float32
    ulp is ~1e-4. ``z'_y - logsumexp(z'_S)`` subtracts two such numbers, each rounded, and loses the
    1e-6 agreement with the sampler; ``log_softmax`` (what vLLM runs) computes ``(x - max) - log(sum)``
    instead. Shifting by the same max in float32 reproduces vLLM's ``x - max`` exactly; the sum and log
    then run in float64 so they add no error of their own.
    """
    return torch.log(torch.exp((vals - m).double()).sum(dim=-1))


def _log_renormalised(z: torch.Tensor | nucleus.Scaled, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``z_y - logsumexp(z over kept)``, computed as ``log_softmax`` does (shift by the kept max first)."""
    vals = _support_values(z, kept)
    m = _row_max(vals)
    zy = z.gather(1, y.unsqueeze(1)) - m
    return (zy.squeeze(1).double() - _log_sum_exp_shifted(vals, m)).to(z.dtype)


@dataclass
class ReplayResult:
    logprobs: torch.Tensor  # [N] z'_y - logsumexp(z'_{S_q})
    outside: torch.Tensor  # bool [N]: the sampled token is not in S_q (capture or engine fault)

    @property
    def outside_count(self) -> int:
        return int(self.outside.sum())


def _contains(kept: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kept.dtype == torch.bool:
        return kept.gather(1, y.unsqueeze(1)).squeeze(1)
    return (kept == y.unsqueeze(1)).any(dim=-1)


def replay(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    kept: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
) -> ReplayResult:
    """Renormalise trainer logits over the sampler's kept set: ``z'_y - logsumexp(z'_{S_q})``.

    With padded ids ``[N, K]`` only the K kept logits and y's are read, validated and scaled: O(K) per
    row, not O(V) (scaling and checking the whole row first cost 0.7x of the full log-softmax). Scaling the gathered values is the same float32 division as scaling the row, so
    the result is bitwise the same. A dense mask reads the whole row by construction.
    """
    if kept.dtype == torch.bool:
        z = scale(logits, specs)
        y = _check_ids(sampled, z)
        return ReplayResult(_log_renormalised(z, y, kept), ~_contains(kept, y))
    if logits.dim() != 2:
        raise ValueError(f"logits has shape {tuple(logits.shape)}: allowed a 2-D [N, V] tensor")
    y = _check_ids(sampled, logits)
    if kept.dim() != 2 or kept.shape[0] != logits.shape[0]:
        raise ValueError(f"kept ids have shape {tuple(kept.shape)}: allowed [{logits.shape[0]}, K]")
    width = kept.shape[1]
    # Columns 0..K-1: the kept ids' logits (padding reads id 0 and is zeroed); column K: y's logit.
    small = logits.gather(1, torch.cat([kept.clamp(min=0).long(), y.unsqueeze(1)], dim=1))
    pad = torch.cat([kept < 0, torch.zeros_like(y, dtype=torch.bool).unsqueeze(1)], dim=1)
    small = small.masked_fill(pad, 0.0)
    if bool(torch.isnan(small).any()) or bool(torch.isposinf(small).any()):
        row = int((torch.isnan(small) | torch.isposinf(small)).any(dim=1).nonzero()[0])
        raise ValueError(f"logits at the kept ids or the sampled id of row {row} contain NaN or +inf: allowed finite values or -inf")
    z = apply_temperature(small.to(torch.float32), per_row(specs, small.shape[0]))
    pos = torch.arange(width, device=kept.device).expand_as(kept)
    lp = _log_renormalised(z, torch.full_like(y, width), torch.where(kept < 0, -1, pos))
    return ReplayResult(lp, ~_contains(kept, y))


def predicted_log_s(
    logits: torch.Tensor, kept: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec]
) -> torch.Tensor:
    """log S = ``logsumexp(z'_{S_q}) - logsumexp(z')``: the mass that survived the filters (<= 0)."""
    z = scale(logits, specs)
    # One shift (the row max) for both sums: the difference of two float32 logsumexps near z' ~ 1e3
    # would carry ~1e-4 of rounding (see _log_sum_exp_shifted).
    m = _row_max(z)
    log_s = _log_sum_exp_shifted(_support_values(z, kept), m) - _log_sum_exp_shifted(z, m)
    return log_s.to(z.dtype)
