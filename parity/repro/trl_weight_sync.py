"""Repro 9: TRL's colocated weight sync crashes on vLLM's CPU engine ('Parameter' has no 'weight_loader').

TRL's ``VLLMGeneration.sync_weights`` (colocate mode) pushes every trainer parameter into the engine
with ``model.load_weights([(name, param)])`` before the first generation. vLLM 0.32's CPU build
replaces each dense linear layer's ``weight`` by an empty ``Parameter`` without a ``weight_loader``
once it has packed the weight for oneDNN or the SGL kernel (``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``, ``remove_weight=True`` from ``linear.py``), so the first sync
fails in ``linear.py`` ``load_weights``. oneDNN packs float32 weights on every x86 CPU, so forcing
the engine to float32 reproduces it everywhere; bfloat16 (TRL's default here, since it passes no
dtype) takes the packing path only where the CPU has AVX-512 BF16 or AMX, so that row is measured
and reported, not checked. The control keeps the weights (:mod:`parity.engines.vllm_cpu_linear`)
and trains. Each run is a fresh subprocess with a timeout.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from parity.repro import standalone
from parity.repro.common import Check, Context
from parity.repro.runner import Measured, child_env, columns, cpu_features
from parity.repro.standalone_child import exceptions, frames, output_lines, run_child

SCRIPT_SOURCE = standalone.TRL_SOURCE
FIXTURE = "qwen2-tiny"
SUBPROCESS_TIMEOUT_S = 300.0
ERROR = "AttributeError: 'Parameter' object has no attribute 'weight_loader'"

RUNS = (
    # name, forced engine dtype, workaround, what is checked
    {"run": "float32 engine", "vllm_dtype": "float32", "keep": False, "expect": "crash"},
    {"run": "float32 engine + kept linear weights (control)", "vllm_dtype": "float32", "keep": True, "expect": "train"},
    {"run": "TRL default dtype (none passed)", "vllm_dtype": None, "keep": False, "expect": "measured"},
)


def settings(small: bool) -> dict[str, Any]:
    runs = [r for r in RUNS if r["expect"] != "measured"] if small else list(RUNS)
    return {"fixture": FIXTURE, "runs": runs, "steps": 1, "timeout_s": SUBPROCESS_TIMEOUT_S}


def parse_crash(text: str) -> dict[str, Any]:
    """The last exception line and where it was raised (vLLM's linear.py, reached from TRL's sync_weights)."""
    lines = output_lines(text)
    errors = exceptions(lines)
    found = frames(lines)
    linear = [f for f in found if f["file"].endswith("layers/linear.py")]
    sync = [f for f in found if f["func"] == "sync_weights"]
    where = f"linear.py:{linear[-1]['line']} in {linear[-1]['func']}" if linear else ""
    if where and sync:
        where += f", reached from {Path(sync[-1]['file']).name} {sync[-1]['func']}"
    return {"error": errors[-1] if errors else "", "where": where, "in_linear_load_weights":
            bool(linear) and linear[-1]["func"] == "load_weights", "from_sync_weights": bool(sync)}


def run_one(spec: dict[str, Any], timeout_s: float, seed: int) -> dict[str, Any]:
    cfg = {"model": FIXTURE, "steps": 1, "phases": ["off"], "seed": seed, "vllm_dtype": spec["vllm_dtype"],
           "keep_linear_weights": spec["keep"], "keep_logits": False}
    with tempfile.TemporaryDirectory(prefix="parity-trl-sync-") as tmp:
        cmd = [sys.executable, "-m", "parity.engines.trl_run", "--config", json.dumps(cfg), "--out", tmp]
        p = run_child(cmd, child_env(), timeout_s)
        if p.timed_out:
            return {"rc": None, "trained": False, "error": p.error, "where": "",
                    "in_linear_load_weights": False, "from_sync_weights": False, "engine_dtype": ""}
        text = p.text
        trained = p.rc == 0 and (Path(tmp) / "result.json").is_file()
    m = re.search(r"PARITY_TRAINER_READY vllm_dtype=(\S+)", text)
    crash = parse_crash(text) if not trained else {"error": "", "where": "", "in_linear_load_weights": False,
                                                   "from_sync_weights": False}
    return {"rc": p.rc, "trained": trained, "engine_dtype": m.group(1) if m else "", **crash,
            "tail": "" if trained else text[-2500:]}


COLUMNS = columns(("run", "run"), ("engine_dtype", "vLLM dtype"), ("workaround", "weights kept"),
                  ("trained", "trained"), ("outcome", "outcome"), ("where", "raised in"))
FINDING = ("TRL's colocated weight sync cannot load into vLLM's CPU linear layers once their weights are "
           "packed (always in float32): AttributeError in linear.py load_weights; keeping the weights fixes it.")


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    timeout = min(ctx.timeout_s, cfg["timeout_s"])
    rows = []
    for spec in cfg["runs"]:
        ctx.progress(f"parity repro: TRL GRPOTrainer, {spec['run']} (subprocess, timeout {timeout:.0f} s)")
        res = run_one(spec, timeout, ctx.seed)
        rows.append({"run": spec["run"], "expect": spec["expect"], "engine_dtype": res["engine_dtype"] or "–",
                     "workaround": spec["keep"], "trained": res["trained"],
                     "outcome": "trained 1 step" if res["trained"] else (res["error"] or f"exit code {res['rc']}"),
                     "where": res["where"], "_res": res})
    crash = [r for r in rows if r["expect"] == "crash"]
    control = [r for r in rows if r["expect"] == "train"]
    checks = [
        Check("with the engine forced to float32, TRL's first weight sync fails with " + ERROR,
              bool(crash) and all(not r["trained"] and r["_res"]["error"] == ERROR for r in crash),
              "; ".join(r["outcome"] for r in crash)),
        Check("raised in vLLM's linear.py load_weights, reached from TRL's VLLMGeneration.sync_weights",
              bool(crash) and all(r["_res"]["in_linear_load_weights"] and r["_res"]["from_sync_weights"] for r in crash),
              "; ".join(r["where"] for r in crash)),
        Check("control: keeping the linear layers' weights (parity.engines.vllm_cpu_linear) lets the same run train",
              bool(control) and all(r["trained"] for r in control), "; ".join(r["outcome"] for r in control)),
    ]
    cpu = cpu_features()
    measured = [r for r in rows if r["expect"] == "measured"]
    notes = [
        f"Fixture {FIXTURE}; TRL GRPOTrainer colocate, use_cpu=True, 1 step. CPU: {cpu}.",
        "The float32 rows are the finding. " + (
            f"With TRL's default (no dtype) the engine ran {measured[0]['engine_dtype']} and "
            + ("crashed the same way" if not measured[0]["trained"] else "trained")
            + " on this CPU: bfloat16 packing depends on AVX-512 BF16 / AMX, so that row is reported, not checked."
            if measured else "The default-dtype row runs without --small."),
    ]
    for r in rows:
        r.pop("_res")
    return Measured(rows, checks, notes, data={"cpu": cpu})


def script_config(small: bool) -> dict[str, Any]:
    return {"timeout_s": SUBPROCESS_TIMEOUT_S, "steps": 1}
