"""How many processed log-probs (the head, K) to ask vLLM for per position: top_k plus a tie margin, an
adaptive plan for top_p or min_p alone (started from the spec or a :class:`CaptureHistory`), or nothing when
no filter applies. The derivation and measurements: docs/capture_plan.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from parity.core.spec import SamplingSpec
from parity.errors import UsageError

FULL_VOCAB = -1  # vLLM's "logprobs=-1": every token of the vocabulary
NEG_INF = float("-inf")
DEFAULT_MAX_HEAD = 4096  # the widest head an adaptive plan asks for (--max-capture-head)
GROWTH = 4  # an unproven sequence is asked again with (at least) this many times the head
MIN_HEAD = 16  # the narrowest start of an adaptive plan
SMALL_VOCAB = 1024  # up to this vocabulary, top_p/min_p without top_k read the whole row at once
# top_p alone: the start by temperature (see start_head); a narrow nucleus (top_p <= 0.5) starts small.
TOP_P_START_COLD, TOP_P_START, TOP_P_START_NARROW = 1024, 4096, 64
MIN_P_START_FACTOR = 4  # min_p alone: start at 4 / min_p (rounded up to a power of two)
MIN_P_START_CAP = 1 << 20  # min_p's start head never exceeds this (a head is capped by max_head anyway)


@dataclass(frozen=True)
class CapturePlan:
    """How many processed log-probs to request per position, and why. ``max_head`` marks an adaptive plan
    (top_p or min_p without top_k): ``logprobs`` is its first head, widened for unproven sequences up to
    ``max_head`` (``FULL_VOCAB`` when the cap is the whole vocabulary)."""

    logprobs: int | None  # None: sampled token only (logprobs=0); -1: full vocabulary; K: top-K
    reason: str
    max_head: int | None = None
    growth: int = GROWTH

    @property
    def captures_support(self) -> bool:
        return self.logprobs is not None and self.logprobs != 0

    @property
    def adaptive(self) -> bool:
        return self.max_head is not None


def pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def start_head(spec: SamplingSpec) -> int:
    """The head an adaptive plan starts with, from the spec alone: 4 / min_p for min_p; for top_p 4096 at
    T >= 1, 1024 below, 64 for top_p <= 0.5 (why, with measurements: docs/capture_plan.md, sections 4 and 5).
    """
    spec = spec.effective()
    starts = []
    if spec.uses_top_p:
        if spec.top_p <= 0.5:
            starts.append(TOP_P_START_NARROW)
        else:
            starts.append(TOP_P_START if spec.temperature >= 1.0 else TOP_P_START_COLD)
    if spec.uses_min_p:
        # A vanishing min_p keeps nearly every token: its bound is no tighter than the largest head.
        want = MIN_P_START_FACTOR / spec.min_p
        starts.append(pow2_at_least(math.ceil(want)) if want < MIN_P_START_CAP else MIN_P_START_CAP)
    return max(MIN_HEAD, min(starts)) if starts else MIN_HEAD


def plan_capture(
    spec: SamplingSpec,
    vocab_size: int,
    *,
    head: int | None = None,
    tie_margin: int = 16,
    max_head: int = DEFAULT_MAX_HEAD,
    start: int | None = None,
    suggested: int | None = None,
) -> CapturePlan:
    """Choose the head size K for ``spec`` on a vocabulary of ``vocab_size``. ``head`` forces K (K >= top_k;
    never widened); ``max_head`` caps it (a top_k plan that needs more is refused); ``start`` sets an adaptive
    plan's first head, else ``suggested`` (a :class:`CaptureHistory`) or :func:`start_head`.
    Raises :class:`~parity.errors.UsageError` naming the field."""
    if isinstance(max_head, bool) or not isinstance(max_head, int) or max_head < 2:
        raise UsageError(
            f"max capture head={max_head!r} is invalid: allowed an integer >= 2 (a head proves itself "
            f"complete only by ending in a dropped token, so it needs room for one)"
        )
    spec = spec.effective()
    if not spec.filtered:
        return CapturePlan(None, "no filter: the support is the whole vocabulary")
    k = spec.top_k if spec.uses_top_k and spec.top_k < vocab_size else None
    if head is not None:
        if head != FULL_VOCAB and head < 1:
            raise UsageError(f"capture head={head} is invalid: allowed -1 (full vocabulary) or >= 1")
        if k is not None and head != FULL_VOCAB and head < k:
            raise UsageError(
                f"capture head={head} is smaller than top_k={k}: allowed head >= top_k "
                f"(a head of top_k + {tie_margin} also captures ties at the k-th value)"
            )
        if head == FULL_VOCAB or head >= vocab_size:
            return CapturePlan(FULL_VOCAB, "full vocabulary (forced)")
        return CapturePlan(head, f"top-{head} (forced)")
    if k is not None:
        kk = k + tie_margin
        if kk >= vocab_size:
            plan = CapturePlan(FULL_VOCAB, f"top_k={k} + tie margin covers the vocabulary")
        else:
            plan = CapturePlan(kk, f"top_k={k} + {tie_margin} to catch ties at the k-th value")
        need = vocab_size if plan.logprobs == FULL_VOCAB else kk
        if need > max_head:
            raise UsageError(
                f"spec {spec.label()} needs a capture head of {need} (top_k={k} + {tie_margin} for ties"
                f"{', the whole vocabulary' if plan.logprobs == FULL_VOCAB else ''}), above the cap "
                f"max_head={max_head}: raise --max-capture-head to {need} or more, or lower top_k"
            )
        return plan
    if not (spec.uses_top_p or spec.uses_min_p):
        # top_k >= V alone keeps every token: S_q is the whole vocabulary, provable only by reading all of it.
        if vocab_size > max_head:
            raise UsageError(
                f"spec {spec.label()} keeps the whole vocabulary (top_k={spec.top_k} >= V={vocab_size}): its "
                f"support is every token, and capturing it needs logprobs=-1, above the cap max_head={max_head}: "
                f"drop top_k (the spec is then unfiltered) or raise --max-capture-head to {vocab_size}"
            )
        return CapturePlan(FULL_VOCAB, f"top_k={spec.top_k} >= V={vocab_size}: full vocabulary")
    cap = FULL_VOCAB if max_head >= vocab_size else max_head
    if start is not None:
        k0 = max(2, int(start))
    else:
        k0 = max(2, int(suggested)) if suggested is not None else start_head(spec)
        if vocab_size <= SMALL_VOCAB and cap == FULL_VOCAB:
            k0 = vocab_size
    what = "top_p/min_p without top_k"
    if cap != FULL_VOCAB:
        k0 = min(k0, cap)  # never above the cap, whatever the start asked for
    if k0 >= vocab_size:
        return CapturePlan(FULL_VOCAB, f"{what}: full vocabulary (V={vocab_size})", max_head=FULL_VOCAB)
    if k0 == cap:
        return CapturePlan(k0, f"{what}: adaptive, top-{k0} first, which is the cap max_head={cap}: positions it "
                           f"does not prove are flagged", max_head=cap)
    cap_text = f"the vocabulary (V={vocab_size})" if cap == FULL_VOCAB else f"max_head={cap}"
    return CapturePlan(
        k0,
        f"{what}: adaptive, top-{k0} first, sequences with an unproven position asked again with "
        f"x{GROWTH} the head and the same seed, up to {cap_text}",
        max_head=cap,
    )


class CaptureHistory:
    """What earlier adaptive captures of one run needed, keyed by the effective (temperature, top_p, min_p):
    a spec starts from the widest head it or any stricter spec needed (docs/capture_plan.md, section 4)."""

    def __init__(self) -> None:
        self._needs: dict[tuple[float, float, float], int] = {}

    @staticmethod
    def _key(spec: SamplingSpec) -> tuple[float, float, float]:
        s = spec.effective()
        return (s.temperature, s.top_p, s.min_p)

    def record(self, spec: SamplingSpec, needs: Sequence[int]) -> None:
        if needs:
            self._needs[self._key(spec)] = int(max(needs))

    def start(self, spec: SamplingSpec) -> int | None:
        """The suggested start head for ``spec``, or None when nothing relevant was captured yet."""
        t, p, m = self._key(spec)
        exact = self._needs.get((t, p, m))
        if exact is not None:
            return max(MIN_HEAD, pow2_at_least(exact))
        stricter = [need for (tt, pp, mm), need in self._needs.items() if tt <= t and pp <= p and mm >= m]
        if not stricter:
            return None
        return max(start_head(spec), pow2_at_least(max(stricter)))
