"""Cost of batch invariance on the trainer side: a forward under the CPU kernel set against the default.

Target: the trainer's forward inside ``batch_invariant_mode(device="cpu", models=[model])``
(parity.determinism.kernels: row-wise matrix products, tree reductions, own float64 functions, per-sequence
chunked attention), entered and left every round as a trainer step would. Baseline, interleaved
round by round (conftest.paired): the same forward with torch's own kernels and the model's default
attention (sdpa). No target: the ratio is reported, not gated.

Workloads, on the 32k-vocabulary fixture (Llama layers):

* ``padded 8x128``: eight sequences of 72..128 tokens, right-padded, 2D mask (what
  ``TransformersTrainer.logits`` sends with batch_size 8);
* ``packed 1024``: the same amount of tokens as one packed row (4D block-diagonal mask).

Each run also records what it computed: the largest |mode-on - mode-off| logit difference on the
workload (rounding: the mode is invariant, not equal to torch's kernels), reported in the table.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from layouts import BatchLayout, max_abs_diff, sequence_logits

from parity.determinism.knobs import batch_invariant_mode

# One fixture (a 32k vocabulary, Llama layers): the ratio is the kernels', and each fixture added a
# quarter minute to the session.
MODELS = ["llama-32k"]
LENGTHS = [128, 72, 101, 128, 90, 117, 84, 128]
WORKLOADS: dict[str, Callable[[int], BatchLayout]] = {
    "padded 8x128": lambda n: BatchLayout(tuple((i,) for i in range(n)), side="right", mask="2d"),
    "packed 1024": lambda n: BatchLayout((tuple(range(n)),), mask="4d-bool"),
}
ROUNDS, WARMUP = 3, 1
TITLE = "Trainer forward under batch-invariant mode (CPU kernels): ratio to the default forward"
INTRO = (
    "float32 fixture models, torch's thread count as set (the mode pins it). Target: forward inside "
    "batch_invariant_mode(device='cpu', models=[model]), entered every round; baseline: the same forward "
    "with torch's kernels and sdpa attention. In parentheses the target's min; after it, the largest "
    "|mode-on - mode-off| logit difference (rounding, not a failure)."
)
_MODELS: dict[str, torch.nn.Module] = {}


def load(name: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from parity.fixtures import resolve_model

    if name not in _MODELS:
        _MODELS.clear()
        _MODELS[name] = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=torch.float32).eval()
    return _MODELS[name]


def sequences(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_case(
    report: Any,
    timer: Callable[..., Any],
    model: torch.nn.Module,
    model_name: str,
    workload: str,
    lengths: list[int] = LENGTHS,
    *,
    rounds: int = ROUNDS,
    warmup_rounds: int = WARMUP,
) -> Any:
    """Time the forward under the mode against the default one; check it; report the ratio and distance."""
    layout = WORKLOADS[workload](len(lengths))
    seqs = sequences(model.config.vocab_size, lengths)

    def default() -> dict[int, torch.Tensor]:
        return sequence_logits(model, layout, seqs)

    def under_mode() -> dict[int, torch.Tensor]:
        with batch_invariant_mode(device="cpu", models=[model]) as state:
            out = sequence_logits(model, layout, seqs)
        assert state.knobs["cpu_kernels"].status == "on", state.knobs["cpu_kernels"]
        return out

    pair = timer(under_mode, default, rounds=rounds, warmup_rounds=warmup_rounds)
    ref = default()
    dist = max(max_abs_diff(ref[i], pair.result[i]) for i in ref)
    scale = max(float(r.abs().max()) for r in ref.values())
    # What was timed must be the same function: mode-on logits are mode-off ones up to rounding.
    assert dist <= 1e-4 * max(1.0, scale), f"{model_name} {workload}: mode-on logits off by {dist} (scale {scale})"
    pair.result = None
    table = report.table("cpu-kernels", TITLE, "fixture", INTRO, rows=MODELS, cols=list(WORKLOADS))
    cell = table.put_pair(model_name, workload, pair, note=f"max diff {dist:.1e}")
    report.check("batch-invariant trainer forward vs default (reported)", None, f"{model_name} {workload}", pair.ratio)
    return cell, dist


CASES = [(m, w) for m in MODELS for w in WORKLOADS]


@pytest.mark.parametrize(("model_name", "workload"), CASES, ids=[f"{m}-{w.replace(' ', '-')}" for m, w in CASES])
def test_bench_cpu_kernels(timer, bench_report, model_name, workload) -> None:
    run_case(bench_report, timer, load(model_name), model_name, workload)
