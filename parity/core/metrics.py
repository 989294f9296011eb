"""Comparison metrics between the two sides: support equality, bias, drift, KL/TV, IS ratios.

Pure torch; every function takes tensors and returns plain Python numbers or tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from parity.errors import UsageError


def support_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: do two kept masks ``[N, V]`` hold exactly the same tokens?"""
    if a.shape != b.shape:
        raise UsageError(f"kept masks differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a == b).all(dim=-1)


def difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b`` in float64 under the one comparison rule of parity.

    Equal entries count 0 (equal infinities included: -inf on both sides is agreement, off the
    support on both). A one-sided infinity is a gap of +-inf, and a NaN on either side (NaN vs NaN
    included) is +inf: a NaN never agrees with anything.
    """
    a = a.double()
    b = b.double()
    diff = torch.where(a == b, torch.zeros_like(a), a - b)
    # Not nan_to_num(nan=inf) alone: it also clamps +-inf to +-1.8e308, so a support mismatch would
    # read as a huge finite gap and the p99 below would be computed over it.
    return torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)


def abs_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` in float64 under the rule of :func:`difference`."""
    return difference(a, b).abs()


def max_abs_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest :func:`abs_difference` (0.0 when empty)."""
    return float(abs_difference(a, b).max()) if a.numel() else 0.0


def _quantile(x: torch.Tensor, q: float) -> float:
    """``torch.quantile(x, q)`` with its default linear interpolation, for any size.

    torch.quantile refuses inputs of 2**24 elements or more ("input tensor is too large"), which a
    full-vocabulary comparison reaches (512 positions x 33k vocabulary); kthvalue has no such limit
    and, unlike a full sort, is linear in the size.
    """
    flat = x.flatten()
    pos = q * (flat.numel() - 1)
    lo = int(pos)
    hi = min(lo + 1, flat.numel() - 1)
    v_lo = flat.kthvalue(lo + 1).values
    v_hi = flat.kthvalue(hi + 1).values if hi != lo else v_lo
    return float(v_lo + (v_hi - v_lo) * (pos - lo))


@dataclass
class DiffStats:
    max_abs_diff: float
    mean_diff: float
    mean_abs_diff: float
    p99_abs_diff: float
    argmax: int  # flat index of the largest |diff| (-1 when empty)

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d.pop("argmax")
        return d


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> DiffStats:
    """max/mean/p99 of ``a - b`` over matching elements (float64)."""
    if a.shape != b.shape:
        raise UsageError(f"cannot compare shapes {tuple(a.shape)} and {tuple(b.shape)}")
    d = difference(a.flatten(), b.flatten())
    if d.numel() == 0:
        return DiffStats(0.0, 0.0, 0.0, 0.0, -1)
    ad = d.abs()
    finite = ad[torch.isfinite(ad)]
    p99 = _quantile(finite, 0.99) if finite.numel() == ad.numel() else math.inf
    return DiffStats(
        max_abs_diff=float(ad.max()),
        mean_diff=float(d.mean()),
        mean_abs_diff=float(ad.mean()),
        p99_abs_diff=p99,
        argmax=int(ad.argmax()),
    )


def bias(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean of ``a - b``: the systematic offset of one side against the other."""
    return diff_stats(a, b).mean_diff


def kl_tv_over_support(logp: torch.Tensor, logq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row KL(p || q) and TV(p, q) between two processed distributions ``[N, V]`` (-inf = 0 mass).

    Mass that p puts where q has none makes KL infinite, which is the right answer for a support
    mismatch.
    """
    p = logp.double().exp()
    q = logq.double().exp()
    on_p = p > 0
    term = torch.where(on_p, p * (logp.double() - logq.double()), torch.zeros_like(p))
    kl = term.sum(dim=-1)
    tv = 0.5 * (p - q).abs().sum(dim=-1)
    return kl, tv


@dataclass
class ISRatios:
    """Importance ratios trainer / sampler, per token and per sequence (products over tokens)."""

    token_mean: float
    token_min: float
    token_max: float
    seq_mean: float
    seq_min: float
    seq_max: float
    seq_identity_max_rel_err: float  # |seq ratio - prod S| / prod S, for the naive estimator

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def is_ratios(
    train: torch.Tensor,
    sampler: torch.Tensor,
    seq_lengths: Sequence[int],
    log_s: torch.Tensor | None = None,
) -> ISRatios:
    """Token ratios ``exp(train - sampler)`` and sequence ratios ``exp(sum over the sequence)``.

    ``seq_lengths`` splits the flat token axis into sequences. When ``log_s`` is given, also report how
    far the sequence ratio is from the identity ``prod S`` that the naive estimator must satisfy.
    """
    d = (train.double() - sampler.double())
    tok = d.exp()
    seqs = torch.split(d, list(seq_lengths))
    seq = torch.stack([s.sum() for s in seqs]).exp() if seqs else torch.zeros(0, dtype=torch.float64)
    rel = 0.0
    if log_s is not None and seqs:
        pred = torch.stack([s.sum() for s in torch.split(log_s.double(), list(seq_lengths))]).exp()
        rel = float(((seq - pred).abs() / pred).max())

    def stat(t: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor]) -> float:
        return float(f(t)) if t.numel() else 1.0

    return ISRatios(
        token_mean=stat(tok, torch.mean),
        token_min=stat(tok, torch.min),
        token_max=stat(tok, torch.max),
        seq_mean=stat(seq, torch.mean),
        seq_min=stat(seq, torch.min),
        seq_max=stat(seq, torch.max),
        seq_identity_max_rel_err=rel,
    )
