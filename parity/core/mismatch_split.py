"""The part of the mismatch budget that two log-prob columns support on their own (``parity analyze``; no torch):
mean |δ| as a systematic shift and a symmetric spread, a growing gap's steps, and what needs the model
(docs/budget.md, section 6). The split into causes is :mod:`parity.core.budget`'s."""

from __future__ import annotations

from collections.abc import Sequence

# What a split needs the model for: each is a second pass over the model's logits or a second engine.
NEEDS_THE_MODEL: tuple[str, ...] = (
    "which cause the systematic shift belongs to (truncation, the filter boundary, the logits processors): the "
    "trainer's logits scored each way",
    "sampler precision: a second engine at the trainer's dtype",
    "trainer batch composition: the trainer scoring each sequence alone",
    "MoE routing: the trainer with routing replay",
    "engine settings: an engine without prefix caching and chunked prefill",
)


def records_split(comparison: str, tokens: int, mean_delta: float, mean_abs_delta: float, limit: float | None,
                  steps: Sequence[tuple[int, float]]) -> dict[str, object]:
    """What two log-prob columns alone say about a gap (``parity analyze``; docs/budget.md, section 6):
    mean |δ| splits into the systematic shift |mean δ| (what a bias class such as log S gives: every token
    moved one way) and the symmetric spread mean |δ| - |mean δ| >= 0 (rounding, precision, layout: tokens
    moved both ways). ``limit``: the mean-bias gate's resolution for the comparison; the shift is
    ``resolved`` beyond it.
    ``steps``: (step, mean |δ|) in step order; where mean |δ| grew from the first step to the last, each later
    step's share of that growth is its rise over the step before (the shares add up to 1)."""
    shift = abs(mean_delta)
    spread = max(mean_abs_delta - shift, 0.0)
    growth = steps[-1][1] - steps[0][1] if len(steps) >= 2 else 0.0
    per_step = [{"step": s, "mean_abs_delta": v,
                 "share_of_growth": (v - steps[i - 1][1]) / growth if i and growth > 0 else None}
                for i, (s, v) in enumerate(steps)]
    return {
        "comparison": comparison,
        "tokens": tokens,
        "mean_delta": mean_delta,
        "mean_abs_delta": mean_abs_delta,
        "systematic": shift,
        "spread": spread,
        "systematic_share": shift / mean_abs_delta if mean_abs_delta > 0 else None,
        "limit": limit,
        "resolved": None if limit is None else shift > limit,
        "growth": growth if len(steps) >= 2 else None,
        "per_step": per_step,
        "needs_the_model": list(NEEDS_THE_MODEL),
    }
