"""Repro 2: top_k's severity depends on entropy; top_p keeps S near top_p (the GRPO importance-sampling report).

The report's logit-scale sweep (1, 2, 4, 6, 8, 12) x (top_p 0.9, top_k 50, top_k 20) on a
32768-token vocabulary: the fixtures ``llama-32k-s1`` ... ``llama-32k-s12`` are one model at those
logit scales (entropy ~9.9 nats down to ~0.6).

Capture decision: S per setting needs no capture. Measured log S per token is the trainer's
full-vocabulary log-prob minus vLLM's processed log-prob of the sampled token (exactly log S when
the two sides agree); predicted log S is the reference filters on the trainer's logits (S_p). So
vLLM is asked for the sampled token's log-prob only (``logprobs=0``), which keeps top_p alone on a
32k vocabulary cheap (full-vocabulary capture would cost seconds per hundred tokens per scale).
"""

from __future__ import annotations

from typing import Any

import torch

from parity.core import estimators
from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec
from parity.repro.common import Check, Column, Context, cat, fmax, fmean, sample, token_bound
from parity.repro.runner import Measured, bound_detail, filter_kwargs, scored, sweep

SCALES = (1, 2, 4, 6, 8, 12)
SMALL_SCALES = (1, 4, 12)
SETTINGS = (
    ("top_p=0.9", SamplingSpec(1.0, top_p=0.9)),
    ("top_k=50", SamplingSpec(1.0, top_k=50)),
    ("top_k=20", SamplingSpec(1.0, top_k=20)),
)
TOP_P_NEAR = 0.1  # "S stays near top_p": within this of it at every entropy (the shape, not a fit)
MONOTONE_SLACK = 1e-3  # top_k's S may dip by this much between scales (different sampled positions)


def fixture(scale: int) -> str:
    return f"llama-32k-s{scale}"


def settings(small: bool) -> dict[str, Any]:
    return {"scales": SMALL_SCALES if small else SCALES, "settings": [label for label, _ in SETTINGS],
            "prompts": 6 if small else 16, "tokens": 8 if small else 16}


def _scale_row(ctx: Context, scale: int, cfg: dict[str, Any]) -> dict[str, Any]:
    fx = fixture(scale)
    trainer = ctx.trainer(fx)
    from parity.fixtures import fixture_metadata

    row: dict[str, Any] = {"scale": scale, "fixture": fx, "max_gap": 0.0, "max_gap_over_tol": 0.0, "max_bound": 0.0,
                 "fixture_entropy": fixture_metadata(ctx.model_path(fx)).get("mean_entropy_nats")}
    entropies = []
    for label, spec in SETTINGS:
        records = sample(ctx, fx, spec, prompts=cfg["prompts"], max_tokens=cfg["tokens"], logprobs=0)
        logits = trainer.logits(records)
        pred, meas, tol = [], [], []
        for r, z, y in scored(records, logits):
            kept = reference_filter(z, spec).kept
            tol.append(token_bound(z, y, spec, kept))
            pred.append(estimators.predicted_log_s(z, kept, spec).double())
            meas.append(estimators.full(z, y, spec).double() - r.logprobs.double())
            logp = torch.log_softmax(z.double(), dim=-1)  # T = 1 in every setting
            entropies.append(-(logp.exp() * logp).sum(-1))
        p, m = cat(pred), cat(meas)
        row[f"{label} pred"] = fmean(p.exp())
        row[f"{label} meas"] = fmean(m.exp())
        row[f"{label} min_pred"] = float(p.exp().min())
        row["max_gap"] = max(row["max_gap"], fmax((p - m).abs()))
        row["max_gap_over_tol"] = max(row["max_gap_over_tol"], fmax((p - m).abs() / cat(tol)))
        row["max_bound"] = max(row.get("max_bound", 0.0), fmax(cat(tol)))
    row["entropy"] = fmean(cat(entropies))
    row["positions"] = sum(int(e.numel()) for e in entropies)
    return row


