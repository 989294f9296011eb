"""Repro 5: ties at the top_k boundary.

vLLM's top_k drops values *below* the k-th largest, so every token tied with the k-th value is kept
and |S_q| can exceed k (``apply_top_k_only`` / ``apply_top_k_top_p``, PyTorch path, measured on the
CPU engine; the CUDA path may differ). A trainer that recomputes the support with a strict
``torch.topk(k)`` renormalises over a smaller set, and scores ``-inf`` when the sampled token is a tie
it left out; replay of the captured S_q agrees. Fixture ``qwen2-tiny-ties`` (duplicated lm_head rows
among the most likely tokens: bitwise ties on small-k boundaries), captured at top_k + 16. Predicted:
where the reference filter keeps more than k tokens; measured: where the captured S_q does.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.core import estimators
from parity.core.error_model import headroom
from parity.core.filters import FilterFaults, reference_filter
from parity.core.spec import SamplingSpec
from parity.core.table import build_table
from parity.repro.common import Check, Context, fmax, sample
from parity.repro.runner import Measured, bound_detail, columns, scored, sweep

FIXTURE = "qwen2-tiny-ties"
TOP_KS = (1, 2, 3, 5)
STRICT = FilterFaults(drop_top_k_ties=True)  # torch.topk semantics: exactly k, ties broken by index


def settings(small: bool) -> dict[str, Any]:
    return {"fixture": FIXTURE, "top_ks": TOP_KS[:3] if small else TOP_KS, "temperature": 1.0,
            "prompts": 12 if small else 32, "tokens": 16}


def _row(ctx: Context, k: int, cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = SamplingSpec(temperature=cfg["temperature"], top_k=k)
    records = sample(ctx, FIXTURE, spec, prompts=cfg["prompts"], max_tokens=cfg["tokens"])
    logits = ctx.trainer(FIXTURE).logits(records)
    table = build_table(records, logits, spec)
    pred_over, strict_differs, strict_lost, strict_err, tie_aware_differs = [], [], [], [], []
    for r, z, y in scored(records, logits):
        q = estimators.ids_to_mask(r.kept_ids, z.shape[-1])
        aware = reference_filter(z, spec).kept
        strict = reference_filter(z, spec, faults=STRICT).kept
        pred_over.append(aware.sum(-1) > k)
        tie_aware_differs.append((aware != q).any(-1))
        strict_differs.append((strict != q).any(-1))
        naive = estimators.recompute(z, y, spec, force_include=False, faults=STRICT).logprobs
        strict_lost.append(torch.isinf(naive))
        forced = estimators.recompute(z, y, spec, force_include=True, faults=STRICT).logprobs
        strict_err.append((forced.double() - r.logprobs.double()).abs())
    over = table.support_size > k  # measured from vLLM's capture
    pred_over_t = torch.cat(pred_over)
    strict_differs_t = torch.cat(strict_differs)
    strict_err_t = torch.cat(strict_err)
    row = {
        "top_k": k,
        "tokens": table.tokens,
        "over": int(over.sum()),
        "share": float(over.double().mean()),
        "predicted_over": int(pred_over_t.sum()),
        "predicted_mismatch": int((pred_over_t != over).sum()),
        "max_support": int(table.support_size.max()),
        "strict_differs": int(strict_differs_t.sum()),
        "strict_differs_elsewhere": int((strict_differs_t != over).sum()),
        "strict_lost": int(torch.cat(strict_lost).sum()),
        "strict_misscored": int((strict_err_t > table.bound).sum()),
        "strict_err": fmax(strict_err_t),
        "tie_aware_differs": int(torch.cat(tie_aware_differs).sum()),
        "recompute_max": fmax((table.recompute - table.vllm).abs()),
        "recompute_headroom": headroom(table.recompute - table.vllm, table.bound),
        "replay_max": fmax((table.replay - table.vllm).abs()),
        "replay_headroom": headroom(table.replay - table.vllm, table.bound),
        "incomplete": int(table.incomplete.sum()),
    }
    return row, {"support_size_histogram": torch.bincount(table.support_size).tolist()}


COLUMNS = columns(
    ("top_k", "top_k"), ("tokens", "tokens"), ("over", "positions with len(S_q) > k (vLLM)"), ("share", "share", ".1%"),
    ("predicted_over", "len(S_p) > k (trainer ties)"), ("max_support", "max len(S_q)"),
    ("strict_differs", "torch.topk support != S_q"), ("strict_lost", "torch.topk drops the sampled token (-inf)"),
    ("strict_misscored", "torch.topk + force-include mis-scored"), ("strict_err", "its max abs diff", ".3f"),
    ("tie_aware_differs", "tie-aware recompute != S_q"), ("replay_max", "replay max abs diff", ".1e"),
)
FINDING = ("vLLM keeps every token tied with the k-th logit, so len(S_q) > k at tie positions; a trainer "
           "that recomputes with a strict torch.topk disagrees on the support there (and scores -inf "
           "when it dropped the sampled token); replay and a tie-aware recompute agree.")


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    measured = sweep(ctx, cfg["top_ks"], lambda k: _row(ctx, k, cfg))
    rows = [row for row, _ in measured]
    extras = {f"top_k={k}": extra for k, (_, extra) in zip(cfg["top_ks"], measured, strict=True)}
    from parity.fixtures import fixture_metadata

    tie_plan = fixture_metadata(ctx.model_path(FIXTURE)).get("tie_plan", [])
    total = sum(r["tokens"] for r in rows)
    over = sum(r["over"] for r in rows)
    checks = [
        Check("vLLM keeps every token tied at the k-th value: len(S_q) > k at some positions", over > 0,
              f"{over} of {total} positions ({over / max(total, 1):.1%})"),
        Check("the capture head (top_k + 16) held S_q at every position", all(r["incomplete"] == 0 for r in rows)),
        Check("trainer logits predict exactly where len(S_q) > k (ties at the k-th value, position by position)",
              all(r["predicted_mismatch"] == 0 for r in rows)),
        Check("a strict torch.topk recompute disagrees with S_q exactly at those positions",
              all(r["strict_differs_elsewhere"] == 0 for r in rows)),
        Check("a tie-aware recompute agrees with S_q everywhere, and scores within the rounding bound",
              all(r["tie_aware_differs"] == 0 and r["recompute_headroom"] <= 1.0 for r in rows)),
        Check("replay agrees with vLLM within the rounding bound", all(r["replay_headroom"] <= 1.0 for r in rows),
              bound_detail(rows, "replay_max", "replay_headroom")),
    ]
    notes = [
        f"Fixture {FIXTURE} (tie groups {tie_plan}), T = {cfg['temperature']:g}, {cfg['prompts']} prompts x "
        f"{cfg['tokens']} tokens per setting, vLLM CPU engine (PyTorch sampler path).",
        "torch.topk + force-include: the strict support with the sampled token added; it still mis-scores a tie "
        "position whenever the renormalising set differs from S_q.",
    ]
    return Measured(rows, checks, notes, data={"tie_plan": tie_plan, "per_setting": extras})


def script_config(small: bool) -> dict[str, Any]:
    cfg = settings(small)
    return {"vocab": 400, "logit_scale": 3.0, "tie_sizes": [2, 3, 2, 4], "top_ks": list(cfg["top_ks"]),
            "margin": 16, "tokens": cfg["tokens"], "prompts": cfg["prompts"]}
