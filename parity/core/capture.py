"""Capturing the sampler's kept set S_q from top-K processed log-probs, with completeness proofs.

vLLM returns, per position, the sampled token's processed log-prob and the top-K processed log-probs
sorted descending; a token off the support has ``-inf``. So a head whose last entry is ``-inf`` holds
all of S_q; a head of K finite entries on a partial vocabulary may not, and that position is flagged
incomplete and counted, never guessed. :func:`plan_capture` sizes the head: top_k + a tie margin when
top_k is set; an adaptive plan for top_p or min_p alone (:func:`run_capture` asks unproven sequences
again, same seed, wider heads, up to a cap; :class:`CaptureHistory` picks the start); nothing when no
filter applies. The derivation and measurements: docs/capture_plan.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from parity.core.spec import SamplingSpec
from parity.errors import EngineError, UsageError

if TYPE_CHECKING:
    import torch  # the support functions import it when called: the capture plan and its stats need none

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
# Below the head's processed mass, tolerance for float32 rounding of the values before the tail bound
# of :func:`support_lower_bound` counts missing tokens (a sum of float32 probabilities can be off by
# about 1e-5 on wide rows; the bound only skips ahead, it never proves anything).
MASS_SLACK = 1e-4


@dataclass(frozen=True)
class CapturePlan:
    """How many processed log-probs to request per position, and why.

    ``max_head`` marks an adaptive plan (top_p or min_p without top_k): ``logprobs`` is the head it
    starts with, and unproven sequences are asked again up to ``max_head`` (``FULL_VOCAB`` when the cap
    is the whole vocabulary).
    """

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


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def start_head(spec: SamplingSpec) -> int:
    """The head an adaptive plan starts with, from the spec alone (before any history).

    min_p keeps tokens with p >= min_p * p_max, so a row keeps at most 1 / (min_p * p_max) of them:
    4 / min_p covers rows whose top token has p_max >= 1/4. top_p has no such bound, and a sequence
    needs the head of its widest position: on SmolLM2-135M at T=1, top_p=0.9 the nucleus was 25
    tokens at the median position but 235 to 2,827 at each sequence's widest (192 positions), at
    T=0.7 at most 271. A head entry costs about 0.5 us on CPU and a second generation about what the
    first did, so top_p starts wide: 4096 at T >= 1, 1024 below, 64 for a narrow nucleus
    (top_p <= 0.5); docs/capture_plan.md has the measurements.
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
        starts.append(_pow2_at_least(math.ceil(want)) if want < MIN_P_START_CAP else MIN_P_START_CAP)
    return max(MIN_HEAD, min(starts)) if starts else MIN_HEAD


def _check_max_head(max_head: int) -> None:
    if isinstance(max_head, bool) or not isinstance(max_head, int) or max_head < 2:
        raise UsageError(
            f"max capture head={max_head!r} is invalid: allowed an integer >= 2 (a head proves itself complete "
            f"only by ending in a dropped token, so it needs room for one)"
        )


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
    """Choose the head size K for ``spec`` on a vocabulary of ``vocab_size``.

    ``head`` forces K (validated: K >= top_k when top_k is set; a forced head is never widened).
    ``max_head`` caps K: an adaptive plan widens up to it, and a top_k plan that needs more is
    refused. ``start`` sets the head an adaptive plan starts with; without it the plan starts from
    ``suggested`` (what a :class:`CaptureHistory` suggests) or :func:`start_head`, and a vocabulary of
    at most ``SMALL_VOCAB`` tokens is read whole at once. Raises :class:`~parity.errors.UsageError` naming the field when
    the spec cannot be captured within the allowed head.
    """
    _check_max_head(max_head)
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


# --------------------------------------------------------------------------------------------------
# the adaptive capture loop (engine-free: the engine is a callable)


def _head_complete(values: Sequence[float], *, full: bool, vocab_size: int) -> bool:
    """The sentinel proof: the head ends in a dropped token (some entry is -inf), or it is the vocabulary."""
    return full or len(values) >= vocab_size or NEG_INF in values


