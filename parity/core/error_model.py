"""How far two engines' per-token log-probs may differ from rounding alone (engine-free).

:func:`logprob_bound` bounds one token, :func:`mean_bias_limit` a mean (:func:`systematic_bound` plus
``MEAN_BIAS_Z`` standard errors of the measured spread). The derivations: docs/error_model.md."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypedDict, TypeGuard, cast

from parity.errors import UsageError

if TYPE_CHECKING:
    import numpy as np
    import torch
    from torch import Tensor

    # One dtype or several (both sides of a comparison): the looser one counts.
    Dtypes: TypeAlias = str | torch.dtype | Iterable[str | torch.dtype]

# torch is imported by the functions that compute on tensors (their callers have imported it already):
# the records analysis reads the roundoff and the mean-bias limits here without loading torch.

# Unit roundoff (half an ulp at 1) per dtype name.
UNIT_ROUNDOFF: dict[str, float] = {
    "float64": 2.0**-53,
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
}

# Per-side logit error, in units of roundoff of the row's largest |z'|.
LOGIT_ULPS = 8.0
# Standard errors of the measured spread a mean may sit from its systematic bound (about 6e-5 two-sided
# for Gaussian noise; each scenario has a handful of mean gates).
MEAN_BIAS_Z = 4.0
# The float32 normalisation counts once per side: each side sums its own row, in its own kernel's order.
KERNEL_SIDES = 2.0
# A captured kept set's mass (a float32 sum of up to V probabilities) counts as 1 within this: far above
# rounding, far below one missing token of any mass the filters would keep.
SUPPORT_MASS_TOL = 1e-4


def _name(dtype: str | torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in UNIT_ROUNDOFF:
        raise UsageError(f"dtype={dtype!r} has no unit roundoff: allowed {sorted(UNIT_ROUNDOFF)}")
    return name


def _is_torch_dtype(x: object) -> TypeGuard[torch.dtype]:
    torch_module = sys.modules.get("torch")  # a torch.dtype exists only once torch is imported
    return torch_module is not None and isinstance(x, torch_module.dtype)


def unit_roundoff(dtypes: Dtypes) -> float:
    """The unit roundoff of the looser of the given dtypes (both sides of a comparison)."""
    if isinstance(dtypes, str) or _is_torch_dtype(dtypes):
        items: list[str | torch.dtype] = [dtypes]
    else:
        items = list(cast("Iterable[str | torch.dtype]", dtypes))
    if not items:
        raise UsageError("dtypes is empty: name at least one dtype")
    return max(UNIT_ROUNDOFF[_name(d)] for d in items)


def logprob_bound_terms(
    row_absmax: Tensor,
    lse: Tensor,
    logprob: Tensor,
    support_size: Tensor,
    u: float,
) -> Tensor:
    """The bound from its ingredients, one value per token: ``row_absmax`` (max |z'| over finite logits),
    ``lse`` (logsumexp over the support), ``logprob`` and ``support_size``. Non-finite ingredients give an
    infinite bound only where the log-prob itself is non-finite.
    """
    import torch

    n = support_size.double().clamp(min=1.0)
    logits_term = 4.0 * LOGIT_ULPS * u * _finite_abs(row_absmax)
    norm_term = 2.0 * u * (_finite_abs(lse) + _finite_abs(logprob) + torch.log2(n) + 2.0)
    return logits_term + norm_term


def _finite_abs(x: Tensor) -> Tensor:
    """float64 ``|x|``, 0 where it is not finite."""
    import torch

    x = x.double().abs()
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def logprob_bound(
    scaled_logits: Tensor, sampled: Tensor, support: Tensor | None = None, *, dtype: Dtypes = "float32"
) -> Tensor:
    """Per-token bound on ``|lp_sampler - lp_trainer|``, float64 ``[N]`` (docs/error_model.md, section 1).
    ``scaled_logits``: ``[N, V]`` logits divided by the temperature (``-inf`` allowed); ``sampled``: ``[N]`` ids;
    ``support``: bool ``[N, V]`` (``None`` = the whole vocabulary); ``dtype``: both sides' (the looser counts)."""
    z, _, sup, lse, lp = _rows(scaled_logits, sampled, support)
    bound = logprob_bound_terms(_finite_abs(z).amax(dim=-1), lse, lp, sup.sum(dim=-1), unit_roundoff(dtype))
    return bound + KERNEL_SIDES * normalisation_errors(scaled_logits, support)["bound"]


def _rows(
    scaled_logits: Tensor, sampled: Tensor, support: Tensor | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """float64 ``z``, its finite mask, the support's finite mask, ``logsumexp`` over the support and
    the token's log-prob over it (what both bounds read)."""
    import torch

    if scaled_logits.dim() != 2:
        raise UsageError(f"scaled_logits has shape {tuple(scaled_logits.shape)}: allowed [N, V]")
    z = scaled_logits.double()
    finite = torch.isfinite(z)
    sup = finite if support is None else (support & finite)
    lse = torch.logsumexp(torch.where(sup, z, torch.full_like(z, -math.inf)), dim=-1)
    zy = z.gather(1, sampled.long().view(-1, 1)).squeeze(1)
    return z, finite, sup, lse, zy - lse


def kernel_offset(scaled_logits: Tensor, support: Tensor | None = None) -> Tensor:
    """Per row (float64 ``[N]``, >= 0): the largest offset of a float32 ``log_softmax`` over the support from exact,
    measured on the row in every order of ``REDUCTION_ORDERS`` (docs/error_model.md, section 9)."""
    return normalisation_errors(scaled_logits, support)["offset"]


def systematic_bound(
    scaled_logits: Tensor, sampled: Tensor, support: Tensor | None = None, *, dtype: Dtypes = "float32"
) -> Tensor:
    """Per token (float64 ``[N]``): what of ``lp_trainer - lp_sampler`` can have one sign over many tokens: the
    float32 normalisation kernel's offset per side, ``2 u32 |lp|`` for the last float32 operations, and below
    float32 the second-order rounding of the logits (docs/error_model.md, section 2).
    """
    import torch

    z, finite, _, _, lp = _rows(scaled_logits, sampled, support)
    kernel = kernel_offset(scaled_logits, support)
    if support is not None:
        kernel = torch.maximum(kernel, kernel_offset(scaled_logits, None))
    out = KERNEL_SIDES * kernel + 2.0 * UNIT_ROUNDOFF["float32"] * _finite_abs(lp)
    u = unit_roundoff(dtype)
    if u > UNIT_ROUNDOFF["float32"]:
        p = torch.softmax(torch.where(finite, z, torch.full_like(z, -math.inf)), dim=-1)
        e2 = (p * torch.where(finite, z * z, torch.zeros_like(z))).sum(dim=-1)
        out = out + u * u * e2
    return out


# -- the float32 normalisation in every reduction order ---------------------------------------------
# A float32 log_softmax or logsumexp sums exp(z' - m) over the support, in its kernel's order: torch's generic
# CPU path (ATEN_CPU_CAPABILITY=default) and its AVX2 path keep 8 lane accumulators, its AVX-512 path 16, a
# scalar loop one, numpy and cascade sums a pairwise tree. Each order is evaluated on the row itself, never
# only the one this machine runs (docs/error_model.md, section 9).

# (name, lanes): lanes > 0 sums each lane sequentially over the row in index order (ATen's
# vec::map_reduce_all), then combines the lane sums sequentially (the generic vec_reduce_all) and as a tree of
# halves (the AVX shuffles); lanes == 0 is a pairwise tree over neighbours in index order.
REDUCTION_ORDERS: tuple[tuple[str, int], ...] = (("sequential", 1), ("8-lane", 8), ("16-lane", 16), ("pairwise", 0))
# exp and log of a float32 kernel, in ulps of their result: libm's expf is below 1, Sleef's u10 1.0, ATen's
# exp_u20 2.0; twice the largest.
EXP_ULPS = 4.0
# Standard deviations of a fresh draw of rounding errors (an order between the listed ones, another exp): the
# mean gates' MEAN_BIAS_Z.
ORDER_Z = 4.0
# Elements per block when the orders are evaluated (memory: a few float32 copies of a block of rows).
_BLOCK_ELEMENTS = 1 << 22


def _lane_sums(x: np.ndarray, lanes: int) -> tuple[list[np.ndarray], np.ndarray]:
    """Float32 sums of ``x`` ``[N, n]`` with ``lanes`` sequential accumulators in index order (the lane sums
    combined sequentially, then as a tree of halves), and the lane partial sums ``[N, k, lanes]``."""
    import numpy as np

    rows, n = x.shape
    k = max(1, -(-n // lanes))
    padded = np.zeros((rows, k * lanes), dtype=np.float32)  # adding 0.0 is exact: the padding changes nothing
    padded[:, :n] = x
    part = np.add.accumulate(padded.reshape(rows, k, lanes), axis=1, dtype=np.float32)
    acc = part[:, -1, :]
    if lanes == 1:
        return [acc[:, 0]], part
    seq = np.add.accumulate(acc, axis=1, dtype=np.float32)[:, -1]
    tree = acc
    while tree.shape[1] > 1:
        h = tree.shape[1] // 2
        tree = tree[:, :h] + tree[:, h:]
    return [seq, tree[:, 0]], part


def _pairwise_sum(x: np.ndarray) -> np.ndarray:
    """Float32 pairwise sum of ``x`` ``[N, n]`` over neighbours in index order."""
    import numpy as np

    rows, n = x.shape
    width = 1 << max(0, (n - 1).bit_length())
    cur = np.zeros((rows, width), dtype=np.float32)
    cur[:, :n] = x
    while cur.shape[1] > 1:
        cur = cur[:, 0::2] + cur[:, 1::2]
    return cur[:, 0]


def order_sums(x: np.ndarray) -> dict[str, np.ndarray]:
    """The float32 sum of the terms ``x >= 0`` ``[N, n]`` in every order of ``REDUCTION_ORDERS`` (a lane order once
    per combine: ``"8-lane"`` sequential, ``"8-lane tree"``)."""
    out: dict[str, np.ndarray] = {}
    for name, lanes in REDUCTION_ORDERS:
        if lanes == 0:
            out[name] = _pairwise_sum(x)
            continue
        sums, _ = _lane_sums(x, lanes)
        for suffix, val in zip(("", " tree"), sums, strict=False):
            out[name + suffix] = val
    return out


def _walk_scale(x: np.ndarray) -> np.ndarray:
    """float64 ``[N]``: the standard deviation of a sequential float32 sum's rounding errors (the longest chain, so
    the largest of the orders'), each addition erring by up to ``u s_k`` at partial sum ``s_k``: independent between
    distinct terms, and alike for tied ones (they round the same way within a binade), so each group of equal terms
    counts as one draw of ``u * sum_k s_k``: ``u sqrt(sum over groups of (sum_k s_k)^2)``."""
    import numpy as np

    rows, n = x.shape
    _, part = _lane_sums(x, 1)
    s = np.zeros((rows, n), dtype=np.float64)
    s[:, 1:] = np.where(x[:, 1:] > 0, part[:, 1:, 0], 0.0)  # the first term and adding 0 (off the support): exact
    order = np.argsort(x, axis=1, kind="stable")
    xs = np.take_along_axis(x, order, axis=1)
    ss = np.take_along_axis(s, order, axis=1)
    new = np.ones((rows, n), dtype=bool)
    new[:, 1:] = xs[:, 1:] != xs[:, :-1]
    group = np.cumsum(new, axis=1) - 1 + (np.arange(rows) * n)[:, None]
    sums = np.bincount(group.ravel(), weights=ss.ravel(), minlength=rows * n).reshape(rows, n)
    out: np.ndarray = UNIT_ROUNDOFF["float32"] * np.sqrt((sums * sums).sum(axis=1))
    return out


class NormalisationErrors(TypedDict):
    offset: Tensor  # float64 [N]: the largest |float32 log-sum - exact| over the orders, measured on the row
    bound: Tensor  # float64 [N]: what a float32 log-sum may lie from exact in any of them, the exp and log included
    log_sum: Tensor  # float64 [N]: log sum exp(z' - m) over the support (exact)
    row_max: Tensor  # float64 [N]: m, the largest scaled logit of the support


def normalisation_errors(scaled_logits: Tensor, support: Tensor | None = None) -> NormalisationErrors:
    """How far a float32 ``log sum exp(z' - m)`` over the support lies from exact, per row, in every order of
    ``REDUCTION_ORDERS`` with this machine's float32 exp and a correctly rounded one (``offset``), and the bound
    a kernel's result is held to (``bound``; docs/error_model.md, section 9)."""
    import numpy as np
    import torch

    z32 = scaled_logits.to(torch.float32)
    if support is not None:
        z32 = z32.masked_fill(~support, -math.inf)
    rows, n = z32.shape
    out = {k: torch.zeros(rows, dtype=torch.float64) for k in ("offset", "bound", "log_sum", "row_max")}
    u = UNIT_ROUNDOFF["float32"]
    step = max(1, _BLOCK_ELEMENTS // max(n, 1))
    for lo in range(0, rows, step):
        z = z32[lo : lo + step]
        finite = torch.isfinite(z)
        m = torch.where(finite, z, torch.full_like(z, -math.inf)).amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        arg = torch.where(finite, z - m, torch.full_like(z, -math.inf))  # float32, as every kernel shifts
        exact_terms = torch.exp(torch.where(finite, z.double() - m.double(), torch.full_like(z, -math.inf, dtype=torch.float64)))
        s = exact_terms.sum(dim=-1)
        ok = s > 0
        s = torch.where(ok, s, torch.ones_like(s))
        log_s = torch.log(s)
        offset = torch.zeros_like(s)
        terms = (torch.exp(arg).numpy(), torch.exp(arg.double()).float().numpy())  # this machine's exp, exact exp
        for x in terms:
            for val in order_sums(x).values():
                got = torch.from_numpy(val.astype(np.float64)).clamp(min=1.0)  # the largest term is exp(0) = 1
                offset = torch.maximum(offset, (torch.log(got) - log_s).abs())
        walk = torch.from_numpy(_walk_scale(terms[0])) / s
        # Each term's relative error beyond this machine's: another exp (EXP_ULPS ulps) and another rounding of
        # its argument (u |z' - m|); a term below float32's normal range carries an absolute 2**-149.
        spread = (exact_terms / s.unsqueeze(1) * torch.where(finite, (z.double() - m.double()).abs(), 0.0)).sum(-1)
        term_rel = u * (2.0 * EXP_ULPS + spread) + n * 2.0**-149 / s
        # The log of the sum, rounded: EXP_ULPS ulps of its own value.
        bound = offset + ORDER_Z * walk + term_rel + 2.0 * EXP_ULPS * u * log_s.abs()
        sl = slice(lo, lo + z.shape[0])
        zero = torch.zeros_like(s)
        out["offset"][sl] = torch.where(ok, offset, zero)
        out["bound"][sl] = torch.where(ok, bound, zero)
        out["log_sum"][sl] = torch.where(ok, log_s, zero)
        out["row_max"][sl] = m.squeeze(1).double()
    return {"offset": out["offset"], "bound": out["bound"], "log_sum": out["log_sum"], "row_max": out["row_max"]}


def log_softmax_bound(scaled_logits: Tensor, support: Tensor | None = None) -> Tensor:
    """Per token (float64 ``[N, V]``): how far a float32 ``log_softmax`` over the support may lie from exact in
    any order of ``REDUCTION_ORDERS``: the row's normalisation bound, the float32 ``z' - m`` and the final
    subtraction (docs/error_model.md, section 9). 0 off the support (``-inf`` on every side)."""
    import torch

    ne = normalisation_errors(scaled_logits, support)
    z = scaled_logits.double()
    inside = torch.isfinite(z) if support is None else (support & torch.isfinite(z))
    shifted = (z - ne["row_max"].unsqueeze(1)).abs()
    lp = (shifted + ne["log_sum"].unsqueeze(1)).abs()  # |z' - m - log S| >= |lp| up to the sign of z' - m
    u = UNIT_ROUNDOFF["float32"]
    out = ne["bound"].unsqueeze(1) + u * (shifted + lp)
    return torch.where(inside, out, torch.zeros_like(out))


def headroom(diff: Tensor, bound: Tensor) -> float:
    """``max |diff| / bound`` over the tokens (0 for none; NaN in ``diff`` counts as infinite)."""
    import torch

    if diff.numel() == 0:
        return 0.0
    d = diff.double().abs().nan_to_num(math.inf)
    return float((d / bound.double().clamp(min=torch.finfo(torch.float64).tiny)).max())


def mean_bias_limit(n: int, systematic_mean: float, spread_sd: float) -> float:
    """How far ``mean(diff)`` over ``n`` tokens may sit from 0 without a bias, the rule of every mean gate:
    ``systematic_mean`` (mean :func:`systematic_bound`) plus ``MEAN_BIAS_Z`` standard errors of ``spread_sd``
    (a reference comparison's spread). It is the verdict's resolution (docs/error_model.md, section 2)."""
    if n <= 0:
        return math.inf
    sd = spread_sd if n > 1 else 0.0
    return systematic_mean + MEAN_BIAS_Z * sd / math.sqrt(n)


def log_s_signature(n: int, cross: float, log_s_sq: float, spread_sd: float) -> dict[str, float] | None:
    """The least-squares slope of ``d`` on log S through 0 (1 = a full-vocabulary trainer, 0 = none of
    log S), from ``sum(d * log S)`` and ``sum(log S^2)``, with its standard error from the reference spread."""
    if n == 0 or log_s_sq <= 0.0:
        return None
    return {"slope": cross / log_s_sq, "slope_se": spread_sd / math.sqrt(log_s_sq)}


def mean_bias_entry(n: int, mean: float, systematic_mean: float, spread_sd: float,
                    signature: dict[str, float] | None = None) -> dict[str, object]:
    """One mean gate's numbers: the mean, its limit split into systematic and statistical parts (the
    limit is the gate's resolution: the smallest per-token bias it detects)."""
    limit = mean_bias_limit(n, systematic_mean, spread_sd)
    out: dict[str, object] = {"mean": mean, "limit": limit, "systematic": systematic_mean,
                           "statistical": limit - systematic_mean, "spread_sd": spread_sd, "tokens": n}
    if signature is not None:
        out["log_s_signature"] = signature
    return out


# -- the mean-bias gate on two log-prob columns -----------------------------------------------------
# What a training run logs per token is the sampler's and the trainer's log-prob of the sampled token. The
# gate on those alone (logprob_mean_bias): the log of the mean IS ratio, whose honest value is 0 whatever
# the drift, against a systematic allowance from the records' stated facts plus MEAN_BIAS_Z standard errors
# over sequences. The derivation: docs/error_model.md, section 8.

# Below this many sequences a between-sequence standard error is not trusted: the token spread is used
# with an effective n of one per sequence (every token of a sequence taken as perfectly correlated).
MIN_SEQUENCES_FOR_SE = 8
# The widest vocabulary in use (Gemma 3's 262,144), taken when the records do not state vocab_size.
WIDEST_VOCAB = 262_144
# The sign test judges a one-signed shift only: "nearly every token" below its systematic allowance.
NEARLY_ALL_NEGATIVE = 0.9


def normalisation_allowance(n: int, u: float) -> float:
    """How far one side's normalisation (a float sum of ``n`` exponentials, then its log) may shift every
    log-prob of a row one way: ``MEAN_BIAS_Z * sqrt(n) * u`` (the probabilistic bound of a sum of ``n``
    terms, each addition rounded once)."""
    return MEAN_BIAS_Z * math.sqrt(max(int(n), 1)) * u


class StatedFacts(TypedDict):
    vocab: int
    sampler_support: int
    u: float
    assumed: list[str]
    allowance: float


def stated_facts(vocab_size: int, sampler_dtype: str, trainer_dtype: str, top_k: int) -> StatedFacts:
    """What the two-column gate takes from the records' stated facts (``""`` / 0: not stated): the vocabulary
    (the widest in use when not stated), each side's normalisation size, the accumulator's roundoff, the
    per-token allowance of both normalisations, and what was assumed."""
    assumed = []
    vocab = vocab_size
    if not vocab:
        vocab = WIDEST_VOCAB
        assumed.append(f"vocab_size not stated: taken as {WIDEST_VOCAB:,} (the widest vocabulary in use); "
                       f"records metadata vocab_size narrows the systematic allowance")
    for side, key, dt in (("sampler", "dtype", sampler_dtype), ("trainer", "trainer_dtype", trainer_dtype)):
        if not dt:
            assumed.append(f"the {side}'s dtype not stated ({key} metadata): its normalisation taken as a float32 "
                           f"sum, the widest in use")
    u = UNIT_ROUNDOFF["float64"] if sampler_dtype == trainer_dtype == "float64" else UNIT_ROUNDOFF["float32"]
    n_s = min(top_k, vocab) if top_k > 0 else vocab
    return {"vocab": vocab, "sampler_support": n_s, "u": u, "assumed": assumed,
            "allowance": normalisation_allowance(n_s, u) + normalisation_allowance(vocab, u)}


def sign_test(*, tokens: int, effective_n: float, d_sum: float, d_sq: float, negative: int,
              positive: int) -> dict[str, object]:
    """The sign part of the two-column gate: of the tokens beyond their systematic allowance, the share below
    it, against the ``Phi(s / 2)`` an honest drift gives (docs/error_model.md, section 8).
    """
    m = negative + positive
    n = max(tokens, 1)
    sd = math.sqrt(max(d_sq / n - (d_sum / n) ** 2, 0.0))
    honest = 0.5 * (1.0 + math.erf(sd / 2.0 / math.sqrt(2.0)))
    deff = max(n / effective_n, 1.0) if effective_n > 0 else float(n)
    se = math.sqrt(honest * (1.0 - honest) * deff / m) if m else math.inf
    share = negative / m if m else 0.0
    z = (share - honest) / se if m and se > 0 else (math.inf if m and share > honest else 0.0)
    limit = max(NEARLY_ALL_NEGATIVE, honest + MEAN_BIAS_Z * se)
    return {"beyond_allowance": m, "negative_share": share, "honest_share": honest, "z": z, "limit": limit,
            "failed": bool(m and share >= NEARLY_ALL_NEGATIVE and z > MEAN_BIAS_Z)}


def ratio_bias_entry(
    *, tokens: int, sequences: int, e_sum: float, e_sq: float, seq_e_sq: float, seq_ne: float, seq_n_sq: float,
    d_sum: float, lp_abs_sum: float, sampler_support: int, trainer_support: int, accumulate_u: float,
    d_sq: float = 0.0, beyond_negative: int = 0, beyond_positive: int = 0,
) -> dict[str, object] | None:
    """The mean-bias gate of two log-prob columns from mergeable sums of ``e = expm1(d)``, ``d = trainer - sampler``:
    ``mean`` the log of the mean IS ratio, ``mean_diff`` the plain mean of ``d``; the per-sequence sums and the
    two sides' support sizes: docs/error_model.md, section 8."""
    if tokens <= 0:
        return None
    n = tokens
    ebar = e_sum / n
    rbar = 1.0 + ebar
    mean = math.log1p(ebar) if rbar > 0 else -math.inf
    var = max(e_sq - n * ebar * ebar, 0.0) / (n - 1) if n > 1 else 0.0
    se_tokens = math.sqrt(var / n)
    if sequences >= MIN_SEQUENCES_FOR_SE:
        ss = max(seq_e_sq - 2.0 * ebar * seq_ne + ebar * ebar * seq_n_sq, 0.0)
        se = max(math.sqrt(sequences / (sequences - 1) * ss) / n, se_tokens)
        method = f"between {sequences} sequences"
    else:
        se = math.sqrt(var / max(sequences, 1))
        method = f"effective n = {max(sequences, 1)} (fewer than {MIN_SEQUENCES_FOR_SE} sequences: each counts once)"
    effective_n = n * se_tokens**2 / se**2 if se > 0 else float(n)
    se_b = se / rbar if rbar > 0 else math.inf
    systematic = (normalisation_allowance(sampler_support, accumulate_u)
                  + normalisation_allowance(trainer_support, accumulate_u)
                  + 2.0 * UNIT_ROUNDOFF["float32"] * lp_abs_sum / n)
    statistical = MEAN_BIAS_Z * se_b
    sign = sign_test(tokens=n, effective_n=effective_n, d_sum=d_sum, d_sq=d_sq, negative=beyond_negative,
                     positive=beyond_positive)
    return {"sign_test": sign, "mean": mean, "limit": systematic + statistical, "systematic": systematic, "statistical": statistical,
            "spread_sd": math.sqrt(var), "tokens": n, "sequences": sequences, "mean_diff": d_sum / n,
            "kl_estimate": mean - d_sum / n, "standard_error": se_b, "effective_n": effective_n,
            "standard_error_from": method, "sampler_support": int(sampler_support),
            "trainer_support": int(trainer_support)}


# -- the final-logit rounding bound -------------------------------------------------------------
# A narrower model for a narrower question: how far a log-prob moves when one side only rounds its
# final logits to a low-precision dtype (TRL's bfloat16 sampler against a float32 trainer), checked
# against means over many tokens. The derivation: docs/error_model.md, section 6.


class TemperatureSpec(Protocol):
    """What the rounding bound reads of a sampling spec."""

    @property
    def greedy(self) -> bool: ...

    @property
    def effective_temperature(self) -> float: ...


def logprob_rounding_bound(
    logits: Tensor,
    sampled: Tensor,
    spec: TemperatureSpec,  # a SamplingSpec, or the emitted scripts' stand-in (they inline this module)
    dtype: str | torch.dtype,
    kept: Tensor | None = None,
) -> Tensor:
    """Per-token bound ``u (|z_y| + E|z|) / T + u^2 E[z^2] / T^2`` (float64 ``[N]``) for logits ``[N, V]``; ``E`` is
    the larger of the expectations under ``softmax(z / T)`` and, given ``kept`` (padded ids ``[N, K]``, ``-1`` =
    padding), under its renormalisation over the kept set (docs/error_model.md, section 6)."""
    import torch

    if logits.dim() != 2 or sampled.dim() != 1 or sampled.shape[0] != logits.shape[0]:
        raise UsageError(
            f"logits {tuple(logits.shape)} and sampled {tuple(sampled.shape)}: allowed [N, V] and [N]"
        )
    t = spec.effective_temperature if not spec.greedy else 1.0
    z = logits.double()
    p = torch.softmax(z / t, dim=-1)
    e1, e2 = (p * z.abs()).sum(dim=-1), (p * z * z).sum(dim=-1)
    if kept is not None:
        if kept.dim() != 2 or kept.shape[0] != z.shape[0]:
            raise UsageError(f"kept has shape {tuple(kept.shape)}: allowed [{z.shape[0]}, K] padded ids")
        zk = z.gather(1, kept.clamp(min=0).long())
        q = torch.softmax((zk / t).masked_fill(kept < 0, float("-inf")), dim=-1)
        e1 = torch.maximum(e1, (q * zk.abs()).sum(dim=-1))
        e2 = torch.maximum(e2, (q * zk * zk).sum(dim=-1))
    zy = z.gather(1, sampled.long().unsqueeze(1)).squeeze(1).abs()
    u = unit_roundoff(dtype)
    return u * (zy + e1) / t + u * u * e2 / (t * t)
