"""Repro 11: torch's float32 ``log_softmax`` on CPU is biased high on wide, peaked rows.

Every log-prob of a row comes out too high by one and the same amount: the kernel's float32 sum of
exponentials loses its small terms (it behaves like a recursive sum that drops terms below half an ulp
of the running sum), so the row's log-sum-exp comes out low and ``x - max - lse`` high. The bias grows
with the vocabulary and with how peaked the row is; it is systematic per row, so an error model must not
treat it as noise that averages out over tokens. float32 ``z - torch.logsumexp(z)`` (its sum is
``at::sum``'s) and a written-out max + exp + sum are the controls: same dtype, same rows.

Measured per (V, sigma) on seeded N(0, sigma^2) rows against float64 ``log_softmax``, on both of torch's
CPU kernel paths: in this process (the native, vectorised kernels unless this process was started
under ``ATEN_CPU_CAPABILITY``) and in a subprocess under ``ATEN_CPU_CAPABILITY=default`` (read when torch
is imported, hence the subprocess). The measurement and the verdict's rule are the standalone script's
own functions (``standalone_src``'s section of this name), so the script and this repro are one copy.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from parity.repro.common import Check, Context
from parity.repro.runner import Measured, child_env, columns
from parity.repro.standalone_child import run_child
from parity.repro.standalone_src import (
    LSM_COLUMNS,
    LSM_DEFAULT,
    LSM_IN_PROCESS,
    lsm_checks,
    lsm_measure,
    lsm_parse,
)

KNOB = "ATEN_CPU_CAPABILITY"
SUBPROCESS_TIMEOUT_S = 300.0
VERDICT_SCALE = 4.0  # the verdict's logit scale: N(0, 4^2) rows, peaked like a trained model's
# The child measures on its own kernel path and prints lsm_print's lines; argv[1] is the settings as JSON.
CHILD = (
    "import json, sys\n"
    "from parity.repro.standalone_src import lsm_measure, lsm_print\n"
    "cfg = json.loads(sys.argv[1])\n"
    "lsm_print(lsm_measure(cfg['vocabs'], cfg['scales'], cfg['rows'], cfg['seed']))\n"
)
COLUMNS = columns(*LSM_COLUMNS)
SCRIPT_ABOUT = (
    "Needs only torch; samples nothing and downloads nothing. It measures float32 torch.log_softmax\n"
    "against float64 on seeded rows, in this process and in itself run again under ATEN_CPU_CAPABILITY=default,\n"
    "prints a Markdown table and the checks, and exits 0 when the finding reproduces, 1 when it does not.\n\n"
    "    python torch_cpu_log_softmax.py [--seed S]\n"
)


def settings(small: bool) -> dict[str, Any]:
    if small:
        return {"vocabs": [4096, 152064], "scales": [1.0, VERDICT_SCALE], "rows": 8,
                "verdict_scale": VERDICT_SCALE, "timeout_s": SUBPROCESS_TIMEOUT_S}
    return {"vocabs": [4096, 32000, 49152, 152064], "scales": [1.0, VERDICT_SCALE, 8.0], "rows": 64,
            "verdict_scale": VERDICT_SCALE, "timeout_s": SUBPROCESS_TIMEOUT_S}


def script_config(small: bool) -> dict[str, Any]:
    return settings(small)


def measure_default(cfg: dict[str, Any], seed: int, timeout_s: float) -> tuple[list[dict[str, Any]], str, dict[str, Any]]:
    """The table rows measured in a subprocess under ``ATEN_CPU_CAPABILITY=default``, its error line (``""``
    when it printed rows) and what to keep of it."""
    arg = json.dumps({"vocabs": cfg["vocabs"], "scales": cfg["scales"], "rows": cfg["rows"], "seed": seed})
    p = run_child([sys.executable, "-c", CHILD, arg], child_env({KNOB: "default"}), timeout_s)
    rows = [dict(r, path=LSM_DEFAULT) for r in lsm_parse(p.stdout)]
    error = "" if rows else p.error[:300]
    return rows, error, {"rc": p.rc, "error": error, "tail": "" if rows else p.text[-2500:]}


def finding(rows: list[dict[str, Any]], vocab: int, scale: float, passed: bool, failed: list[Check]) -> str:
    """What the table shows, in one sentence with its numbers."""
    if not passed:
        return "not reproduced: " + "; ".join(f"{c.statement.split(':', 1)[0]}: {c.detail}" for c in failed)
    top = [r for r in rows if r["vocab"] == vocab and r["sigma"] == scale]
    per_path = ", ".join(f"{r['ls_mean']:+.1e} ({r['path']}, {r['capability']}; positive on {r['positive']:.0%} of rows, "
                         f"{r['ls_mean'] / r['lse_abs'] if r['lse_abs'] > 0 else float('inf'):.0f}x float32 logsumexp's "
                         "mean |offset|)" for r in top)
    small = min(r["vocab"] for r in rows)
    at_small = max(abs(r["ls_mean"]) for r in rows if r["vocab"] == small)
    return (f"reproduced: at V={vocab:,} on N(0, {scale:g}^2) logits every float32 torch.log_softmax log-prob of a row "
            f"is high by one constant, mean {per_path}; at V={small:,} the mean offset is at most {at_small:.1e}")


def run(ctx: Context, cfg: dict[str, Any]) -> Measured:
    capability = torch.backends.cpu.get_cpu_capability()
    ctx.progress(f"parity repro: float32 log_softmax vs float64, in this process ({capability})")
    rows = [dict(r, path=LSM_IN_PROCESS) for r in lsm_measure(cfg["vocabs"], cfg["scales"], cfg["rows"], ctx.seed)]
    timeout = min(ctx.timeout_s, cfg["timeout_s"])
    ctx.progress(f"parity repro: the same in a subprocess with {KNOB}=default (timeout {timeout:.0f} s)")
    child_rows, error, child = measure_default(cfg, ctx.seed, timeout)
    rows += child_rows
    vocab, scale = max(cfg["vocabs"]), cfg["verdict_scale"]
    checks = [Check(s, ok, d) for s, ok, d in lsm_checks(rows, vocab, scale, error)]
    passed = all(c.passed for c in checks)
    native = {(r["vocab"], r["sigma"]): r["fingerprint"] for r in rows if r["path"] == LSM_IN_PROCESS}
    paired = [native.get((r["vocab"], r["sigma"])) == r["fingerprint"] for r in child_rows]
    same = bool(paired) and all(paired)
    notes = [
        f"{cfg['rows']} seeded rows per (V, sigma), the same standard normal rows scaled by each sigma; offsets are "
        "float32 result - float64 log_softmax, averaged over a row's tokens. Within-row spread is the std over a "
        "row's tokens of that difference (mean over rows); float32 rounding spread is the same std for the float64 "
        "values rounded to float32: a spread near it means one constant per row plus output rounding.",
        f"This process runs torch's {capability} kernels"
        + (f" ({KNOB} is set here, so the in-process path is not the native one)" if capability == "DEFAULT" else "")
        + "; both kernel paths measured " + ("the same logits (bitwise)." if same else "different logits (fingerprints differ)."),
        f"The verdict reads V={vocab:,} at sigma={scale:g}; the other scales are context (flat rows lose few terms, "
        "very peaked rows are dominated by a few large ones).",
    ]
    return Measured(rows, checks, notes, data={"capability": capability, "same_logits": same, "child": child},
                    finding=finding(rows, vocab, scale, passed, [c for c in checks if not c.passed]))
