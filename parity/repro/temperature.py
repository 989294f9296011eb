"""Repro 3: temperature asymmetry (the earlier TRL bug class: vLLM scores z / T, the trainer scored z).

vLLM's processed log-prob of a sampled token is ``log_softmax(z / T)[y]``. A trainer that forgets to
divide by T scores ``log_softmax(z)[y]``; its per-token bias is exactly the difference of the two,
computable from the trainer's logits alone (predicted), and in expectation over the sampler's tokens
it is ``-KL(softmax(z / T) || softmax(z)) < 0`` for every T != 1. A trainer that divides by T has no
bias. No filters are set, so log S = 0 and the temperature is the only difference.

Fixture ``llama-32k-s1`` (shares the engine of repro 1). Measured: trainer minus vLLM per token.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.core import estimators
from parity.core.error_model import headroom
from parity.core.spec import SamplingSpec
from parity.repro.common import Check, Context, cat, fmax, fmean, sample, seq_sums, token_bound
from parity.repro.runner import Measured, bound_detail, columns, scored, sweep

FIXTURE = "llama-32k-s1"
TEMPERATURES = (0.5, 0.7, 1.0, 1.3)
NONZERO = 1e-3  # a bias at T != 1 must exceed this to count as present


def settings(small: bool) -> dict[str, Any]:
    return {"fixture": FIXTURE, "temperatures": TEMPERATURES, "prompts": 6 if small else 16, "tokens": 8 if small else 16}


def _row(ctx: Context, temp: float, cfg: dict[str, Any]) -> dict[str, Any]:
    spec = SamplingSpec(temperature=temp)
    forgot_spec = SamplingSpec(temperature=1.0)  # what the buggy trainer uses whatever the sampler's T
    records = sample(ctx, FIXTURE, spec, prompts=cfg["prompts"], max_tokens=cfg["tokens"], logprobs=0)
    logits = ctx.trainer(FIXTURE).logits(records)
    right, forgot, pred, expected, vllm, bound, bound_t1 = [], [], [], [], [], [], []
    for r, z, y in scored(records, logits):
        right.append(estimators.full(z, y, spec).double())
        forgot.append(estimators.full(z, y, forgot_spec).double())
        # Predicted from trainer logits alone (float64): the per-token bias, and its expectation under
        # the sampler's distribution q = softmax(z / T): E_q[log p - log q] = -KL(q || p).
        log_p = torch.log_softmax(z.double(), dim=-1)
        log_q = torch.log_softmax(z.double() / temp, dim=-1)
        pred.append((log_p - log_q).gather(1, y.unsqueeze(1)).squeeze(1))
        expected.append(-(log_q.exp() * (log_q - log_p)).sum(-1))
        vllm.append(r.logprobs.double())
        bound.append(token_bound(z, y, spec))  # vLLM at T against the trainer at T
        bound_t1.append(token_bound(z, y, forgot_spec))  # plus the trainer's own rounding at T = 1
    right_t, forgot_t, pred_t, vllm_t = cat(right), cat(forgot), cat(pred), cat(vllm)
    lengths = [r.length for r in records]
    d_forgot = forgot_t - vllm_t
    d_right = right_t - vllm_t
    b = cat(bound)
    return {
        "T": temp,
        "tokens": int(vllm_t.numel()),
        "expected": fmean(cat(expected)),
        "predicted": fmean(pred_t),
        "measured": fmean(d_forgot),
        "gap": fmax((d_forgot - pred_t).abs()),
        "gap_headroom": headroom(d_forgot - pred_t, b + cat(bound_t1)),
        "max_abs_pred": fmax(pred_t.abs()),
        "forgot_seq": fmean(seq_sums(d_forgot, lengths).exp()),
        "right_max": fmax(d_right.abs()),
        "right_headroom": headroom(d_right, b),
        "right_seq": fmean(seq_sums(d_right, lengths).exp()),
    }


COLUMNS = columns(
    ("T", "T", "g"), ("expected", "predicted E[bias] = -KL(q_T, p)", ".4f"),
    ("predicted", "predicted mean bias (sampled tokens)", ".4f"), ("measured", "measured mean(forgot-T - vLLM)", ".4f"),
    ("gap", "max abs(measured - predicted)", ".1e"), ("forgot_seq", "forgot-T seq IS ratio", ".4g"),
    ("right_max", "divides by T: max abs(full - vLLM)", ".1e"), ("right_seq", "divides by T: seq IS ratio", ".6f"),
)
FINDING = ("A trainer scoring log_softmax(z) while vLLM sampled from softmax(z / T) is biased by "
           "log_softmax(z)[y] - log_softmax(z / T)[y] per token (negative on average for every T != 1); "
           "dividing by T removes it.")


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    rows = sweep(ctx, cfg["temperatures"], lambda temp: _row(ctx, temp, cfg), lambda temp: f"T={temp}")
    off = [r for r in rows if r["T"] != 1.0]
    on = [r for r in rows if r["T"] == 1.0]
    checks = [
        Check("a trainer that divides by T agrees with vLLM per token within the rounding bound (no bias)",
              all(r["right_headroom"] <= 1.0 for r in rows),
              bound_detail(rows, "right_max", "right_headroom")),
        Check("a trainer that forgets T is off by exactly the predicted per-token bias (within the rounding bound)",
              all(r["gap_headroom"] <= 1.0 for r in rows),
              bound_detail(rows, "gap", "gap_headroom", suffix="")),
        Check(f"the bias is present at every T != 1 (predicted |bias| > {NONZERO:g} somewhere, expected -KL < 0)",
              bool(off) and all(r["max_abs_pred"] > NONZERO and r["expected"] < 0 for r in off)),
        Check("control: at T = 1 both trainers are the same and unbiased",
              bool(on) and all(r["max_abs_pred"] == 0.0 and r["gap_headroom"] <= 1.0 for r in on)),
    ]
    notes = [
        f"Fixture {FIXTURE}, no filters, {cfg['prompts']} prompts x {cfg['tokens']} tokens per temperature.",
        "The measured mean over sampled tokens is a Monte Carlo estimate of E[bias] = -KL(q_T || p); it is reported, "
        "not gated (with few tokens it can land on either side of the expectation). The per-token identity is exact.",
    ]
    return Measured(rows, checks, notes)


def script_config(small: bool) -> dict[str, Any]:
    cfg = settings(small)
    return {"vocab": 32768, "logit_scale": 1.0, "temperatures": list(cfg["temperatures"]),
            "tokens": cfg["tokens"], "prompts": cfg["prompts"]}
