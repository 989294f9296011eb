"""log S from the sampler's side, so the naive bias can be gated against something the trainer did not compute.

The trainer-side log S and the trainer's full-vocabulary log-prob come from the same logits, so
checking one against the other re-checks replay by algebra. Two sources do not go through the
trainer: the sampler's raw logits (a second pass with ``logprobs_mode="raw_logits"`` and the same
seeds, :func:`log_s_from_raw_logits`), and, for top_p alone, the nucleus rule itself, which bounds S
from the processed log-probs (``p <= S < p / (1 - r)``, :func:`top_p_bracket`). The derivation:
docs/error_model.md, section 7.
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
    """Sampler-side ``log S`` per position (float64 ``[N]``) from its raw logits ``[N, V]``.

    ``kept_ids``: the captured S_q, ``[N, K]`` padded with -1. Temperature as the sampler applies it
    (:func:`parity.core.estimators.scale`: float32 division, greedy rows unscaled).
    """
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
    """``(lo, hi)`` float64 ``[N]``: ``log S`` lies in ``[lo, hi]`` by the nucleus rule, from processed log-probs.

    ``kept_logprobs``: the sampler's processed log-probs of S_q, ``[N, K]`` (``-inf`` = padding).
    ``lo = log p - slack``, ``hi = log p - log(1 - r) + slack`` with ``r`` the smallest kept token's
    processed probability; ``slack`` covers the float32 cumulative sum over ``vocab`` terms. A row
    holding a single token has ``r = 1`` and no upper end.
    """
    lp = kept_logprobs.double()
    finite = torch.isfinite(lp)
    if not bool(finite.any(dim=-1).all()):
        raise UsageError("kept_logprobs has a row without any finite entry: allowed rows with at least one kept token")
    r = torch.where(finite, lp, torch.full_like(lp, math.inf)).amin(dim=-1).exp().clamp(max=1.0)
    slack = vocab * unit_roundoff(dtype) / top_p
    lo = torch.full_like(r, math.log(top_p) - slack)
    hi = math.log(top_p) - torch.log1p(-r) + slack  # r = 1 -> +inf
    return lo, hi
