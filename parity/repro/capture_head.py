"""Repro 6: a capture head smaller than the support.

Replay needs the sampler's whole kept set S_q per position, read from the top-K processed log-probs.
vLLM accepts any K: with ``logprobs < top_k``, or top_p without a top_k cap, the head can hold only
part of S_q, and replay over it renormalises over too few tokens, silently. The harness refuses a head
below top_k (``parity.core.capture.plan_capture``), widens top_p-alone heads adaptively, and flags a
forced head that is full of finite values as incomplete. Here vLLM is asked for the too-small head
directly, and each position is predicted (len(S_p) >= K from trainer logits), flagged, and checked
for mis-scoring; the fix rows let the harness plan the head. Fixture ``llama-32k-s4``.
"""

from __future__ import annotations

from typing import Any

import torch

from parity.core import estimators
from parity.core.capture import plan_capture
from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec
from parity.repro.common import Check, Context, cat, fmax, sample, token_bound
from parity.repro.runner import Measured, columns, filter_kwargs, scored, sweep

FIXTURE = "llama-32k-s4"
# (case, spec, head): head None = the harness's own plan (the fix)
CASES = (
    ("top_logprobs < top_k", SamplingSpec(1.0, top_k=50), 20),
    ("top_logprobs < top_k, with top_p", SamplingSpec(1.0, top_k=50, top_p=0.9), 20),
    ("top_p without a top_k cap", SamplingSpec(1.0, top_p=0.9), 64),
    ("fix: cap with top_k, harness plans the head", SamplingSpec(1.0, top_k=64, top_p=0.9), None),
    ("fix: top_p alone, harness plans an adaptive head", SamplingSpec(1.0, top_p=0.9), None),
)


def settings(small: bool) -> dict[str, Any]:
    return {"fixture": FIXTURE, "cases": [(c, s.label(), h) for c, s, h in CASES],
            "prompts": 8 if small else 16, "tokens": 8 if small else 16}


def _plan_outcome(spec: SamplingSpec, vocab: int, head: int | None) -> tuple[bool, str]:
    """(refused, message): what the harness says about this capture before any sampling."""
    try:
        plan = plan_capture(spec, vocab) if head is None else plan_capture(spec, vocab, head=head)
    except ValueError as exc:
        return True, str(exc)
    if head is not None and plan.logprobs == head and plan_capture(spec, vocab).adaptive:
        # A forced head the harness would not settle for (top_p alone): accepted, never widened, flagged.
        return True, (f"not used by default ({plan_capture(spec, vocab).reason}); a forced head={head} is "
                      f"accepted, never widened, and flagged per position")
    return False, f"accepted: {plan.reason}"


def _row(ctx: Context, case: str, spec: SamplingSpec, head: int | None, cfg: dict[str, Any]) -> dict[str, Any]:
    trainer = ctx.trainer(FIXTURE)
    vocab = trainer.vocab_size
    refused, message = _plan_outcome(spec, vocab, head)
    # head None: the harness plans the capture; otherwise vLLM is asked for exactly that head
    records = sample(ctx, FIXTURE, spec, prompts=cfg["prompts"], max_tokens=cfg["tokens"], logprobs=head)
    logits = trainer.logits(records)
    planned = None
    if head is None:
        st = ctx.rollout(FIXTURE).last_capture
        assert st is not None  # set by the generate() that sample() ran
        planned = (f"{st.logprobs} (planned)" if not st.adaptive else
                   f"{st.logprobs} (adaptive: widest {st.widest_head}, {st.widened_sequences} sequences widened)")
    pred, flagged, wrong, outside, err = [], [], [], [], []
    for r, z, y in scored(records, logits):
        size_p = reference_filter(z, spec).kept.sum(-1)
        rep = estimators.replay(z, y, r.kept_ids, spec)
        e = (rep.logprobs.double() - r.logprobs.double()).abs()
        pred.append(size_p >= head if head is not None else torch.zeros_like(size_p, dtype=torch.bool))
        flagged.append(r.incomplete)
        outside.append(rep.outside)
        wrong.append((e > token_bound(z, y, spec, r.kept_ids)) | rep.outside)
        err.append(e)
    pred_t, flag_t, wrong_t, out_t, err_t = cat(pred), cat(flagged), cat(wrong), cat(outside), cat(err)
    ok_err = err_t[~wrong_t]
    return {
        "case": case,
        "setting": spec.label(),
        "head": head if head is not None else planned,
        "refused": refused,
        "message": message,
        "tokens": int(flag_t.numel()),
        "predicted": int(pred_t.sum()),
        "predicted_vs_flagged": int((pred_t != flag_t).sum()) if head is not None else 0,
        "flagged": int(flag_t.sum()),
        "wrong": int(wrong_t.sum()),
        "wrong_share": float(wrong_t.double().mean()),
        "missing_sampled": int(out_t.sum()),
        "silent": int((wrong_t & ~flag_t).sum()),
        "max_err": fmax(err_t),
        "max_err_correct": fmax(ok_err),
    }