def support_lower_bound(values: Sequence[float]) -> int:
    """A lower bound on |S_q| at a position whose head of K processed log-probs is all finite.

    Every token beyond the head has a processed probability no larger than the head's smallest, and
    together they hold what the head misses of the mass 1: at least ``(1 - mass - MASS_SLACK) / p_min``
    of them. The bound only lets a plan skip ahead (or stop before a head that cannot suffice); it
    never proves a position complete.
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
    """One sequence as the engine returned it: sampled tokens and, per position, the top-K head.

    ``head_ids`` / ``head_logprobs`` exclude the sampled entry; ``payload`` is the engine's own object
    for the sequence (a ``CompletionOutput``, a JSON answer), handed back to the adapter untouched.
    """

    completion_ids: list[int]
    sampled_logprobs: list[float]
    head_ids: list[list[int]]
    head_logprobs: list[list[float]]
    payload: Any = None
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

    def to_dict(self) -> dict[str, Any]:
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


def _status(h: Heads, requested: int, vocab_size: int) -> tuple[list[bool], int]:
    """Per position: proven complete; and the widest support proven in this sequence."""
    full = requested == FULL_VOCAB or requested >= vocab_size
    done, widest = [], 0
    for t, vals in enumerate(h.head_logprobs):
        if t in h.rows:
            done.append(True)
            widest = max(widest, int(h.rows[t][0].numel()))
            continue
        ok = _head_complete(vals, full=full, vocab_size=vocab_size)
        done.append(ok)
        if ok:
            widest = max(widest, len(vals) - vals.count(NEG_INF))
    return done, widest


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

    A fixed plan asks once. An adaptive plan asks every sequence with its start head, proves each
    position by the sentinel (:func:`_head_complete`), and asks the sequences with an unproven
    position again (same seeds: ``ask`` owns them) with ``growth`` times the head, or more where the
    head's mass shows more is needed (:func:`support_lower_bound`), until every position is proven or
    the head reaches ``plan.max_head``. A sequence whose second draw differs from its first keeps its
    first capture (its unproven positions stay flagged) and is counted: passes are never mixed.
    """
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
    done_seq = [False] * n
    if plan.adaptive:
        stats.unproven_positions = sum(d.count(False) for d, _ in status)
        cap_k = _as_k(plan.max_head if plan.max_head is not None else FULL_VOCAB, vocab_size)
        widened: set[int] = set()
        while True:
            todo: list[tuple[int, int]] = []
            for i in range(n):
                if done_seq[i] or all(status[i][0]):
                    continue
                k = _as_k(requested[i], vocab_size)
                bounds = [support_lower_bound(v) for v, ok in zip(heads[i].head_logprobs, status[i][0], strict=True)
                          if not ok]
                # A head of |S_q| + 1 entries proves a position; positions that need more than the cap are left.
                reachable = [b for b in bounds if b + 1 <= cap_k]
                if k >= cap_k or not reachable:
                    done_seq[i] = True
                    continue
                nxt = min(cap_k, max(k * plan.growth, _pow2_at_least(max(reachable) + 1)))
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
                    stats.widened_positions += status[i][0].count(False)
                if list(h.completion_ids) != list(heads[i].completion_ids):
                    stats.resampled_differently += 1
                    stats.resampled_prompts.append(i)
                    done_seq[i] = True
                    continue
                new_status = _status(h, k, vocab_size)
                old = heads[i]
                for t, (was, now) in enumerate(zip(status[i][0], new_status[0], strict=True)):
                    if was and now and _kept_set(old, t) != _kept_set(h, t):
                        stats.support_changed_positions += 1
                heads[i], requested[i], status[i] = h, k, new_status
        stats.widened_sequences = len(widened)
        stats.widest_head = FULL_VOCAB if FULL_VOCAB in requested else max(requested)
        for i in range(n):
            for vals, ok in zip(heads[i].head_logprobs, status[i][0], strict=True):
                if not ok:
                    stats.incomplete_positions += 1
                    if support_lower_bound(vals) + 1 > cap_k:
                        stats.beyond_cap_positions += 1
    else:
        stats.unproven_positions = stats.incomplete_positions = sum(d.count(False) for d, _ in status)
    stats.largest_support = max((w for _, w in status), default=0)
    stats.row_positions = sum(len(h.rows) for h in heads)
    if history is not None and spec is not None and plan.adaptive:
        history.record(spec, [_need(heads[i], status[i][0], requested[i], vocab_size) for i in range(n)])
    return CaptureResult(heads, requested, stats)


