"""The training-log view of a records analysis: drift per training step, its trend, and the ``drift_trend`` gate.

The per-step state is small mergeable accumulators (docs/records.md, section 7); the gate and the choice of
:data:`TREND_Z`, :data:`BAND_K` and :data:`MIN_STEPS`: docs/error_model.md, section 5."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from parity.errors import UsageError
from parity.report.blocks import TrendJson

TREND_GATE = "drift_trend"
# The slope must exceed TREND_Z standard errors, and some step after the baseline must sit more than
# BAND_K noise units above the baseline mean (docs/error_model.md, section 5, says why these values).
TREND_Z = 4.0
BAND_K = 3.0
BASELINE_STEPS = 3  # the first steps, whose mean |diff| is the band's centre
MIN_STEPS = 6  # below this the residual spread has under 4 degrees of freedom: the gate is not evaluated
# The comparisons kept per step (summary stream names) and their names in the report.
COMPARISONS = ("replay", "recompute", "user")
REPORT_NAMES = {"replay": "replay", "recompute": "recompute", "user": "trainer_under_test"}
# Which support equality belongs to each comparison: replay's gate (is the captured S_q the sampler's
# whole support) for replay and the trainer under test, recompute's own for recompute.
SUPPORT_OF = {"replay": "replay", "recompute": "recompute", "user": "replay"}
EPS = float(np.finfo(np.float64).eps)


# -- the mergeable accumulators --------------------------------------------------------------------


@dataclass
class StepStream:
    """One comparison's differences ``d = trainer - sampler`` at one step: every compared token (``n``, ``total``,
    ``total_abs``), the finite ``|d|``'s moments (``fin_*``) and the largest headroom (docs/records.md, section 7)."""

    n: int = 0
    total: float = 0.0
    total_abs: float = 0.0
    fin_n: int = 0
    fin_mean: float = 0.0
    fin_m2: float = 0.0
    head_n: int = 0
    headroom: float = 0.0

    def merge(self, o: StepStream) -> None:
        self.n += o.n
        self.total += o.total
        self.total_abs += o.total_abs
        if o.fin_n:
            if self.fin_n == 0:
                self.fin_n, self.fin_mean, self.fin_m2 = o.fin_n, o.fin_mean, o.fin_m2
            else:
                n = self.fin_n + o.fin_n
                delta = o.fin_mean - self.fin_mean
                # Written symmetrically in the two sides, so a merge gives the same bits either way round.
                self.fin_mean = (self.fin_n * self.fin_mean + o.fin_n * o.fin_mean) / n
                self.fin_m2 = self.fin_m2 + o.fin_m2 + delta * delta * (self.fin_n * o.fin_n / n)
                self.fin_n = n
        self.head_n += o.head_n
        self.headroom = max(self.headroom, o.headroom)

    @property
    def mean_bias(self) -> float:
        return self.total / self.n if self.n else 0.0

    @property
    def mean_abs(self) -> float:
        return self.total_abs / self.n if self.n else 0.0

    @property
    def abs_se(self) -> float:
        """Per-token standard error of the step's mean |diff|: the sample sd of |d| over sqrt(n) (0 for one token)."""
        if self.fin_n < 2:
            return 0.0
        return math.sqrt(max(self.fin_m2, 0.0) / (self.fin_n - 1) / self.fin_n)

    def to_json(self) -> list[float]:
        return list(self.__dict__.values())


@dataclass
class StepAcc:
    """What one scenario's per-step view needs at one step: sizes, a :class:`StepStream` per comparison,
    and the replay (captured S_q complete) and recompute (same support) equality counts."""

    sequences: int = 0
    tokens: int = 0
    streams: dict[str, StepStream] = field(default_factory=lambda: {k: StepStream() for k in COMPARISONS})
    replay_ok: int = 0
    replay_n: int = 0
    recompute_eq: int = 0
    recompute_n: int = 0

    COUNTS = ("sequences", "tokens", "replay_ok", "replay_n", "recompute_eq", "recompute_n")

    def merge(self, o: StepAcc) -> None:
        for k in self.COUNTS:
            setattr(self, k, getattr(self, k) + getattr(o, k))
        for k in COMPARISONS:
            self.streams[k].merge(o.streams[k])

    def support(self, which: str) -> tuple[int, int]:
        return (self.replay_ok, self.replay_n) if which == "replay" else (self.recompute_eq, self.recompute_n)

    def to_json(self) -> dict[str, object]:
        return {**self.__dict__, "streams": {k: s.to_json() for k, s in self.streams.items()}}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StepAcc:
        return cls(**{**d, "streams": {k: StepStream(*v) for k, v in d["streams"].items()}})


def merge_steps(into: dict[int, StepAcc], other: dict[int, StepAcc]) -> None:
    """Add ``other``'s per-step accumulators to ``into`` (steps it lacks are copied, never shared)."""
    for step, acc in other.items():
        into.setdefault(step, StepAcc()).merge(acc)


