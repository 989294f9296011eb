"""The sampler's kept set S_q read from captured heads (or whole sampler rows), and comparisons of supports;
a position whose head cannot prove S_q is flagged incomplete (docs/capture_plan.md, section 2).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from parity.core.capture_plan import FULL_VOCAB, NEG_INF
from parity.core.spec import SamplingSpec
from parity.errors import UsageError

if TYPE_CHECKING:
    import torch  # imported where called: the capture plan and its stats need none

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
    """Build S_q from per-position heads (token ids and processed log-probs, sampled entry excluded). ``requested``
    is the K asked for (-1 = full vocabulary); ``rows`` (``Heads.rows``) holds whole kept sets read from the
    sampler, which replace the head where it could not prove them. Tensor operations (wide adaptive heads),
    ragged heads padded with -1 / -inf."""
    import torch

    if len(head_ids) != len(sampled) or len(head_logprobs) != len(sampled):
        raise UsageError(
            f"capture has {len(head_ids)} heads and {len(head_logprobs)} log-prob rows for {len(sampled)} "
            f"sampled tokens"
        )
    lens = [len(r) for r in head_ids]
    # The lengths are checked above, so this zip's strict= cannot change anything; nor can the dtype= of
    # the int tensors marked below (int values make long tensors), nor a wider padding k.
    for ids_row, lps_row in zip(head_ids, head_logprobs, strict=True):  # pragma: no mutate
        if len(ids_row) != len(lps_row):
            list(zip(ids_row, lps_row, strict=True))  # zip's ValueError: one log-prob per id
    n, k = len(sampled), max([1, *lens])  # pragma: no mutate
    ids = torch.tensor([[*r, *[-1] * (k - len(r))] for r in head_ids], dtype=torch.long)  # pragma: no mutate
    lps = torch.tensor([[*r, *[NEG_INF] * (k - len(r))] for r in head_logprobs], dtype=torch.float32)
    ids, lps = ids.reshape(n, k), lps.reshape(n, k)  # no heads: [0, k]
    y = torch.tensor([int(v) for v in sampled], dtype=torch.long)  # pragma: no mutate
    count = (lps != NEG_INF).sum(dim=1)
    # A full head of finite values on a partial vocabulary may hide more kept tokens.
    head_len = torch.tensor(lens, dtype=torch.long)  # pragma: no mutate
    full = requested == FULL_VOCAB or requested >= vocab_size
    incomplete = (count >= head_len) & (head_len < vocab_size) & (not full)
    # Order: by value descending, ties by id ascending (a stable sort by id, then a stable one by
    # value); dropped entries and padding (-inf) sort after every kept one.
    by_id = torch.argsort(ids, dim=1, stable=True)
    ids, lps = ids.gather(1, by_id), lps.gather(1, by_id)
    by_value = torch.sort(lps, dim=1, descending=True, stable=True).indices
    ids, lps = ids.gather(1, by_value), lps.gather(1, by_value)
    w = max(int(count.max()) if n else 0, 1)
    keep = lps[:, :w] != NEG_INF
    kept_ids = ids[:, :w].masked_fill(~keep, -1)
    kept_lps = lps[:, :w].masked_fill(~keep, NEG_INF)
    missing = ~(kept_ids == y[:, None]).any(dim=1)
    base = CapturedSupport(kept_ids.contiguous(), kept_lps.contiguous(), incomplete, missing)
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


def support_mass(kept_logprobs: torch.Tensor) -> torch.Tensor:
    """Sum of the sampler's processed probabilities over the captured support, per position: 1 (to float
    rounding) when the capture holds a processed distribution's whole support; less when tokens are missing,
    or when a server runs ``raw_logprobs`` (its head is not renormalised)."""
    import torch

    return torch.exp(kept_logprobs.double()).sum(dim=-1)


def validate_native_mask(spec: SamplingSpec) -> None:
    """vLLM's native kept-set return (``return_sampling_mask=True``) refuses some specs: say so first. As in
    ``InputProcessor`` (vllm/v1/engine/input_processor.py): temperature > 0 (no greedy rows) and top_k > 0
    (to bound the mask's size)."""
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
    """Positions where two captured supports (``[L, K]`` padded ids, any order) differ, leaving out those
    ``skip`` marks (for example top-K positions flagged incomplete)."""
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