def _need(h: Heads, done: list[bool], requested: int, vocab_size: int) -> int:
    """The head that would have proven this sequence in one generation (as far as its capture shows)."""
    need = 2
    for t, (vals, ok) in enumerate(zip(h.head_logprobs, done, strict=True)):
        if t in h.rows:
            need = max(need, int(h.rows[t][0].numel()) + 1)
        elif ok:
            need = max(need, len(vals) - vals.count(NEG_INF) + 1)
        else:
            need = max(need, support_lower_bound(vals) + 1, _as_k(requested, vocab_size) + 1)
    return need


class CaptureHistory:
    """What earlier adaptive captures of one run needed: the start head of the next.

    Keyed by the effective (temperature, top_p, min_p). A spec's support contains that of any
    stricter spec at the same logits (lower temperature, lower top_p, higher min_p: the nucleus and
    the min_p set only grow as the row flattens or the thresholds loosen), so the start for a spec is
    the widest head that the latest capture of it, or of any stricter spec, needed per sequence
    (rounded up to a power of two). TRL's steps reuse their spec; a run's scenarios reuse the stricter
    ones'.
    """

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
            return max(MIN_HEAD, _pow2_at_least(exact))
        stricter = [need for (tt, pp, mm), need in self._needs.items() if tt <= t and pp <= p and mm >= m]
        if not stricter:
            return None
        return max(start_head(spec), _pow2_at_least(max(stricter)))


@dataclass
class CapturedSupport:
    """S_q for each position of one sequence."""

    kept_ids: torch.Tensor  # long [L, K] padded with -1 (K = widest captured support)
    kept_logprobs: torch.Tensor  # float32 [L, K]: the sampler's processed log-probs of kept_ids (-inf pad)
    incomplete: torch.Tensor  # bool [L]: the head was full, the support may extend beyond it
    sampled_missing: torch.Tensor  # bool [L]: the sampled token is not among the kept ids (engine fault)


