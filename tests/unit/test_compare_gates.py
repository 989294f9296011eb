"""The comparison table and the gates on synthetic sampler records (no engine).

The sampler side is the reference filter pipeline applied to known logits; the trainer side gets the
same logits. Agreement must pass every gate on any machine (the limits come from the error model),
and every gate has a planted fault near its limit: a few times the limit fails that gate, a tenth of
it does not.
"""

from __future__ import annotations

import math

import pytest
import torch
from judged import failed as failed_gates
from judged import judged

from parity.core.capture import support_from_heads
from parity.core.error_model import SUPPORT_MASS_TOL
from parity.core.filters import reference_filter
from parity.core.gates import Thresholds
from parity.core.log_s import log_s_from_raw_logits
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.core.token_table import TrainerFaults, build_table

V = 64


def sampler_records(
    spec: SamplingSpec, n_seq: int = 3, length: int = 6, seed: int = 0, head: int | None = None, raw: bool = False,
    scale: float = 3.0,
):
    """Records as the engine adapter makes them; ``raw`` adds the sampler-side log S of a raw-logits pass."""
    g = torch.Generator().manual_seed(seed)
    records, logits = [], []
    for i in range(n_seq):
        z = torch.randn(length, V, generator=g) * scale
        ref = reference_filter(z, spec)
        probs = ref.logprobs.exp()
        y = torch.multinomial(probs, 1, generator=g).squeeze(1)
        kept = kept_lp = incomplete = None
        extras: dict = {}
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
            extras["sampled_missing"] = cap.sampled_missing
            if raw:
                extras["sampler_log_s"] = log_s_from_raw_logits(z, kept, spec)
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
                extras=extras,
            )
        )
        logits.append(z)
    return records, logits


def gates(spec: SamplingSpec, faults: TrainerFaults | None = None, th: Thresholds | None = None, **kw):
    records, logits = sampler_records(spec, **kw)
    table = build_table(records, logits, spec, faults=faults)
    summary = judged(records, logits, table, th)
    return failed_gates(summary), table, summary


FILTERED = [
    SamplingSpec(temperature=0.7, top_p=0.9),
    SamplingSpec(temperature=1.3, top_k=5),
    SamplingSpec(temperature=1.0, min_p=0.1),
    SamplingSpec(temperature=0.8, top_k=10, top_p=0.8, min_p=0.05),
    SamplingSpec(temperature=0.3, top_k=2),  # hot logits: |z|/T of order 30
]


@pytest.mark.parametrize("spec", FILTERED + [SamplingSpec(), SamplingSpec(temperature=0.0)], ids=str)
@pytest.mark.parametrize("raw", [False, True], ids=["no-raw", "raw-logits"])
def test_identical_sides_pass_every_gate(spec: SamplingSpec, raw: bool) -> None:
    failed, table, summary = gates(spec, raw=raw)
    assert failed == set()
    assert summary["headroom"]["replay"] <= 1.0 and summary["headroom"]["recompute"] <= 1.0
    assert summary["recompute"]["support_equal_frac"] == 1.0


def test_the_sampler_side_log_s_comes_from_the_source_that_has_it() -> None:
    assert gates(SamplingSpec())[2]["sampler_log_s"]["source"] == "unfiltered"
    assert gates(SamplingSpec(0.7, top_p=0.9))[2]["sampler_log_s"]["source"] == "top_p_bracket"
    none = gates(SamplingSpec(1.3, top_k=5))[2]
    assert none["sampler_log_s"]["source"] == "none" and none["headroom"]["naive_vs_sampler_log_s"] is None
    assert gates(SamplingSpec(1.3, top_k=5), raw=True)[2]["sampler_log_s"]["source"] == "raw_logits"


@pytest.mark.parametrize("spec", FILTERED, ids=str)
def test_the_naive_bias_is_measured_against_the_samplers_log_s(spec: SamplingSpec) -> None:
    """Not an identity: the trainer's full log-prob minus vLLM's, against a log S from the sampler's logits."""
    failed, _, summary = gates(spec, raw=True)
    assert summary["log_s"]["mean"] < -1e-3  # the bias is there
    assert summary["headroom"]["naive_vs_sampler_log_s"] <= 1.0 and "naive_vs_sampler_log_s" not in failed
    # Negative control: a trainer that forgets the temperature is biased by more than log S.
    if spec.temperature != 1.0:
        assert "naive_vs_sampler_log_s" in gates(spec, TrainerFaults(forget_temperature=True), raw=True)[0]


@pytest.mark.parametrize(
    "spec", [SamplingSpec(0.7, top_k=10, top_p=0.9), SamplingSpec(1.0), SamplingSpec(0.3, top_k=2)], ids=str
)
def test_per_token_drift_fault_fails_at_four_bounds_and_passes_at_a_tenth(spec: SamplingSpec) -> None:
    four, _, s4 = gates(spec, TrainerFaults(shift_bounds=4.0), raw=True)
    assert {"replay_drift", "recompute_drift", "naive_vs_sampler_log_s"} <= four, s4["headroom"]
    tenth, _, s01 = gates(spec, TrainerFaults(shift_bounds=0.1), raw=True)
    assert not tenth & {"replay_drift", "recompute_drift", "naive_vs_sampler_log_s"}, s01["headroom"]


