"""``parity ties``: how the engine treats ties at the k-th value, per batch size, measured not assumed.

vLLM's PyTorch top-k path keeps every token tied with the k-th value; fused GPU kernels may not. This runs
the tie fixture at batch sizes 1..16 with top_k at a tie boundary and reports how often |S_q| > k.
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

import torch

from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.determinism.checks import Generates
from parity.errors import UsageError


class TiesRow(TypedDict):
    batch_size: int
    positions: int
    support_gt_k: int
    support_lt_k: int
    ties_dropped: int
    max_support: int
    incomplete: int


class TiesResult(TypedDict):
    """ties.json (``device``: added by ``parity ties``)."""

    top_k: int
    temperature: float
    tie_groups_known: bool
    rows: list[TiesRow]
    boundary_ties_seen: int
    batch_sizes_dropping_ties: list[int]
    device: NotRequired[str]


def _kept_ids(rec: SequenceRecord) -> torch.Tensor:
    if rec.kept_ids is None:
        raise UsageError(f"{rec.source} record {rec.prompt_index} has no kept_ids: allowed a top-k sampled record")
    return rec.kept_ids


def characterize_ties(
    rollout: Generates,
    prompts: list[list[int]],
    *,
    top_k: int,
    batch_sizes: list[int],
    max_tokens: int = 8,
    seed: int = 0,
    temperature: float = 1.0,
    tie_groups: list[list[int]] | None = None,
) -> TiesResult:
    """Sample each batch size with the same seeds; count positions whose kept set exceeds k.

    ``tie_groups`` (the fixture's duplicated lm_head rows: bitwise-equal logits) lets a dropped tie
    be seen: a kept token whose twin is not kept was separated from an equal logit by tie-breaking.
    """
    mates = {int(t): {int(u) for u in group if u != t} for group in tie_groups or [] for t in group}
    spec = SamplingSpec(temperature=temperature, top_k=top_k)
    rows: list[TiesRow] = []
    for bs in batch_sizes:
        if bs > len(prompts):
            raise UsageError(f"batch size {bs} exceeds the {len(prompts)} prompts given")
        records = rollout.generate(prompts[:bs], spec, max_tokens=max_tokens, seed=seed)
        sizes = [int(s) for r in records for s in (_kept_ids(r) >= 0).sum(dim=-1)]
        dropped = 0
        for r in records:
            for row in _kept_ids(r).tolist():
                kept = {i for i in row if i >= 0}
                dropped += any(mates.get(i, set()) - kept for i in kept)
        incomplete = sum(int(r.incomplete.sum()) for r in records if r.incomplete is not None)
        rows.append({"batch_size": bs, "positions": len(sizes), "support_gt_k": sum(s > top_k for s in sizes),
                     "support_lt_k": sum(s < top_k for s in sizes), "ties_dropped": dropped,
                     "max_support": max(sizes, default=0), "incomplete": incomplete})
    return {
        "top_k": top_k,
        "temperature": temperature,
        "tie_groups_known": bool(mates),
        "rows": rows,
        "boundary_ties_seen": sum(r["support_gt_k"] + r["ties_dropped"] for r in rows),
        # The PyTorch path predicts no dropped tie at any batch size.
        "batch_sizes_dropping_ties": [r["batch_size"] for r in rows if r["ties_dropped"]],
    }


def render(result: TiesResult) -> str:
    lines = [
        f"Ties at top_k={result['top_k']} (T={result['temperature']:g}): positions with |S_q| > k per batch size",
        "",
        "| batch size | positions | |S_q| > k (tie kept) | tie dropped | |S_q| < k | max |S_q| | incomplete |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['batch_size']} | {r['positions']} | {r['support_gt_k']} | {r['ties_dropped']} | {r['support_lt_k']} | {r['max_support']} | {r['incomplete']} |"
        )
    lines.append("")
    if result["batch_sizes_dropping_ties"]:
        verdict = f"ties at the k-th value were dropped at batch sizes {result['batch_sizes_dropping_ties']}"
    elif result["boundary_ties_seen"]:
        verdict = f"every tie at the k-th value was kept ({result['boundary_ties_seen']} positions), at every batch size"
    else:
        verdict = "no tie reached the k-th value: nothing measured (try another top_k)"
    if not result["tie_groups_known"]:
        verdict += " (no tie plan known for this model: dropped ties cannot be seen)"
    lines.append(f"Verdict: {verdict}.")
    return "\n".join(lines) + "\n"