def support_from_heads(
    sampled: Sequence[int],
    head_ids: Sequence[Sequence[int]],
    head_logprobs: Sequence[Sequence[float]],
    *,
    requested: int,
    vocab_size: int,
    rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> CapturedSupport:
    """Build S_q from per-position heads (token ids and processed log-probs, sampled entry excluded).

    ``requested`` is the K that was asked for (-1 = full vocabulary); ``rows`` (``Heads.rows``) holds
    whole kept sets read from the sampler where the head could not prove them: they replace the head there.
    """
    base = _support_of_heads(sampled, head_ids, head_logprobs, requested=requested, vocab_size=vocab_size)
    return _with_rows(base, sampled, rows) if rows else base


def _with_rows(base: CapturedSupport, sampled: Sequence[int],
               rows: Mapping[int, tuple[torch.Tensor, torch.Tensor]]) -> CapturedSupport:
    """``base`` with the positions of ``rows`` replaced by the sampler's whole kept set (proven complete)."""
    import torch

    n, w0 = base.kept_ids.shape
    width = max([w0] + [int(ids.numel()) for ids, _ in rows.values()])
    ids_t = torch.full((n, width), -1, dtype=torch.long)
    lps_t = torch.full((n, width), NEG_INF, dtype=torch.float32)
    ids_t[:, :w0], lps_t[:, :w0] = base.kept_ids, base.kept_logprobs
    incomplete, missing = base.incomplete.clone(), base.sampled_missing.clone()
    for t, (ids, vals) in rows.items():
        if not 0 <= t < n or ids.numel() != vals.numel():
            raise UsageError(f"a sampler row at position {t} of {n} holds {ids.numel()} ids and {vals.numel()} values")
        k = int(ids.numel())
        ids_t[t], lps_t[t] = -1, NEG_INF
        ids_t[t, :k], lps_t[t, :k] = ids.long(), vals.float()
        incomplete[t] = False
        missing[t] = not bool((ids == int(sampled[t])).any())
    return CapturedSupport(ids_t, lps_t, incomplete, missing)


def _support_of_heads(
    sampled: Sequence[int],
    head_ids: Sequence[Sequence[int]],
    head_logprobs: Sequence[Sequence[float]],
    *,
    requested: int,
    vocab_size: int,
) -> CapturedSupport:
    import torch

    if len(head_ids) != len(sampled) or len(head_logprobs) != len(sampled):
        raise UsageError(
            f"capture has {len(head_ids)} heads and {len(head_logprobs)} log-prob rows for {len(sampled)} sampled tokens"
        )
    full = requested == FULL_VOCAB or requested >= vocab_size
    lengths = {len(r) for r in head_ids} | {len(r) for r in head_logprobs}
    if len(sampled) and len(lengths) == 1:
        n, k = len(sampled), len(head_ids[0])
        return _support_dense(
            torch.tensor([int(v) for v in sampled], dtype=torch.long),
            torch.tensor([list(r) for r in head_ids], dtype=torch.long).reshape(n, k),
            torch.tensor([list(r) for r in head_logprobs], dtype=torch.float32).reshape(n, k),
            partial=not full and k < vocab_size,
        )
    rows: list[list[tuple[int, float]]] = []
    incomplete: list[bool] = []
    missing: list[bool] = []
    # The lengths are checked above, so this zip's strict= cannot change anything.
    for y, ids, lps in zip(sampled, head_ids, head_logprobs, strict=True):  # pragma: no mutate
        finite = [(int(i), float(v)) for i, v in zip(ids, lps, strict=True) if v != NEG_INF]
        # One order whatever the head's order among equal values (torch.topk leaves ties unordered).
        finite.sort(key=lambda iv: (-iv[1], iv[0]))
        rows.append(finite)
        # A full head of finite values on a partial vocabulary may hide more kept tokens.
        incomplete.append(not full and len(finite) >= len(ids) and len(ids) < vocab_size)
        missing.append(all(i != int(y) for i, _ in finite))
    width = max([len(r) for r in rows] + [1])
    # Int and bool values make long and bool tensors whatever torch's default dtype: the dtype= of the
    # lines marked below is there for the reader, and its mutants are equivalent.
    ids_t = torch.full((len(rows), width), -1, dtype=torch.long)  # pragma: no mutate
    lps_t = torch.full((len(rows), width), NEG_INF, dtype=torch.float32)
    for t, r in enumerate(rows):
        if r:
            ids_t[t, : len(r)] = torch.tensor([i for i, _ in r], dtype=torch.long)  # pragma: no mutate
            lps_t[t, : len(r)] = torch.tensor([v for _, v in r], dtype=torch.float32)  # pragma: no mutate (cast on assignment)
    incomplete_t = torch.tensor(incomplete, dtype=torch.bool)  # pragma: no mutate
    missing_t = torch.tensor(missing, dtype=torch.bool)  # pragma: no mutate
    return CapturedSupport(ids_t, lps_t, incomplete_t, missing_t)


def _support_dense(y: torch.Tensor, ids: torch.Tensor, lps: torch.Tensor, *, partial: bool) -> CapturedSupport:
    """:func:`support_from_heads` for heads of one length ``[L, K]``, as tensor operations (wide adaptive heads).

    The same rules and the same output as the per-position loop: finite entries kept, ordered by
    processed log-prob descending and then by id, padded with -1 / -inf to the widest support.
    ``partial``: the heads are neither the vocabulary nor as wide as it.
    """
    import torch

    n, k = ids.shape
    finite = lps != NEG_INF
    count = finite.sum(dim=1)
    # A full head of finite values on a partial vocabulary may hide more kept tokens.
    incomplete = count >= k if partial else torch.zeros(n, dtype=torch.bool)
    # Order: by value descending, ties by id ascending (a stable sort by id, then a stable one by
    # value); dropped entries (-inf) sort after every kept one.
    by_id = torch.argsort(ids, dim=1, stable=True)
    ids, lps = ids.gather(1, by_id), lps.gather(1, by_id)
    by_value = torch.sort(lps, dim=1, descending=True, stable=True).indices
    ids, lps = ids.gather(1, by_value), lps.gather(1, by_value)
    width = max(int(count.max()), 1)
    if k == 0:
        kept_ids = torch.full((n, 1), -1, dtype=torch.long)
        kept_lps = torch.full((n, 1), NEG_INF, dtype=torch.float32)
    else:
        keep = lps[:, :width] != NEG_INF
        kept_ids = ids[:, :width].masked_fill(~keep, -1)
        kept_lps = lps[:, :width].masked_fill(~keep, NEG_INF)
    missing = ~(kept_ids == y[:, None]).any(dim=1)
    return CapturedSupport(kept_ids.contiguous(), kept_lps.contiguous(), incomplete, missing)


def support_mass(kept_logprobs: torch.Tensor) -> torch.Tensor:
    """Sum of the sampler's processed probabilities over the captured support, per position.

    1 (to float rounding) when the capture holds the whole support of a processed distribution; less
    when tokens are missing; a server running ``raw_logprobs`` also fails this (its head is not
    renormalised).
    """
    import torch

    return torch.exp(kept_logprobs.double()).sum(dim=-1)


def validate_native_mask(spec: SamplingSpec) -> None:
    """vLLM's native kept-set return (``return_sampling_mask=True``) refuses some specs: say so first.

    Mirrors the checks in ``InputProcessor`` (vllm/v1/engine/input_processor.py): temperature > 0
    (no greedy rows) and top_k > 0 (to bound the mask's size).
    """
    if spec.temperature <= 0:
        raise UsageError(
            f"native sampling-mask capture needs temperature > 0, got temperature={spec.temperature!r}: "
            f"use top-K capture (--capture topk) for greedy scenarios"
        )
    if spec.top_k <= 0:
        raise UsageError(
            f"native sampling-mask capture needs top_k > 0 to bound the mask, got top_k={spec.top_k!r}: "
            f"set top_k or use top-K capture (--capture topk)"
        )


def padded_ids(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Ragged per-position id lists → ``[L, K]`` sorted ascending, ``-1`` padded."""
    import torch

    width = max([len(r) for r in rows] + [1])
    # An int fill and int ids make long tensors without the dtype: its mutants are equivalent.
    out = torch.full((len(rows), width), -1, dtype=torch.long)  # pragma: no mutate
    for t, r in enumerate(rows):
        if len(r):
            out[t, : len(r)] = torch.tensor(sorted(int(i) for i in r), dtype=torch.long)  # pragma: no mutate
    return out


def compare_supports(a: torch.Tensor, b: torch.Tensor, *, skip: torch.Tensor | None = None) -> list[int]:
    """Positions where two captured supports (``[L, K]`` padded ids, any order) differ.

    ``skip`` marks positions to leave out (for example top-K positions flagged incomplete).
    """
    if a.shape[0] != b.shape[0]:
        raise UsageError(f"supports cover {a.shape[0]} and {b.shape[0]} positions")
    bad = []
    for t in range(a.shape[0]):
        if skip is not None and bool(skip[t]):
            continue
        sa = {int(i) for i in a[t] if int(i) >= 0}
        sb = {int(i) for i in b[t] if int(i) >= 0}
        if sa != sb:
            bad.append(t)
    return bad
