"""Repro 10: vLLM's CPU engine under ``ATEN_CPU_CAPABILITY=default`` (torch's non-vectorised kernel path).

``ATEN_CPU_CAPABILITY=default`` is how one machine runs torch's second CPU kernel path (parity uses it
to check that its tests hold under another path). torch inductor reads the same variable
(``torch/_inductor/cpu_vec_isa.py`` ``pick_vec_isa``) and then generates scalar C++; the failure
reported for vLLM's CPU engine is that this C++ does not compile (``'at::vec' has not been
declared``), so the engine never starts. Whether the compiled graph hits it depends on the CPU and
on which of vLLM's CPU ops run natively there, so this repro measures it in a fresh subprocess with
fresh compile caches (a cached kernel from the vectorised path would hide it) and a timeout, beside
a control without the variable, and reports which one it saw. The engine is started as TRL starts it
(no ``enforce_eager``, so vLLM compiles the model).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

from parity.repro.common import Check, Context
from parity.repro.runner import (
    ENGINE_CHILD,
    GENERATED,
    STARTED,
    Measured,
    columns,
    cpu_features,
    engine_env,
    exceptions,
    output_lines,
    run_child,
)

FIXTURE = "qwen2-tiny"
KNOB = "ATEN_CPU_CAPABILITY"
SUBPROCESS_TIMEOUT_S = 420.0
SYMPTOM = "'at::vec' has not been declared"
COLUMNS = columns(("dtype", "dtype"), ("knob", KNOB), ("started", "engine started"), ("generated", "generated"),
                  ("symptom", f"output names {SYMPTOM}"), ("outcome", "outcome"))


def settings(small: bool) -> dict[str, Any]:
    return {"fixture": FIXTURE, "knob": KNOB, "dtypes": ["bfloat16"] if small else ["bfloat16", "float32"],
            "timeout_s": SUBPROCESS_TIMEOUT_S}


def parse(text: str) -> dict[str, Any]:
    lines = output_lines(text)
    errors = exceptions(lines)
    compile_lines = [ln.strip() for ln in lines if "error:" in ln and ".cpp" in ln]
    return {"error": errors[-1][:300] if errors else "", "symptom": SYMPTOM in text,
            "compile_error": compile_lines[0][:300] if compile_lines else ""}


def child(model: Path, dtype: str, value: str | None, timeout_s: float) -> dict[str, Any]:
    """The engine compiled on ``model`` in a fresh process with fresh compile caches, ``KNOB`` = ``value``."""
    with tempfile.TemporaryDirectory(prefix="parity-cap-") as cache:
        env = engine_env(KNOB, value, VLLM_CACHE_ROOT=str(Path(cache) / "vllm"),
                         TORCHINDUCTOR_CACHE_DIR=str(Path(cache) / "inductor"))
        p = run_child([sys.executable, "-c", ENGINE_CHILD, str(model), dtype, "compiled", "5", "6", "7"], env, timeout_s)
    if p.timed_out:
        return {"rc": None, "started": False, "generated": False, "error": f"timeout after {timeout_s:.0f} s",
                "symptom": False, "compile_error": ""}
    return {"rc": p.rc, "started": STARTED in p.stdout, "generated": GENERATED in p.stdout,
            **parse(p.text), "tail": "" if GENERATED in p.stdout else p.text[-2500:]}


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    model = ctx.model_path(FIXTURE)
    timeout = min(ctx.timeout_s, cfg["timeout_s"])
    rows, raw = [], []
    for dtype in cfg["dtypes"]:
        for value in (None, "default"):
            ctx.progress(f"parity repro: vLLM CPU engine, {dtype}, {KNOB}={value or 'unset'} (subprocess, fresh caches)")
            res = child(model, dtype, value, timeout)
            raw.append({"dtype": dtype, "knob": value, **res})
            rows.append({"dtype": dtype, "knob": value or "unset", "started": res["started"],
                         "generated": res["generated"],
                         "outcome": "generated" if res["generated"] else (res["compile_error"] or res["error"]
                                                                          or f"exit code {res['rc']}"),
                         "symptom": res["symptom"]})
    controls = [r for r in rows if r["knob"] == "unset"]
    knob = [r for r in rows if r["knob"] == "default"]
    seen = [r for r in knob if not r["generated"] and r["symptom"]]
    checks = [
        Check(f"control: without {KNOB} the engine starts and generates (fresh caches)",
              bool(controls) and all(r["generated"] for r in controls), "; ".join(r["outcome"] for r in controls)),
        Check(f"with {KNOB}=default the engine fails and the output names {SYMPTOM}",
              bool(knob) and len(seen) == len(knob), "; ".join(f"{r['dtype']}: {r['outcome']}" for r in knob)),
    ]
    cpu = cpu_features()
    if seen:
        finding = f"reproduced: under {KNOB}=default vLLM's CPU engine fails to compile ({SYMPTOM})"
    elif knob and all(r["generated"] for r in knob):
        finding = (f"not reproduced on this CPU ({cpu['capability']}): under {KNOB}=default the engine started and "
                   "generated with fresh compile caches; the failure depends on the machine")
    else:
        finding = "not reproduced: " + "; ".join(r["outcome"] for r in knob)
    notes = [f"Fixture {FIXTURE}; greedy, 2 tokens, compiled (no enforce_eager), fresh VLLM_CACHE_ROOT and "
             f"TORCHINDUCTOR_CACHE_DIR per run. CPU: {cpu}. A machine where this does not reproduce reports "
             "NOT REPRODUCED: the outcome is measured, not assumed."]
    return Measured(rows, checks, notes, data={"cpu": cpu, "runs": raw}, finding=finding)


def script_config(small: bool) -> dict:
    return {"vocab": 512, "timeout_s": SUBPROCESS_TIMEOUT_S}
