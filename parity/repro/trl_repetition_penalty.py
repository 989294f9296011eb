"""TRL's own GRPOTrainer metrics under ``GRPOConfig.repetition_penalty``: vLLM applies the penalty before
temperature and the filters, TRL's trainer side does not, so its IS correction is biased at every token the
penalty touches; ``patch_grpo("replay")`` applies the penalty and removes it.

Each configuration runs TRL's real ``GRPOTrainer`` (``python -m parity.engines.trl_run``) as shipped (``observe``)
and patched (``replay``). REPRODUCED: the shipped ``sampling/sampling_logp_difference/mean`` moves away from the
unpenalised control's by more than its resolution (the control's bf16 bound), and the patched one stays within the
control's floor plus that bound. Run: ``parity repro trl_repetition_penalty --model smollm2-135m``.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, TypedDict

from parity.repro.common import Check, Context
from parity.repro.runner import Measured
from parity.repro.trl_grpo_top_p import mean_of, phase_table, run_config

FIXTURE = "qwen2-tiny"
FIX = "replay"
CONFIG_TIMEOUT_S = 1200.0


class PenaltyConfig(TypedDict, total=False):
    repetition_penalty: float
    top_p: float
    top_k: int


# The unpenalised control, TRL's GRPOConfig.repetition_penalty at 1.1, and Qwen2.5-Instruct's generation defaults
# (repetition_penalty 1.05, top_p 0.8, top_k 20).
CONFIGS: tuple[PenaltyConfig, ...] = (
    {"repetition_penalty": 1.0},
    {"repetition_penalty": 1.1},
    {"repetition_penalty": 1.05, "top_p": 0.8, "top_k": 20},
)

COLUMNS = [
    ("config", "config", ""), ("tokens", "tokens", ""), ("abs_log_s", "abs(log S)", ".4f"),
    ("trl_before", "TRL logp_difference/mean (as shipped)", ".4f"),
    ("trl_after", "TRL logp_difference/mean (replay patch)", ".4f"), ("bound", "bound (bf16)", ".4f"),
    ("trl_is_before", "TRL importance_sampling_ratio/mean (as shipped)", ".4f"),
    ("trl_is_after", "TRL importance_sampling_ratio/mean (replay patch)", ".4f"),
    ("gate_before", "mean-bias gate (as shipped)", ""), ("gate_after", "(patch)", ""), ("seconds", "seconds", ".0f"),
]
FINDING = ("Under GRPOConfig.repetition_penalty, TRL's sampling_logp_difference/mean moves with the penalty (its "
           "trainer side scores the unpenalised distribution); patch_grpo('replay') applies the penalty and the metric "
           "returns to the unpenalised control's floor.")


def label(c: PenaltyConfig) -> str:
    parts = [f"repetition_penalty={c.get('repetition_penalty', 1.0):g}"]
    parts += [f"top_p={c['top_p']:g}"] if c.get("top_p", 1.0) < 1.0 else []
    parts += [f"top_k={c['top_k']}"] if c.get("top_k") else []
    return " ".join(parts)


def settings(small: bool, model: str | None = None) -> dict[str, Any]:
    configs = list(CONFIGS[:2]) if small else list(CONFIGS)
    return {"fixture": model or FIXTURE, "steps": 1 if small else 2, "batch": 8, "num_generations": 4,
            "max_completion_length": 16, "fix": FIX, "configs": configs, "timeout_s": CONFIG_TIMEOUT_S}


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    from parity.analyze.trl import judge_logged
    from parity.engines.trl_grpo import load_sequences

    timeout = min(ctx.timeout_s, cfg["timeout_s"])
    tmp = Path(tempfile.mkdtemp(prefix="parity-trl-rep-"))
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        for c in cfg["configs"]:
            name = label(c)
            run_cfg = {"model": cfg["fixture"], "top_p": c.get("top_p", 1.0), "top_k": c.get("top_k", 0),
                       "repetition_penalty": c.get("repetition_penalty", 1.0), "is_mode": "sequence_mask",
                       "steps": cfg["steps"], "batch": cfg["batch"], "num_generations": cfg["num_generations"],
                       "max_completion_length": cfg["max_completion_length"], "seed": ctx.seed,
                       "phases": ["observe", cfg["fix"]]}
            ctx.progress(f"parity repro: TRL GRPOTrainer {name}, subprocess, timeout {timeout:.0f} s")
            out = tmp / name.replace(" ", "_").replace("=", "")
            res = run_config(run_cfg, out, timeout)
            if "error" in res:
                failures.append(f"{name}: {res['error']}: {res.get('tail', '')[-400:]}")
                continue
            by_mode = {p["mode"]: p for p in res["phases"]}
            captured = {m: load_sequences(out / p["capture"]) for m, p in by_mode.items() if p.get("capture")}
            tables = {m: phase_table(by_mode[m], seqs)["steps"] for m, seqs in captured.items()}
            before, after = tables["observe"], tables[cfg["fix"]]
            row: dict[str, Any] = {
                "config": name, "penalised": c.get("repetition_penalty", 1.0) != 1.0,
                "tokens": sum(r["tokens"] for r in before), "abs_log_s": mean_of(before, "abs_log_s"),
                "trl_before": mean_of(before, "trl_logp_diff"), "trl_after": mean_of(after, "trl_logp_diff"),
                "bound": max(mean_of(before, "bound"), mean_of(after, "bound")),
                "trl_is_before": mean_of(before, "trl_is_mean"), "trl_is_after": mean_of(after, "trl_is_mean"),
                "seconds": res.get("wall_s", res.get("seconds")),
            }
            for phase, key in (("observe", "before"), (cfg["fix"], "after")):
                g = judge_logged(captured[phase])
                m = (g.get("mean_bias") or {}).get("logprob")
                row[f"gate_{key}"] = g["verdict"]
                row[f"gate_bias_{key}"], row[f"gate_limit_{key}"] = (m["mean"], m["limit"]) if m else (None, None)
                tut = g.get("trainer_under_test")
                row[f"gate_class_{key}"] = tut["diagnosis"] if tut else None
            rows.append(row)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _result(rows, failures)


def _result(rows: list[dict[str, Any]], failures: list[str]) -> Measured:
    control = [r for r in rows if not r["penalised"]]
    pen = [r for r in rows if r["penalised"]]
    floor = control[0]["trl_before"] if control else None
    res = control[0]["bound"] if control else None
    checks = [
        Check("every configuration ran TRL to completion in its subprocess", not failures and bool(rows),
              "; ".join(failures)),
        Check("as shipped, TRL's sampling_logp_difference/mean moves with the penalty beyond the control's resolution "
              "(its bf16 bound)", bool(pen) and floor is not None and res is not None
              and all(r["trl_before"] - floor > res for r in pen),
              ", ".join(f"{r['config']}: {r['trl_before']:.4f} vs control {floor:.4f} + {res:.4f}" for r in pen)
              if floor is not None and res is not None else "no control ran"),
        Check("with the replay patch (penalty applied), the metric stays at the control's floor within that bound",
              bool(pen) and floor is not None and res is not None
              and all(r["trl_after"] <= floor + res for r in pen),
              ", ".join(f"{r['config']}: {r['trl_after']:.4f}" for r in pen)),
        Check("the mean-bias gate on TRL's logged tensors passes every config with the replay patch",
              bool(rows) and all(r["gate_after"] == "pass" for r in rows),
              ", ".join(f"{r['config']}: {r['gate_after']}" for r in rows)),
    ]
    notes = ["as shipped, the gate on TRL's logged tensors: " + ", ".join(
        f"{r['config']}: {r['gate_before']} (bias {r['gate_bias_before']}, resolution {r['gate_limit_before']})"
        for r in rows)]
    return Measured(rows, checks, notes)
