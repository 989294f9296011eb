"""Capturing the sampler's kept set S_q from top-K processed log-probs, with completeness proofs.

:func:`run_capture` proves each position by the sentinel, asks unproven sequences again and flags what stays
unproven; it re-exports capture_plan and support for its callers (docs/capture_plan.md, sections 2 and 4)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from parity.core.capture_plan import (
    DEFAULT_MAX_HEAD,
    FULL_VOCAB,
    MIN_P_START_CAP,
    NEG_INF,
    CaptureHistory,
    CapturePlan,
    plan_capture,
    pow2_at_least,
    start_head,
)
from parity.core.json_types import JsonObject
from parity.core.spec import SamplingSpec
from parity.core.support import (
    CapturedSupport,
    compare_supports,
    padded_ids,
    support_from_heads,
    support_mass,
    validate_native_mask,
)
from parity.errors import EngineError

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_MAX_HEAD", "FULL_VOCAB", "MASS_SLACK", "MIN_P_START_CAP", "NEG_INF", "AskFn", "CaptureHistory",
    "CapturePlan", "CaptureResult", "CaptureStats", "CapturedSupport", "Heads", "compare_supports", "padded_ids",
    "plan_capture", "run_capture", "start_head", "support_from_heads", "support_lower_bound", "support_mass",
    "validate_native_mask",
]

# Below the head's processed mass, tolerance for float32 rounding of the values before the tail bound
# of :func:`support_lower_bound` counts missing tokens (a sum of float32 probabilities can be off by
# about 1e-5 on wide rows; the bound only skips ahead, it never proves anything).
MASS_SLACK = 1e-4


def support_lower_bound(values: Sequence[float]) -> int:
    """A lower bound on |S_q| where a head of K processed log-probs is all finite: at least
    ``(1 - mass - MASS_SLACK) / p_min`` tokens beyond it. It only lets a plan skip ahead, never proves anything
    (docs/capture_plan.md, section 3).
    """
    if not values:
        return 0
    mass = math.fsum(math.exp(v) for v in values)
    p_min = math.exp(min(values))
    rest = 1.0 - mass - MASS_SLACK
    if not rest > 0.0:  # nothing missing, or a NaN in the head: no bound beyond the head itself
        return len(values)
    if p_min <= 0.0:
        return 2**62
    return len(values) + math.ceil(rest / p_min)


@dataclass
class Heads:
    """One sequence as the engine returned it: sampled tokens and, per position, the top-K head
    (``head_ids`` / ``head_logprobs``, sampled entry excluded); ``payload`` is the engine's own object for the
    sequence (a ``CompletionOutput``, a JSON answer), handed back to the adapter untouched."""

    completion_ids: list[int]
    sampled_logprobs: list[float]
    head_ids: list[list[int]]
    head_logprobs: list[list[float]]
    payload: Any = None  # the adapter's own object, handed back untouched
    # position -> (kept ids, their processed log-probs): S_q read whole from the sampler's row where
    # the head could not prove it (parity.engines.sampler_rows); such a position is proven.
    rows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


# ask(indices, heads) -> one Heads per index: sample sequences ``indices`` again (same seeds) with
# ``heads[j]`` processed log-probs per position (0: none, -1: the vocabulary).
AskFn = Callable[[list[int], list[int]], list[Heads]]


@dataclass
class CaptureStats:
    """What a capture did, for report.json's ``capture_plan`` (one scenario, or one TRL generation batch)."""

    logprobs: int | None  # the head asked first (-1: the vocabulary; None: sampled token only)
    reason: str
    adaptive: bool = False
    max_head: int | None = None  # adaptive cap (-1: the vocabulary)
    sequences: int = 0
    positions: int = 0
    rounds: int = 0  # widening rounds after the first generation
    asks: list[dict[str, int]] = field(default_factory=list)  # per round: sequences asked again, widest head
    unproven_positions: int = 0  # positions the first generation did not prove complete
    widened_sequences: int = 0  # sequences asked again with a wider head
    widened_positions: int = 0  # their positions that the first generation had not proven
    largest_support: int = 0  # the largest |S_q| met at a position proven complete
    widest_head: int = 0  # the largest head asked (-1: the vocabulary)
    incomplete_positions: int = 0  # still unproven at the end: counted, reported and gated, never guessed
    beyond_cap_positions: int = 0  # of those, positions whose head's mass shows the support exceeds the cap
    resampled_differently: int = 0  # sequences whose second draw differed (their first capture is kept)
    resampled_prompts: list[int] = field(default_factory=list)
    support_changed_positions: int = 0  # proven in both draws of the same tokens, with different kept sets
    sampler_rows: str = ""  # "" where the head route alone ran; else how the sampler's rows were read
    row_positions: int = 0  # positions proven by the sampler's own row (the head could not prove them)
    row_mismatched: int = 0  # sampler rows that did not match the position's returned token and value

    def to_dict(self) -> JsonObject:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaptureStats:
        return cls(**data)

    def summary(self) -> str:
        """One line for progress output and report.md."""
        if not self.adaptive:
            return f"capture: {self.reason}"
        cap = "V" if self.max_head == FULL_VOCAB else str(self.max_head)
        start = "V" if self.logprobs == FULL_VOCAB else str(self.logprobs)
        text = (f"capture: adaptive, start K={start}, cap {cap}; widened {self.widened_sequences}/{self.sequences} "
                f"sequences ({self.widened_positions} positions) in {self.rounds} round(s); largest |S_q| "
                f"{self.largest_support}; incomplete at the cap {self.incomplete_positions}")
        if self.beyond_cap_positions:
            text += f" ({self.beyond_cap_positions} beyond it)"
        if self.resampled_differently:
            text += f"; {self.resampled_differently} resample(s) came back different"
        return text


