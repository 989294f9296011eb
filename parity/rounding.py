"""How far a log-prob may move when one side computes its logits in a low-precision dtype (engine-free).

A sampler that runs the model in bfloat16 rounds every logit: ``z~_i = z_i (1 + d_i)`` with
``|d_i| <= u``, ``u`` the dtype's unit roundoff (``finfo(dtype).eps / 2``; 2^-8 for bfloat16). To
first order, the log-prob of the sampled token y under ``log_softmax(z / T)`` — over the whole
vocabulary or renormalised over any kept set — then moves by

    eps_y = (dz_y - E_p[dz]) / T,   so   |eps_y| <= u * (|z_y| + E_p|z|) / T,

with p the (renormalised) distribution. :func:`logprob_rounding_bound` returns that per-token bound
from the trainer's float32 logits; a relation between a low-precision sampler's log-probs and
float32 ones holds "to the dtype" when it holds within this bound. It is a model of rounding the
final logits, not a proof about every kernel: the relations parity checks against it are means over
many tokens, where it holds with a wide margin.
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
    logits: torch.Tensor, sampled: torch.Tensor, spec: SamplingSpec, dtype: str | torch.dtype
) -> torch.Tensor:
    """Per-token bound ``u * (|z_y| + E_p|z|) / T`` (float64 ``[N]``) for logits ``[N, V]``.

    ``p`` is ``softmax(z / T)`` over the whole vocabulary: the kept-set expectation is no larger
    than the maximum of ``|z|``, and the full expectation keeps the bound independent of the filter.
    """
    if logits.dim() != 2 or sampled.dim() != 1 or sampled.shape[0] != logits.shape[0]:
        raise ValueError(
            f"logits {tuple(logits.shape)} and sampled {tuple(sampled.shape)}: allowed [N, V] and [N]"
        )
    t = spec.effective_temperature if not spec.greedy else 1.0
    z = logits.double()
    p = torch.softmax(z / t, dim=-1)
    zy = z.gather(1, sampled.long().unsqueeze(1)).squeeze(1).abs()
    return unit_roundoff(dtype) * (zy + (p * z.abs()).sum(dim=-1)) / t
