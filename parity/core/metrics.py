"""Comparison metrics between the two sides (pure torch): support equality, the comparison rule for
differences."""

from __future__ import annotations

import math

import torch

from parity.errors import UsageError


def support_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: do two kept masks ``[N, V]`` hold exactly the same tokens?"""
    if a.shape != b.shape:
        raise UsageError(f"kept masks differ in shape: {tuple(a.shape)} vs {tuple(b.shape)}")
    return (a == b).all(dim=-1)


def boundary_only(a: torch.Tensor, b: torch.Tensor, scaled_logits: torch.Tensor, bound: torch.Tensor) -> torch.Tensor:
    """Per row: do two kept masks ``[N, V]`` differ only by tokens that a drift of ``bound`` (the row's per-token
    rounding bound) can move across a top_p cutoff or min_p threshold? (docs/capture_plan.md, section 9)"""
    diff = a != b
    p = torch.softmax(scaled_logits.double(), dim=-1).masked_fill(~diff, 0.0)
    eps = torch.expm1(2.0 * bound.double())
    return p.sum(dim=-1) <= 2.0 * eps + p.amax(dim=-1)


def top_k_count_differs(a: torch.Tensor, b: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: does one kept mask ``[N, V]`` hold more than ``k`` tokens (ties at the k-th value kept, as vLLM's
    top_k keeps them) while the other holds another count? A top_k cutoff keeps a count: drift swaps tokens
    across it but does not change how many, so such a one-sided difference is a different filter, not a moved
    cutoff (docs/capture_plan.md, section 9). ``k`` <= 0: no top_k, never."""
    if k <= 0:
        return torch.zeros(a.shape[0], dtype=torch.bool, device=a.device)
    na, nb = a.sum(dim=-1), b.sum(dim=-1)
    return ((na > k) | (nb > k)) & (na != nb)


def difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a - b`` in float64 under parity's one comparison rule: equal entries count 0 (-inf on both sides is
    agreement, off the support on both), a one-sided infinity is a gap of +-inf, and a NaN on either side (NaN
    vs NaN included) is +inf: a NaN never agrees with anything."""
    a = a.double()
    b = b.double()
    diff = torch.where(a == b, torch.zeros_like(a), a - b)
    # Not nan_to_num(nan=inf) alone: it also clamps +-inf to +-1.8e308, so a support mismatch would
    # read as a huge finite gap.
    return torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)


def abs_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a - b|`` in float64 under the rule of :func:`difference`."""
    return difference(a, b).abs()


def max_abs_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest :func:`abs_difference` (0.0 when empty)."""
    return float(abs_difference(a, b).max()) if a.numel() else 0.0


