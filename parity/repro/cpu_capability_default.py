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

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from parity.repro import standalone
from parity.repro.common import Check, Column, Context, ReproResult

NAME = "cpu_capability_default"
NUMBER = 10
TITLE = "vLLM's CPU engine does not start under ATEN_CPU_CAPABILITY=default ('at::vec' has not been declared)"
FIXTURE = "qwen2-tiny"
KNOB = "ATEN_CPU_CAPABILITY"
MARK = "PARITY_REPRO_GENERATED"
SUBPROCESS_TIMEOUT_S = 420.0
SYMPTOM = "'at::vec' has not been declared"

CHILD = f"""
import sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype=sys.argv[2], max_model_len=256, seed=0,
          enable_prefix_caching=False)
print("PARITY_REPRO_ENGINE_STARTED", flush=True)
out = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in sys.argv[3:]])],
                   SamplingParams(temperature=0.0, max_tokens=2, detokenize=False), use_tqdm=False)
print("{MARK}", list(out[0].outputs[0].token_ids), flush=True)
"""


def settings(small: bool) -> dict[str, Any]:
    return {"fixture": FIXTURE, "knob": KNOB, "dtypes": ["bfloat16"] if small else ["bfloat16", "float32"],
            "timeout_s": SUBPROCESS_TIMEOUT_S}


def parse(text: str) -> dict[str, Any]:
    lines = [ln.split("]: ", 1)[-1] if ln.startswith("[rank") else ln for ln in text.splitlines()]
    errors = [ln.strip() for ln in lines if re.match(r"^\s*[A-Za-z_.]*(Error|Exception)\b.*:", ln)]
    compile_lines = [ln.strip() for ln in lines if "error:" in ln and ".cpp" in ln]
    return {"error": errors[-1][:300] if errors else "", "symptom": SYMPTOM in text,
            "compile_error": compile_lines[0][:300] if compile_lines else ""}


def run_child(model: Path, dtype: str, value: str | None, timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="parity-cap-") as cache:
        env = dict(os.environ)
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_LOGGING_LEVEL="WARNING",
                   VLLM_CACHE_ROOT=str(Path(cache) / "vllm"), TORCHINDUCTOR_CACHE_DIR=str(Path(cache) / "inductor"))
        if value is None:
            env.pop(KNOB, None)
        else:
            env[KNOB] = value
        cmd = [sys.executable, "-c", CHILD, str(model), dtype, "5", "6", "7"]
        try:
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"rc": None, "started": False, "generated": False, "error": f"timeout after {timeout_s:.0f} s",
                    "symptom": False, "compile_error": ""}
    text = (p.stdout or "") + "\n" + (p.stderr or "")
    return {"rc": p.returncode, "started": "PARITY_REPRO_ENGINE_STARTED" in p.stdout, "generated": MARK in p.stdout,
            **parse(text), "tail": "" if MARK in p.stdout else text[-2500:]}


def run(ctx: Context) -> ReproResult:
    import torch

    cfg = settings(ctx.small)
    model = ctx.model_path(FIXTURE)
    timeout = min(ctx.timeout_s, cfg["timeout_s"])
    rows, raw = [], []
    for dtype in cfg["dtypes"]:
        for value in (None, "default"):
            ctx.progress(f"parity repro: vLLM CPU engine, {dtype}, {KNOB}={value or 'unset'} (subprocess, fresh caches)")
            res = run_child(model, dtype, value, timeout)
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
    cpu = {"capability": torch.backends.cpu.get_cpu_capability(), "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
           "amx_tile": bool(torch.cpu._is_amx_tile_supported())}
    if seen:
        finding = f"reproduced: under {KNOB}=default vLLM's CPU engine fails to compile ({SYMPTOM})"
    elif knob and all(r["generated"] for r in knob):
        finding = (f"not reproduced on this CPU ({cpu['capability']}): under {KNOB}=default the engine started and "
                   "generated with fresh compile caches; the failure depends on the machine")
    else:
        finding = "not reproduced: " + "; ".join(r["outcome"] for r in knob)
    return ReproResult(
        name=NAME, number=NUMBER, title=TITLE, finding=finding,
        columns=[Column("dtype", "dtype"), Column("knob", KNOB), Column("started", "engine started"),
                 Column("generated", "generated"), Column("symptom", f"output names {SYMPTOM}"),
                 Column("outcome", "outcome")],
        rows=rows, checks=checks,
        notes=[f"Fixture {FIXTURE}; greedy, 2 tokens, compiled (no enforce_eager), fresh VLLM_CACHE_ROOT and "
               f"TORCHINDUCTOR_CACHE_DIR per run. CPU: {cpu}. A machine where this does not reproduce reports "
               "NOT REPRODUCED: the outcome is measured, not assumed."],
        data={"settings": cfg, "cpu": cpu, "runs": raw},
    )


def emit_script(small: bool) -> str:
    return standalone.emit(NAME, TITLE, config={"vocab": 512, "timeout_s": SUBPROCESS_TIMEOUT_S})
