"""How far a log-prob may move when one side computes its logits in a low-precision dtype (engine-free).

A sampler that runs the model in bfloat16 rounds every logit: ``z~_i = z_i (1 + d_i)`` with
``|d_i| <= u``, ``u`` the dtype's unit roundoff (``finfo(dtype).eps / 2``; 2^-8 for bfloat16). To
first order, the log-prob of the sampled token y under ``log_softmax(z / T)`` — over the whole
vocabulary or renormalised over any kept set — then moves by

    eps_y = dz_y / T - log E_p[exp(dz / T)],  so  |eps_y| <= u (|z_y| + E_p|z|) / T + u^2 E_p[z^2] / T^2

(Jensen below, ``e^x <= 1 + x + x^2`` above), p the distribution the log-prob is taken over.
:func:`logprob_rounding_bound` returns that per-token bound from the trainer's float32 logits, taking
the larger expectation of the full and the kept-set distribution, so it holds for the full
log-softmax and for the renormalised one. A relation between a low-precision sampler's log-probs and
float32 ones holds "to the dtype" when it holds within this bound. It bounds rounding the final
logits, not every kernel upstream of them: the relations parity checks against it are means over
many tokens, where the measured noise sits far inside it.
"""

from __future__ import annotations

import torch

from parity.spec import SamplingSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def unit_roundoff(dtype: str | torch.dtype) -> float:
    """``finfo(dtype).eps / 2``: the largest relative rounding error of one value in ``dtype``."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype={dtype!r} is invalid: allowed {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} is invalid: allowed a floating-point dtype")
    return float(torch.finfo(dtype).eps) / 2.0


def logprob_rounding_bound(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    spec: SamplingSpec,
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
