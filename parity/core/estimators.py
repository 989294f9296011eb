"""Trainer-side log-prob estimators on ``[N, V]`` logits and sampled ids ``[N]``, pure torch: ``full``
(``log_softmax(z / T)[y]``, the biased baseline), ``recompute`` (the reference filters on the trainer's logits,
sampled token forced in), ``replay`` (renormalised over the captured S_q) and ``predicted_log_s``. Kept sets
are a bool mask ``[N, V]`` or padded ids ``[N, K]`` (``-1`` = padding). The logits are those after the penalties
(:func:`parity.core.penalties.penalise_sequence`); a spec's penalty fields are not applied here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from parity.core import tolerances
from parity.core.filters import (
    FilterFaults,
    apply_temperature,
    check_logits,
    min_p_mask,
    reference_filter,
    top_k_top_p_sorted,
)
from parity.core.spec import SamplingSpec, per_row
from parity.errors import UsageError

NEG_INF = float("-inf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _check_ids(sampled: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    if sampled.dim() != 1 or sampled.shape[0] != logits.shape[0]:
        raise UsageError(
            f"sampled has shape {tuple(sampled.shape)}: allowed a 1-D tensor of {logits.shape[0]} token ids"
        )
    if sampled.numel() and (int(sampled.min()) < 0 or int(sampled.max()) >= logits.shape[1]):
        raise UsageError(f"sampled ids must lie in [0, {logits.shape[1]}): got min {int(sampled.min())}, max {int(sampled.max())}")
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
    # bool [N]: the top_k candidate path could not decide the row exactly (rounding band, split tie), so
    # the row ran the reference sort; or its min_p had a candidate in the min_p band and took the
    # reference's min_p softmax; all False where the candidate path did not run
    fallback: torch.Tensor | None = None


def recompute(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
    *,
    force_include: bool = True,
    faults: FilterFaults | None = None,
    select_dtype: str | None = None,
) -> RecomputeResult:
    """Reference filters on trainer logits -> S_p; ``z'_y - logsumexp(z'_{S_p ∪ {y}})``. S_p is exactly
    :func:`parity.core.filters.reference_filter`'s kept set (top_k rows from their ``topk(k)`` candidates, the
    rest and undecided rows by the reference: docs/capture_plan.md, section 8). ``force_include=False``
    (negative controls only) scores a token outside S_p ``-inf``. ``select_dtype``: choose S_p on the logits
    rounded to that dtype (the sampler's: its ties at the k-th value then recur), score in the logits' own."""
    if faults is not None and faults != FilterFaults():
        return _recompute_reference(logits, sampled, specs, force_include=force_include, faults=faults)
    z = scale(logits, specs)
    y = _check_ids(sampled, z)
    row_specs = per_row(specs, z.shape[0])
    if all(s.greedy for s in row_specs):  # reference_filter's all-greedy path: nothing to bound
        return _recompute_reference(logits, sampled, specs, force_include=force_include)
    z_select = z if select_dtype is None else scale(logits.to(DTYPES[select_dtype]), specs)
    kept, ids, listed, fallback = _kept_bounded(z_select, row_specs)
    forced = ~kept.gather(1, y.unsqueeze(1)).squeeze(1)
    lp = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
    if bool(listed.any()):
        extra = torch.where(forced, y, -1) if force_include else torch.full_like(y, -1)
        lp_ids = _log_renormalised(z, y, torch.cat([ids, extra.unsqueeze(1)], dim=1))
        lp = torch.where(listed, lp_ids, lp)
    rest = (~listed).nonzero().squeeze(1)
    if rest.numel():
        sub_kept = kept[rest]
        if force_include:
            sub_kept = sub_kept.scatter(1, y[rest].unsqueeze(1), True)
        lp[rest] = _log_renormalised(z[rest], y[rest], sub_kept)
    if not force_include:  # y outside S_p scores -inf, as a naive trainer would get
        lp = lp.masked_fill(forced, NEG_INF)
    return RecomputeResult(lp, kept, forced, fallback)


def _recompute_reference(
    logits: torch.Tensor, sampled: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec], *,
    force_include: bool = True, faults: FilterFaults | None = None,
) -> RecomputeResult:
    """recompute straight from :func:`reference_filter` (full-row sort, dense renormalisation). The logits are
    already penalised (every estimator reads the logits after the penalties), so the penalties are not run again."""
    check_logits(logits)
    bare = [s.without_penalties() for s in per_row(specs, logits.shape[0])]
    res = reference_filter(logits, bare, faults=faults)
    y = _check_ids(sampled, res.scaled)
    kept = res.kept
    forced = ~kept.gather(1, y.unsqueeze(1)).squeeze(1)
    if force_include:
        lp = _log_renormalised(res.scaled, y, kept.scatter(1, y.unsqueeze(1), True))
    else:  # y outside S_p scores -inf, as a naive trainer would get
        lp = _log_renormalised(res.scaled, y, kept).masked_fill(forced, NEG_INF)
    return RecomputeResult(lp, kept, forced, torch.zeros_like(forced))


# -- the kept set of reference_filter from topk(k) candidates ---------------------------------------
# Exact, not an approximation: the widened topk list holds every survivor in the reference's order;
# a row whose top_p decision lies within float32 rounding of 1 - p, or whose nucleus cut splits a tie,
# runs the reference sort itself. The proof: docs/capture_plan.md, section 8.

def _candidates(work: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top_k survivors of each row, descending: values (-inf past the survivors) and ids; survivors are
    the finite values >= the k-th largest, ties kept. The list is ``topk(k + 1)``, widened to every token tied
    with the k-th value when the extra entry shows a tie may continue (docs/capture_plan.md, section 8)."""
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


def min_p_decide(vals: torch.Tensor, row_max: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`min_p_mask` on some of a row's values without the row's softmax: (dropped, rows to redo).
    ``vals`` float32 ``[R, C]``, ``row_max`` and ``min_p`` ``[R]``. Below the float32 band's ``lo`` min_p
    drops, from ``hi`` it keeps; a row with a value in between (:func:`parity.core.tolerances.min_p_band`), or
    with ``0 < min_p < tolerances.MIN_P_FAST_MIN``, is redone by the reference (docs/capture_plan.md,
    section 8)."""
    row_max, mp = row_max.to(device=vals.device), min_p.to(device=vals.device, dtype=torch.float64)
    log_mp = torch.log(mp)
    width = tolerances.min_p_band(torch.where(mp > 0, log_mp, torch.zeros_like(log_mp)))
    at = row_max.to(dtype=torch.float64) + log_mp
    lo, hi = at - width, at + width
    lo32, hi32 = lo.to(row_max.dtype), hi.to(row_max.dtype)  # rounded outward: the float32 band covers [lo, hi)
    lo32 = torch.where(lo32.double() > lo, torch.nextafter(lo32, torch.full_like(lo32, NEG_INF)), lo32)
    hi32 = torch.where(hi32.double() < hi, torch.nextafter(hi32, torch.full_like(hi32, float("inf"))), hi32)
    dropped = vals < lo32.unsqueeze(1)  # certainly below the threshold (every -inf when min_p > 0)
    near = ((vals >= lo32.unsqueeze(1)) & (vals < hi32.unsqueeze(1))).any(dim=1)
    return dropped, near | ((mp > 0) & (mp < tolerances.MIN_P_FAST_MIN))


def _top_k_candidates(
    z: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, mp: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_candidates` of ``rows`` of ``z`` after min_p (``mp``, or None), min_p decided on the candidates
    (:func:`min_p_decide`) instead of a full-row softmax. Returns (values, ids, redo [R]: the rows whose min_p
    the reference's :func:`min_p_mask` decided)."""
    sub = z if rows.numel() == z.shape[0] else z[rows]
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
    """The nucleus cut of ``apply_top_k_top_p`` over descending survivor values ``[n, W]``: (keep ``[n, W]`` in
    the same order, fallback ``[n]``: rows with a decision inside the rounding band or a tie group split by the cut)."""
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
    fallback: torch.Tensor  # bool [N]: the candidates could not decide the row exactly (it was sorted)


def _kept_bounded(z: torch.Tensor, specs: list[SamplingSpec]) -> _Bounded:
    """reference_filter's kept mask for a not-all-greedy batch of scaled logits ``z``: top_k rows from their
    candidates (the ids are the whole kept set on those rows), other rows and ``fallback`` rows by the reference."""
    n, vocab = z.shape
    dev = z.device
    use_min_p = any(s.uses_min_p for s in specs)
    mp = torch.tensor([s.min_p if s.uses_min_p else 0.0 for s in specs], dtype=torch.float32, device=dev)
    any_p = any(s.uses_top_p for s in specs)
    k = torch.tensor([s.top_k_for_vocab(vocab) for s in specs], dtype=torch.long, device=dev)
    p = torch.tensor([s.top_p if s.uses_top_p else 1.0 for s in specs], dtype=torch.float32, device=dev)
    listed = k < vocab
    fallback = torch.zeros(n, dtype=torch.bool, device=dev)
    kept = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
    ids = torch.full((n, 1), -1, dtype=torch.long, device=dev)
    rows = listed.nonzero().squeeze(1)
    if rows.numel():
        vals, cand, redo = _top_k_candidates(z, rows, k[rows], mp[rows] if use_min_p else None)
        fallback[rows[redo]] = True  # min_p decided by the reference's softmax on the whole row
        keep = vals > NEG_INF
        if any_p:
            keep, fb = _top_p_on_candidates(vals, p[rows])
            listed[rows[fb]] = False
            fallback[rows[fb]] = True
            keep &= ~fb.unsqueeze(1)
        # Every row keeps its largest candidate (column 0): padding scatters onto it, harmlessly.
        filled = torch.where(keep, cand, cand[:, :1])
        if rows.numel() == n:
            kept.scatter_(1, filled, True)
        else:
            kept[rows] = torch.zeros(rows.numel(), vocab, dtype=torch.bool, device=dev).scatter_(1, filled, True)
        ids = torch.full((n, cand.shape[1]), -1, dtype=torch.long, device=dev)
        ids[rows] = torch.where(keep, cand, torch.full_like(cand, -1))
    rest = (~listed).nonzero().squeeze(1)
    if rest.numel():  # rows without top_k, and the fallback rows: the reference itself
        sub = z[rest]
        if use_min_p:
            sub = sub.masked_fill(min_p_mask(sub, mp[rest]), NEG_INF)
        if any_p:
            sub = top_k_top_p_sorted(sub, k[rest], p[rest])
        kept[rest] = sub > NEG_INF
        ids[rest] = -1
    return _Bounded(kept, ids, listed, fallback)


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
        raise UsageError(f"kept ids must lie in [0, {vocab}): got {int(ids.max())}")
    mask = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
    mask.scatter_(1, torch.where(ids < 0, vocab, ids).long(), True)
    return mask[:, :vocab]


def _support_values(z: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """z on the kept set: ``[N, V]`` with -inf off a mask, or ``[N, K]`` gathered from padded ids."""
    if kept.dtype == torch.bool:
        if kept.shape != z.shape:
            raise UsageError(f"kept mask has shape {tuple(kept.shape)}: allowed the logits' shape {tuple(z.shape)}")
        return z.masked_fill(~kept, NEG_INF)
    if kept.dim() != 2 or kept.shape[0] != z.shape[0]:
        raise UsageError(f"kept ids have shape {tuple(kept.shape)}: allowed [{z.shape[0]}, K]")
    # Gather K values per row: never touches the other V - K logits.
    return z.gather(1, kept.clamp(min=0).long()).masked_fill(kept < 0, NEG_INF)


def _row_max(vals: torch.Tensor) -> torch.Tensor:
    """Row max ``[N, 1]``; 0 where a row has no finite value, so an empty set gives +-inf, not NaN."""
    m = vals.amax(dim=-1, keepdim=True)
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _log_sum_exp_shifted(vals: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``log(sum(exp(vals - m)))`` per row, in float64 after the float32 shift by ``m``: the shift reproduces
    vLLM's ``x - max`` exactly (at small T one float32 ulp of z' is ~1e-4), and the sum and log add no error.
    """
    return torch.log(torch.exp((vals - m).double()).sum(dim=-1))


def _log_renormalised(z: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``z_y - logsumexp(z over kept)``, computed as ``log_softmax`` does (shift by the kept max first)."""
    vals = _support_values(z, kept)
    m = _row_max(vals)
    zy = z.gather(1, y.unsqueeze(1)) - m
    return (zy.squeeze(1).double() - _log_sum_exp_shifted(vals, m)).to(z.dtype)


@dataclass
class ReplayResult:
    logprobs: torch.Tensor  # [N] z'_y - logsumexp(z'_{S_q})
    outside: torch.Tensor  # bool [N]: the sampled token is not in S_q (capture or engine fault)


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
    """Renormalise trainer logits over the sampler's kept set: ``z'_y - logsumexp(z'_{S_q})``. With padded ids
    ``[N, K]`` only the K kept logits and y's are read, validated and scaled (O(K) per row, bitwise the same
    result); a dense mask reads the whole row (docs/capture_plan.md, section 8)."""
    if kept.dtype == torch.bool:
        z = scale(logits, specs)
        y = _check_ids(sampled, z)
        return ReplayResult(_log_renormalised(z, y, kept), ~_contains(kept, y))
    if logits.dim() != 2:
        raise UsageError(f"logits has shape {tuple(logits.shape)}: allowed a 2-D [N, V] tensor")
    y = _check_ids(sampled, logits)
    if kept.dim() != 2 or kept.shape[0] != logits.shape[0]:
        raise UsageError(f"kept ids have shape {tuple(kept.shape)}: allowed [{logits.shape[0]}, K]")
    width = kept.shape[1]
    # Columns 0..K-1: the kept ids' logits (padding reads id 0 and is zeroed); column K: y's logit.
    small = logits.gather(1, torch.cat([kept.clamp(min=0).long(), y.unsqueeze(1)], dim=1))
    pad = torch.cat([kept < 0, torch.zeros_like(y, dtype=torch.bool).unsqueeze(1)], dim=1)
    small = small.masked_fill(pad, 0.0)
    if bool(torch.isnan(small).any()) or bool(torch.isposinf(small).any()):
        row = int((torch.isnan(small) | torch.isposinf(small)).any(dim=1).nonzero()[0])
        raise UsageError(f"logits at the kept ids or the sampled id of row {row} contain NaN or +inf: allowed finite values or -inf")
    z = apply_temperature(small.to(torch.float32), per_row(specs, small.shape[0]))
    pos = torch.arange(width, device=kept.device).expand_as(kept)
    lp = _log_renormalised(z, torch.full_like(y, width), torch.where(kept < 0, -1, pos))
    return ReplayResult(lp, ~_contains(kept, y))


def penalty_term(
    raw: torch.Tensor, penalised: torch.Tensor, sampled: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec]
) -> torch.Tensor:
    """``full(pen(z))[y] - full(z)[y]``, float64 ``[N]``: the part of a penalty-ignoring trainer's gap to the sampler
    that is not log S (that trainer reads ``processed - log S - penalty_term``; docs/penalties.md)."""
    return full(penalised, sampled, specs).double() - full(raw, sampled, specs).double()


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
