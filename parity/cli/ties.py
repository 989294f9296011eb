"""``parity ties``: how the engine keeps ties at the k-th value, per batch size (measured, not assumed), by
:func:`parity.determinism.ties.characterize_ties` on the tie fixture; writes ``ties.json`` and ``ties.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from parity.determinism.ties import characterize_ties, render
from parity.errors import UsageError


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
            raise UsageError(f"--batch-sizes {text!r} is invalid: allowed e.g. 1-16 or 1,2,4,8") from None
    if not out or min(out) < 1:
        raise UsageError(f"--batch-sizes {text!r} is invalid: allowed sizes >= 1")
    return out


def main(args: argparse.Namespace) -> int:
    from parity.engines.session import make_prompts
    from parity.engines.vllm_offline import VllmRollout
    from parity.fixtures import fixture_metadata, resolve_model

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
