"""The reproductions, numbered as ``parity repro list`` shows them (and run in that order by ``all``).

Most repros are their section of ``standalone_src.py`` alone, with their settings here (``SCRIPT_CONFIGS``):
:mod:`parity.repro.runner` runs the emitted script. The others are the module ``parity.repro.NAME``:
``settings(small)``, ``run(ctx, settings) -> Measured``, ``FINDING``, ``COLUMNS``, ``script_config(small)``
unless it is in ``NO_SCRIPT`` (``settings(small, model)`` where it is in ``MODEL_REPROS``). Nothing is
imported until a repro runs, so ``parity repro list`` needs no engine.
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

    @property
    def takes_model(self) -> bool:
        """Whether ``parity repro NAME --model`` may run the repro on another fixture or checkpoint."""
        return self.name in MODEL_REPROS

    @property
    def has_script(self) -> bool:
        """Whether ``--emit-script`` can write the repro as a standalone script (see ``NO_SCRIPT``)."""
        return self.name not in NO_SCRIPT

    @property
    def scripted(self) -> bool:
        """Whether ``parity repro`` runs the repro's emitted script itself (it has no module of its own)."""
        return self.name in SCRIPT_CONFIGS

    def load(self) -> ModuleType:
        return importlib.import_module(f"parity.repro.{self.name}")


MODEL_REPROS = ("trl_grpo_top_p", "trl_async_grpo", "trl_repetition_penalty")  # ``--model``: another fixture or a real checkpoint in place of its own
# Repros with no standalone script: they need parity's own machinery at run time (trl_async_grpo: the capture
# proxy between TRL's rollout worker and the server; trl_repetition_penalty: parity's penalty model in the patched
# trainer), so ``--emit-script`` refuses them and ``all`` skips them.
NO_SCRIPT = ("trl_async_grpo", "trl_repetition_penalty")

# The repros whose one implementation is their section of standalone_src.py: ``parity repro NAME`` runs the
# emitted script. Their settings (the script's CONFIG), and what ``--small`` changes.
_VOCAB_32K = {"vocab": 32768, "logit_scale": 1.0}
SCRIPT_CONFIGS: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    "top_p_bias": ({**_VOCAB_32K, "top_ps": [1.0, 0.95, 0.9, 0.8], "tokens": 16, "prompts": 16}, {"prompts": 4}),
    "top_k_entropy": ({"vocab": 32768, "scales": [1, 2, 4, 6, 8, 12], "tokens": 16, "prompts": 16,
                       "settings": [("top_p=0.9", {"top_p": 0.9}), ("top_k=50", {"top_k": 50}), ("top_k=20", {"top_k": 20})]},
                      {"scales": [1, 4, 12], "tokens": 8, "prompts": 6}),
    "temperature": ({**_VOCAB_32K, "temperatures": [0.5, 0.7, 1.0, 1.3], "tokens": 16, "prompts": 16},
                    {"tokens": 8, "prompts": 6}),
    "recompute_boundary": ({**_VOCAB_32K, "settings": [{"top_k": 1}, {"top_k": 2}, {"top_k": 5}, {"top_k": 50, "top_p": 0.9}],
                            "tokens": 16, "prompts": 32}, {"prompts": 16}),
    "top_k_ties": ({"vocab": 400, "logit_scale": 3.0, "tie_sizes": [2, 3, 2, 4], "top_ks": [1, 2, 3, 5], "margin": 16,
                    "tokens": 16, "prompts": 32}, {"top_ks": [1, 2, 3], "prompts": 12}),
    "capture_head": ({"vocab": 32768, "logit_scale": 4.0, "tokens": 16, "prompts": 16,
                      "cases": [(20, {"top_k": 50}), (20, {"top_k": 50, "top_p": 0.9}), (64, {"top_p": 0.9})]},
                     {"tokens": 8, "prompts": 8}),
    "batch_invariant_cpu": ({"vocab": 512, "timeout_s": 300.0}, {}),
    "trl_weight_sync": ({"timeout_s": 300.0, "default_dtype_row": True}, {"default_dtype_row": False}),
    "torch_cpu_log_softmax": ({"vocabs": [4096, 32000, 49152, 152064], "scales": [1.0, 4.0, 8.0], "rows": 64,
                               "verdict_scale": 4.0, "timeout_s": 300.0},
                              {"vocabs": [4096, 152064], "scales": [1.0, 4.0], "rows": 8}),
    "prefix_cache_logprobs": ({"vocab": 512, "shared": 300, "own": 20, "tokens": 8}, {}),
    "cpu_capability_default": ({"vocab": 512, "cases": ["torch", "vllm"], "timeout_s": 300.0}, {"cases": ["vllm"]}),
}

