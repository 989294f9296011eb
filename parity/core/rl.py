"""The RL view of a sampler/trainer mismatch (engine-free): δ = log p_trainer − log q_sampler in, statistics out.

Each framework's mismatch metric, and what each importance-sampling correction would do to the same tokens
(docs/internals.md, section 4)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Generic, TypeVar

import torch

from parity.errors import UsageError

ASSUMPTION = (
    "First update after a rollout: the policy is still the trainer, so its own ratio is 1 and every ratio "
    "a method sees is r = p_trainer / q_sampler (the sampler's log-probs are the anchor). Only the "
    "sampler/trainer mismatch moves the weights."
)

LEVELS = ("token", "sequence")
ACTIONS = ("none", "clip", "mask", "veto", "drop")
# both: the rule applies whatever the advantage; ppo: PPO's pessimistic clip, binding only in the
# direction that would increase the objective (A > 0: above the interval; A < 0: below it, and above
# the dual clip); neg: only negative advantages are corrected, positive ones keep weight 1.
SIGNS = ("both", "ppo", "neg")
WEIGHTS = ("statistic", "ratio", "one")
T = TypeVar("T")


@dataclass(frozen=True, eq=False)
class Mismatch:
    """Per-sequence δ (and, when known, the sampler's log-probs, for probability-space statistics): build it
    with :meth:`from_logprobs` or :meth:`from_flat`, or as ``Mismatch(deltas)`` (probability-space entries None)."""

    deltas: tuple[torch.Tensor, ...]
    sampler: tuple[torch.Tensor, ...] | None = None
    # Derived once in __post_init__: the valid (non-NaN) tokens, flat, with their sequence index.
    _delta: torch.Tensor = field(init=False, repr=False)
    _lq: torch.Tensor | None = field(init=False, repr=False)
    _seq: torch.Tensor = field(init=False, repr=False)
    _counts: torch.Tensor = field(init=False, repr=False)
    excluded_nan: int = field(init=False)

    def __post_init__(self) -> None:
        deltas = tuple(_as_1d(d, f"deltas[{i}]") for i, d in enumerate(self.deltas))
        object.__setattr__(self, "deltas", deltas)
        sampler = None
        if self.sampler is not None:
            if len(self.sampler) != len(deltas):
                raise UsageError(
                    f"sampler has {len(self.sampler)} sequences but deltas has {len(deltas)}: allowed the same count"
                )
            sampler = tuple(_as_1d(s, f"sampler[{i}]") for i, s in enumerate(self.sampler))
            for i, (d, s) in enumerate(zip(deltas, sampler, strict=True)):
                if d.shape != s.shape:
                    raise UsageError(
                        f"sampler[{i}] has {s.numel()} tokens but deltas[{i}] has {d.numel()}: allowed the same length"
                    )
            object.__setattr__(self, "sampler", sampler)
        empty = torch.zeros(0, dtype=torch.float64)  # the concatenation of no sequences
        flat = torch.cat([empty, *deltas])
        counts = torch.tensor([d.numel() for d in deltas], dtype=torch.long)
        seq = torch.repeat_interleave(torch.arange(len(deltas)), counts)
        lq = None if sampler is None else torch.cat([empty, *sampler])
        valid = ~torch.isnan(flat)
        if lq is not None:
            valid &= ~torch.isnan(lq)
        object.__setattr__(self, "excluded_nan", int((~valid).sum()))
        object.__setattr__(self, "_delta", flat[valid])
        object.__setattr__(self, "_lq", lq[valid] if lq is not None else None)
        object.__setattr__(self, "_seq", seq[valid])
        object.__setattr__(self, "_counts", torch.bincount(seq[valid], minlength=len(deltas)))

    @classmethod
    def from_logprobs(cls, trainer: Sequence[torch.Tensor], sampler: Sequence[torch.Tensor]) -> Mismatch:
        """One 1-D tensor of log-probs per sequence on each side."""
        if len(trainer) != len(sampler):
            raise UsageError(
                f"trainer has {len(trainer)} sequences but sampler has {len(sampler)}: allowed the same count"
            )
        pairs = [
            (_as_1d(t, f"trainer[{i}]"), _as_1d(s, f"sampler[{i}]"))
            for i, (t, s) in enumerate(zip(trainer, sampler, strict=True))
        ]
        for i, (t, s) in enumerate(pairs):
            if t.shape != s.shape:
                raise UsageError(
                    f"trainer[{i}] has {t.numel()} tokens but sampler[{i}] has {s.numel()}: allowed the same length"
                )
        # Equal infinities (both sides give the token zero probability) are not scorable: NaN, excluded.
        return cls(tuple(t - s for t, s in pairs), tuple(s for _, s in pairs))

    @classmethod
    def from_flat(cls, trainer: torch.Tensor, sampler: torch.Tensor, seq_lengths: Sequence[int]) -> Mismatch:
        """Flat ``[T]`` log-probs split into sequences by ``seq_lengths`` (the comparison table's layout)."""
        trainer, sampler = _as_1d(trainer, "trainer"), _as_1d(sampler, "sampler")
        lengths = [int(n) for n in seq_lengths]
        if any(n < 0 for n in lengths) or sum(lengths) != trainer.numel() or trainer.shape != sampler.shape:
            raise UsageError(
                f"seq_lengths sum to {sum(lengths)} (min {min(lengths, default=0)}) for {trainer.numel()} trainer and "
                f"{sampler.numel()} sampler tokens: allowed non-negative lengths summing to both"
            )
        return cls.from_logprobs(list(torch.split(trainer, lengths)), list(torch.split(sampler, lengths)))

    @property
    def sequences(self) -> int:
        return len(self.deltas)

    @property
    def tokens(self) -> int:
        return int(self._delta.numel())

    @property
    def empty_sequences(self) -> int:
        return int((self._counts == 0).sum())

    @property
    def has_probs(self) -> bool:
        return self._lq is not None

    def delta(self) -> torch.Tensor:
        return self._delta

    def probs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(p, q) of the sampled tokens, trainer and sampler."""
        assert self._lq is not None
        return (self._lq + self._delta).exp(), self._lq.exp()

    def seq_reduce(self, values: torch.Tensor, how: str) -> torch.Tensor:
        """Per non-empty sequence: 'sum', 'mean', 'min' or 'max' of a per-token tensor."""
        n = self.sequences
        if how in ("sum", "mean"):
            s = torch.zeros(n, dtype=torch.float64).index_add(0, self._seq, values)
            out = s / self._counts.clamp(min=1) if how == "mean" else s
        elif how in ("min", "max"):
            fill = math.inf if how == "min" else -math.inf
            out = torch.full((n,), fill, dtype=torch.float64).scatter_reduce(
                0, self._seq, values, reduce="amin" if how == "min" else "amax", include_self=True
            )
        else:
            raise UsageError(f"seq_reduce how={how!r}: allowed sum, mean, min, max")
        return out[self._counts > 0]


def _as_1d(x: object, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64)
    if t.dim() != 1:
        raise UsageError(f"{name} has shape {tuple(t.shape)}: allowed a 1-D tensor of per-token values")
    return t


def k3(delta: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = r − log r − 1 (≥ 0), computed as expm1(δ) − δ so small δ keeps its digits."""
    out = torch.expm1(delta) - delta
    return torch.where(torch.isposinf(delta), torch.full_like(delta, math.inf), out)


@dataclass(frozen=True)
class Threshold:
    """A documented limit on a metric: the value is healthy when ``value <op> limit``."""

    limit: float
    op: str  # "<=" or "<"
    source: str

    def __post_init__(self) -> None:
        if self.op not in ("<=", "<"):
            raise UsageError(f"Threshold.op={self.op!r} is invalid: allowed '<=' or '<'")
        if not math.isfinite(self.limit):
            raise UsageError(f"Threshold.limit={self.limit!r} is invalid: allowed a finite number")

    def holds(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return value <= self.limit if self.op == "<=" else value < self.limit

    def label(self) -> str:
        return f"{'≤' if self.op == '<=' else '<'} {self.limit:g} ({self.source})"


@dataclass(frozen=True)
class Statistic(Generic[T]):
    """Per-unit values of a mismatch (one per token, or one per non-empty sequence), or a metric's number
    computed over all tokens at once (not reduced from per-unit values)."""

    level: str
    compute: Callable[[Mismatch], T]
    needs_probs: bool = False


@dataclass(frozen=True)
class Metric:
    """One framework's mismatch metric under its dashboard name: ``reduce`` over the per-unit ``values``
    (:data:`METRIC_VALUES`, :data:`REDUCTIONS`), or ``compute`` (:data:`METRIC_FUNCTIONS`) for a metric that is
    no such reduction."""

    framework: str
    name: str
    level: str  # where the last reduction runs: over tokens, or over per-sequence values
    statistic: str  # what it computes, in words
    source: str  # the framework file and function it mirrors
    values: str | None = None
    reduce: str | None = None
    compute: str | None = None
    threshold: Threshold | None = None

    def __post_init__(self) -> None:
        def bad(fieldname: str, value: object, allowed: str) -> UsageError:
            return UsageError(f"Metric {self.name!r}: {fieldname}={value!r} is invalid: allowed {allowed}")

        if self.compute is not None:
            if self.values is not None or self.reduce is not None:
                raise bad("compute", self.compute, "compute alone, or values with reduce")
            if self.compute not in METRIC_FUNCTIONS:
                raise bad("compute", self.compute, ", ".join(METRIC_FUNCTIONS))
        else:
            if self.values not in METRIC_VALUES:
                raise bad("values", self.values, ", ".join(METRIC_VALUES) + " (or compute)")
            if self.reduce not in REDUCTIONS:
                raise bad("reduce", self.reduce, ", ".join(REDUCTIONS))
        if self.level not in LEVELS or self.level != self._kind.level:
            raise bad("level", self.level, f"{self._kind.level!r} (the level of its values)")

    @property
    def _kind(self) -> Statistic[torch.Tensor] | Statistic[float | None]:
        if self.compute is not None:
            return METRIC_FUNCTIONS[self.compute]
        assert self.values is not None
        return METRIC_VALUES[self.values]

    @property
    def needs_probs(self) -> bool:
        return self._kind.needs_probs

    def value(self, m: Mismatch) -> float | None:
        if self.needs_probs and not m.has_probs:
            return None
        if self.compute is not None:
            return METRIC_FUNCTIONS[self.compute].compute(m)
        assert self.values is not None and self.reduce is not None
        return _reduce(METRIC_VALUES[self.values].compute(m), self.reduce)

    def describe(self) -> dict[str, object]:
        keys = ("framework", "name", "level", "statistic", "source")
        out: dict[str, object] = {k: getattr(self, k) for k in keys}
        return {**out, "threshold": None if self.threshold is None else asdict(self.threshold)}


REDUCTIONS = ("mean", "max", "min", "std")


def _reduce(x: torch.Tensor, how: str) -> float | None:
    """One of :data:`REDUCTIONS` of a 1-D tensor (std Bessel-corrected, as torch.std in verl and SkyRL); None
    where it is undefined."""
    if x.numel() == 0 or (how == "std" and x.numel() < 2):
        return None
    return float(getattr(x, how)())


def _abs_delta(m: Mismatch) -> torch.Tensor:
    return m.delta().abs()


def _prob_diff(m: Mismatch) -> torch.Tensor:
    p, q = m.probs()
    return p - q


def _pearson_probs(m: Mismatch) -> float | None:
    # verl/utils/debug/metrics.py pearson_correlation_coefficient: torch.corrcoef of the two sides'
    # probabilities (not log-probs) over the response mask. Undefined (None) when either side is
    # constant or there are fewer than two tokens; torch would return NaN.
    if m.tokens < 2:
        return None
    p, q = m.probs()
    pc, qc = p - p.mean(), q - q.mean()
    den = math.sqrt(float((pc * pc).sum()) * float((qc * qc).sum()))
    if den == 0.0 or not math.isfinite(den):
        return None
    return float((pc * qc).sum()) / den


TRL_IS_CAP = 3.0  # trl GRPOConfig.vllm_importance_sampling_clip_max default


def _trl_seq_mask_ratio(m: Mismatch) -> torch.Tensor:
    # trl/trainer/grpo_trainer.py GRPOTrainer._generate_and_score_completions, default
    # vllm_importance_sampling_mode="sequence_mask" with vllm_importance_sampling_clip_max=3.0 and
    # clip_min=None: exp of the SUM of δ over the completion mask, set to 0 above 3.0. The logged
    # min/mean/max run over the (B, 1) per-sequence ratios after masking, so a masked sequence reads 0.
    # TRL zeroes NaN δ before the sum, which equals excluding it here. Unlike TRL, a sequence with no
    # tokens is left out (TRL would log exp(0) = 1 for it).
    ratio = m.seq_reduce(m.delta(), "sum").exp()
    return ratio.masked_fill(ratio > TRL_IS_CAP, 0.0)


def _trl_token_truncate_ratio(m: Mismatch) -> torch.Tensor:
    # Same function, vllm_importance_sampling_mode="token_truncate": per-token exp(δ) clamped at 3.0,
    # logged over the completion mask.
    return m.delta().exp().clamp(max=TRL_IS_CAP)


def _seq_mean_abs_delta(m: Mismatch) -> torch.Tensor:
    # slime/backends/megatron_utils/loss.py policy_loss_function: train_rollout_logprob_abs_diff =
    # sum_of_sample_mean(|old_log_probs - rollout_log_probs|); sum_of_sample_mean (cp_utils.py
    # get_sum_of_sample_mean, default calculate_per_token_loss=False) averages within each sample, and
    # the logged value is that sum over the number of samples: the mean over sequences of each
    # sequence's mean |δ|.
    return m.seq_reduce(_abs_delta(m), "mean")


def _seq_mean_k3(m: Mismatch) -> torch.Tensor:
    # A method's statistic too (verl's K3 rejection). As a metric, prime_rl/trainer/rl/loss.py
    # compute_loss: per sequence, token_mismatch_kl = r - log r - 1 is averaged over the loss mask; the
    # per-sequence values are stacked and logged as mismatch_kl/mean, /max, ... across sequences.
    return m.seq_reduce(k3(m.delta()), "mean")


# The per-unit values a metric reduces, by the name a catalogue entry gives as ``values``.
METRIC_VALUES: dict[str, Statistic[torch.Tensor]] = {
    "abs_delta": Statistic("token", _abs_delta),  # |δ|
    # nemo_rl/algorithms/loss_functions.py ClippedPGLossFn.__call__: token_mult_prob_error =
    # masked_mean(exp(|generation_logprobs - prev_logprobs| * mask), mask) over all valid tokens.
    "exp_abs_delta": Statistic("token", lambda m: _abs_delta(m).exp()),  # e^|δ|
    "probs_abs_diff": Statistic("token", lambda m: _prob_diff(m).abs(), needs_probs=True),  # |p − q|
    "trl_token_truncate_ratio": Statistic("token", _trl_token_truncate_ratio),  # min(e^δ, 3)
    "trl_sequence_mask_ratio": Statistic("sequence", _trl_seq_mask_ratio),  # exp(Σδ), 0 above 3
    "seq_mean_abs_delta": Statistic("sequence", _seq_mean_abs_delta),  # mean |δ| per sequence
    "seq_mean_k3": Statistic("sequence", _seq_mean_k3),  # mean (r − log r − 1) per sequence
}
# Metrics that are no reduction of per-unit values, by the name an entry gives as ``compute``.
METRIC_FUNCTIONS: dict[str, Statistic[float | None]] = {
    "pearson_probs": Statistic("token", _pearson_probs, needs_probs=True),  # corr(p, q)
}


# The per-unit statistics a method can threshold. Token statistics have one value per token, sequence
# statistics one per non-empty sequence.
STATISTICS: dict[str, Statistic[torch.Tensor]] = {
    "ratio": Statistic("token", lambda m: m.delta().exp()),  # r = e^δ
    "tv": Statistic("token", _prob_diff, needs_probs=True),  # binary TV, signed: p − q
    "seq_ratio": Statistic("sequence", lambda m: m.seq_reduce(m.delta(), "sum").exp()),  # Π r = exp(Σδ)
    "geo_ratio": Statistic("sequence", lambda m: m.seq_reduce(m.delta(), "mean").exp()),  # exp(mean δ)
    "seq_mean_k3": Statistic("sequence", _seq_mean_k3),  # mean (r − log r − 1)
    # the sequence's smallest token ratio
    "min_ratio": Statistic("sequence", lambda m: m.seq_reduce(m.delta(), "min").exp()),
}


@dataclass(frozen=True)
class Method:
    """One importance-sampling correction with its frameworks' default parameters: a unit outside ``interval``
    (strictly) gets ``action``; ``sign`` (:data:`SIGNS`) says which advantage signs it binds for, ``weight`` what
    a kept unit is weighted by (docs/internals.md, section 4)."""

    name: str
    frameworks: tuple[str, ...]
    level: str
    statistic: str
    interval: tuple[float, float]
    action: str
    source: str  # the framework file and function it mirrors
    sign: str = "both"
    weight: str = "statistic"
    dual_clip: float | None = None  # PPO dual clip: with A < 0, a ratio above this is also dropped
    note: str = ""

    def __post_init__(self) -> None:
        def bad(fieldname: str, value: object, allowed: str) -> UsageError:
            return UsageError(f"Method {self.name!r}: {fieldname}={value!r} is invalid: allowed {allowed}")

        if self.statistic not in STATISTICS:
            raise bad("statistic", self.statistic, ", ".join(STATISTICS))
        if self.level not in LEVELS or STATISTICS[self.statistic].level != self.level:
            raise bad(
                "level",
                self.level,
                f"{STATISTICS[self.statistic].level!r} (the level of statistic {self.statistic!r})",
            )
        for name, allowed in (("action", ACTIONS), ("sign", SIGNS), ("weight", WEIGHTS)):
            if getattr(self, name) not in allowed:
                raise bad(name, getattr(self, name), ", ".join(allowed))
        lo, hi = self.interval
        if math.isnan(lo) or math.isnan(hi) or lo > hi:
            raise bad("interval", self.interval, "(low, high) with low <= high")
        if self.action == "clip" and self.weight != "statistic":
            raise bad("weight", self.weight, "'statistic' for a clip (the clipped statistic is the weight)")
        if self.dual_clip is not None and self.sign != "ppo":
            raise bad("dual_clip", self.dual_clip, "None unless sign='ppo'")
        if self.weight == "ratio" and self.level != "token":
            raise bad("weight", self.weight, "'statistic' or 'one' for a sequence-level method")

    @property
    def signs(self) -> tuple[str, ...]:
        """The advantage signs reported: one result when the rule ignores the sign, else '+' and '-'."""
        return ("any",) if self.sign == "both" else ("+", "-")

    @property
    def needs_probs(self) -> bool:
        return STATISTICS[self.statistic].needs_probs

    def describe(self) -> dict[str, object]:
        keys = ("name", "frameworks", "level", "statistic", "interval", "action", "sign", "weight",
                "dual_clip", "source", "note")
        out: dict[str, object] = {k: getattr(self, k) for k in keys}
        return {**out, "frameworks": list(self.frameworks), "interval": list(self.interval)}

    def apply(self, m: Mismatch, sign: str = "any") -> MethodResult:
        """What this method does to the units of ``m`` for advantages of ``sign`` ('any', '+', '-')."""
        if sign not in self.signs:
            raise UsageError(
                f"Method {self.name!r}: sign={sign!r} is invalid: allowed {', '.join(self.signs)}"
            )
        if self.needs_probs and not m.has_probs:
            return MethodResult(self.name, sign, self.level, self.action, 0, None, None, None, None)
        x = STATISTICS[self.statistic].compute(m)
        lo, hi = self.interval
        inside = (x >= lo) & (x <= hi)  # NaN statistics count as outside
        if self.sign == "both" or (self.sign == "neg" and sign == "-"):
            affected = ~inside
        elif self.sign == "ppo" and sign == "+":
            affected = ~(x <= hi)
        elif self.sign == "ppo":
            affected = ~(x >= lo)
            if self.dual_clip is not None:
                affected |= x > self.dual_clip
        else:  # neg, positive advantage: no correction
            affected = torch.zeros_like(x, dtype=torch.bool)
        if self.sign == "neg" and sign == "+":
            w = torch.ones_like(x)
        elif self.action == "clip":
            w = x.clamp(min=lo, max=hi)
        else:
            base = {
                "statistic": x,
                "ratio": m.delta().exp() if self.level == "token" else x,
                "one": torch.ones_like(x),
            }[self.weight]
            w = base.masked_fill(affected, 0.0) if self.action in ("mask", "veto", "drop") else base
        w = torch.nan_to_num(w, nan=0.0, posinf=math.inf)
        n, k = int(x.numel()), int(affected.sum())
        if not n:
            return MethodResult(self.name, sign, self.level, self.action, 0, None, None, None, None)
        return MethodResult(self.name, sign, self.level, self.action, n, k, k / n, float(w.mean()),
                            effective_sample_size(w))


@dataclass(frozen=True)
class MethodResult:
    method: str
    sign: str
    level: str
    action: str
    units: int  # tokens or sequences
    affected: int | None  # clipped / masked / vetoed / dropped
    affected_frac: float | None
    mean_weight: float | None
    ess: float | None  # (Σw)² / (n Σw²), in [0, 1]

    def to_dict(self) -> dict[str, float | None]:
        """The numbers (the method, sign, level and action are the keys this goes under)."""
        return {k: getattr(self, k) for k in ("units", "affected", "affected_frac", "mean_weight", "ess")}


def effective_sample_size(w: torch.Tensor) -> float:
    """(Σw)² / Σw², normalised by the count: 1 for equal weights, 1/n for one weight carrying all; weights at
    +inf share the mass equally, all-zero weights give 0 (docs/internals.md, section 4)."""
    w = w.double().flatten()
    if w.numel() == 0:
        raise UsageError("effective_sample_size of no weights: allowed at least one weight")
    if bool((w < 0).any()) or bool(torch.isnan(w).any()):
        raise UsageError(f"effective_sample_size: weights must be >= 0 and not NaN, got min {float(w.min())}")
    top = float(w.max())
    if top == 0.0:
        return 0.0
    v = torch.isinf(w).double() if math.isinf(top) else w / top
    # <= 1 by Cauchy-Schwarz; the min only absorbs the last bit of rounding.
    return min(1.0, float(v.sum() ** 2 / (w.numel() * (v * v).sum())))
