"""The batch_invariant_cpu repro: vLLM's CPU engine with and without VLLM_BATCH_INVARIANT=1, each in a fresh
child process. Inlined into its script section (``# @inline``) after the prelude, which carries what it
imports.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import TypedDict

from parity.repro.script_engines import build_model, save
from parity.repro.standalone_child import frames, output_lines, run_child
from parity.repro.standalone_report import Outcome

# The child starts vLLM on argv[1] (float32, eager) and asks one greedy request of two tokens for the prompt ids
# argv[2:]; it prints "STARTED" once the engine is up and "GENERATED <ids>" when the request got through.
BI_CHILD = r'''
import sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
          enable_prefix_caching=False)
print("STARTED", flush=True)
out = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in sys.argv[2:]])],
                   SamplingParams(temperature=0, max_tokens=2, detokenize=False), use_tqdm=False)
print("GENERATED", list(out[0].outputs[0].token_ids), flush=True)
'''


class ChildConfig(TypedDict):
    vocab: int
    timeout_s: float


class BatchInvariantRow(TypedDict):
    knob: str  # VLLM_BATCH_INVARIANT
    rc: int | None  # None: timed out
    generated: bool
    error: str
    where: str  # the last batch_invariant.py frame


def repro_batch_invariant_cpu(cfg: ChildConfig, args: argparse.Namespace) -> Outcome:
    """VLLM_BATCH_INVARIANT=1 crashes vLLM's CPU engine at the first forward with a TypeError raised in its
    batch_invariant.py (no Triton on CPU); without the knob the same request generates. Each run is a fresh
    process: the knob is read when vLLM is imported."""
    path = save(build_model(cfg["vocab"], seed=args.seed))
    rows: list[BatchInvariantRow] = []
    for knob in ("0", "1"):
        p = run_child([sys.executable, "-c", BI_CHILD, path, "5", "6", "7"], dict(os.environ, VLLM_BATCH_INVARIANT=knob),
                      cfg["timeout_s"])
        where = [f"{os.path.basename(f['file'])}:{f['line']} in {f['func']}" for f in frames(output_lines(p.text))
                 if f["file"].endswith("batch_invariant.py")]
        rows.append({"knob": knob, "rc": p.rc, "generated": "GENERATED" in p.stdout, "error": p.error,
                     "where": where[-1] if where else ""})
    off, on = rows
    return ([("knob", "VLLM_BATCH_INVARIANT", ""), ("rc", "exit code", ""), ("generated", "generated", ""),
                    ("error", "last error", ""), ("where", "last batch_invariant.py frame", "")], rows, [
        ("without the knob the CPU engine generates", off["generated"]),
        ("with VLLM_BATCH_INVARIANT=1 it crashes with a TypeError", not on["generated"] and on["error"].startswith("TypeError")),
        ("raised inside vLLM's batch_invariant.py", bool(on["where"])),
    ])
