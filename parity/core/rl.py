"""The RL view of a sampler/trainer mismatch (engine-free): δ in, statistics out.

With δ = log p_trainer − log q_sampler per sampled token and r = e^δ, this module computes

* every RL framework's own mismatch metric, under the name its dashboard shows, exactly as that
  framework reduces it (which mask, sum or mean, per token or per sequence first);
* what each importance-sampling correction would do to the same tokens with its frameworks' default
  parameters: the fraction of units (tokens or sequences) it clips, masks, vetoes or drops, the mean
  weight it leaves, and the effective sample size of those weights.

Each metric and each method is one small frozen entry in :data:`METRICS` or :data:`METHODS`; adding a
method is adding one entry.

Assumption behind the method numbers: the first update after a rollout. The policy is still the
trainer (π_θ = p), so its own ratio to the trainer is 1 and every ratio a method sees is the
sampler/trainer ratio r = p / q (the sampler's log-probs are the anchor, as in verl's bypass mode or
prime-rl). Only the mismatch moves the weights.

Non-finite input: a NaN δ (a position neither side can score) is excluded from every statistic and
counted (``excluded_nan``); ±inf is kept and flows through (r = 0 or inf, masks drop it, clips cap it),
because a token the trainer gives zero probability is a real, reportable mismatch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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


# --------------------------------------------------------------------------------------------- input


@dataclass(frozen=True, eq=False)
class Mismatch:
    """Per-sequence δ (and, when known, the sampler's log-probs, for probability-space statistics).

    Build it with :meth:`from_logprobs`, :meth:`from_flat`, :meth:`from_padded` or :meth:`from_deltas`.
    """

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
        flat = torch.cat(deltas) if deltas else torch.zeros(0, dtype=torch.float64)
        seq = (
            torch.cat([torch.full((d.numel(),), i, dtype=torch.long) for i, d in enumerate(deltas)])
            if deltas
            else torch.zeros(0, dtype=torch.long)
        )
        lq = (
            torch.cat(sampler)
            if sampler
            else (torch.zeros(0, dtype=torch.float64) if sampler is not None else None)
        )
        valid = ~torch.isnan(flat)
        if lq is not None:
            valid &= ~torch.isnan(lq)
        object.__setattr__(self, "excluded_nan", int((~valid).sum()))
        object.__setattr__(self, "_delta", flat[valid])
        object.__setattr__(self, "_lq", lq[valid] if lq is not None else None)
        object.__setattr__(self, "_seq", seq[valid])
        object.__setattr__(self, "_counts", torch.bincount(seq[valid], minlength=len(deltas)))

    # -- constructors

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
        return cls(tuple(_delta(t, s) for t, s in pairs), tuple(s for _, s in pairs))

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

    @classmethod
    def from_padded(cls, trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> Mismatch:
        """``[B, T]`` log-probs with a completion mask (1 = a sampled token, 0 = padding)."""
        if trainer.dim() != 2 or trainer.shape != sampler.shape or trainer.shape != mask.shape:
            raise UsageError(
                f"trainer {tuple(trainer.shape)}, sampler {tuple(sampler.shape)}, mask {tuple(mask.shape)}: "
                "allowed three [B, T] tensors of one shape"
            )
        m = mask.bool()
        return cls.from_logprobs(
            [trainer[b][m[b]] for b in range(len(m))], [sampler[b][m[b]] for b in range(len(m))]
        )

    @classmethod
    def from_deltas(
        cls, deltas: Sequence[torch.Tensor], sampler: Sequence[torch.Tensor] | None = None
    ) -> Mismatch:
        """δ per sequence; without the sampler's log-probs the probability-space entries report None."""
        return cls(tuple(deltas), tuple(sampler) if sampler is not None else None)

    # -- views used by the entries

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


def _as_1d(x: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(x, dtype=torch.float64)
    if t.dim() != 1:
        raise UsageError(f"{name} has shape {tuple(t.shape)}: allowed a 1-D tensor of per-token values")
    return t


def _delta(trainer: torch.Tensor, sampler: torch.Tensor) -> torch.Tensor:
    # Equal infinities (both sides give the token zero probability) are not scorable: NaN, excluded.
    return trainer - sampler


def k3(delta: torch.Tensor) -> torch.Tensor:
    """Per-token k3 = r − log r − 1 (≥ 0), computed as expm1(δ) − δ so small δ keeps its digits."""
    out = torch.expm1(delta) - delta
    return torch.where(torch.isposinf(delta), torch.full_like(delta, math.inf), out)


# ------------------------------------------------------------------------------------------ metrics


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
class Metric:
    """One framework's mismatch metric under its dashboard name."""

    framework: str
    name: str
    level: str  # where the last reduction runs: over tokens, or over per-sequence values
    statistic: str  # what it computes, in words
    compute: Callable[[Mismatch], float | None]
    source: str  # the framework file and function it mirrors
    threshold: Threshold | None = None
    needs_probs: bool = False

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise UsageError(
                f"Metric {self.name!r}: level={self.level!r} is invalid: allowed {', '.join(LEVELS)}"
            )

    def value(self, m: Mismatch) -> float | None:
        if self.needs_probs and not m.has_probs:
            return None
        return self.compute(m)

    def describe(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "name": self.name,
            "level": self.level,
            "statistic": self.statistic,
            "source": self.source,
            "threshold": None
            if self.threshold is None
            else {"limit": self.threshold.limit, "op": self.threshold.op, "source": self.threshold.source},
        }


def _reduce(x: torch.Tensor, how: str) -> float | None:
    """mean/max/min/std (unbiased, like torch.std) of a 1-D tensor; None where it is undefined."""
    if x.numel() == 0 or (how == "std" and x.numel() < 2):
        return None
    if how == "mean":
        return float(x.mean())
    if how == "max":
        return float(x.max())
    if how == "min":
        return float(x.min())
    if how == "std":
        return float(x.std())  # Bessel-corrected, as torch.std in verl and SkyRL
    raise UsageError(f"reduction how={how!r}: allowed mean, max, min, std")


def _abs_delta(m: Mismatch) -> torch.Tensor:
    return m.delta().abs()


def _probs_abs_diff(m: Mismatch) -> torch.Tensor:
    p, q = m.probs()
    return (p - q).abs()


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


def _slime_abs_diff(m: Mismatch) -> float | None:
    # slime/backends/megatron_utils/loss.py policy_loss_function: train_rollout_logprob_abs_diff =
    # sum_of_sample_mean(|old_log_probs - rollout_log_probs|); sum_of_sample_mean (cp_utils.py
    # get_sum_of_sample_mean, default calculate_per_token_loss=False) averages within each sample, and
    # the logged value is that sum over the number of samples: the mean over sequences of each
    # sequence's mean |δ|.
    per_seq = m.seq_reduce(_abs_delta(m), "mean")
    return _reduce(per_seq, "mean")


def _nemo_mult_prob_error(m: Mismatch) -> float | None:
    # nemo_rl/algorithms/loss_functions.py ClippedPGLossFn.__call__: token_mult_prob_error =
    # masked_mean(exp(|generation_logprobs - prev_logprobs| * mask), mask) over all valid tokens.
    return _reduce(_abs_delta(m).exp(), "mean")


def _prime_mismatch_kl(how: str) -> Callable[[Mismatch], float | None]:
    # prime_rl/trainer/rl/loss.py compute_loss: per sequence, token_mismatch_kl = r - log r - 1 is
    # averaged over the loss mask; the per-sequence values are stacked and logged as mismatch_kl/mean,
    # /max, ... across sequences.
    def f(m: Mismatch) -> float | None:
        return _reduce(m.seq_reduce(k3(m.delta()), "mean"), how)

    return f


TRL_IS_CAP = 3.0  # trl GRPOConfig.vllm_importance_sampling_clip_max default
TRL_SRC = "trl/trainer/grpo_trainer.py GRPOTrainer._generate_and_score_completions"
VERL_DEBUG_SRC = "verl/utils/debug/metrics.py calculate_debug_metrics"
SKYRL_SRC = "skyrl_train/trainer.py RayPPOTrainer.fwd_logprobs_values_reward"


def _tok(transform: Callable[[Mismatch], torch.Tensor], how: str) -> Callable[[Mismatch], float | None]:
    return lambda m: _reduce(transform(m), how)


METRICS: tuple[Metric, ...] = (
    # TRL: |δ| over the completion mask, NaN excluded (TRL logs 0.0 for an empty batch; here None).
    Metric(
        "TRL",
        "sampling/sampling_logp_difference/mean",
        "token",
        "mean |δ|",
        _tok(_abs_delta, "mean"),
        TRL_SRC,
    ),
    Metric(
        "TRL", "sampling/sampling_logp_difference/max", "token", "max |δ|", _tok(_abs_delta, "max"), TRL_SRC
    ),
    Metric(
        "TRL",
        "sampling/importance_sampling_ratio/min",
        "sequence",
        "min over sequences of exp(Σδ), 0 above 3 (sequence_mask, default)",
        _tok(_trl_seq_mask_ratio, "min"),
        TRL_SRC,
    ),
    Metric(
        "TRL",
        "sampling/importance_sampling_ratio/mean",
        "sequence",
        "mean over sequences of exp(Σδ), 0 above 3 (sequence_mask, default)",
        _tok(_trl_seq_mask_ratio, "mean"),
        TRL_SRC,
    ),
    Metric(
        "TRL",
        "sampling/importance_sampling_ratio/max",
        "sequence",
        "max over sequences of exp(Σδ), 0 above 3 (sequence_mask, default)",
        _tok(_trl_seq_mask_ratio, "max"),
        TRL_SRC,
    ),
    Metric(
        "TRL",
        "sampling/importance_sampling_ratio/min [token_truncate]",
        "token",
        "min of min(e^δ, 3) over tokens",
        _tok(_trl_token_truncate_ratio, "min"),
        TRL_SRC,
    ),
    Metric(
        "TRL",
        "sampling/importance_sampling_ratio/mean [token_truncate]",
        "token",
        "mean of min(e^δ, 3) over tokens",
        _tok(_trl_token_truncate_ratio, "mean"),
        TRL_SRC,
    ),
    Metric(
        "TRL",
        "sampling/importance_sampling_ratio/max [token_truncate]",
        "token",
        "max of min(e^δ, 3) over tokens",
        _tok(_trl_token_truncate_ratio, "max"),
        TRL_SRC,
    ),
    # verl: in probability space, |e^lp − e^lq| over the response mask; std is torch.std (unbiased).
    Metric(
        "verl",
        "training/rollout_probs_diff_max",
        "token",
        "max |p − q|",
        _tok(_probs_abs_diff, "max"),
        VERL_DEBUG_SRC,
        needs_probs=True,
    ),
    Metric(
        "verl",
        "training/rollout_probs_diff_mean",
        "token",
        "mean |p − q|",
        _tok(_probs_abs_diff, "mean"),
        VERL_DEBUG_SRC,
        needs_probs=True,
    ),
    Metric(
        "verl",
        "training/rollout_probs_diff_std",
        "token",
        "std |p − q| (unbiased)",
        _tok(_probs_abs_diff, "std"),
        VERL_DEBUG_SRC,
        needs_probs=True,
    ),
    Metric(
        "verl",
        "training/rollout_actor_probs_pearson_corr",
        "token",
        "Pearson correlation of p and q",
        _pearson_probs,
        VERL_DEBUG_SRC,
        needs_probs=True,
    ),
    Metric(
        "slime",
        "train_rollout_logprob_abs_diff",
        "sequence",
        "mean over sequences of mean |δ|",
        _slime_abs_diff,
        "slime/backends/megatron_utils/loss.py policy_loss_function",
        Threshold(0.1, "<=", "slime CI asserts ≤ 0.1"),
    ),
    Metric(
        "NeMo-RL",
        "token_mult_prob_error",
        "token",
        "mean e^|δ|",
        _nemo_mult_prob_error,
        "nemo_rl/algorithms/loss_functions.py ClippedPGLossFn.__call__",
        Threshold(1.05, "<", "NeMo-RL: 1.05 or more is treated as a framework issue"),
    ),
    Metric(
        "prime-rl",
        "mismatch_kl/mean",
        "sequence",
        "mean over sequences of mean (r − log r − 1)",
        _prime_mismatch_kl("mean"),
        "prime_rl/trainer/rl/loss.py compute_loss",
        Threshold(0.015, "<", "prime-rl: new models < 0.015"),
    ),
    Metric(
        "prime-rl",
        "mismatch_kl/max",
        "sequence",
        "max over sequences of mean (r − log r − 1)",
        _prime_mismatch_kl("max"),
        "prime_rl/trainer/rl/loss.py compute_loss",
    ),
    # SkyRL: |rollout − trainer| over loss_mask > 0; std is torch.std (unbiased).
    Metric(
        "SkyRL",
        "policy/rollout_train_logprobs_abs_diff_mean",
        "token",
        "mean |δ|",
        _tok(_abs_delta, "mean"),
        SKYRL_SRC,
    ),
    Metric(
        "SkyRL",
        "policy/rollout_train_logprobs_abs_diff_std",
        "token",
        "std |δ| (unbiased)",
        _tok(_abs_delta, "std"),
        SKYRL_SRC,
    ),
    Metric(
        "SkyRL",
        "policy/rollout_train_logprobs_abs_diff_max",
        "token",
        "max |δ|",
        _tok(_abs_delta, "max"),
        SKYRL_SRC,
    ),
    Metric(
        "SkyRL",
        "policy/rollout_train_logprobs_abs_diff_min",
        "token",
        "min |δ|",
        _tok(_abs_delta, "min"),
        SKYRL_SRC,
    ),
)


# ------------------------------------------------------------------------------------------ methods


def _stat_token_ratio(m: Mismatch) -> torch.Tensor:
    return m.delta().exp()


def _stat_token_prob_diff(m: Mismatch) -> torch.Tensor:
    p, q = m.probs()
    return p - q


def _stat_seq_ratio(m: Mismatch) -> torch.Tensor:
    return m.seq_reduce(m.delta(), "sum").exp()


def _stat_seq_geo_ratio(m: Mismatch) -> torch.Tensor:
    return m.seq_reduce(m.delta(), "mean").exp()


def _stat_seq_k3_mean(m: Mismatch) -> torch.Tensor:
    return m.seq_reduce(k3(m.delta()), "mean")


def _stat_seq_min_ratio(m: Mismatch) -> torch.Tensor:
    return m.seq_reduce(m.delta(), "min").exp()


@dataclass(frozen=True)
class Statistic:
    level: str
    compute: Callable[[Mismatch], torch.Tensor]
    needs_probs: bool = False


# The per-unit statistics a method can threshold. Token statistics have one value per token, sequence
# statistics one per non-empty sequence.
STATISTICS: dict[str, Statistic] = {
    "ratio": Statistic("token", _stat_token_ratio),  # r = e^δ
    "tv": Statistic("token", _stat_token_prob_diff, needs_probs=True),  # binary TV, signed: p − q
    "seq_ratio": Statistic("sequence", _stat_seq_ratio),  # Π r = exp(Σδ)
    "geo_ratio": Statistic("sequence", _stat_seq_geo_ratio),  # exp(mean δ)
    "seq_mean_k3": Statistic("sequence", _stat_seq_k3_mean),  # mean (r − log r − 1)
    "min_ratio": Statistic("sequence", _stat_seq_min_ratio),  # the sequence's smallest token ratio
}


@dataclass(frozen=True)
class Method:
    """One importance-sampling correction with its frameworks' default parameters.

    A unit (token or sequence) is outside when its statistic is below ``interval[0]`` or above
    ``interval[1]`` (the interval itself is kept, as every framework here compares strictly). ``action``
    says what happens to an outside unit: ``clip`` caps the weight to the interval, ``mask`` / ``drop`` /
    ``veto`` zero it (the names follow each framework's own word), ``none`` leaves it. ``sign`` says
    which advantage signs the rule binds for (see :data:`SIGNS`), ``weight`` what a kept unit is
    weighted by: the statistic itself, the token ratio r, or 1 (rejection without reweighting).
    """

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
        def bad(fieldname: str, value: Any, allowed: str) -> UsageError:
            return UsageError(f"Method {self.name!r}: {fieldname}={value!r} is invalid: allowed {allowed}")

        if self.statistic not in STATISTICS:
            raise bad("statistic", self.statistic, ", ".join(STATISTICS))
        if self.level not in LEVELS or STATISTICS[self.statistic].level != self.level:
            raise bad(
                "level",
                self.level,
                f"{STATISTICS[self.statistic].level!r} (the level of statistic {self.statistic!r})",
            )
        if self.action not in ACTIONS:
            raise bad("action", self.action, ", ".join(ACTIONS))
        if self.sign not in SIGNS:
            raise bad("sign", self.sign, ", ".join(SIGNS))
        if self.weight not in WEIGHTS:
            raise bad("weight", self.weight, ", ".join(WEIGHTS))
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

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "frameworks": list(self.frameworks),
            "level": self.level,
            "statistic": self.statistic,
            "interval": list(self.interval),
            "action": self.action,
            "sign": self.sign,
            "weight": self.weight,
            "dual_clip": self.dual_clip,
            "source": self.source,
            "note": self.note,
        }

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
        n = int(x.numel())
        k = int(affected.sum())
        return MethodResult(
            self.name,
            sign,
            self.level,
            self.action,
            n,
            k if n else None,
            k / n if n else None,
            float(w.mean()) if n else None,
            effective_sample_size(w) if n else None,
        )


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "units": self.units,
            "affected": self.affected,
            "affected_frac": self.affected_frac,
            "mean_weight": self.mean_weight,
            "ess": self.ess,
        }


