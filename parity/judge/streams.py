"""Mergeable streams of per-token differences: counts, sums, moments, maxima, histograms and the positions a
violation names; the gates' statistics are kept exactly (docs/records.md, section 5).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from parity.core.violation import Position
from parity.report import blocks

# Histogram of |diff|: bin 0 exact zeros, bin 1 below 1e-16, then 0.01-decade bins up to 1e4, then one
# overflow bin; non-finite differences are counted apart.
HIST_LO, HIST_HI, HIST_STEP = -16.0, 4.0, 0.01
HIST_LOG_BINS = int(round((HIST_HI - HIST_LO) / HIST_STEP))
HIST_BINS = HIST_LOG_BINS + 3
TINY = float(np.finfo(np.float64).tiny)
# Histogram of |diff| / bound for the drift plot (parity.report.plots.DRIFT_RANGE): 0.01-decade bins
# over [1e-4, 1e4], values below (exact matches too) in the first bin, above (inf, NaN) in the last.
HEAD_LO, HEAD_HI, HEAD_STEP = -4.0, 4.0, 0.01
HEAD_BINS = int(round((HEAD_HI - HEAD_LO) / HEAD_STEP))


def finite_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a - b in float64 as :func:`parity.core.metrics.difference`: equal infinities 0, NaN -> inf."""
    a = a.astype(np.float64, copy=False)
    b = b.astype(np.float64, copy=False)
    with np.errstate(invalid="ignore"):
        d = a - b
    if bool(np.isfinite(d).all()):  # no infinity or NaN on either side: nothing to map
        return np.asarray(d, dtype=np.float64)
    both = np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b))
    d = np.where(both, 0.0, d)
    return np.where(np.isnan(d), math.inf, d)


def _hist_index(ad: np.ndarray) -> np.ndarray:
    """Bins of finite |d| values."""
    idx = np.full(ad.shape, 1, dtype=np.int64)
    idx[ad == 0] = 0
    pos = ad > 0
    with np.errstate(divide="ignore"):
        lg = np.log10(ad[pos])
    b = np.floor((lg - HIST_LO) / HIST_STEP).astype(np.int64) + 2
    idx[pos] = np.clip(b, 1, HIST_BINS - 1)
    return idx


def _bin_value(b: int, max_abs: float) -> float:
    if b == 0:
        return 0.0
    if b == 1:
        return float(min(10.0**HIST_LO, max_abs))
    if b == HIST_BINS - 1:
        return max_abs
    return float(min(10.0 ** (HIST_LO + (b - 2 + 0.5) * HIST_STEP), max_abs))


@dataclass
class Worst:
    """The n entries with the largest key (ties: the earliest order), mergeable. Each names a :class:`Position`."""

    n: int
    items: list[tuple[float, tuple[int, int, int], Position]] = field(default_factory=list)

    def offer(self, key: np.ndarray, order: Callable[[int], tuple[int, int, int]], position: Callable[[int], Position]) -> None:
        if not key.size or self.n <= 0:
            return
        k = np.where(np.isnan(key), math.inf, key)
        take = np.argsort(-k, kind="stable")[: self.n]
        for i in take:
            self.items.append((float(k[i]), order(int(i)), position(int(i))))
        self._trim()

    def _trim(self) -> None:
        self.items.sort(key=lambda x: (-x[0], x[1]))
        del self.items[self.n :]

    def merge(self, other: Worst) -> None:
        self.items += other.items
        self._trim()

    def positions(self, n: int) -> tuple[Position, ...]:
        return tuple(p for _, _, p in self.items[:n])


@dataclass
class First:
    """The first n (by order) positions where a flag holds, mergeable."""

    n: int
    items: list[tuple[tuple[int, int, int], Position]] = field(default_factory=list)

    def offer(self, mask: np.ndarray, order: Callable[[int], tuple[int, int, int]], position: Callable[[int], Position]) -> None:
        if self.n <= 0:
            return
        for i in np.flatnonzero(mask)[: self.n]:
            self.items.append((order(int(i)), position(int(i))))
        self.items.sort(key=lambda x: x[0])
        del self.items[self.n :]

    def merge(self, other: First) -> None:
        self.items = sorted(self.items + other.items, key=lambda x: x[0])[: self.n]

    def positions(self, n: int) -> tuple[Position, ...]:
        return tuple(p for _, p in self.items[:n])