@dataclass
class CaptureResult:
    heads: list[Heads]
    requested: list[int]  # per sequence: the head its kept heads were asked with (0: none)
    stats: CaptureStats


def _as_k(k: int, vocab_size: int) -> int:
    return vocab_size if k == FULL_VOCAB else k


def _status(h: Heads, requested: int, vocab_size: int) -> list[int | None]:
    """Per position: the size of the support proven complete (None: not proven)."""
    full = requested == FULL_VOCAB or requested >= vocab_size
    # The sentinel proof: the head ends in a dropped token (some entry is -inf), or it is the vocabulary.
    done = [full or len(v) >= vocab_size or NEG_INF in v for v in h.head_logprobs]
    return [int(h.rows[t][0].numel()) if t in h.rows else len(v) - v.count(NEG_INF) if ok else None
            for t, (v, ok) in enumerate(zip(h.head_logprobs, done, strict=True))]


def _kept_set(h: Heads, t: int) -> set[int]:
    if t in h.rows:
        return {int(i) for i in h.rows[t][0].tolist()}
    return {int(i) for i, v in zip(h.head_ids[t], h.head_logprobs[t], strict=True) if v != NEG_INF}


def run_capture(
    plan: CapturePlan,
    n: int,
    ask: AskFn,
    *,
    vocab_size: int,
    spec: SamplingSpec | None = None,
    history: CaptureHistory | None = None,
) -> CaptureResult:
    """Generate ``n`` sequences under ``plan`` through ``ask``; widen adaptive plans until proven or capped.
    A sequence whose second draw differs keeps its first capture and is counted (docs/capture_plan.md, section 4)."""
    first = plan.logprobs if plan.logprobs is not None else 0
    stats = CaptureStats(plan.logprobs, plan.reason, adaptive=plan.adaptive, max_head=plan.max_head, sequences=n,
                         widest_head=first)
    if n == 0:
        return CaptureResult([], [], stats)
    heads = ask(list(range(n)), [first] * n)
    if len(heads) != n:
        raise EngineError(f"capture asked for {n} sequences and got {len(heads)}")
    requested = [first] * n
    stats.positions = sum(len(h.completion_ids) for h in heads)
    if first == 0:
        return CaptureResult(heads, requested, stats)
    status = [_status(h, first, vocab_size) for h in heads]
    if plan.adaptive:
        _widen(plan, heads, requested, status, ask, vocab_size, stats)
    else:
        stats.unproven_positions = stats.incomplete_positions = sum(d.count(None) for d in status)
    stats.largest_support = max((w for d in status for w in d if w is not None), default=0)
    stats.row_positions = sum(len(h.rows) for h in heads)
    if history is not None and spec is not None and plan.adaptive:
        history.record(spec, [_need(heads[i], status[i], requested[i], vocab_size) for i in range(n)])
    return CaptureResult(heads, requested, stats)