def effective_sample_size(w: torch.Tensor) -> float:
    """(Σw)² / Σw², normalised by the count: 1 for equal weights, 1/n for one weight carrying all.

    Scaled by the largest weight first so huge ratios do not overflow; weights at +inf share the mass
    equally among themselves (the limit of the formula). All-zero weights (everything dropped) give 0.
    """
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


_INF = math.inf
VERL_RC = "verl/trainer/ppo/rollout_corr_helper.py"
VERL_PRESETS = "verl/trainer/config/algorithm.py RolloutCorrectionConfig"
SKYRL_OPC = "skyrl_train/utils/off_policy_correction.py"
VERL_CORE = "verl/trainer/ppo/core_algos.py"

METHODS: tuple[Method, ...] = (
    Method(
        name="Naive IS (token)",
        frameworks=("reference",),
        level="token",
        statistic="ratio",
        interval=(0.0, _INF),
        action="none",
        source="per-token importance weight r, no truncation",
    ),
    Method(
        name="Naive IS (sequence)",
        frameworks=("reference",),
        level="sequence",
        statistic="seq_ratio",
        interval=(0.0, _INF),
        action="none",
        source="per-sequence importance weight Π r, no truncation",
    ),
    Method(
        name="Token TIS C=2",
        frameworks=("verl", "slime", "SkyRL"),
        level="token",
        statistic="ratio",
        interval=(0.0, 2.0),
        action="clip",
        source=f"{VERL_RC} compute_rollout_correction_weights (rollout_is='token', threshold 2.0); "
        f"{SKYRL_OPC} compute_tis_ratio (token)",
    ),
    Method(
        name="Token TIS C=3",
        frameworks=("TRL",),
        level="token",
        statistic="ratio",
        interval=(0.0, TRL_IS_CAP),
        action="clip",
        source=f"{TRL_SRC}, vllm_importance_sampling_mode='token_truncate', clip_max 3.0",
    ),
    Method(
        name="Sequence TIS C=2",
        frameworks=("verl",),
        level="sequence",
        statistic="seq_ratio",
        interval=(0.0, 2.0),
        action="clip",
        source=f"{VERL_RC} compute_rollout_correction_weights (rollout_is='sequence', threshold 2.0)",
    ),
    Method(
        name="TRL sequence_mask (default)",
        frameworks=("TRL",),
        level="sequence",
        statistic="seq_ratio",
        interval=(0.0, TRL_IS_CAP),
        action="mask",
        source=f"{TRL_SRC}, vllm_importance_sampling_mode='sequence_mask' (default), clip_max 3.0, no lower bound",
    ),
    Method(
        name="Token MIS/IcePop [0.5, 5]",
        frameworks=("verl", "OpenRLHF"),
        level="token",
        statistic="ratio",
        interval=(0.5, 5.0),
        action="mask",
        source=f"{VERL_RC} compute_rollout_rejection_mask (token level, IcePop bounds 0.5 and 5)",
    ),
    Method(
        name="Token MIS [0.5, 2]",
        frameworks=("SkyRL",),
        level="token",
        statistic="ratio",
        interval=(0.5, 2.0),
        action="mask",
        source=f"{SKYRL_OPC} compute_token_mask (token_mask_is_threshold_low/high)",
    ),
    Method(
        name="Sequence MIS [0.5, 2]",
        frameworks=("verl",),
        level="sequence",
        statistic="seq_ratio",
        interval=(0.5, 2.0),
        action="mask",
        source=f"{VERL_PRESETS}.decoupled_seq_is_rs (sequence IS 2.0 + sequence RS, lower bound 1/2)",
    ),
    Method(
        name="Geo-mean RS [0.999, 1.001]",
        frameworks=("verl",),
        level="sequence",
        statistic="geo_ratio",
        interval=(0.999, 1.001),
        action="drop",
        weight="one",
        source=f"{VERL_PRESETS}.decoupled_geo_rs (geometric RS 0.999-1.001)",
    ),
    Method(
        name="Geo-mean RS [0.99, 1.01]",
        frameworks=("SkyRL",),
        level="sequence",
        statistic="geo_ratio",
        interval=(0.99, 1.01),
        action="drop",
        weight="one",
        source=f"{SKYRL_OPC} compute_sequence_mask (sequence_mask_metric='geometric', geo_mask_low/high)",
    ),
    Method(
        name="K3 RS 0.01",
        frameworks=("verl",),
        level="sequence",
        statistic="seq_mean_k3",
        interval=(-_INF, 0.01),
        action="drop",
        weight="one",
        source=f"{VERL_PRESETS}.decoupled_k3_rs (seq_mean_k3 <= 0.01); {VERL_RC} compute_rollout_rejection_mask",
    ),
    Method(
        name="Token veto 1e-4",
        frameworks=("verl", "SkyRL"),
        level="sequence",
        statistic="min_ratio",
        interval=(1e-4, _INF),
        action="veto",
        weight="one",
        source="verl rollout_token_veto_threshold 1e-4 (a sequence with any token ratio below it is rejected); "
        f"{SKYRL_OPC} compute_outlier_token_mask (outlier_token_is_threshold_low 1e-4)",
    ),
    Method(
        name="PPO clip [0.8, 1.2]",
        frameworks=("verl", "TRL", "OpenRLHF"),
        level="token",
        statistic="ratio",
        interval=(0.8, 1.2),
        action="drop",
        sign="ppo",
        dual_clip=3.0,
        source=f"{VERL_CORE} compute_policy_loss_vanilla (clip_ratio 0.2, dual clip c=3)",
    ),
    Method(
        name="DAPO clip [0.8, 1.28]",
        frameworks=("verl", "TRL"),
        level="token",
        statistic="ratio",
        interval=(0.8, 1.28),
        action="drop",
        sign="ppo",
        dual_clip=3.0,
        source=f"{VERL_CORE} compute_policy_loss_vanilla (clip_ratio_low 0.2, clip_ratio_high 0.28, dual clip c=3)",
    ),
    Method(
        name="GSPO [1-3e-4, 1+4e-4]",
        frameworks=("verl", "TRL"),
        level="sequence",
        statistic="geo_ratio",
        interval=(1 - 3e-4, 1 + 4e-4),
        action="drop",
        sign="ppo",
        source=f"{VERL_CORE} compute_policy_loss_gspo (sequence ratio exp(mean δ), clip 3e-4 / 4e-4)",
    ),
    Method(
        name="CISPO cap 5",
        frameworks=("TRL", "MiniMax-M1"),
        level="token",
        statistic="ratio",
        interval=(0.0, 5.0),
        action="clip",
        source="trl/trainer/grpo_trainer.py GRPOTrainer._compute_loss, loss_type='cispo': "
        "clamp(r, max=epsilon_high), epsilon_high 5.0 as ScaleRL recommends",
    ),
    Method(
        name="TOPR",
        frameworks=("TOPR",),
        level="sequence",
        statistic="seq_ratio",
        interval=(0.0, 1.0),
        action="clip",
        sign="neg",
        source="Tapered Off-Policy REINFORCE: positive advantages weight 1, negative ones min(Π r, 1)",
    ),
    Method(
        name="DPPO binary-TV 0.2",
        frameworks=("verl",),
        level="token",
        statistic="tv",
        interval=(-0.2, 0.2),
        action="drop",
        sign="ppo",
        weight="ratio",
        source=f"{VERL_CORE} compute_policy_loss_dppo_tv (A > 0 keeps p − q <= 0.2, A < 0 keeps p − q >= -0.2; "
        "the kept weight is r, no ratio clipping)",
    ),
)