@dataclass
class DiffStream:
    """max / mean / mean |.| / p99 of one difference, streamed."""

    n: int = 0
    total: float = 0.0
    total_abs: float = 0.0
    max_abs: float = 0.0
    nonfinite: int = 0
    hist: np.ndarray = field(default_factory=lambda: np.zeros(HIST_BINS, dtype=np.int64))

    def add(self, d: np.ndarray) -> None:
        """``d``: finite-pair differences (see :func:`finite_pair`)."""
        if not d.size:
            return
        ad = np.abs(d)
        self.n += int(d.size)
        with np.errstate(invalid="ignore"):
            self.total += float(np.sum(d))
            self.total_abs += float(np.sum(ad))
        self.max_abs = max(self.max_abs, float(np.max(ad)))
        fin = np.isfinite(ad)
        n_fin = int(fin.sum())
        self.nonfinite += int(d.size - n_fin)
        vals = ad if n_fin == ad.size else ad[fin]
        if vals.any():
            self.hist += np.bincount(_hist_index(vals), minlength=HIST_BINS)
        else:  # exact matches only: bin 0
            self.hist[0] += vals.size

    def merge(self, other: DiffStream) -> None:
        self.n += other.n
        self.total += other.total
        self.total_abs += other.total_abs
        self.max_abs = max(self.max_abs, other.max_abs)
        self.nonfinite += other.nonfinite
        self.hist += other.hist

    def quantile(self, q: float) -> float:
        if self.nonfinite:
            return math.inf
        n = int(self.hist.sum())
        if n == 0:
            return 0.0
        pos = q * (n - 1)
        lo = int(pos)
        hi = min(lo + 1, n - 1)
        cum = np.cumsum(self.hist)
        v_lo = _bin_value(int(np.searchsorted(cum, lo + 1)), self.max_abs)
        v_hi = _bin_value(int(np.searchsorted(cum, hi + 1)), self.max_abs)
        return v_lo + (v_hi - v_lo) * (pos - lo)

    def stats(self) -> dict[str, float]:
        if self.n == 0:
            return {"max_abs_diff": 0.0, "mean_diff": 0.0, "mean_abs_diff": 0.0, "p99_abs_diff": 0.0}
        return {
            "max_abs_diff": self.max_abs,
            "mean_diff": self.total / self.n,
            "mean_abs_diff": self.total_abs / self.n,
            "p99_abs_diff": self.quantile(0.99),
        }


def _fold(acc: tuple[int, float, float, float], n: int, total: float, lo: float, hi: float) -> tuple[int, float, float, float]:
    """A running (count, sum, min, max) after ``n`` more values whose sum, min and max are given."""
    count, run_sum, run_min, run_max = acc
    return count + n, run_sum + total, float(np.minimum(run_min, lo)), float(np.maximum(run_max, hi))


@dataclass
class Ratios:
    """IS ratios exp(trainer - sampler) per token and per sequence (products over its tokens), streamed."""

    tok_n: int = 0
    tok_sum: float = 0.0
    tok_min: float = math.inf
    tok_max: float = -math.inf
    seq_n: int = 0
    seq_sum: float = 0.0
    seq_min: float = math.inf
    seq_max: float = -math.inf
    rel_err: float = 0.0  # max |seq ratio - prod S| / prod S (naive estimator)

    def _add_tok(self, n: int, total: float, lo: float, hi: float) -> None:
        self.tok_n, self.tok_sum, self.tok_min, self.tok_max = _fold(
            (self.tok_n, self.tok_sum, self.tok_min, self.tok_max), n, total, lo, hi)

    def _add_seq(self, n: int, total: float, lo: float, hi: float) -> None:
        self.seq_n, self.seq_sum, self.seq_min, self.seq_max = _fold(
            (self.seq_n, self.seq_sum, self.seq_min, self.seq_max), n, total, lo, hi)

    def add(self, d: np.ndarray, seq_d: np.ndarray, seq_log_s: np.ndarray | None = None) -> None:
        with np.errstate(over="ignore", invalid="ignore"):
            if d.size:
                r = np.exp(d)
                self._add_tok(int(r.size), float(np.sum(r)), float(np.min(r)), float(np.max(r)))
            if seq_d.size:
                s = np.exp(seq_d)
                self._add_seq(int(s.size), float(np.sum(s)), float(np.min(s)), float(np.max(s)))
                if seq_log_s is not None:
                    pred = np.exp(seq_log_s)
                    self.rel_err = float(np.maximum(self.rel_err, np.max(np.abs(s - pred) / pred)))

    def merge(self, o: Ratios) -> None:
        self._add_tok(o.tok_n, o.tok_sum, o.tok_min, o.tok_max)
        self._add_seq(o.seq_n, o.seq_sum, o.seq_min, o.seq_max)
        self.rel_err = float(np.maximum(self.rel_err, o.rel_err))

    def to_report(self, identity: bool = False) -> blocks.Ratios:
        def m(total: float, n: int) -> float:
            return total / n if n else 1.0

        out: blocks.Ratios = {
            "token": {"mean": m(self.tok_sum, self.tok_n), "min": self.tok_min if self.tok_n else 1.0, "max": self.tok_max if self.tok_n else 1.0},
            "sequence": {"mean": m(self.seq_sum, self.seq_n), "min": self.seq_min if self.seq_n else 1.0, "max": self.seq_max if self.seq_n else 1.0},
        }
        if identity:
            out["sequence_identity_max_rel_err"] = self.rel_err
        return out


