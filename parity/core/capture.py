"""Capturing the sampler's kept set S_q from top-K processed log-probs, with completeness checks.

vLLM returns, per generated position, the sampled token's processed log-prob followed by the top-K
processed log-probs (sorted descending). Under ``processed_logprobs`` a token off the support has
log-prob ``-inf``, so the finite entries of the head are S_q — *when the head holds the whole
support*. If every one of the K entries is finite and K < V, tokens beyond the head may also be kept
(most often a tie with the k-th value, which top_k keeps): that position is flagged incomplete and
counted, never guessed.

Head-size rules:
* top_k set: K >= top_k is required; a margin above top_k lets ties at the k-th value be captured.
* top_p or min_p without top_k: the support can be most of the vocabulary, so the head must be the
  full vocabulary (``logprobs=-1``). That is affordable for small vocabularies only; above
  ``full_vocab_limit`` the harness refuses and asks for a top_k cap instead.
* no filter (or greedy): S_q is the whole vocabulary by definition; nothing is captured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from parity.core.spec import SamplingSpec
from parity.errors import UsageError

FULL_VOCAB = -1  # vLLM's "logprobs=-1": every token of the vocabulary
NEG_INF = float("-inf")


@dataclass(frozen=True)
class CapturePlan:
    """How many processed log-probs to request per position, and why."""

    logprobs: int | None  # None: sampled token only (logprobs=0); -1: full vocabulary; K: top-K
    reason: str

    @property
    def captures_support(self) -> bool:
        return self.logprobs is not None and self.logprobs != 0


def plan_capture(
    spec: SamplingSpec,
    vocab_size: int,
    *,
    head: int | None = None,
    tie_margin: int = 16,
    full_vocab_limit: int = 4096,
) -> CapturePlan:
    """Choose the head size K for ``spec`` on a vocabulary of ``vocab_size``.

    ``head`` forces K (validated: K >= top_k when top_k is set). Raises ``ValueError`` naming the
    field when the spec cannot be captured exactly with the allowed head.
    """
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
            return CapturePlan(FULL_VOCAB, f"top_k={k} + tie margin covers the vocabulary")
        return CapturePlan(kk, f"top_k={k} + {tie_margin} to catch ties at the k-th value")
    if vocab_size <= full_vocab_limit:
        return CapturePlan(FULL_VOCAB, f"top_p/min_p without top_k: full vocabulary (V={vocab_size})")
    raise UsageError(
        f"spec {spec.label()} filters with top_p/min_p but sets no top_k on a vocabulary of {vocab_size} "
        f"tokens: capturing S_q exactly needs the full vocabulary per position (logprobs=-1), above the "
        f"limit full_vocab_limit={full_vocab_limit}. Set top_k (e.g. top_k=64) to cap the support, or "
        f"raise the limit (--full-vocab-limit) and accept the cost"
    )


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
) -> CapturedSupport:
    """Build S_q from per-position heads (token ids and processed log-probs, sampled entry excluded).

    ``requested`` is the K that was asked for (-1 = full vocabulary).
    """
    if len(head_ids) != len(sampled) or len(head_logprobs) != len(sampled):
        raise UsageError(
            f"capture has {len(head_ids)} heads and {len(head_logprobs)} log-prob rows for {len(sampled)} sampled tokens"
        )
    full = requested == FULL_VOCAB or requested >= vocab_size
    rows: list[list[tuple[int, float]]] = []
    incomplete: list[bool] = []
    missing: list[bool] = []
    # The lengths are checked above, so this zip's strict= cannot change anything.
    for y, ids, lps in zip(sampled, head_ids, head_logprobs, strict=True):  # pragma: no mutate
        finite = [(int(i), float(v)) for i, v in zip(ids, lps, strict=True) if v != NEG_INF]
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


def support_mass(kept_logprobs: torch.Tensor) -> torch.Tensor:
    """Sum of the sampler's processed probabilities over the captured support, per position.

    1 (to float rounding) when the capture holds the whole support of a processed distribution; less
    when tokens are missing; a server running ``raw_logprobs`` also fails this (its head is not
    renormalised).
    """
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