def _widen(plan: CapturePlan, heads: list[Heads], requested: list[int], status: list[list[int | None]],
           ask: AskFn, vocab_size: int, stats: CaptureStats) -> None:
    """The adaptive rounds of :func:`run_capture`: ask the sequences with an unproven position again with a
    wider head until every position is proven or the cap is reached (``heads``, ``requested`` and ``status``
    are updated in place)."""
    n = len(heads)
    done_seq = [False] * n
    stats.unproven_positions = sum(d.count(None) for d in status)
    cap_k = _as_k(plan.max_head if plan.max_head is not None else FULL_VOCAB, vocab_size)
    widened: set[int] = set()
    while True:
        todo: list[tuple[int, int]] = []
        for i in range(n):
            if done_seq[i] or None not in status[i]:
                continue
            k = _as_k(requested[i], vocab_size)
            bounds = [support_lower_bound(v) for v, w in zip(heads[i].head_logprobs, status[i], strict=True)
                      if w is None]
            # A head of |S_q| + 1 entries proves a position; positions that need more than the cap are left.
            reachable = [b for b in bounds if b + 1 <= cap_k]
            if k >= cap_k or not reachable:
                done_seq[i] = True
                continue
            nxt = min(cap_k, max(k * plan.growth, pow2_at_least(max(reachable) + 1)))
            todo.append((i, FULL_VOCAB if nxt >= vocab_size else nxt))
        if not todo:
            break
        stats.rounds += 1
        idx = [i for i, _ in todo]
        ks = [k for _, k in todo]
        stats.asks.append({"sequences": len(idx), "head": FULL_VOCAB if FULL_VOCAB in ks else max(ks)})
        again = ask(idx, ks)
        if len(again) != len(idx):
            raise EngineError(f"capture asked again for {len(idx)} sequences and got {len(again)}")
        for i, k, h in zip(idx, ks, again, strict=True):
            if i not in widened:
                widened.add(i)
                stats.widened_positions += status[i].count(None)
            if list(h.completion_ids) != list(heads[i].completion_ids):
                stats.resampled_differently += 1
                stats.resampled_prompts.append(i)
                done_seq[i] = True
                continue
            new_status = _status(h, k, vocab_size)
            old = heads[i]
            for t, (was, now) in enumerate(zip(status[i], new_status, strict=True)):
                if was is not None and now is not None and _kept_set(old, t) != _kept_set(h, t):
                    stats.support_changed_positions += 1
            heads[i], requested[i], status[i] = h, k, new_status
    stats.widened_sequences = len(widened)
    stats.widest_head = FULL_VOCAB if FULL_VOCAB in requested else max(requested)
    for i in range(n):
        for vals, w in zip(heads[i].head_logprobs, status[i], strict=True):
            if w is None:
                stats.incomplete_positions += 1
                if support_lower_bound(vals) + 1 > cap_k:
                    stats.beyond_cap_positions += 1


def _need(h: Heads, sizes: list[int | None], requested: int, vocab_size: int) -> int:
    """The head that would have proven this sequence in one generation (as far as its capture shows)."""
    k = _as_k(requested, vocab_size)
    return max([2] + [1 + (w if w is not None else max(support_lower_bound(vals), k))
                      for vals, w in zip(h.head_logprobs, sizes, strict=True)])
