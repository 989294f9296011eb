"""Float32 rounding bands of vLLM's filters: where an exact-arithmetic decision (recompute's top_k candidate
path) may differ from vLLM's; inside a band the row falls back to the reference filter itself
(docs/capture_plan.md, section 8).
"""

from __future__ import annotations

import math

import torch

U32 = 2.0**-24  # float32 unit roundoff

# log of half the smallest float32 subnormal (2**-149): a probability below it rounds to exactly 0.
LOG_ZERO_PROB = math.log(2.0**-150)
# p = 1 rows on the sort path drop the survivors whose float32 probability is exactly 0
# (cumsum <= 1 - p = 0). Against log q = x - m - log S (exact): below -120 the float32 probability is
# 0 whatever the rounding (exp(x - m) is 0, or a subnormal of at most 2**-149 divided by S > 2**23);
# above -80 exp(x - m) is a normal float >= 1.8e-35 and times 1/S >= 2**-24 (V <= 2**24) stays
# nonzero. In between the decision depends on float32 rounding.
UNDERFLOW_BAND = (-120.0, -80.0)


def top_p_band(mass: torch.Tensor, count: torch.Tensor, span: torch.Tensor) -> torch.Tensor:
    """Half-width around ``1 - p`` inside which vLLM's float32 cumsum may fall on either side of the exact
    cumulative mass: ``(2c + 16)u`` relative for c survivors, plus absolute terms. ``mass`` is ``max(C, 1 - p)``
    around a cumulative mass C, ``1 - p`` where the band bounds the mass left outside
    (docs/capture_plan.md, section 8)."""
    return mass * (U32 * (2.0 * count + 16.0)) + 2 * U32 * torch.minimum(mass * span, 0.37 * count) + count * 2.0**-50 + 2.0**-40


def underflow_decision(log_q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For p = 1 rows on the sort path: (dropped, ambiguous) from the exact ``log q``. ``dropped``: the float32
    probability rounds to 0 (the best exact-arithmetic answer); ``ambiguous``: ``log q`` lies in
    :data:`UNDERFLOW_BAND`, where float32 rounding decides."""
    lo, hi = UNDERFLOW_BAND
    return log_q <= LOG_ZERO_PROB, (log_q >= lo) & (log_q <= hi)


# min_p compares float32 probabilities: p_i < min_p * max_j p_j (MinPLogitsProcessor). Both sides share
# the softmax's denominator, so its rounding cancels, and the decision is the exact ``z_i - m <
# log(min_p)`` except within a narrow band: the exp of token i and of the max (each allowed
# MIN_P_EXP_REL relative error: 256 ulp, far above the 1 ulp of a libm-quality float32 exp), the product
# by the reciprocal, the max probability's rounding and its product by min_p (u each), and the float32
# argument ``fl(z_i - m)`` (u |z_i - m|, in nats).
MIN_P_EXP_REL = 2.0**-15
# Below this min_p the threshold min_p * p_max (p_max >= 1/V) may be subnormal, where relative error
# bounds do not hold: such rows take the reference's softmax.
MIN_P_FAST_MIN = 2.0**-90


def min_p_band(log_min_p: torch.Tensor) -> torch.Tensor:
    """Half-width in nats, around ``z - m = log(min_p)``, inside which vLLM's float32 min_p may decide
    either way (float64, per row; ``log_min_p`` float64)."""
    return 2 * MIN_P_EXP_REL + 4 * U32 + U32 * 1.01 * (log_min_p.abs() + 1) + 2.0**-40