def test_a_violation_names_scenario_position_token_both_sides_the_gap_and_the_bound() -> None:
    spec = SamplingSpec(0.7, top_k=10, top_p=0.9)
    records, logits = sampler_records(spec)
    table = build_table(records, logits, spec, faults=TrainerFaults(shift_bounds=4.0))
    v = next(v for v in judged(records, logits, table)["violations"] if v.gate == "replay_drift")
    assert v.scenario == "planted" and v.statistic > v.limit == 1.0
    worst = v.worst[0]
    assert worst.position == 3 and set(worst.values) == {"vllm", "trainer_replay"}
    assert worst.gap == pytest.approx(worst.values["trainer_replay"] - worst.values["vllm"])
    assert abs(worst.gap) > worst.bound
    text = v.message()
    for part in ("[planted]", "prompt ", "position 3", "token ", "vllm=", "trainer_replay=", "gap=", "bound="):
        assert part in text
    assert v.to_dict()["worst"][0]["position"] == 3 and v.to_dict()["message"] == text


def test_mean_bias_fault_fails_at_three_limits_and_passes_at_a_tenth() -> None:
    """A systematic shift too small for any one token's bound: only the mean gate can see it."""
    spec = SamplingSpec(0.8, top_k=20)
    kw = {"n_seq": 8, "length": 16}
    _, _, clean = gates(spec, **kw)
    limit = clean["mean_bias_limit"]["replay"]
    three, _, s3 = gates(spec, TrainerFaults(bias_logprob=3 * limit), **kw)
    assert {"replay_mean_bias", "recompute_mean_bias"} <= three
    assert s3["headroom"]["replay"] <= 1.0, "the shift is below every per-token bound"
    tenth, _, _ = gates(spec, TrainerFaults(bias_logprob=0.1 * limit), **kw)
    assert not tenth & {"replay_mean_bias", "recompute_mean_bias"}


def test_recompute_support_fault_fails_at_four_times_the_allowance_and_passes_at_a_fifth() -> None:
    """recompute_support_equal_frac = 0.99 allows 1 % of positions to differ."""
    spec = SamplingSpec(1.0, top_k=8)
    kw = {"n_seq": 16, "length": 64}  # 1024 positions
    four, _, s4 = gates(spec, TrainerFaults(move_boundary_every=25), **kw)  # 4 %
    assert "recompute_support" in four and s4["recompute"]["support_equal_frac"] < 0.97
    fifth, _, s02 = gates(spec, TrainerFaults(move_boundary_every=500), **kw)  # 0.3 %
    assert "recompute_support" not in fifth and s02["recompute"]["support_equal_frac"] > 0.99
    assert "replay_support" not in four | fifth  # the sampler's capture is untouched


def test_replay_support_fault_by_the_mass_the_capture_lost() -> None:
    """SUPPORT_MASS_TOL: losing a token of 4x that mass fails, a tenth of it passes."""
    spec = SamplingSpec(1.0, min_p=1e-9)  # keeps (nearly) everything: kept masses span many decades
    kw = {"n_seq": 4, "length": 8, "scale": 4.0}
    heavy, _, _ = gates(spec, TrainerFaults(drop_kept_mass=4 * SUPPORT_MASS_TOL), **kw)
    light, _, _ = gates(spec, TrainerFaults(drop_kept_mass=0.1 * SUPPORT_MASS_TOL), **kw)
    assert "replay_support" in heavy
    assert "replay_support" not in light


def test_an_engine_flagged_token_outside_its_kept_set_is_blamed_on_the_capture() -> None:
    spec = SamplingSpec(0.7, top_k=10)
    records, logits = sampler_records(spec)
    # The engine's kept set at position 2 lacks the token it sampled (and the capture flags it).
    r = records[1]
    at = r.kept_ids[2] == r.completion_ids[2]
    r.kept_ids, r.kept_logprobs = r.kept_ids.clone(), r.kept_logprobs.clone()
    r.kept_ids[2][at], r.kept_logprobs[2][at] = -1, -math.inf
    r.extras["sampled_missing"] = r.extras["sampled_missing"].clone()
    r.extras["sampled_missing"][2] = True
    table = build_table(records, logits, spec)
    failed = failed_gates(judged(records, logits, table, name="engine"))
    assert "sampled_outside" in failed and "token_mismatch" not in failed


def test_a_trainer_scoring_another_token_is_blamed_on_the_trainer() -> None:
    failed, table, summary = gates(SamplingSpec(0.7, top_k=10, top_p=0.9), TrainerFaults(swap_token=True))
    assert "token_mismatch" in failed and "sampled_outside" not in failed
    assert summary["token_mismatch"] == 3 and summary["sampled_outside_support"] == 0


