"""Repro 10: vLLM's CPU engine fails under ``ATEN_CPU_CAPABILITY=default`` after a vectorised run.

torch inductor reads ``ATEN_CPU_CAPABILITY`` (``torch/_inductor/cpu_vec_isa.py`` ``pick_vec_isa``), but
its FX graph cache does not key on it: a graph compiled on the vectorised path (any earlier run sharing
``/tmp/torchinductor_$USER``) is found under ``=default``, rebuilt against the scalar header, and g++
stops with ``'at::vec' has not been declared``. vLLM's sampler always compiles one such graph when
log-probs are requested (``batched_count_greater_than``, ``vllm/v1/sample/ops/logprobs.py``), so the
engine fails at its first request even with ``enforce_eager=True``. Each case (torch alone, vLLM's
engine) runs three processes over one fresh cache: the control (variable unset), ``=default`` (the
failure), and ``=default`` with ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` (the workaround, which pins the
cause). A control with no vector ISA has nothing to go stale, and the repro says so.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from parity.repro.common import Check, Context
from parity.repro.runner import Measured, child_env, columns, cpu_features
from parity.repro.standalone_child import exceptions, output_lines, run_child

# The children and the symptom are the standalone script's own (the children's argv: model, dtype for vLLM's);
# they print "ISA ..." and "GENERATED ..." lines. Importing the script source only sets the CPU engine's
# environment defaults (setdefault), which this CPU-only repro's children get from child_env anyway.
from parity.repro.standalone_src import CAP_SYMPTOM, CAP_TORCH, CAP_VLLM

FIXTURE = "qwen2-tiny"
KNOB = "ATEN_CPU_CAPABILITY"
MARK = "GENERATED"
ISA_MARK = "ISA"
SUBPROCESS_TIMEOUT_S = 300.0
SYMPTOM = "'at::vec' has not been declared"
SCALAR = ("INVALID_VEC_ISA", "none", "?")
# (step, ATEN_CPU_CAPABILITY, TORCHINDUCTOR_FX_GRAPH_CACHE, what the step is expected to do)
STEPS = (("control", None, None, "generates"), ("stale cache", "default", None, "fails"),
         ("FX graph cache off", "default", "0", "generates"))


def settings(small: bool) -> dict[str, Any]:
    cases = ["vllm-bfloat16"] if small else ["torch", "vllm-bfloat16"]
    return {"fixture": FIXTURE, "knob": KNOB, "cases": cases, "steps": [s[0] for s in STEPS],
            "timeout_s": SUBPROCESS_TIMEOUT_S}


def parse(stdout: str, text: str) -> dict[str, Any]:
    """What a child's output says: its last error line, the symptom, the first g++ error, the vector ISA."""
    lines = output_lines(text)
    errors = exceptions(lines)
    compile_lines = [ln.strip() for ln in lines if "error:" in ln and ".cpp" in ln]
    isa = [ln.split(ISA_MARK, 1)[1].strip() for ln in stdout.splitlines() if ln.startswith(ISA_MARK + " ")]
    return {"error": errors[-1][:300] if errors else "", "symptom": bool(CAP_SYMPTOM.search(text)),
            "compile_error": re.sub(r"^\S*/", "", compile_lines[0])[:300] if compile_lines else "",
            "vec_isa": isa[0] if isa else "?"}


