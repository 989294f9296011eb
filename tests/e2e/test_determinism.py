"""Invariance checks on the real vLLM CPU engine and transformers, each with a negative control.

One engine pair for the module (EnginePool), small batches (2, 4, 8) and few tokens: the CPU cost is
the engine start-up, not the checks.

Negative controls:
- trainer: sdpa attention (transformers' default) is a configuration known to break invariance on
  CPU: left padding moves logits (measured ~4e-6 on qwen2-tiny), so the left-padded check must fail.
  Under the mode (eager attention) a long packed row is one too: measured bitwise up to ~370 tokens
  per row, not at 452..943 (one sequence off by ~4e-6..6e-6), so a ~940-token row must fail the
  packed check.
- rollout, and the trainer layouts that are invariant under the mode: vLLM's CPU engine was bitwise
  invariant in every configuration tried (batch 1..32, greedy and top_p), and the cheap natural
  sources are closed here (vLLM's worker disables torch.set_num_threads in-process; a second engine
  in another dtype costs a full start-up on 2 cores). So the control perturbs what the check compares:
  one log-prob (or logit) moved by one float step with torch.nextafter, through the checks' documented
  ``perturb`` hook. A check that misses a 1-ulp change would miss any real one.
"""

from __future__ import annotations

import pytest
import torch

from parity.core.spec import SamplingSpec
from parity.determinism.checks import (
    check_rollout_invariance,
    check_trainer_invariance,
    nudge_one_ulp,
    nudge_record,
)
from parity.determinism.gate import determinism_section, invariance_gate
from parity.determinism.knobs import ON, UNAVAILABLE, batch_invariant_mode
from parity.engines.session import EnginePool, make_prompts
from parity.records.sequence import SequenceRecord
from parity.run import RunConfig

pytestmark = pytest.mark.e2e

MODEL = "qwen2-tiny"
SPEC = SamplingSpec(
    temperature=1.0, top_p=0.9
)  # seeded sampling with a filter, so the kept set is compared too
SIZES = (2, 4, 8)
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def engines():
    pool = EnginePool()
    rollout, trainer = pool.get(MODEL, RunConfig(model=MODEL), progress=lambda s: None)
    yield rollout, trainer
    pool.close()


@pytest.fixture(scope="module")
def prompts(engines):
    _, trainer = engines
    return make_prompts(trainer.tokenizer(), 8)


@pytest.fixture(scope="module")
def rollout_run(engines, prompts):
    rollout, _ = engines
    with batch_invariant_mode(device="cpu") as state:
        result = check_rollout_invariance(
            rollout, prompts, SPEC, max_tokens=MAX_TOKENS, seed=3, batch_sizes=SIZES, repeats=3
        )
    return state, result


@pytest.fixture(scope="module")
def records(engines, prompts):
    rollout, _ = engines
    return rollout.generate(prompts[:6], SPEC, max_tokens=MAX_TOKENS, seed=0)


@pytest.fixture(scope="module")
def trainer_run(engines, records):
    _, trainer = engines
    with batch_invariant_mode(device="cpu", models=[trainer.model]) as state:
        result = check_trainer_invariance(trainer, records)
    return state, result


def test_mode_on_the_cpu_engine_reports_what_is_in_force(rollout_run) -> None:
    state, _ = rollout_run
    knobs = state.to_dict()["knobs"]
    assert knobs["torch.use_deterministic_algorithms"]["status"] == ON
    # The in-process engine bound its OpenMP threads and disabled torch.set_num_threads (measured).
    assert knobs["torch_num_threads"]["status"] == ON and "vLLM" in knobs["torch_num_threads"]["reason"]
    assert knobs["VLLM_BATCH_INVARIANT"]["status"] == UNAVAILABLE
    assert knobs["tf32_off"]["status"] == UNAVAILABLE
    assert not torch.are_deterministic_algorithms_enabled()  # restored after the mode


def test_rollout_is_batch_invariant_on_cpu(rollout_run) -> None:
    """Measured: vLLM's CPU engine gives bitwise the same answer at batch size 1 and in mixed batches."""
    _, result = rollout_run
    names = [c["name"] for c in result["checks"]]
    assert names == [
        f"rollout {m} {k}"
        for m in ("greedy", "sampled")
        for k in [*(f"batch={b}" for b in SIZES), "run-to-run x3"]
    ]
    assert result["modes"]["sampled"] == SPEC.to_dict()
    for c in result["checks"]:
        assert c["bitwise"] and c["tokens_equal"] and c["max_abs_diff"] == 0.0, c
        if c["kind"] == "batch":
            assert c["filler_lengths"], c  # mixed with prompts of other lengths
            assert c["support_equal"] is (True if c["mode"] == "sampled" else None), c
        else:
            assert c["unique_outputs"] == 1
    assert result["invariant"]
    assert invariance_gate(result, required=True) == []


def test_rollout_negative_control_fails_the_check_and_the_gate(engines, prompts) -> None:
    rollout, _ = engines
    perturbed = []

    def nudge(name: str, rec):
        if name in ("rollout greedy batch=4", "rollout sampled run-to-run #1"):
            perturbed.append(name)
            return nudge_record(rec, position=MAX_TOKENS - 1)
        return rec

    result = check_rollout_invariance(
        rollout, prompts, SPEC, max_tokens=MAX_TOKENS, seed=3, batch_sizes=(4,), repeats=2, perturb=nudge
    )
    assert perturbed == ["rollout greedy batch=4", "rollout sampled run-to-run #1"]
    by = {c["name"]: c for c in result["checks"]}
    bad = by["rollout greedy batch=4"]
    assert not bad["bitwise"] and bad["tokens_equal"] and bad["max_abs_diff"] > 0.0
    assert by["rollout sampled run-to-run x2"]["unique_outputs"] == 2
    assert [n for n, c in by.items() if not c["bitwise"]] == [
        "rollout greedy batch=4",
        "rollout sampled run-to-run x2",
    ]
    assert not result["invariant"]
    violations = invariance_gate(result, required=True)
    assert len(violations) == 2
    assert "rollout greedy batch=4" in violations[0] and "batch size 4" in violations[0]
    assert f"{bad['max_abs_diff']:.3e}" in violations[0]
    assert "2 unique outputs from 2 identical requests" in violations[1]
    assert invariance_gate(result, required=False) == []


