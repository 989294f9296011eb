"""``parity ties``: how the engine treats ties at the k-th value, per batch size, measured not assumed.

vLLM's PyTorch top-k path keeps every token tied with the k-th value, so |S_q| can exceed k. Fused
GPU kernels may not (a report says ties are kept only when a step samples fewer than 8 rows). This
runs the tie fixture at batch sizes 1..16 with top_k at a tie boundary and reports, per batch size,
how often |S_q| > k.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from parity.spec import SamplingSpec


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
            raise ValueError(f"batch size {bs} exceeds the {len(prompts)} prompts given")
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2-tiny-ties", help="tie fixture (default) or a checkpoint")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--batch-sizes", default="1-16", help="e.g. 1-16 or 1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--out", type=Path, default=Path("reports/ties"))


def parse_batch_sizes(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        a, sep, b = part.partition("-")
        try:
            out.extend(range(int(a), int(b) + 1) if sep else [int(a)])
        except ValueError:
            raise ValueError(f"--batch-sizes {text!r} is invalid: allowed e.g. 1-16 or 1,2,4,8") from None
    if not out or min(out) < 1:
        raise ValueError(f"--batch-sizes {text!r} is invalid: allowed sizes >= 1")
    return out


def main(args: argparse.Namespace) -> int:
    from parity.engines.rollout import VllmRollout
    from parity.fixtures import fixture_metadata, resolve_model
    from parity.run import make_prompts

    sizes = parse_batch_sizes(args.batch_sizes)
    path = resolve_model(args.model)
    groups = fixture_metadata(path).get("tie_plan") or []
    rollout = VllmRollout(path, dtype=args.dtype, device=args.device)
    try:
        prompts = make_prompts(rollout.tokenizer(), max(sizes))
        result = characterize_ties(
            rollout, prompts, top_k=args.top_k, batch_sizes=sizes, max_tokens=args.max_tokens, tie_groups=groups
        )
    finally:
        rollout.close()
    result["device"] = args.device
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ties.json").write_text(json.dumps(result, indent=2) + "\n")
    text = render(result)
    (args.out / "ties.md").write_text(text)
    sys.stdout.write(text)
    return 0