def _check_unique(entries: Sequence[Any], kind: str) -> None:
    seen: set[str] = set()
    for e in entries:
        if e.name in seen:
            raise UsageError(f"{kind} name {e.name!r} is used twice: allowed unique names")
        seen.add(e.name)


_check_unique(METRICS, "metric")
_check_unique(METHODS, "method")


# ------------------------------------------------------------------------------------------ summary


def metric_values(m: Mismatch, metrics: Sequence[Metric] = METRICS) -> dict[str, float | None]:
    return {e.name: e.value(m) for e in metrics}


def method_results(m: Mismatch, methods: Sequence[Method] = METHODS) -> dict[str, dict[str, dict[str, Any]]]:
    return {e.name: {s: e.apply(m, s).to_dict() for s in e.signs} for e in methods}


def summarize(
    m: Mismatch, *, metrics: Sequence[Metric] = METRICS, methods: Sequence[Method] = METHODS
) -> dict[str, Any]:
    """Every metric and every method on one trainer's tokens, as plain numbers (None = undefined)."""
    values = metric_values(m, metrics)
    over = [e.name for e in metrics if e.threshold is not None and e.threshold.holds(values[e.name]) is False]
    return {
        "tokens": m.tokens,
        "sequences": m.sequences,
        "empty_sequences": m.empty_sequences,
        "excluded_nan": m.excluded_nan,
        "metrics": values,
        "over_threshold": over,
        "methods": method_results(m, methods),
    }


def summarize_trainers(
    sampler: torch.Tensor, trainers: Mapping[str, torch.Tensor], seq_lengths: Sequence[int]
) -> dict[str, Any]:
    """The RL view of several trainers scored against one sampler, on the flat token layout."""
    return {name: summarize(Mismatch.from_flat(lp, sampler, seq_lengths)) for name, lp in trainers.items()}


def catalogue() -> dict[str, Any]:
    """What each entry is (for report.json): the assumption, the metrics and the methods."""
    return {
        "assumption": ASSUMPTION,
        "metrics": [e.describe() for e in METRICS],
        "methods": [e.describe() for e in METHODS],
    }