COLUMNS = columns(
    ("case", "case"), ("setting", "setting"), ("head", "top-K head"), ("refused", "harness does not use this head by default"),
    ("tokens", "tokens"), ("predicted", "len(S_p) >= K (trainer logits)"), ("flagged", "flagged incomplete (harness)"),
    ("wrong", "mis-scored by replay over the head"), ("wrong_share", "share", ".1%"),
    ("missing_sampled", "sampled token not in head"), ("max_err", "max abs error (nats)", ".3f"),
    ("silent", "mis-scored, not flagged"),
)
FINDING = ("vLLM silently returns a head smaller than the support when asked; replay over it mis-scores every "
           "position whose support does not fit. The harness refuses heads below top_k, widens top_p-alone heads "
           "until they end in a dropped token, and flags positions it cannot prove.")


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    rows = sweep(ctx, CASES, lambda c: _row(ctx, *c, cfg), lambda c: c[0])
    small_heads = [r for r, (_, _, head) in zip(rows, CASES, strict=True) if head is not None]
    fixes = [r for r, (_, _, head) in zip(rows, CASES, strict=True) if head is None]
    checks = [
        Check("the harness never uses a too-small head by default (a head below top_k is refused, top_p alone is "
              "planned adaptively)", all(r["refused"] for r in small_heads)),
        Check("vLLM accepts the too-small head, and replay over it mis-scores positions in every case",
              all(r["wrong"] > 0 for r in small_heads),
              ", ".join(f"{r['wrong_share']:.1%}" for r in small_heads)),
        Check("trainer logits predict the flagged positions exactly (len(S_p) >= K, position by position)",
              all(r["predicted_vs_flagged"] == 0 for r in small_heads)),
        Check("the harness's completeness check flags every mis-scored position (none silent)",
              all(r["silent"] == 0 for r in rows)),
        Check("the fixes (top_k cap; top_p alone adaptively) capture S_q everywhere and replay is exact",
              all(not f["refused"] and f["flagged"] == 0 and f["wrong"] == 0 for f in fixes),
              ", ".join(f"max abs diff {f['max_err']:.1e}" for f in fixes)),
    ]
    notes = [
        f"Fixture {FIXTURE} (vocabulary {ctx.trainer(FIXTURE).vocab_size}), T = 1, {cfg['prompts']} prompts x "
        f"{cfg['tokens']} tokens per case. Mis-scored: abs(replay over the head - vLLM) above the per-token rounding "
        "bound (it grows with the logits' magnitude and the support size), or the sampled token is not in the head "
        "at all.",
        *[f"{r['case']}: {r['message']}" for r in rows],
    ]
    return Measured(rows, checks, notes)


def script_config(small: bool) -> dict[str, Any]:
    cfg = settings(small)
    cases = [(head, filter_kwargs(spec)) for _, spec, head in CASES if head is not None]
    return {"vocab": 32768, "logit_scale": 4.0, "cases": cases, "tokens": cfg["tokens"], "prompts": cfg["prompts"]}
