"""``parity ties``: how the engine treats ties at the k-th value, per batch size, measured not assumed.

vLLM's PyTorch top-k path keeps every token tied with the k-th value; fused GPU kernels may not. This runs
the tie fixture at batch sizes 1..16 with top_k at a tie boundary and reports how often |S_q| > k.
"""

from __future__ import annotations

from typing import Any

from parity.core.spec import SamplingSpec
from parity.errors import UsageError


def characterize_ties(
    rollout: Any,
    prompts: list[list[int]],
    *,
    top_k: int,
    batch_sizes: list[int],
    max_tokens: int = 8,
    seed: int = 0,
    temperature: float = 1.0,
    tie_groups: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Sample each batch size with the same seeds; count positions whose kept set exceeds k.

    ``tie_groups`` (the fixture's duplicated lm_head rows: bitwise-equal logits) lets a dropped tie
    be seen: a kept token whose twin is not kept was separated from an equal logit by tie-breaking.
    """
    mates: dict[int, set[int]] = {}
    for group in tie_groups or []:
        for t in group:
            mates[int(t)] = {int(u) for u in group if u != t}
    spec = SamplingSpec(temperature=temperature, top_k=top_k)
    rows = []
    for bs in batch_sizes:
        if bs > len(prompts):
            raise UsageError(f"batch size {bs} exceeds the {len(prompts)} prompts given")
        records = rollout.generate(prompts[:bs], spec, max_tokens=max_tokens, seed=seed)
        sizes = [int(s) for r in records for s in (r.kept_ids >= 0).sum(dim=-1)]
        dropped = 0
        for r in records:
            for row in r.kept_ids.tolist():
                kept = {i for i in row if i >= 0}
                dropped += any(mates.get(i, set()) - kept for i in kept)
        incomplete = sum(int(r.incomplete.sum()) for r in records if r.incomplete is not None)
        rows.append(
            {
                "batch_size": bs,
                "positions": len(sizes),
                "support_gt_k": sum(s > top_k for s in sizes),
                "support_lt_k": sum(s < top_k for s in sizes),
                "ties_dropped": dropped,
                "max_support": max(sizes) if sizes else 0,
                "incomplete": incomplete,
            }
        )
    return {
        "top_k": top_k,
        "temperature": temperature,
        "tie_groups_known": bool(mates),
        "rows": rows,
        "boundary_ties_seen": sum(r["support_gt_k"] + r["ties_dropped"] for r in rows),
        # The PyTorch path predicts no dropped tie at any batch size.
        "batch_sizes_dropping_ties": [r["batch_size"] for r in rows if r["ties_dropped"]],
    }


def render(result: dict[str, Any]) -> str:
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


