"""How far two engines' per-token log-probabilities may differ from rounding alone (engine-free).

Both sides compute logits of the same model with different kernels (GEMM blocking, vector width,
reduction order), then normalise over a support. The bound on ``|lp_a - lp_b|`` for one token is
derived from that arithmetic, not fitted to one machine:

* **Logits.** Each side's scaled logits ``z' = z / T`` agree with exact arithmetic to within
  ``LOGIT_ULPS`` units of roundoff of the row's magnitude ``A = max_i |z'_i|``: the error of a logit
  comes from reductions over hidden states whose size sets the scale of the whole row, so it is
  relative to the row, not to the token. Two sides then differ by ``2 * LOGIT_ULPS * u * A`` per logit,
  and ``lp_y = z'_y - logsumexp_S(z')`` moves by at most twice the largest logit change (once through
  ``z'_y``, once through the probability-weighted mean in the logsumexp): ``4 * LOGIT_ULPS * u * A``.
  Temperature enters here: ``A`` grows as ``1 / T``.
* **Normalisation.** Each side rounds a logsumexp over ``n = |S|`` terms: the exponent sum carries a
  relative error of about ``log2(n)`` roundoffs (blocked/pairwise summation), the log itself, the
  subtraction and the result one each, at the magnitude of the values involved:
  ``u * (|logsumexp_S| + |lp_y| + log2(n) + 2)`` per side.

``u`` is the unit roundoff of the looser dtype of the two sides (a bfloat16 sampler against a float32
trainer is bounded by bfloat16). ``LOGIT_ULPS`` is the model's one free constant: 8 roundoffs of the
row magnitude per side. Gates report the headroom ``max |diff| / bound`` so a reader sees how much of
the allowance kernel noise used on their machine.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

# Unit roundoff (half an ulp at 1) per dtype name.
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}

# Per-side logit error, in units of roundoff of the row's largest |z'|.
LOGIT_ULPS = 8.0


def _name(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype={dtype!r} has no unit roundoff: allowed {sorted(UNIT_ROUNDOFF)}")
    return name


def unit_roundoff(dtypes: str | torch.dtype | Iterable[str | torch.dtype]) -> float:
    """The unit roundoff of the looser of the given dtypes (both sides of a comparison)."""
    items = [dtypes] if isinstance(dtypes, (str, torch.dtype)) else list(dtypes)
    if not items:
        raise ValueError("dtypes is empty: name at least one dtype")
    return max(UNIT_ROUNDOFF[_name(d)] for d in items)


def looser_dtype(*dtypes: str | torch.dtype) -> str:
    """The dtype name with the largest unit roundoff."""
    return max((_name(d) for d in dtypes), key=UNIT_ROUNDOFF.__getitem__)


def logprob_bound_terms(
    row_absmax: torch.Tensor,
    lse: torch.Tensor,
    logprob: torch.Tensor,
    support_size: torch.Tensor,
    u: float,
) -> torch.Tensor:
    """The bound from its ingredients, each a float tensor of one value per token.

    ``row_absmax``: ``max |z'|`` over the row's finite logits; ``lse``: ``logsumexp`` of ``z'`` over
    the support; ``logprob``: the token's log-prob over that support; ``support_size``: ``|S|``.
    Non-finite ingredients (a token outside the support, an empty row) give an infinite bound only
    where the log-prob itself is non-finite; that comparison is the diff rule's, not the bound's.
    """

    def mag(x: torch.Tensor) -> torch.Tensor:
        x = x.double().abs()
        return torch.where(torch.isfinite(x), x, torch.zeros_like(x))

    n = support_size.double().clamp(min=1.0)
    logits_term = 4.0 * LOGIT_ULPS * u * mag(row_absmax)
    norm_term = 2.0 * u * (mag(lse) + mag(logprob) + torch.log2(n) + 2.0)
    return logits_term + norm_term


def logprob_bound(
    scaled_logits: torch.Tensor,
    sampled: torch.Tensor,
    support: torch.Tensor | None = None,
    *,
    dtype: str | torch.dtype | Iterable[str | torch.dtype] = "float32",
) -> torch.Tensor:
    """Per-token bound on ``|lp_sampler - lp_trainer|`` for float64 ``[N]``.

    ``scaled_logits``: ``[N, V]`` logits already divided by the temperature (``-inf`` allowed);
    ``sampled``: ``[N]`` token ids; ``support``: bool ``[N, V]`` (``None`` = the whole vocabulary);
    ``dtype``: the two sides' dtypes (the looser one counts).
    """
    if scaled_logits.dim() != 2:
        raise ValueError(f"scaled_logits has shape {tuple(scaled_logits.shape)}: allowed [N, V]")
    z = scaled_logits.double()
    finite = torch.isfinite(z)
    sup = finite if support is None else (support & finite)
    neg = torch.full_like(z, -math.inf)
    row_absmax = torch.where(finite, z.abs(), torch.zeros_like(z)).amax(dim=-1)
    lse = torch.logsumexp(torch.where(sup, z, neg), dim=-1)
    zy = z.gather(1, sampled.long().view(-1, 1)).squeeze(1)
    return logprob_bound_terms(row_absmax, lse, zy - lse, sup.sum(dim=-1), unit_roundoff(dtype))


def headroom(diff: torch.Tensor, bound: torch.Tensor) -> float:
    """``max |diff| / bound`` over the tokens (0 for none; NaN in ``diff`` counts as infinite)."""
    if diff.numel() == 0:
        return 0.0
    d = diff.double().abs().nan_to_num(math.inf)
    return float((d / bound.double().clamp(min=torch.finfo(torch.float64).tiny)).max())


def mean_bias_limit(diff: torch.Tensor, bound: torch.Tensor, values: torch.Tensor, u: float) -> float:
    """How far ``mean(diff)`` may sit from 0 when the per-token differences are rounding noise.

    Rounding noise within ``bound`` averages out: its mean lies within ``mean(bound) / sqrt(N)`` and
    within four standard errors of the observed spread (``4 * sd(diff) / sqrt(N)``). What does not
    average out is each side storing a log-prob of magnitude ``|v|`` in its dtype, one roundoff each:
    ``2 u mean(|v|)``. A systematic offset beyond the sum is a bias, not noise (a fault shifting
    every token by a fraction of the per-token bound is caught here and nowhere else).
    """
    d = diff.double()
    n = int(d.numel())
    if n == 0:
        return math.inf
    v = values.double().abs()
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    sd = float(d.std()) if n > 1 else 0.0
    return (4.0 * sd + float(bound.double().mean())) / math.sqrt(n) + 2.0 * u * float(v.mean())


# -- the final-logit rounding bound -------------------------------------------------------------
# A narrower model for a narrower question: how far a log-prob moves when one side only rounds its
# final logits to a low-precision dtype (TRL's bfloat16 sampler against a float32 trainer). It is
# checked against means over many tokens, where upstream kernel noise averages out.
#
# A sampler that runs the model in bfloat16 rounds every logit: ``z~_i = z_i (1 + d_i)`` with
# ``|d_i| <= u``, ``u`` the dtype's unit roundoff (``finfo(dtype).eps / 2``; 2^-8 for bfloat16). To
# first order, the log-prob of the sampled token y under ``log_softmax(z / T)`` — over the whole
# vocabulary or renormalised over any kept set — then moves by
#
#     eps_y = dz_y / T - log E_p[exp(dz / T)],  so  |eps_y| <= u (|z_y| + E_p|z|) / T + u^2 E_p[z^2] / T^2
#
# (Jensen below, ``e^x <= 1 + x + x^2`` above), p the distribution the log-prob is taken over.
# :func:`logprob_rounding_bound` returns that per-token bound from the trainer's float32 logits, taking
# the larger expectation of the full and the kept-set distribution, so it holds for the full
# log-softmax and for the renormalised one. A relation between a low-precision sampler's log-probs and
# float32 ones holds "to the dtype" when it holds within this bound. It bounds rounding the final
# logits, not every kernel upstream of them: the relations parity checks against it are means over
# many tokens, where the measured noise sits far inside it.


def logprob_rounding_bound(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    spec: Any,  # a parity.core.spec.SamplingSpec (not imported: emitted scripts inline this module)
    dtype: str | torch.dtype,
    kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token bound ``u (|z_y| + E|z|) / T + u^2 E[z^2] / T^2`` (float64 ``[N]``) for logits ``[N, V]``.

    ``E`` is the larger of the expectations under ``softmax(z / T)`` and, when ``kept`` (padded ids
    ``[N, K]``, ``-1`` = padding) is given, under the distribution renormalised over the kept set.
    """
    if logits.dim() != 2 or sampled.dim() != 1 or sampled.shape[0] != logits.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and sampled {tuple(sampled.shape)}: allowed [N, V] and [N]"
        )
    t = spec.effective_temperature if not spec.greedy else 1.0
    z = logits.double()
    p = torch.softmax(z / t, dim=-1)
    e1, e2 = (p * z.abs()).sum(dim=-1), (p * z * z).sum(dim=-1)
    if kept is not None:
        if kept.dim() != 2 or kept.shape[0] != z.shape[0]:
            raise ValueError(f"kept has shape {tuple(kept.shape)}: allowed [{z.shape[0]}, K] padded ids")
        zk = z.gather(1, kept.clamp(min=0).long())
        q = torch.softmax((zk / t).masked_fill(kept < 0, float("-inf")), dim=-1)
        e1 = torch.maximum(e1, (q * zk.abs()).sum(dim=-1))
        e2 = torch.maximum(e2, (q * zk * zk).sum(dim=-1))
    zy = z.gather(1, sampled.long().unsqueeze(1)).squeeze(1).abs()
    u = unit_roundoff(dtype)
    return u * (zy + e1) / t + u * u * e2 / (t * t)
