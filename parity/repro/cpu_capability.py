# ruff: noqa: E501
"""The cpu_capability_default repro: torch inductor's FX graph cache under ATEN_CPU_CAPABILITY=default, on torch
alone and on vLLM's CPU engine, each step a child process over one fresh inductor cache. Inlined into its
script section (``# @inline``) after the prelude, which carries what it imports.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import TypedDict

from parity.repro.script_engines import build_model, save
from parity.repro.standalone_child import run_child
from parity.repro.standalone_report import Outcome

# The children print "ISA <inductor's vector ISA>" first and "GENERATED <ids>" when they got through.
CAP_ISA = "from torch._inductor import cpu_vec_isa\nprint('ISA', str(cpu_vec_isa.pick_vec_isa()), flush=True)\n"
CAP_TORCH = CAP_ISA + r"""
import torch
@torch.compile(dynamic=True)
def count_ge(x, v):
    return (x >= v).sum(-1)
print("GENERATED", count_ge(torch.arange(12.0).reshape(3, 4), torch.tensor([[1.0], [5.0], [20.0]])).tolist(), flush=True)
"""
CAP_VLLM = CAP_ISA + r"""
import sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype=sys.argv[2], max_model_len=256, seed=0, enforce_eager=True,
          enable_prefix_caching=False)
out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])],
                   SamplingParams(temperature=0, max_tokens=2, logprobs=1, detokenize=False), use_tqdm=False)
print("GENERATED", list(out[0].outputs[0].token_ids), flush=True)
"""
# g++ quotes the name with typographic quotes under a UTF-8 locale, ASCII ones otherwise.
CAP_SYMPTOM = re.compile("[\u2018']at::vec[\u2019'] has not been declared")


class CapabilityConfig(TypedDict):
    vocab: int
    cases: list[str]  # "torch", "vllm"
    timeout_s: float  # per child process


class CapabilityRow(TypedDict):
    case: str
    step: str
    knob: str  # ATEN_CPU_CAPABILITY ("unset")
    isa: str  # inductor's vector ISA as the child printed it ("?": none)
    generated: bool
    symptom: bool  # 'at::vec' has not been declared


def repro_cpu_capability_default(cfg: CapabilityConfig, args: argparse.Namespace) -> Outcome:
    """torch inductor's FX graph cache ignores ATEN_CPU_CAPABILITY: after a vectorised run fills the cache, a run
    under ATEN_CPU_CAPABILITY=default gets the vectorised graph back, g++ builds it against the scalar header and
    stops with 'at::vec' has not been declared; TORCHINDUCTOR_FX_GRAPH_CACHE=0 works around it. Shown on torch
    alone and on vLLM's CPU engine (log-probs on, so its sampler compiles a rank count), each in three processes
    over one fresh inductor cache."""
    path = save(build_model(cfg["vocab"], seed=args.seed))
    steps = (("control", None, None), ("stale cache", "default", None), ("FX graph cache off", "default", "0"))
    rows: list[CapabilityRow] = []
    for case, code, argv in (("torch", CAP_TORCH, []), ("vllm", CAP_VLLM, [path, "bfloat16"])):
        if case not in cfg["cases"]:
            continue
        cache = tempfile.mkdtemp(prefix="repro-cache-")
        for step, knob, fx in steps:
            env = dict(os.environ, VLLM_CACHE_ROOT=os.path.join(cache, "vllm"), TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "ind"))
            for key, value in (("ATEN_CPU_CAPABILITY", knob), ("TORCHINDUCTOR_FX_GRAPH_CACHE", fx)):
                env.pop(key, None)
                if value:
                    env[key] = value
            p = run_child([sys.executable, "-c", code, *argv], env, cfg["timeout_s"])
            isa = [ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("ISA ")]
            rows.append({"case": case, "step": step, "knob": knob or "unset", "isa": isa[0] if isa else "?",
                         "generated": any(ln.startswith("GENERATED ") for ln in p.stdout.splitlines()),
                         "symptom": bool(CAP_SYMPTOM.search(p.text))})
    pick = {s: [r for r in rows if r["step"] == s] for s, _, _ in steps}
    return ([("case", "case", ""), ("step", "step", ""), ("knob", "ATEN_CPU_CAPABILITY", ""),
                    ("isa", "inductor vector ISA", ""), ("generated", "generated", ""),
                    ("symptom", "'at::vec' has not been declared", "")], rows, [
        ("control: without the variable every case generates", all(r["generated"] for r in pick["control"])),
        ("the control compiled for a vectorised ISA (without one nothing can go stale)",
         all(r["isa"] not in ("INVALID_VEC_ISA", "?") for r in pick["control"])),
        ("ATEN_CPU_CAPABILITY=default over the same cache fails with 'at::vec' has not been declared",
         all(not r["generated"] and r["symptom"] for r in pick["stale cache"])),
        ("the same with TORCHINDUCTOR_FX_GRAPH_CACHE=0 generates", all(r["generated"] for r in pick["FX graph cache off"])),
    ])