def _columns() -> list[Column]:
    cols = [Column("scale", "logit scale", "g"), Column("entropy", "entropy (nats)", ".3f")]
    for label, _ in SETTINGS:
        cols += [Column(f"{label} pred", f"S @ {label} predicted", ".4f"), Column(f"{label} meas", f"S @ {label} measured", ".4f")]
    return cols + [Column("max_gap", "max abs(log S meas - pred)", ".1e")]


COLUMNS = _columns()
FINDING = ("top_p keeps the surviving mass S near top_p whatever the entropy; top_k's S collapses on flat "
           "(uncertain) distributions and approaches 1 on peaked ones.")


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    # Scales whose engine is already running first (``parity repro all`` shares them), then the rest.
    alive = set(ctx.alive())
    order = sorted(cfg["scales"], key=lambda s: fixture(s) not in alive)
    measured = sweep(ctx, order, lambda scale: _scale_row(ctx, scale, cfg), lambda scale: f"logit scale {scale}")
    rows = sorted(measured, key=lambda r: r["scale"])
    p_label, p_spec = SETTINGS[0]
    p = p_spec.top_p
    k_labels = [label for label, spec in SETTINGS if spec.uses_top_k]
    flat, peaked = rows[0], rows[-1]

    def series(label: str) -> str:
        return " ".join(f"{r[f'{label} meas']:.4f}" for r in rows)

    checks = [
        Check("per token, measured log S (full - vLLM) = predicted (trainer logits, reference filters) within "
              "the rounding bound (it grows with the logits' magnitude and the support size)",
              all(r["max_gap_over_tol"] <= 1.0 for r in rows),
              bound_detail(rows, "max_gap", "max_gap_over_tol")),
        Check(f"top_p keeps S near top_p at every entropy: top_p <= S <= top_p + {TOP_P_NEAR:g}",
              all(r[f"{p_label} min_pred"] >= p - 1e-6 and r[f"{p_label} meas"] <= p + TOP_P_NEAR for r in rows),
              f"S @ {p_label}: {series(p_label)}"),
        Check("top_k's S rises with the logit scale (falls with entropy)",
              all(b[f"{k} meas"] >= a[f"{k} meas"] - MONOTONE_SLACK for k in k_labels for a, b in zip(rows, rows[1:], strict=False)),
              "; ".join(f"S @ {k}: {series(k)}" for k in k_labels)),
        Check("top_k is severe on the flattest model: S below top_p's",
              all(flat[f"{k} meas"] < flat[f"{p_label} meas"] for k in k_labels),
              f"scale {flat['scale']}: " + ", ".join(f"{k} {flat[f'{k} meas']:.4f}" for k in k_labels)),
        Check("top_k is harmless on the most peaked model: S above top_p's",
              all(peaked[f"{k} meas"] > peaked[f"{p_label} meas"] for k in k_labels),
              f"scale {peaked['scale']}: " + ", ".join(f"{k} {peaked[f'{k} meas']:.4f}" for k in k_labels)),
    ]
    notes = [
        f"Fixtures llama-32k-s{{{','.join(str(s) for s in cfg['scales'])}}} (32768-token vocabulary, one model at "
        f"each logit scale), T = 1, {cfg['prompts']} prompts x {cfg['tokens']} tokens per setting. S = mean over the "
        "sampled positions of the surviving mass; entropy = mean entropy of softmax(z) at every scored position.",
        "Predicted: reference filters on the trainer's float32 logits. Measured: exp(trainer full-vocabulary "
        "log-prob - vLLM processed log-prob) of each sampled token; vLLM was asked for logprobs=0 (no capture).",
        "Tolerance: the per-token rounding bound of parity.core.error_model. Both sides round float32 logits "
        "independently and the rounding grows with |z| / T and the support size, so a peaked model's bound is wider.",
    ]
    return Measured(rows, checks, notes)


def script_config(small: bool) -> dict[str, Any]:
    cfg = settings(small)
    return {"vocab": 32768, "scales": list(cfg["scales"]),
            "settings": [(label, filter_kwargs(spec, ("top_p", "top_k"))) for label, spec in SETTINGS],
            "tokens": cfg["tokens"], "prompts": cfg["prompts"]}
