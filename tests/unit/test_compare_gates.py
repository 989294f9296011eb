"""The comparison table and the gates on synthetic sampler records (no engine).

The sampler side is the reference filter pipeline applied to known logits; the trainer side gets the
same logits. Exact agreement must pass every gate, and each planted fault must fail a named gate.
"""

from __future__ import annotations

import pytest
import torch

from parity.core.capture import support_from_heads
from parity.core.filters import reference_filter
from parity.core.gates import Thresholds, evaluate
from parity.core.spec import SamplingSpec
from parity.core.table import TrainerFaults, build_table, summarize
from parity.records.sequence import SequenceRecord

V = 64


def sampler_records(spec: SamplingSpec, n_seq: int = 3, length: int = 6, seed: int = 0, head: int | None = None):
    g = torch.Generator().manual_seed(seed)
    records, logits = [], []
    for i in range(n_seq):
        z = torch.randn(length, V, generator=g) * 3
        ref = reference_filter(z, spec)
        probs = ref.logprobs.exp()
        y = torch.multinomial(probs, 1, generator=g).squeeze(1)
        kept = kept_lp = incomplete = None
        if spec.effective().filtered:
            # Mimic vLLM's head: top-`head` entries sorted by log-prob, -inf padding included.
            k = head or V
            order = torch.argsort(ref.logprobs, dim=-1, descending=True)[:, :k]
            cap = support_from_heads(
                y.tolist(),
                order.tolist(),
                ref.logprobs.gather(1, order).tolist(),
                requested=k if head else -1,
                vocab_size=V,
            )
            kept, kept_lp, incomplete = cap.kept_ids, cap.kept_logprobs, cap.incomplete
        records.append(
            SequenceRecord(
                source="sampler",
                prompt_index=i,
                prompt_ids=[1, 2],
                completion_ids=y.tolist(),
                spec=spec,
                seed=i,
                logprobs=ref.logprobs.gather(1, y.unsqueeze(1)).squeeze(1),
                kept_ids=kept,
                kept_logprobs=kept_lp,
                incomplete=incomplete,
            )
        )
        logits.append(z)
    return records, logits


FILTERED = [
    SamplingSpec(temperature=0.7, top_p=0.9),
    SamplingSpec(temperature=1.3, top_k=5),
    SamplingSpec(temperature=1.0, min_p=0.1),
    SamplingSpec(temperature=0.8, top_k=10, top_p=0.8, min_p=0.05),
]


@pytest.mark.parametrize("spec", FILTERED + [SamplingSpec(), SamplingSpec(temperature=0.0)], ids=str)
def test_identical_sides_pass_every_gate(spec: SamplingSpec) -> None:
    records, logits = sampler_records(spec)
    table = build_table(records, logits, spec)
    summary = summarize(table)
    assert evaluate("synthetic", table, summary, Thresholds()) == []
    assert summary["replay"]["max_abs_diff"] <= 1e-6
    assert summary["recompute"]["support_equal_frac"] == 1.0


@pytest.mark.parametrize("spec", FILTERED, ids=str)
def test_naive_bias_is_log_s(spec: SamplingSpec) -> None:
    records, logits = sampler_records(spec)
    summary = summarize(build_table(records, logits, spec))
    # The negative control: the naive estimator is biased, and by exactly log S.
    assert summary["log_s"]["mean"] < -1e-3
    assert summary["naive"]["bias_mean"] == pytest.approx(summary["log_s"]["mean"], abs=1e-6)
    assert summary["naive"]["max_abs_gap_to_log_s"] <= 1e-5
    assert summary["is_ratio"]["naive"]["sequence_identity_max_rel_err"] <= 1e-5


@pytest.mark.parametrize(
    ("fault", "gate"),
    [
        (TrainerFaults(perturb_logits=0.05), "replay max |diff|"),
        (TrainerFaults(forget_temperature=True), "replay max |diff|"),
        (TrainerFaults(swap_token=True), "replay max |diff|"),
        (TrainerFaults(drop_kept=True), "replay support equality"),
    ],
    ids=["perturb", "forget-temperature", "swap-token", "drop-kept"],
)
def test_planted_faults_fail_a_named_gate(fault: TrainerFaults, gate: str) -> None:
    spec = SamplingSpec(temperature=0.7, top_k=10, top_p=0.9)
    records, logits = sampler_records(spec)
    table = build_table(records, logits, spec, faults=fault)
    violations = evaluate("planted", table, summarize(table), Thresholds())
    assert any(gate in v for v in violations), violations
    # A token-level violation names scenario, prompt, position, token, both values and the gap.
    if "diff" in gate:
        line = next(v for v in violations if gate in v)
        for part in ("[planted]", "prompt ", "position ", "token ", "vllm=", "trainer_replay=", "gap="):
            assert part in line


def test_incomplete_capture_is_counted_and_gated() -> None:
    spec = SamplingSpec(temperature=1.0, top_p=0.99)  # wide support
    records, logits = sampler_records(spec, head=4)  # far too small a head
    table = build_table(records, logits, spec)
    summary = summarize(table)
    assert summary["incomplete_positions"] > 0
    violations = evaluate("head", table, summary, Thresholds())
    assert any("incomplete capture" in v for v in violations)
    # Incomplete positions are excluded, not guessed: nothing else fails on them.
    assert summary["compared_tokens"] == summary["tokens"] - summary["incomplete_positions"]
    relaxed = Thresholds(max_incomplete_frac=1.0)
    assert not [v for v in evaluate("head", table, summary, relaxed) if "incomplete" not in v]


def test_thresholds_validate_and_load(tmp_path) -> None:
    with pytest.raises(ValueError, match="replay_max_abs_diff"):
        Thresholds(replay_max_abs_diff=-1)
    with pytest.raises(ValueError, match="allowed a fraction"):
        Thresholds(replay_support_equal_frac=2)
    with pytest.raises(ValueError, match="unknown threshold"):
        Thresholds().override(nope=1)
    with pytest.raises(ValueError, match="float8"):
        Thresholds.for_dtype("float8")
    f = tmp_path / "t.toml"
    f.write_text("[thresholds]\nreplay_max_abs_diff = 0.5\n[thresholds.bfloat16]\nfixed_mean_bias = 0.3\n")
    assert Thresholds.from_toml(f).replay_max_abs_diff == 0.5
    bf = Thresholds.from_toml(f, "bfloat16")
    assert (bf.replay_max_abs_diff, bf.fixed_mean_bias) == (0.5, 0.3)