def test_trainer_is_batch_invariant_under_the_mode(trainer_run, engines) -> None:
    """Measured: with eager attention, alone = right-padded = left-padded = packed (a ~200-token row), bitwise."""
    state, result = trainer_run
    _, trainer = engines
    assert state.knobs["trainer_attention"].status == ON
    assert result["attention"] == "eager"
    assert trainer.model.config._attn_implementation == "sdpa"  # restored after the mode
    assert [c["layout"] for c in result["checks"]] == ["right_padded", "left_padded", "packed"]
    for c in result["checks"]:
        assert c["status"] == "measured" and c["bitwise"] and c["max_abs_diff"] == 0.0, c
    assert result["invariant"] and invariance_gate(result, required=True) == []


def test_trainer_negative_control_sdpa_left_padding_is_detected(engines, records) -> None:
    """sdpa (the default) is not batch-invariant on CPU: the check must see it and the gate must fail."""
    _, trainer = engines
    assert trainer.model.config._attn_implementation == "sdpa"
    result = check_trainer_invariance(trainer, records)
    by = {c["layout"]: c for c in result["checks"]}
    left = by["left_padded"]
    assert not left["bitwise"] and left["max_abs_diff"] > 0.0 and left["records_not_bitwise"] >= 1
    # Packing puts each sequence at an offset in one row: measured not bitwise under sdpa either.
    assert not by["packed"]["bitwise"] and by["packed"]["max_abs_diff"] > 0.0
    # Right padding under sdpa depends on where the padded width puts each sequence in the kernel's
    # blocks (measured both ways on different prompt sets): only the report's consistency is asserted.
    right = by["right_padded"]
    assert right["bitwise"] == (right["max_abs_diff"] == 0.0)
    assert not result["invariant"]
    violations = invariance_gate(result, required=True)
    assert any("trainer left-padded" in v and f"{left['max_abs_diff']:.3e}" in v for v in violations), (
        violations
    )
    assert invariance_gate(result, required=False) == []


def test_trainer_negative_control_long_packed_row_under_the_mode(engines, prompts) -> None:
    """Eager attention is not enough for packing once the row is long: the packed check must see it."""
    _, trainer = engines
    g = torch.Generator().manual_seed(0)
    long_prompts = make_prompts(trainer.tokenizer(), 24)
    recs = [
        SequenceRecord(
            "synthetic",
            i,
            p,
            torch.randint(0, trainer.vocab_size, (8,), generator=g).tolist(),
            SPEC,
            0,
            torch.zeros(8),
        )
        for i, p in enumerate(long_prompts)
    ]
    with batch_invariant_mode(device="cpu", models=[trainer.model]):
        result = check_trainer_invariance(trainer, recs)
    by = {c["layout"]: c for c in result["checks"]}
    assert sum(result["lengths"]) > 900
    assert by["right_padded"]["bitwise"] and by["left_padded"]["bitwise"]  # measured: padding stays invariant
    packed = by["packed"]
    assert not packed["bitwise"] and packed["max_abs_diff"] > 0.0 and packed["records_not_bitwise"] >= 1
    assert invariance_gate(result, required=True) == [
        f"determinism: trainer packed: not bitwise equal to the sequence alone in packed: max |diff| "
        f"{packed['max_abs_diff']:.3e}, {packed['records_not_bitwise']} record(s), worst record {packed['worst_record']}"
    ]


def test_trainer_negative_control_for_the_invariant_layouts(engines, records) -> None:
    """Under the mode every layout is bitwise; a 1-ulp nudge of one logit must still fail each check."""
    _, trainer = engines
    for layout in ("trainer right-padded", "trainer left-padded", "trainer packed"):

        def nudge(name: str, rows: list[torch.Tensor], target: str = layout) -> list[torch.Tensor]:
            return [nudge_one_ulp(rows[0], 7), *rows[1:]] if name == target else rows

        with batch_invariant_mode(device="cpu", models=[trainer.model]):
            result = check_trainer_invariance(trainer, records, perturb=nudge)
        failed = [c["name"] for c in result["checks"] if not c["bitwise"]]
        assert failed == [layout]
        c = next(c for c in result["checks"] if c["name"] == layout)
        assert 0.0 < c["max_abs_diff"] < 1e-5 and c["records_not_bitwise"] == 1 and c["worst_record"] == 0
        assert c["tokens_equal"]
        assert invariance_gate(result, required=True)[0].startswith(f"determinism: {layout}:")


def test_report_section_puts_both_sides_next_to_each_other(rollout_run, trainer_run) -> None:
    state, rollout = rollout_run
    _, trainer = trainer_run
    sec = determinism_section(state, rollout=rollout, trainer=trainer, replay_max_abs_diff=1.5e-6)
    assert sec["required"] and sec["invariant"] and sec["violations"] == []
    assert sec["cross_side"] == {"kernel_noise_max_abs_diff": 0.0, "replay_max_abs_diff": 1.5e-6}
    assert sec["mode"]["device"] == "cpu"
