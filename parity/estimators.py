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

import torch

from parity.filters import FilterFaults, apply_temperature, check_logits, reference_filter
from parity.spec import SamplingSpec

NEG_INF = float("-inf")


def _specs(specs: SamplingSpec | Sequence[SamplingSpec], n: int) -> list[SamplingSpec]:
    if isinstance(specs, SamplingSpec):
        return [specs.effective()] * n
    out = [s.effective() for s in specs]
    if len(out) != n:
        raise ValueError(f"specs has {len(out)} entries for {n} rows: allowed one spec or one per row")
    return out


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
    return apply_temperature(logits, _specs(specs, logits.shape[0]))


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

    @property
    def forced_count(self) -> int:
        return int(self.forced.sum())


def recompute(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
    *,
    force_include: bool = True,
    faults: FilterFaults | None = None,
) -> RecomputeResult:
    """Reference filters on trainer logits → S_p; ``z'_y - logsumexp(z'_{S_p ∪ {y}})``.

    With ``force_include=False`` (only for negative controls) a sampled token outside S_p scores
    ``-inf``, which is what a trainer that recomputes filters naively gets.
    """
    res = reference_filter(logits, specs, faults=faults)
    y = _check_ids(sampled, res.scaled)
    kept = res.kept
    forced = ~kept.gather(1, y.unsqueeze(1)).squeeze(1)
    if force_include:
        lp = _log_renormalised(res.scaled, y, kept.scatter(1, y.unsqueeze(1), True))
    else:  # y outside S_p scores -inf, as a naive trainer would get
        lp = _log_renormalised(res.scaled, y, kept).masked_fill(forced, NEG_INF)
    return RecomputeResult(lp, kept, forced)


def mask_to_ids(kept: torch.Tensor) -> torch.Tensor:
    """Dense bool mask ``[N, V]`` → padded ids ``[N, K]`` (K = largest support, ``-1`` padding)."""
    counts = kept.sum(dim=-1)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
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


def _support_values(z: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """z on the kept set: ``[N, V]`` with -inf off a mask, or ``[N, K]`` gathered from padded ids."""
    if kept.dtype == torch.bool:
        if kept.shape != z.shape:
            raise ValueError(f"kept mask has shape {tuple(kept.shape)}: allowed the logits' shape {tuple(z.shape)}")
        return z.masked_fill(~kept, NEG_INF)
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
    """Renormalise trainer logits over the sampler's kept set: ``z'_y - logsumexp(z'_{S_q})``."""
    z = scale(logits, specs)
    y = _check_ids(sampled, z)
    lp = _log_renormalised(z, y, kept)
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
