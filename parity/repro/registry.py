"""The reproductions, numbered as ``parity repro list`` shows them, and the order ``all`` runs them in.

Each repro is the module ``parity.repro.NAME``, run by :mod:`parity.repro.runner`; it exposes
``settings(small) -> dict``, ``run(ctx, settings) -> Measured``, ``script_config(small) -> dict`` (its
standalone script's ``CONFIG``; every repro has one), and ``FINDING`` and ``COLUMNS`` unless ``run``
measures them; ``SCRIPT_SOURCE`` where its script is cut from another source than the default,
``SCRIPT_ABOUT`` where its script needs and does other things than sampling with vLLM (its docstring's
text), ``TITLE`` where its report carries a longer title than its line here, and ``TAKES_MODEL = True``
where ``parity repro NAME --model`` may run it on another model (``settings(small, model=...)``). Modules are imported
only when a repro runs, so ``parity repro list`` and ``parity --help`` need no engine.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from parity.errors import UsageError


@dataclass(frozen=True)
class Entry:
    number: int
    name: str
    title: str
    fixtures: tuple[str, ...]  # fixtures whose engines it uses (for the run order of ``all``)

    @property
    def module(self) -> str:
        return f"parity.repro.{self.name}"

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


# name, title, fixtures; numbered in this order.
_REPROS = (
    ("top_p_bias", "top_p biases the importance-sampling correction by log S per token, S^L per sequence",
     ("llama-32k-s1",)),
    ("top_k_entropy", "top_k severity depends on entropy; top_p keeps S near top_p (32k-vocab logit-scale sweep)",
     ("llama-32k-s1", "llama-32k-s2", "llama-32k-s4", "llama-32k-s6", "llama-32k-s8", "llama-32k-s12")),
    ("temperature", "a trainer that forgets to divide by the temperature is biased; one that divides is not",
     ("llama-32k-s1",)),
    ("recompute_boundary",
     "recompute at the boundary: a bf16 trainer loses the sampled token (-inf) without force-include",
     ("llama-32k-s1",)),
    ("top_k_ties", "ties at the top_k boundary: vLLM keeps every tied token, a strict torch.topk recompute does not",
     ("qwen2-tiny-ties",)),
    ("capture_head",
     "capture head too small: top_logprobs < top_k or top_p without a top_k cap mis-scores positions",
     ("llama-32k-s4",)),
    ("batch_invariant_cpu", "VLLM_BATCH_INVARIANT=1 crashes vLLM's CPU engine at the first forward",
     ("qwen2-tiny-ties",)),
    ("trl_grpo_top_p", "TRL GRPOTrainer's own metrics: IS ratio scaled by S (S^L per sequence) under "
     "top_p/top_k/min_p; a replay patch removes it", ("qwen2-tiny",)),
    ("trl_weight_sync",
     "TRL colocate weight sync on vLLM's CPU engine: 'Parameter' object has no attribute 'weight_loader'",
     ("qwen2-tiny",)),
    ("cpu_capability_default",
     "vLLM's CPU engine under ATEN_CPU_CAPABILITY=default after a vectorised run: inductor's FX graph cache "
     "ignores the vector ISA ('at::vec' has not been declared)",
     ("qwen2-tiny",)),
    ("torch_cpu_log_softmax",
     "torch's float32 log_softmax on CPU: every log-prob of a wide, peaked row is high by one constant "
     "(its sum of exponentials drops small terms)", ()),
)
REPROS: tuple[Entry, ...] = tuple(Entry(i, *row) for i, row in enumerate(_REPROS, start=1))

BY_NAME = {e.name: e for e in REPROS}

# ``all``: the repros on the flat 32k fixture, then the one on scale 4, then the sweep (which visits the
# scales whose engines are still alive first), then the tie fixture: with two live engines, each
# fixture's engine starts once.
# The TRL and engine-start repros start their own engines in subprocesses: they come last.
# torch_cpu_log_softmax starts no engine (torch alone, a subprocess for the second kernel path).
RUN_ORDER = ("top_p_bias", "temperature", "recompute_boundary", "capture_head", "top_k_entropy",
             "top_k_ties", "batch_invariant_cpu", "trl_grpo_top_p", "trl_weight_sync", "cpu_capability_default",
             "torch_cpu_log_softmax")


def get(name: str) -> Entry:
    key = name.replace("-", "_")
    if key.isdigit():
        for e in REPROS:
            if e.number == int(key):
                return e
    if key not in BY_NAME:
        raise UsageError(f"unknown reproduction {name!r}: allowed list, all, or one of {', '.join(BY_NAME)} (or 1-{len(REPROS)})")
    return BY_NAME[key]
