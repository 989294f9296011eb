"""Repro: TRL's asynchronous GRPO trainer takes vLLM's processed log-probs as the PPO ratio's denominator.

One subprocess (``python -m parity.repro.trl_async_run``) runs, per sampling setting, TRL's own rollout worker
against a vLLM server started with TRL's log-prob flags, and TRL's own ``compute_loss`` at step 0 on the batch TRL's
collator packs: as shipped, under parity's replay patch, and under a replay of the wrong step's kept sets (the
negative control). What each substitution is, and why: docs/trl_async.md.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, TypedDict

from parity.repro.common import Check, Context
from parity.repro.runner import Measured, run_for_json

FIXTURE = "qwen2-tiny"
TIMEOUT_S = 1800.0
MODEL_TIMEOUT_S = 5400.0
# Each step of one setting (TRL's worker start, its rollouts, one capture request) waits at most this long.
STEP_TIMEOUT_S = 1200.0
# The settings: the control, two nucleus sizes, the top_k of common recipes, and min_p.
SETTINGS: tuple[dict[str, float], ...] = ({"top_p": 1.0}, {"top_p": 0.9}, {"top_p": 0.8}, {"top_k": 50},
                                          {"min_p": 0.1})
SMALL = ({"top_p": 1.0}, {"top_k": 50})
TOP_K_ROW = {"top_k": 50}


class AsyncSettings(TypedDict):
    model: str
    settings: list[dict[str, float]]
    prompts: int
    num_generations: int
    max_tokens: int
    dtype: str
    trainer_dtype: str
    max_model_len: int
    widening_checks: int
    plant: bool
    timeout_s: float


def settings(small: bool, model: str | None = None) -> AsyncSettings:
    return {"model": model or FIXTURE, "settings": [dict(s) for s in (SMALL if small else SETTINGS)],
            "prompts": 2, "num_generations": 4, "max_tokens": 16, "dtype": "float32", "trainer_dtype": "float32",
            "max_model_len": 1024, "widening_checks": 4, "plant": True,
            "timeout_s": TIMEOUT_S if model in (None, FIXTURE) else MODEL_TIMEOUT_S}


COLUMNS = [
    ("config", "config", ""), ("tokens", "tokens", ""), ("neg_adv", "tokens with A<0", ""),
    ("mean_s", "S (parity capture)", ".4f"),
    ("ratio_shipped", "TRL ratio (shipped)", ".4f"), ("err_shipped", "abs(ratio - S)", ".1e"),
    ("low_shipped", "clip_ratio/low_mean (shipped)", ".4f"), ("region_shipped", "clip_ratio/region_mean (shipped)", ".4f"),
    ("kl_shipped", "kl (shipped)", ".2e"),
    ("ratio_fixed", "TRL ratio (replay fix)", ".6f"), ("err_fixed", "abs(ratio - 1)", ".1e"),
    ("region_fixed", "clip_ratio/region_mean (fix)", ".4f"), ("resolution", "resolution", ".1e"),
    ("ratio_planted", "ratio (wrong step's kept set)", ".4f"),
    ("records_shipped", "parity analyze (shipped logs)", ""), ("records_fixed", "(fixed logs)", ""),
    ("seconds", "seconds", ".0f"),
]
FINDING = ("TRL AsyncGRPOTrainer's own compute_loss logs ratio = S at step 0, before the policy has moved (the "
           "processed log-probs TRL's worker keeps as old_log_probs are renormalised over the kept set); where S is "
           "below 1 - epsilon every negative-advantage token is clipped. Replaying the captured kept set in the "
           "trainer brings ratio to 1 and the clip fractions to 0.")


def _row(s: dict[str, Any]) -> dict[str, Any]:
    sh, fx = s["shipped"]["metrics"], s["fixed"]["metrics"]
    rec = s["records"]
    return {
        "config": " ".join(f"{k}={v:g}" for k, v in s["setting"].items()),
        "setting": s["setting"], "tokens": s["tokens"],
        "neg_adv": s["negative_advantage_tokens"], "mean_s": s["mean_s"], "min_s": s["min_s"],
        "clipped_surely": s["clipped_surely"], "clipped_possibly": s["clipped_possibly"],
        "ratio_shipped": sh["ratio"], "err_shipped": abs(sh["ratio"] - s["mean_s"]),
        "low_shipped": sh["clip_ratio/low_mean"], "high_shipped": sh["clip_ratio/high_mean"],
        "region_shipped": sh["clip_ratio/region_mean"], "kl_shipped": sh["kl"],
        "ratio_fixed": fx["ratio"], "err_fixed": abs(fx["ratio"] - 1.0), "kl_fixed": fx["kl"],
        "region_fixed": fx["clip_ratio/region_mean"],
        "clips_fixed": [fx[k] for k in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                                         "clip_ratio/low_min", "clip_ratio/high_max")],
        "resolution": s["resolution"],
        "ratio_planted": s["planted"]["metrics"]["ratio"] if "planted" in s else None,
        "err_planted": abs(s["planted"]["metrics"]["ratio"] - 1.0) if "planted" in s else None,
        "records_shipped": rec["shipped"]["verdict"], "records_fixed": rec["fixed"]["verdict"],
        "diagnosis_shipped": rec["shipped"]["diagnosis"], "failed_shipped": rec["shipped"]["failed"],
        "filtered": s["mean_s"] < 1.0 or any(k != "top_p" or v < 1 for k, v in s["setting"].items()),
        "capture": s["capture"], "largest_support": s["largest_support"], "seconds": s["seconds"],
    }


def run(ctx: Context, cfg: AsyncSettings) -> Measured:
    timeout = min(ctx.timeout_s, cfg["timeout_s"]) if ctx.timeout_s else cfg["timeout_s"]
    tmp = Path(tempfile.mkdtemp(prefix="parity-trl-async-"))
    run_cfg = {**cfg, "seed": ctx.seed, "timeout_s": min(STEP_TIMEOUT_S, timeout)}
    ctx.progress(f"parity repro: TRL AsyncGRPOTrainer step 0 on {cfg['model']}, {len(cfg['settings'])} settings, "
                 f"subprocess, timeout {timeout:.0f} s")
    try:
        cmd = [sys.executable, "-m", "parity.repro.trl_async_run", "--config", json.dumps(run_cfg), "--out", str(tmp)]
        res, p = run_for_json(cmd, tmp / "result.json", timeout)
        error = None if p.rc == 0 and res is not None and res.get("done") else (
            (p.error or "no result") + ": " + ((tmp / "error.txt").read_text() if (tmp / "error.txt").is_file()
                                               else p.stderr[-3000:]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = res or {"settings": []}
    rows = [_row(s) for s in res["settings"]]
    return _result(cfg, res, rows, error)


def _result(cfg: AsyncSettings, res: dict[str, Any], rows: list[dict[str, Any]], error: str | None) -> Measured:
    filtered = [r for r in rows if r["filtered"]]
    control = [r for r in rows if not r["filtered"]]
    top_k = [r for r in rows if r["setting"] == TOP_K_ROW]
    flags, command = res.get("trl_serve_flags") or {}, res.get("server_command") or []
    flag_ok = bool(flags) and all(k in command and command[command.index(k) + 1] == v for k, v in flags.items())
    cap = [r["capture"] for r in rows]
    checks = [
        Check("every setting ran TRL's rollout worker and compute_loss to completion",
              error is None and len(rows) == len(cfg["settings"]), error or ""),
        Check("the vLLM server was started with the log-prob flags TRL's vllm_serve passes",
              flag_ok, " ".join(f"{k} {v}" for k, v in flags.items())),
        Check("the capture held S_q at every position, and TRL's own request, sent unwidened, draws the same tokens",
              bool(cap) and all(c["incomplete"] == 0 and c["widening"]["same_tokens"] == c["widening"]["checked"]
                                for c in cap),
              ", ".join(f"{r['config']}: {r['capture']['requests']} requests, largest S_q {r['largest_support']}, "
                        f"{r['capture']['widening']['same_tokens']}/{r['capture']['widening']['checked']} same draw "
                        f"(log-probs within {r['capture']['widening']['max_logprob_diff']:.1e})" for r in rows)),
        Check("as shipped, TRL's ratio = S (parity's capture) within the resolution, every setting",
              bool(rows) and all(r["err_shipped"] <= r["resolution"] for r in rows),
              ", ".join(f"{r['config']}: {r['err_shipped']:.1e} vs {r['resolution']:.1e}" for r in rows)),
        Check("as shipped, TRL clips the negative-advantage tokens whose S lies below 1 - epsilon (clip_ratio/low_mean x "
              "tokens between those surely below and those possibly below, given the drift bound), nothing on the high "
              "side, every setting; top_k=50 clips some wherever its S falls surely below 1 - epsilon",
              bool(top_k) and all(r["clipped_surely"] <= round(r["low_shipped"] * r["tokens"]) <= r["clipped_possibly"]
                                  and r["high_shipped"] == 0 for r in rows)
              and all(r["low_shipped"] > 0 for r in top_k if r["clipped_surely"] > 0),
              ", ".join(f"{r['config']}: {round(r['low_shipped'] * r['tokens'])} clipped of {r['neg_adv']} with A<0, "
                        f"predicted {r['clipped_surely']}..{r['clipped_possibly']} (S from {r['min_s']:.3f})"
                        for r in rows)),
        Check("with the replay fix, TRL's ratio = 1 within the resolution and every clip metric is 0, every setting",
              bool(rows) and all(r["err_fixed"] <= r["resolution"] and not any(r["clips_fixed"]) for r in rows),
              ", ".join(f"{r['config']}: {r['err_fixed']:.1e}" for r in rows)),
        Check("control: top_p=1 has S = 1 and its shipped ratio is 1 within the resolution",
              bool(control) and all(r["mean_s"] == 1.0 and abs(r["ratio_shipped"] - 1) <= r["resolution"]
                                    for r in control)),
        Check("from the logs alone (old_log_probs against the trainer's log_probs as records, parity analyze): every "
              "filtered setting fails logprob_mean_bias, named a full-vocabulary (log S) trainer; the fixed logs pass",
              bool(filtered) and all(r["records_shipped"] == "fail" and "logprob_mean_bias" in r["failed_shipped"]
                                     and "full-vocabulary (log S)" in (r["diagnosis_shipped"] or "") for r in filtered)
              and all(r["records_fixed"] == "pass" for r in rows),
              ", ".join(f"{r['config']}: {r['records_shipped']}/{r['records_fixed']}" for r in rows)),
    ]
    if cfg["plant"]:
        checks.append(Check(
            "negative control: replaying the previous step's kept set misses ratio 1 by more than the resolution at "
            "every filtered setting", bool(filtered) and all(r["err_planted"] > r["resolution"] for r in filtered),
            ", ".join(f"{r['config']}: {r['ratio_planted']:.4f}" for r in filtered)))
    notes = [
        "TRL's ratio, kl and clip_ratio/* are the values AsyncGRPOTrainer.compute_loss logs, run on TRL's own "
        "collated batch (TreeRow + DataCollatorForRollout) at step 0. S = mean over the trained tokens of exp(log S), "
        "log S = logsumexp(z'/T over S_q) - logsumexp(z'/T) on the trainer's logits, S_q captured from the server's "
        "top-K processed log-probs. resolution = mean over tokens of expm1(per-token drift bound, "
        "parity.core.error_model.logprob_bound, float32) + tokens x 2^-24 (TRL sums the ratios in float32).",
        "Substitutions (CPU): tree attention runs through transformers' SDPA with the tree's mask "
        "(parity.engines.trl_async.tree_sdpa_attention) instead of the CUDA-only FlashAttention-3 kernel; no "
        "AsyncGRPOTrainer object is built, so no weight transfer runs at all (step 0 needs none: the server serves the "
        "checkpoint's weights; TRL's NCCL transfer runs in tests/gpu/test_trl_async_gpu.py); compute_loss runs unbound on a host object with one process's accelerator; "
        "TRL's worker reaches the server through parity's capture proxy, which widens each request's head "
        "(same seed, same draw: checked); vLLM and the trainer run float32.",
        f"Model {cfg['model']}; {cfg['prompts']} prompts x {cfg['num_generations']} generations x up to "
        f"{cfg['max_tokens']} tokens per setting; TRL defaults read from AsyncGRPOConfig: "
        f"{res.get('trl_defaults')}." + (f" {res['template_substitution']}." if res.get("template_substitution") else ""),
    ]
    below = [r for r in rows if r["setting"] == TOP_K_ROW and r["min_s"] >= 0.8]
    if below:
        notes.append("On this model top_k=50 keeps more than 1 - epsilon of the mass at every token (S from "
                     + ", ".join(f"{r['min_s']:.3f}" for r in below) + "): the policy is not flat, so the shipped ratio "
                     "sits above the clip edge and nothing is clipped; the clip claim needs a flat policy.")
    return Measured(rows, checks, notes, data={"result": res})
