"""SamplingSpec: the filter settings one request is sampled with, validated up front; the one description
of what the sampler did that both sides share (the rollout engine's ``SamplingParams``, the reference
filters and the estimators read it). It imports no engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from parity.errors import UsageError

# vLLM treats temperatures below this as greedy (``_SAMPLING_EPS`` in vllm/sampling_params.py and
# vllm/v1/sample/sampler.py).
SAMPLING_EPS = 1e-5
# ``SamplingParams.__post_init__`` raises any temperature in (0, 0.01) to 0.01 before it decides
# greedy vs random (``_MAX_TEMP`` in vllm/sampling_params.py), so only T == 0 is greedy: T = 5e-6 samples
# at T = 0.01 with every filter active. ``_verify_args`` refuses T > 2.
MIN_RANDOM_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0
# ``SamplingParams._verify_args``: presence and frequency penalties in [-2, 2]; repetition penalty finite, > 0.
MAX_ABS_ADDITIVE_PENALTY = 2.0
PENALTY_FIELDS = ("repetition_penalty", "presence_penalty", "frequency_penalty")
SPEC_FIELDS = ("temperature", "top_k", "top_p", "min_p", *PENALTY_FIELDS)
# Each penalty's value when it is off (vLLM's SamplingParams defaults).
PENALTY_OFF: dict[str, float] = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def _fail(field: str, value: object, allowed: str) -> UsageError:
    return UsageError(f"SamplingSpec.{field}={value!r} is invalid: allowed {allowed}")


@dataclass(frozen=True)
class SamplingSpec:
    """Filter settings of one request. ``temperature`` in [0, 2], 0 = greedy (vLLM then ignores top_k/top_p/min_p);
    values in (0, 0.01) are raised to 0.01, as vLLM's SamplingParams does, so they are *not* greedy. ``top_k``: 0
    or -1 = off, else >= 1 (ties with the k-th value are kept, so |S| may exceed k). ``top_p`` in (0, 1], 1 = off.
    ``min_p`` in [0, 1], 0 = off. Penalties under vLLM's ``SamplingParams`` names, applied before temperature and
    kept on greedy rows: ``repetition_penalty`` > 0 (1 = off), ``presence_penalty`` and ``frequency_penalty`` in
    [-2, 2] (0 = off); :mod:`parity.core.penalties`."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        def additive(v: float) -> bool:
            return -MAX_ABS_ADDITIVE_PENALTY <= v <= MAX_ABS_ADDITIVE_PENALTY

        # (field, its range, what is allowed), in the order checked. vLLM's SamplingParams._verify_args
        # refuses T > 2: a spec the engine cannot run is useless.
        checks: tuple[tuple[str, Callable[[float], bool], str], ...] = (
            ("temperature", lambda v: 0 <= v <= MAX_TEMPERATURE,
             "a finite number in [0, 2] (0 means greedy)"),
            ("top_k", lambda v: v >= 1 or v in (0, -1), "an integer: 0 or -1 (off) or >= 1"),
            ("top_p", lambda v: 0.0 < v <= 1.0, "a number in (0, 1]"),
            ("min_p", lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]"),
            ("repetition_penalty", lambda v: 0.0 < v < math.inf, "a finite number > 0 (1 means off)"),
            ("presence_penalty", additive, "a number in [-2, 2] (0 means off)"),
            ("frequency_penalty", additive, "a number in [-2, 2] (0 means off)"),
        )
        for name, in_range, allowed in checks:
            v = getattr(self, name)
            kinds = int if name == "top_k" else (int, float)
            if isinstance(v, bool) or not isinstance(v, kinds) or not in_range(v):
                raise _fail(name, v, allowed)
            if name != "top_k":  # ints as floats, so that equal specs compare and hash equal
                object.__setattr__(self, name, float(v))

    @property
    def effective_temperature(self) -> float:
        """The temperature vLLM samples with: (0, 0.01) is raised to 0.01 (SamplingParams.__post_init__)."""
        t = self.temperature
        return MIN_RANDOM_TEMPERATURE if 0.0 < t < MIN_RANDOM_TEMPERATURE else t

    @property
    def greedy(self) -> bool:
        # SamplingParams.sampling_type: GREEDY when temperature < _SAMPLING_EPS, read *after* the
        # (0, 0.01) -> 0.01 clamp, so in practice only T == 0.
        return self.effective_temperature < SAMPLING_EPS

    @property
    def uses_top_k(self) -> bool:
        return not self.greedy and self.top_k >= 1

    @property
    def uses_top_p(self) -> bool:
        return not self.greedy and self.top_p < 1.0

    @property
    def uses_min_p(self) -> bool:
        return not self.greedy and self.min_p > 0.0

    @property
    def penalised(self) -> bool:
        """True when some penalty is on (vLLM then runs ``apply_penalties``, greedy rows included)."""
        return any(getattr(self, name) != off for name, off in PENALTY_OFF.items())

    @property
    def filtered(self) -> bool:
        """True when the processed distribution can differ from ``softmax(z / T)``."""
        return self.uses_top_k or self.uses_top_p or self.uses_min_p

    def effective(self) -> SamplingSpec:
        """The spec as vLLM applies it, as ``SamplingParams.__post_init__`` (vllm/sampling_params.py): temperatures in
        (0, 0.01) become 0.01, and greedy requests (temperature < _SAMPLING_EPS) drop top_p, top_k and min_p."""
        if self.greedy:  # every filter at its default: off; the penalties stay (vLLM keeps them)
            return replace(self, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)
        t = self.effective_temperature
        if self.top_k == -1 or t != self.temperature:
            return replace(self, temperature=t, top_k=0 if self.top_k == -1 else self.top_k)
        return self

    def without_penalties(self) -> SamplingSpec:
        """The same filters with every penalty off: what a trainer that ignores the penalties applies."""
        return replace(self, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)

    def top_k_for_vocab(self, vocab_size: int) -> int:
        """k as a row filter: the vocabulary size when top_k is off or k >= V."""
        return min(self.top_k, vocab_size) if self.uses_top_k else vocab_size

    def label(self) -> str:
        parts = [
            (True, f"T={self.temperature:g}"),
            (self.uses_top_k, f"top_k={self.top_k}"),
            (self.uses_top_p, f"top_p={self.top_p:g}"),
            (self.uses_min_p, f"min_p={self.min_p:g}"),
            (self.repetition_penalty != 1.0, f"rep={self.repetition_penalty:g}"),
            (self.presence_penalty != 0.0, f"presence={self.presence_penalty:g}"),
            (self.frequency_penalty != 0.0, f"freq={self.frequency_penalty:g}"),
        ]
        return " ".join(text for on, text in parts if on)

    def to_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> SamplingSpec:
        unknown = set(data) - set(SPEC_FIELDS)
        if unknown:
            raise UsageError(f"SamplingSpec got unknown field(s) {sorted(unknown)}: allowed {', '.join(SPEC_FIELDS)}")
        build: Callable[..., SamplingSpec] = cls  # __post_init__ checks each value's type
        return build(**data)

    def sampling_params_kwargs(self) -> dict[str, float]:
        """Keyword arguments for ``vllm.SamplingParams`` (no vLLM import needed). The temperature is passed
        already clamped, so vLLM does not log its clamp warning per request."""
        return {**asdict(self), "temperature": self.effective_temperature, "top_k": max(self.top_k, 0)}


def per_row(specs: SamplingSpec | Sequence[SamplingSpec], n: int) -> list[SamplingSpec]:
    """One effective spec per row of an ``[n, V]`` batch (vLLM batches requests with different settings)."""
    if isinstance(specs, SamplingSpec):
        return [specs.effective()] * n
    out = [s.effective() for s in specs]
    if len(out) != n:
        raise UsageError(f"specs has {len(out)} entries for {n} logit rows: allowed one spec or one per row")
    return out