def na_ratios(identity: bool = False) -> blocks.Ratios:
    out: blocks.Ratios = {"token": {"mean": None, "min": None, "max": None},
                          "sequence": {"mean": None, "min": None, "max": None}}
    if identity:
        out["sequence_identity_max_rel_err"] = None
    return out


def headroom_key(d: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """``|d| / bound`` per token as :func:`parity.core.error_model.headroom` computes it (NaN counts as inf)."""
    ad = np.abs(d.astype(np.float64, copy=False))
    ad = np.where(np.isnan(ad), math.inf, ad)
    with np.errstate(invalid="ignore", over="ignore"):
        out: np.ndarray = ad / np.maximum(bound.astype(np.float64, copy=False), TINY)
    return out


@dataclass
class BoundStream:
    """One gated comparison against the per-token bound: headroom (max ``|d| / bound``) and the mean-bias pieces.
    ``d = trainer - sampler``; ``mean``/``m2`` merge pairwise, so ``sd`` is the sample sd ``torch.std`` gives."""

    n: int = 0
    mean: float = 0.0
    m2: float = 0.0
    bound_sum: float = 0.0
    systematic_sum: float = 0.0
    headroom: float = 0.0
    worst: Worst = field(default_factory=lambda: Worst(5))
    hist: np.ndarray = field(default_factory=lambda: np.zeros(HEAD_BINS, dtype=np.int64))
    cross_log_s: float = 0.0  # sum of d * log S (the trainer-under-test stream's log S signature)
    log_s_sq: float = 0.0  # sum of log S^2 over the same tokens

    def add(self, d: np.ndarray, bound: np.ndarray, systematic: np.ndarray | None = None,
            log_s: np.ndarray | None = None) -> np.ndarray:
        """Add one batch; returns the headroom keys (for the caller to offer the worst positions)."""
        key = headroom_key(d, bound)
        if not d.size:
            return key
        d = d.astype(np.float64, copy=False)
        with np.errstate(invalid="ignore", over="ignore"):
            nb, mb = int(d.size), float(np.mean(d))
            m2b = float(np.sum((d - mb) ** 2))
            self._combine(nb, mb, m2b)
        self.bound_sum += float(np.sum(bound, dtype=np.float64))
        if systematic is not None:
            self.systematic_sum += float(np.sum(systematic, dtype=np.float64))
        if log_s is not None:
            with np.errstate(invalid="ignore", over="ignore"):
                self.cross_log_s += float(np.sum(d * log_s))
                self.log_s_sq += float(np.sum(log_s * log_s))
        self.headroom = max(self.headroom, float(np.max(key)))
        with np.errstate(divide="ignore"):
            lg = np.log10(np.clip(key, 10.0**HEAD_LO, 10.0**HEAD_HI))
        self.hist += np.bincount(np.clip(((lg - HEAD_LO) / HEAD_STEP).astype(np.int64), 0, HEAD_BINS - 1),
                                 minlength=HEAD_BINS)
        return key

    def _combine(self, nb: int, mb: float, m2b: float) -> None:
        if nb == 0:
            return
        if self.n == 0:
            self.n, self.mean, self.m2 = nb, mb, m2b
            return
        n = self.n + nb
        with np.errstate(invalid="ignore", over="ignore"):
            delta = mb - self.mean
            self.mean = self.mean + delta * nb / n
            self.m2 = self.m2 + m2b + delta * delta * self.n * nb / n
        self.n = n

    def merge(self, o: BoundStream) -> None:
        self._combine(o.n, o.mean, o.m2)
        self.bound_sum += o.bound_sum
        self.systematic_sum += o.systematic_sum
        self.cross_log_s += o.cross_log_s
        self.log_s_sq += o.log_s_sq
        self.headroom = max(self.headroom, o.headroom)
        self.worst.merge(o.worst)
        self.hist = self.hist + o.hist

    @property
    def sd(self) -> float:
        """The sample standard deviation of ``d`` (``torch.std``'s)."""
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 and self.m2 >= 0 else (0.0 if self.n <= 1 else math.nan)

    @property
    def systematic_mean(self) -> float:
        return self.systematic_sum / self.n if self.n else 0.0


@dataclass
class ViewMatch:
    """For the trainer-under-test diagnosis: at how many positions a reference view is known, and how many
    of them differ from the trainer's values by more than the bound, and the mean difference where known
    (:func:`parity.judge.diagnosis.diagnosis_text` names the views matched within both)."""

    known: int = 0
    over: int = 0
    diff_sum: float = 0.0  # sum of (trainer - view) where known: the mean must sit within the mean-bias limit too

    def merge(self, o: ViewMatch) -> None:
        self.known += o.known
        self.over += o.over
        self.diff_sum += o.diff_sum

    def close(self, mean_limit: float) -> bool:
        return self.known > 0 and self.over == 0 and abs(self.diff_sum / self.known) <= mean_limit


@dataclass
class RatioStream:
    """The mean-bias gate of the two log-prob columns (:func:`parity.core.error_model.ratio_bias_entry`):
    sums of ``e = expm1(trainer - sampler)`` over finite tokens, per token and per sequence (a row is one
    sequence and never spans batches), the sign count, and the tokens the trainer gives no probability."""

    tokens: int = 0
    sequences: int = 0
    e_sum: float = 0.0
    e_sq: float = 0.0
    seq_e_sq: float = 0.0
    seq_ne: float = 0.0
    seq_n_sq: float = 0.0
    d_sum: float = 0.0
    d_sq: float = 0.0
    lp_abs_sum: float = 0.0
    negative: int = 0
    beyond_negative: int = 0  # tokens below minus their systematic allowance (the sign test's counts)
    beyond_positive: int = 0
    outside: int = 0  # trainer -inf at a token the sampler gave probability: outside the trainer's support
    nonfinite: int = 0  # any other non-finite pair (NaN, +inf, a sampler -inf)

    def add(self, trainer: np.ndarray, sampler: np.ndarray, row: np.ndarray,
            allowance: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
        """One batch's compared tokens; ``allowance``: the per-token systematic allowance beyond which a
        difference counts for the sign test (plus ``2 u32 |lp|``). Returns the masks (outside the support,
        other non-finite)."""
        with np.errstate(invalid="ignore", over="ignore"):
            d = trainer - sampler
        fin = np.isfinite(d)
        outside = np.isneginf(trainer) & np.isfinite(sampler)
        other = ~fin & ~outside
        self.outside += int(outside.sum())
        self.nonfinite += int(other.sum())
        if not fin.any():
            return outside, other
        d, r = d[fin], row[fin]
        with np.errstate(over="ignore"):
            e = np.expm1(d)
        _, inv, n_i = np.unique(r, return_inverse=True, return_counts=True)
        e_i = np.bincount(inv.reshape(-1), weights=e)
        n_f = n_i.astype(np.float64)
        self.tokens += int(d.size)
        self.sequences += int(n_i.size)
        with np.errstate(over="ignore", invalid="ignore"):
            self.e_sum += float(e.sum())
            self.e_sq += float((e * e).sum())
            self.seq_e_sq += float((e_i * e_i).sum())
            self.seq_ne += float((n_f * e_i).sum())
        self.seq_n_sq += float((n_f * n_f).sum())
        self.d_sum += float(d.sum())
        self.d_sq += float((d * d).sum())
        lp_abs = np.abs(sampler[fin])
        self.lp_abs_sum += float(lp_abs.sum())
        self.negative += int((d < 0).sum())
        a = allowance + 2.0 * 2.0**-24 * lp_abs
        self.beyond_negative += int((d < -a).sum())
        self.beyond_positive += int((d > a).sum())
        return outside, other

    def merge(self, o: RatioStream) -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(o, k))