def child(code: str, args: list[str], env_over: dict[str, str | None], cache: Path, timeout_s: float) -> dict[str, Any]:
    """``code`` in a fresh process over the compile caches in ``cache``, with ``env_over`` set (None: unset)."""
    env = child_env({"VLLM_CACHE_ROOT": str(cache / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                     **env_over})
    p = run_child([sys.executable, "-c", code, *args], env, timeout_s)
    if p.timed_out:
        return {"rc": None, "generated": False, "error": p.error, "symptom": False,
                "compile_error": "", "vec_isa": "?", "tail": p.text[-2500:]}
    generated = any(ln.startswith(MARK + " ") for ln in p.stdout.splitlines())
    return {"rc": p.rc, "generated": generated, **parse(p.stdout, p.text), "tail": "" if generated else p.text[-2500:]}


def run_case(case: str, model: Path, timeout_s: float, progress: Any) -> list[dict[str, Any]]:
    code, args = (CAP_TORCH, []) if case == "torch" else (CAP_VLLM, [str(model), case.split("-", 1)[1]])
    rows = []
    with tempfile.TemporaryDirectory(prefix="parity-cap-") as tmp:
        for step, knob, fx_cache, expect in STEPS:
            progress(f"parity repro: {case}, {step} ({KNOB}={knob or 'unset'}, shared fresh cache, subprocess)")
            res = child(code, args, {KNOB: knob, "TORCHINDUCTOR_FX_GRAPH_CACHE": fx_cache}, Path(tmp), timeout_s)
            outcome = "generated" if res["generated"] else (res["compile_error"] or res["error"] or f"exit code {res['rc']}")
            rows.append({"case": case, "step": step, "knob": knob or "unset", "fx_graph_cache": fx_cache or "on",
                         "expect": expect, "vec_isa": res["vec_isa"], "generated": res["generated"],
                         "symptom": res["symptom"], "outcome": outcome, "tail": res.get("tail", "")})
    return rows


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    model = ctx.model_path(FIXTURE)
    timeout = min(ctx.timeout_s, cfg["timeout_s"])
    rows = [r for case in cfg["cases"] for r in run_case(case, model, timeout, ctx.progress)]
    by_step = {s[0]: [r for r in rows if r["step"] == s[0]] for s in STEPS}
    control, stale, off = by_step["control"], by_step["stale cache"], by_step["FX graph cache off"]
    vectorised = bool(control) and all(r["vec_isa"] not in SCALAR for r in control)
    checks = [
        Check(f"control: without {KNOB} each case generates, on a vectorised inductor ISA",
              bool(control) and all(r["generated"] for r in control) and vectorised,
              "; ".join(f"{r['case']}: {r['outcome']} (ISA {r['vec_isa']})" for r in control)),
        Check(f"with {KNOB}=default over the same cache each case fails and the output names {SYMPTOM}",
              bool(stale) and all(not r["generated"] and r["symptom"] for r in stale),
              "; ".join(f"{r['case']}: {r['outcome']} (ISA {r['vec_isa']})" for r in stale)),
        Check(f"with {KNOB}=default over the same cache but TORCHINDUCTOR_FX_GRAPH_CACHE=0 each case generates",
              bool(off) and all(r["generated"] for r in off), "; ".join(f"{r['case']}: {r['outcome']}" for r in off)),
    ]
    cpu = cpu_features()
    if all(c.passed for c in checks):
        finding = (f"reproduced: a graph inductor compiled on the vectorised path ({control[0]['vec_isa']}) is reused "
                   f"from the FX graph cache under {KNOB}=default and fails to build ({SYMPTOM}); with that cache "
                   "off the same process starts")
    elif not vectorised:
        finding = (f"not reproducible on this CPU: the control picked no vector ISA ({control[0]['vec_isa'] if control else '?'}), "
                   "so nothing compiled on a vectorised path can go stale")
    else:
        finding = "not reproduced: " + "; ".join(f"{r['case']} {r['step']}: {r['outcome']}" for r in stale + off)
    for r in rows:  # the output tail is kept only where a step did not do what it was expected to
        if r["generated"] == (r["expect"] == "generates"):
            del r["tail"]
    notes = [f"Fixture {FIXTURE}; greedy, 2 tokens, logprobs=1 (so vLLM's sampler compiles its rank count), "
             "enforce_eager=True; the three steps of a case share one fresh VLLM_CACHE_ROOT and "
             f"TORCHINDUCTOR_CACHE_DIR. CPU: {cpu}. Workarounds: TORCHINDUCTOR_FX_GRAPH_CACHE=0, or a "
             "TORCHINDUCTOR_CACHE_DIR per kernel path."]
    return Measured(rows, checks, notes, data={"cpu": cpu}, finding=finding)


COLUMNS = columns(("case", "case"), ("step", "step"), ("knob", KNOB), ("fx_graph_cache", "FX graph cache"),
                  ("vec_isa", "inductor vector ISA"), ("expect", "expected"), ("generated", "generated"),
                  ("symptom", f"output names {SYMPTOM}"), ("outcome", "outcome"))


def script_config(small: bool) -> dict[str, Any]:
    return {"vocab": 512, "timeout_s": SUBPROCESS_TIMEOUT_S}
