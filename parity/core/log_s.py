"""log S from the sampler's side (its raw logits, or the nucleus rule for top_p alone), so the naive bias
is gated against something the trainer did not compute. The derivation: docs/error_model.md, section 7.
"""

from __future__ import annotations

import math

import torch

from parity.core.error_model import unit_roundoff
from parity.core.estimators import scale
from parity.core.spec import SamplingSpec
from parity.errors import UsageError

NEG_INF = float("-inf")


def log_s_from_raw_logits(raw_logits: torch.Tensor, kept_ids: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """Sampler-side ``log S`` per position (float64 ``[N]``) from raw logits ``[N, V]`` and the captured S_q
    ``kept_ids`` (``[N, K]``, -1 padded); temperature as the sampler applies it
    (:func:`parity.core.estimators.scale`: float32 division, greedy rows unscaled)."""
    if raw_logits.dim() != 2 or kept_ids.dim() != 2 or raw_logits.shape[0] != kept_ids.shape[0]:
        raise UsageError(
            f"raw_logits {tuple(raw_logits.shape)} and kept_ids {tuple(kept_ids.shape)}: allowed [N, V] and [N, K]"
        )
    z = scale(raw_logits, spec).double()  # z / T in float32, as the sampler divides
    vals = z.gather(1, kept_ids.clamp(min=0)).masked_fill(kept_ids < 0, NEG_INF)
    return torch.logsumexp(vals, dim=-1) - torch.logsumexp(z, dim=-1)


def top_p_bracket_applies(spec: SamplingSpec, vocab: int) -> bool:
    """The bracket holds when top_p is the only filter (top_k off or >= V, no min_p)."""
    top_k_off = spec.top_k is None or spec.top_k <= 0 or spec.top_k >= vocab
    return (not spec.greedy) and spec.top_p < 1.0 and top_k_off and not spec.min_p


def top_p_bracket(
    kept_logprobs: torch.Tensor, top_p: float, vocab: int, dtype: str = "float32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo, hi)`` float64 ``[N]`` with ``log S`` in ``[lo, hi]`` by the nucleus rule, from ``kept_logprobs`` (the
    sampler's processed log-probs of S_q, ``[N, K]``, ``-inf`` = padding) and ``vocab`` (the float32 cumsum's
    terms); a single-token row has no upper end (docs/error_model.md, section 7)."""
    lp = kept_logprobs.double()
    finite = torch.isfinite(lp)
    if not bool(finite.any(dim=-1).all()):
        raise UsageError("kept_logprobs has a row without any finite entry: allowed rows with at least one kept token")
    r = torch.where(finite, lp, torch.full_like(lp, math.inf)).amin(dim=-1).exp().clamp(max=1.0)
    slack = vocab * unit_roundoff(dtype) / top_p
    lo = torch.full_like(r, math.log(top_p) - slack)
    hi = math.log(top_p) - torch.log1p(-r) + slack  # r = 1 -> +inf
    return lo, hi