def grouped_streams(slot: np.ndarray, n_slots: int, d: np.ndarray) -> list[StepStream]:
    """One :class:`StepStream` per slot (step) from the differences ``d`` of tokens whose slot is ``slot``
    (finite pairs, :func:`parity.judge.streams.finite_pair`); its sums are float64 sums in token order."""
    n = np.bincount(slot, minlength=n_slots)
    ad = np.abs(d)
    with np.errstate(invalid="ignore"):
        total = np.bincount(slot, weights=d, minlength=n_slots)
        total_abs = np.bincount(slot, weights=ad, minlength=n_slots)
    fin = np.isfinite(ad)
    fs, fa = slot[fin], ad[fin]
    fn = np.bincount(fs, minlength=n_slots)
    fmean = np.bincount(fs, weights=fa, minlength=n_slots) / np.maximum(fn, 1)
    fm2 = np.bincount(fs, weights=(fa - fmean[fs]) ** 2, minlength=n_slots)
    return [StepStream(int(n[i]), float(total[i]), float(total_abs[i]), int(fn[i]), float(fmean[i]) if fn[i] else 0.0,
                       float(fm2[i])) for i in range(n_slots)]


def grouped_headroom(slot: np.ndarray, n_slots: int, key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per slot: how many tokens carry a headroom key (``|d| / bound``) and the largest (0 where none)."""
    count = np.bincount(slot, minlength=n_slots)
    top = np.zeros(n_slots, dtype=np.float64)
    if key.size:
        np.maximum.at(top, slot, np.where(np.isnan(key), math.inf, key))
    return count, top


# -- the report: per-step entries and the trend ----------------------------------------------------


def over(value: float, limit: float) -> bool:
    return not (value <= limit)  # NaN fails


def drift_trend(steps: Sequence[int], means: Sequence[float], token_se: Sequence[float], comparison: str, *,
                tokens: Sequence[int] | None = None) -> TrendJson:
    """Fit mean |diff| (``means``, one per step, ascending ``steps``) against step and judge its growth.

    ``token_se``: each step's per-token standard error of its mean; ``tokens``: each step's token count (for the
    float64 rounding floor of the noise). The rule and its parameters: docs/error_model.md, section 5."""
    z, band_k, baseline, min_steps = TREND_Z, BAND_K, BASELINE_STEPS, MIN_STEPS
    x, y, se = (np.asarray(v, dtype=np.float64) for v in (steps, means, token_se))
    n = int(x.size)
    if n and bool(np.any(np.diff(x) <= 0)):
        raise UsageError("drift_trend: steps must be strictly ascending")
    base_steps = [int(s) for s in steps[:baseline]] if n > baseline else []
    first, last = (int(steps[0]), int(steps[-1])) if n else (None, None)
    fit = TrendJson(comparison=comparison, steps=n, first_step=first, last_step=last, slope=None, intercept=None,
                    slope_se=None, slope_se_residual=None, slope_se_tokens=None, z=z, limit=None,
                    baseline_steps=base_steps, baseline_mean=None, noise=None, band_k=band_k, band_lo=None, band_hi=None,
                    first_step_outside=None, evaluated=False, passed=None, reason="")
    bad = np.flatnonzero(~np.isfinite(y))
    if bad.size:
        # An infinite (or NaN) mean |diff| is drift beyond any band: the gate fails at that step.
        s = int(steps[int(bad[0])])
        return {**fit, "first_step_outside": s, "evaluated": True, "passed": False,
                "reason": f"mean |diff| is not finite at step {s}"}
    if n >= 2:
        xc = x - x.mean()
        sxx = float(xc @ xc)
        slope = float(xc @ (y - y.mean())) / sxx
        intercept = float(y.mean() - slope * x.mean())
        resid = y - (intercept + slope * x)
        s_res = math.sqrt(float(resid @ resid) / (n - 2)) if n > 2 else math.nan
        se_tok = math.sqrt(float((xc * xc) @ (se * se))) / sxx
        # Float64 rounding of the steps' sums: a floor, so exactly flat values never read as a trend.
        most = int(max(tokens)) if tokens is not None and len(tokens) else 1
        floor = EPS * max(most, 1) * float(np.max(np.abs(y)))
        noise = max(s_res if n > 2 else 0.0, math.sqrt(float(np.mean(se * se))), floor)
        slope_se = max(s_res / math.sqrt(sxx) if n > 2 else 0.0, se_tok, floor / math.sqrt(sxx))
        fit = {**fit, "slope": slope, "intercept": intercept, "slope_se": slope_se,
               "slope_se_residual": s_res / math.sqrt(sxx) if n > 2 else None, "slope_se_tokens": se_tok,
               "limit": z * slope_se, "noise": noise}
        if n > baseline:
            mu0 = float(np.mean(y[:baseline]))
            hi = mu0 + band_k * noise
            out = [int(s) for s, m in zip(steps[baseline:], y[baseline:], strict=True) if over(float(m), hi)]
            fit = {**fit, "baseline_mean": mu0, "band_lo": mu0 - band_k * noise, "band_hi": hi,
                   "first_step_outside": out[0] if out else None}
    if n < min_steps:
        why = (f"{n} step(s) with {comparison} values"
               + (f" ({', '.join(str(int(s)) for s in steps[:8])}{' ...' if n > 8 else ''})" if n else "")
               + f": the trend gate needs at least {min_steps} (the first {baseline} are its baseline, and fewer "
               f"steps leave the residual spread under {min_steps - 2} degrees of freedom)")
        return {**fit, "reason": why}
    fitted, limit = fit["slope"], fit["limit"]
    assert fitted is not None and limit is not None  # fitted: min_steps > baseline >= 1
    passed = not (over(fitted, limit) and fit["first_step_outside"] is not None)
    return {**fit, "evaluated": True, "passed": passed}