# A script whose needs differ from the default docstring's (torch, transformers and vLLM; sampling).
SCRIPT_ABOUT = {"torch_cpu_log_softmax": (
    "Needs only torch; samples nothing and downloads nothing. It measures float32 torch.log_softmax\n"
    "against float64 on seeded rows, in this process and in itself run again under ATEN_CPU_CAPABILITY=default,\n"
    "prints a Markdown table and the checks, and exits 0 when the finding reproduces, 1 when it does not.\n\n"
    "    python torch_cpu_log_softmax.py [--seed S]\n")}


def script_config(name: str, small: bool) -> dict[str, object]:
    full, small_changes = SCRIPT_CONFIGS[name]
    return {**full, **small_changes} if small else dict(full)


# name, title; numbered in this order, which is also the order ``all`` runs them in.
_REPROS = (
    ("top_p_bias", "top_p biases the importance-sampling correction by log S per token, S^L per sequence"),
    ("top_k_entropy", "top_k severity depends on entropy; top_p keeps S near top_p (32k-vocab logit-scale sweep)"),
    ("temperature", "a trainer that forgets to divide by the temperature is biased; one that divides is not"),
    ("recompute_boundary",
     "recompute at the boundary: a bf16 trainer loses the sampled token (-inf) without force-include"),
    ("top_k_ties", "ties at the top_k boundary: vLLM keeps every tied token, a strict torch.topk recompute does not"),
    ("capture_head",
     "capture head too small: top_logprobs < top_k or top_p without a top_k cap mis-scores positions"),
    ("batch_invariant_cpu", "VLLM_BATCH_INVARIANT=1 crashes vLLM's CPU engine at the first forward"),
    ("trl_grpo_top_p", "TRL GRPOTrainer's own metrics: IS ratio scaled by S (S^L per sequence) under "
     "top_p/top_k/min_p; a replay patch removes it"),
    ("trl_weight_sync",
     "TRL colocate weight sync on vLLM's CPU engine: 'Parameter' object has no attribute 'weight_loader'"),
    ("cpu_capability_default",
     "vLLM's CPU engine under ATEN_CPU_CAPABILITY=default after a vectorised run: inductor's FX graph cache "
     "ignores the vector ISA ('at::vec' has not been declared)"),
    ("torch_cpu_log_softmax",
     "torch's float32 log_softmax on CPU: every log-prob of a wide, peaked row is high by one constant "
     "(its sum of exponentials drops small terms)"),
    ("prefix_cache_logprobs",
     "prefix caching: requests with prompt log-probs skip the cache (why vLLM #5543 and #42019 do not arise on "
     "CPU); a forced cache read returns wrong prompt log-probs at the cached positions"),
    ("trl_async_grpo", "TRL AsyncGRPOTrainer's own compute_loss: ratio = S at step 0 (processed log-probs as "
     "old_log_probs), negative-advantage tokens below the clip edge get no gradient; a replay patch removes it"),
    ("trl_repetition_penalty", "TRL GRPOTrainer's own metrics under repetition_penalty: vLLM penalises before the "
     "filters, TRL's trainer side does not; a replay patch that applies the penalty removes it"),
)
REPROS: tuple[Entry, ...] = tuple(Entry(i, *row) for i, row in enumerate(_REPROS, start=1))

BY_NAME = {e.name: e for e in REPROS}


def get(name: str) -> Entry:
    key = name.replace("-", "_")
    if key.isdigit() and 1 <= int(key) <= len(REPROS):
        return REPROS[int(key) - 1]
    if key not in BY_NAME:
        raise UsageError(f"unknown reproduction {name!r}: allowed list, all, or one of {', '.join(BY_NAME)} (or 1-{len(REPROS)})")
    return BY_NAME[key]