def test_incomplete_capture_is_counted_and_gated() -> None:
    spec = SamplingSpec(temperature=1.0, top_p=0.99)  # wide support
    records, logits = sampler_records(spec, head=4)  # far too small a head
    table = build_table(records, logits, spec)
    summary = judged(records, logits, table, name="head")
    assert summary["incomplete_positions"] > 0
    # By default the capture's own limit is no FAIL: counted, named with the flag that lifts it, and
    # left out of the kept-set gates (excluded, not guessed: nothing else fails on them).
    assert failed_gates(summary) == set()
    assert summary["capture_limit"].startswith(f"{summary['incomplete_positions']} of {summary['tokens']} positions")
    assert "--max-capture-head" in summary["capture_limit"]
    assert summary["compared_tokens"] == summary["tokens"] - summary["incomplete_positions"]
    strict = Thresholds(max_incomplete_frac=0.0)  # the opt-in
    assert "incomplete_capture" in failed_gates(judged(records, logits, table, strict, name="head"))


def test_the_looser_dtype_sets_the_bound() -> None:
    """A bfloat16 sampler against a float32 trainer is bounded by bfloat16, whichever side it is."""
    spec = SamplingSpec(0.7, top_k=10)
    records, logits = sampler_records(spec)
    f32 = build_table(records, logits, spec, dtype=("float32", "float32"))
    mixed = build_table(records, logits, spec, dtype=("bfloat16", "float32"))
    flipped = build_table(records, logits, spec, dtype=("float32", "bfloat16"))
    assert torch.equal(mixed.bound, flipped.bound)
    assert bool((mixed.bound > 1000 * f32.bound).all())
    assert mixed.roundoff == 2.0**-8


def test_drift_split_reads_logit_drift_from_the_captured_kept_set() -> None:
    """Over S_q, lp_i - lp_j = z'_i - z'_j: a logit moved on one side shows up as spread, normalisation does not."""
    spec = SamplingSpec(1.0, top_k=10)
    records, logits = sampler_records(spec)
    def split(faults: TrainerFaults | None = None):
        return judged(records, logits, build_table(records, logits, spec, faults=faults))["drift_split"]

    clean = split()
    assert clean["logit_drift_max"] < 1e-5
    moved = split(TrainerFaults(perturb_logits=0.01))
    assert moved["logit_drift_max"] == pytest.approx(0.01, rel=1e-3)
    # A constant shift of every trainer log-prob is normalisation, not logit drift.
    shifted = split(TrainerFaults(bias_logprob=0.01))
    assert shifted["logit_drift_max"] < 1e-5


def test_thresholds_validate_load_and_name_what_replaced_a_retired_key(tmp_path) -> None:
    with pytest.raises(ValueError, match="max_headroom"):
        Thresholds(max_headroom=-1)
    with pytest.raises(ValueError, match="allowed a fraction"):
        Thresholds(replay_support_equal_frac=2)
    with pytest.raises(ValueError, match="unknown threshold"):
        Thresholds().override(nope=1)
    with pytest.raises(ValueError, match="float8"):
        Thresholds.for_dtype("float8")
    f = tmp_path / "t.toml"
    f.write_text("[thresholds]\nmax_headroom = 0.5\n[thresholds.bfloat16]\nmean_bias_headroom = 3.0\n")
    assert Thresholds.from_toml(f).max_headroom == 0.5
    bf = Thresholds.from_toml(f, "bfloat16")
    assert (bf.max_headroom, bf.mean_bias_headroom, bf.recompute_support_equal_frac) == (0.5, 3.0, 0.0)
    assert math.isfinite(Thresholds().max_headroom)


def test_native_mask_gate_fails_on_one_planted_mismatch_and_passes_without() -> None:
    """The CUDA-only capture comparison, gated on records as the engine adapter leaves them."""
    from parity.judge.gate_table import GateCase, evaluate
    from parity.run import native_mismatches

    def native_capture_gate(records, name, _mode, th):  # the table's native entry on the adapter's positions
        mism = native_mismatches(records)
        return {"mismatched_positions": len(mism)}, evaluate(GateCase(name, None, None, th, native=mism), "native")

    spec = SamplingSpec(0.7, top_k=10)
    records, _ = sampler_records(spec)
    for r in records:
        r.extras["native_kept_ids"] = r.kept_ids.clone()
        r.extras["native_vs_topk_mismatch"] = torch.zeros(0, dtype=torch.long)
    summary, violations = native_capture_gate(records, "native", "both", Thresholds())
    assert summary["mismatched_positions"] == 0 and violations == []
    records[2].extras["native_vs_topk_mismatch"] = torch.tensor([4])
    summary, violations = native_capture_gate(records, "native", "both", Thresholds())
    assert summary["mismatched_positions"] == 1
    [v] = violations
    assert v.gate == "native_vs_topk" and (v.worst[0].prompt, v.worst[0].position) == (2, 4)
