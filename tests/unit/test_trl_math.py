"""The engine-free parts of the TRL integration: the bfloat16 rounding bound, the relation check, the fix.

No TRL and no engine: synthetic logits stand in for a trainer, and bfloat16 rounding of them for a
bfloat16 sampler (which is what the bound models).
"""

from __future__ import annotations

import math

import pytest
import torch

from parity.core import estimators
from parity.core.error_model import logprob_rounding_bound, unit_roundoff
from parity.core.spec import SamplingSpec


def test_unit_roundoff_is_half_the_machine_epsilon() -> None:
    assert unit_roundoff("bfloat16") == 2.0**-8
    assert unit_roundoff(torch.float32) == 2.0**-24
    with pytest.raises(ValueError, match="dtype=.int8. has no unit roundoff"):
        unit_roundoff("int8")


def _case(seed: int, scale: float, v: int = 300, n: int = 64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=g) * scale
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=g).squeeze(1)
    return z, y


@pytest.mark.parametrize("scale", [1.0, 4.0, 12.0])
@pytest.mark.parametrize("spec", [SamplingSpec(), SamplingSpec(top_p=0.8), SamplingSpec(temperature=0.7, top_k=20)])
def test_bound_holds_for_logits_rounded_to_bfloat16(scale: float, spec: SamplingSpec) -> None:
    """Round the logits to bfloat16: the full and the renormalised log-prob move by at most the bound."""
    z, y = _case(int(scale * 10), scale)
    zb = z.to(torch.bfloat16).float()
    kept = estimators.mask_to_ids(estimators.recompute(z, y, spec).kept | torch.nn.functional.one_hot(y, z.shape[1]).bool())
    bound = logprob_rounding_bound(z, y, spec, "bfloat16", kept=kept)
    for a, b in ((estimators.full(z, y, spec), estimators.full(zb, y, spec)),
                 (estimators.replay(z, y, kept, spec).logprobs, estimators.replay(zb, y, kept, spec).logprobs)):
        gap = (a.double() - b.double()).abs()
        assert bool((gap <= bound).all()), f"max gap/bound {float((gap / bound).max()):.3f}"
    # and it is not vacuous: the rounding moves log-probs by a sizeable part of it
    assert float((estimators.full(z, y, spec) - estimators.full(zb, y, spec)).abs().max()) > 0.05 * float(bound.max())


def _sequences(seed: int, top_p: float, fix: str):
    """Captured-sequence dicts as patch_grpo records them, for a bfloat16 sampler and a float32 trainer."""
    spec = SamplingSpec(top_p=top_p)
    seqs = []
    for b in range(6):
        z, y = _case(seed + b, 3.0, n=16)
        kept = estimators.mask_to_ids(estimators.recompute(z, y, spec).kept | torch.nn.functional.one_hot(y, z.shape[1]).bool())
        sampler = estimators.replay(z.to(torch.bfloat16).float(), y, kept, spec).logprobs
        full = estimators.full(z, y, spec)
        log_s = estimators.predicted_log_s(z, kept, spec).double()
        used = full - log_s.float() if fix != "observe" else full
        seqs.append({"step": 0, "index": b, "prompt_ids": [3, 4, 5], "completion_ids": y.tolist(), "mask": torch.ones(16, dtype=torch.bool),
                     "sampling_logps": sampler, "trainer_logps": full, "is_logps": used, "log_s": log_s,
                     "kept_ids": kept, "kept_logprobs": sampler[:, None].expand(kept.shape).clone(),
                     "incomplete": torch.zeros(16, dtype=torch.bool), "logits": z, "is_ratio": (used - sampler).double().sum().exp().reshape(1),
                     "spec": spec.to_dict(), "is_mode": "sequence_mask", "is_clip": [None, 3.0], "fix": fix,
                     "sampler_dtype": "bfloat16"})
    return seqs


def _trl_metric(seqs) -> float:
    """TRL's sampling_logp_difference/mean: mean |is_logps - sampling| over every masked token, pooled."""
    return float(torch.cat([(s["is_logps"] - s["sampling_logps"]).abs()[s["mask"]] for s in seqs]).mean())


@pytest.mark.parametrize("fix", ["observe", "replay"])
def test_relation_check_holds_and_fails_on_planted_faults_near_the_bound(fix: str) -> None:
    from parity.repro.trl_grpo_top_p import logp_relation, step_stats

    seqs = _sequences(7, 0.8, fix)
    stats = step_stats(seqs)
    expect = fix == "observe"
    m = _trl_metric(seqs)
    rel = logp_relation(m, stats, expect_log_s=expect)
    assert rel["holds"], rel
    assert stats["abs_log_s"] > 3 * stats["bound"]  # top_p=0.8 is far outside the noise: the check can tell
    assert logp_relation(m + 3 * stats["bound"], stats, expect_log_s=expect)["holds"] is False
    assert logp_relation(m - 3 * stats["bound"], stats, expect_log_s=expect)["holds"] is False
    # a fault at a tenth of the bound passes (the measured error itself is far inside the bound)
    assert logp_relation(m + 0.1 * stats["bound"] - rel["err"] * (1 if m > rel["target"] else -1), stats,
                         expect_log_s=expect)["holds"]
    # the wrong expectation fails: the shipped metric is not noise, the fixed one is not log S
    assert logp_relation(m, stats, expect_log_s=not expect)["holds"] is False


def test_step_stats_closed_form_is_the_product_of_s_per_sequence() -> None:
    from parity.repro.trl_grpo_top_p import step_stats

    seqs = _sequences(3, 0.9, "observe")
    stats = step_stats(seqs)
    prod = torch.stack([s["log_s"].sum().exp() for s in seqs]).mean()
    assert math.isclose(stats["is_closed"], float(prod), rel_tol=1e-12)
    assert stats["is_dev_over_bound"] <= 1  # log of the ratio is the sum of log S up to rounding


def test_fix_correction_matches_replay_and_recompute_estimators() -> None:
    from parity.core.capture import support_from_heads
    from parity.engines.trl_grpo import GrpoCapture, _log_mass_correction

    spec = SamplingSpec(top_p=0.85, top_k=40)
    z, y = _case(11, 3.0, n=32)
    kept = estimators.recompute(z, y, spec).kept | torch.nn.functional.one_hot(y, z.shape[1]).bool()
    ids = [row.nonzero().squeeze(1).tolist() for row in kept]
    lps = [[0.0] * len(r) for r in ids]
    support = support_from_heads(y.tolist(), ids, lps, requested=-1, vocab_size=z.shape[1])
    full = estimators.full(z, y, spec).double()
    _, corr = _log_mass_correction(GrpoCapture("replay"), z, y, spec, support)
    assert torch.allclose(full - corr, estimators.replay(z, y, support.kept_ids, spec).logprobs.double(), atol=1e-6)
    cap = GrpoCapture("recompute")
    _, corr = _log_mass_correction(cap, z, y, spec, support)
    assert torch.allclose(full - corr, estimators.recompute(z, y, spec).logprobs.double(), atol=1e-6)
    log_s, corr = _log_mass_correction(GrpoCapture("observe"), z, y, spec, support)
    assert bool((corr == 0).all()) and bool((log_s < 0).all())


@pytest.mark.parametrize("spec", [SamplingSpec(top_p=0.85, top_k=40, repetition_penalty=1.3),
                                  SamplingSpec(0.7, presence_penalty=0.5, frequency_penalty=0.4)], ids=SamplingSpec.label)
def test_fix_correction_applies_the_penalty_trl_leaves_out(spec: SamplingSpec) -> None:
    """Under a penalty, TRL's value is the unpenalised full log-prob; the fix turns it into replay / recompute on
    the logits penalised from the prompt and the earlier tokens."""
    from parity.core.capture import support_from_heads
    from parity.core.penalties import penalise_sequence
    from parity.engines.trl_grpo import GrpoCapture, _log_mass_correction

    z, y = _case(12, 3.0, n=32)
    prompt = y[:8].tolist() + [0, 1, 2]
    zp = penalise_sequence(z, spec, prompt, y.tolist())
    full = estimators.full(z, y, spec).double()
    support = None
    if spec.effective().filtered:
        kept = estimators.recompute(zp, y, spec).kept | torch.nn.functional.one_hot(y, z.shape[1]).bool()
        ids = [row.nonzero().squeeze(1).tolist() for row in kept]
        support = support_from_heads(y.tolist(), ids, [[0.0] * len(r) for r in ids], requested=-1, vocab_size=z.shape[1])
        want = estimators.replay(zp, y, support.kept_ids, spec).logprobs.double()
    else:
        want = estimators.full(zp, y, spec).double()
    _, corr = _log_mass_correction(GrpoCapture("replay"), z, y, spec, support, prompt)
    assert torch.allclose(full - corr, want, atol=1e-6)
    assert float((full - want).abs().max()) > 1e-2  # the penalty does move TRL's value
    _, corr = _log_mass_correction(GrpoCapture("recompute"), z, y, spec, support, prompt)
    assert torch.allclose(full - corr, estimators.recompute(zp, y, spec).logprobs.double(), atol=1e-6)


def test_scoring_drops_and_counts_masked_tokens() -> None:
    from parity.analyze.trl import to_records

    seqs = _sequences(5, 0.8, "observe")
    seqs[0]["mask"] = torch.tensor([True] * 10 + [False] * 6)
    seqs[1]["mask"] = torch.zeros(16, dtype=torch.bool)
    records, logits, used, dropped = to_records(seqs)
    assert dropped == 6 + 16 and len(records) == 5
    assert records[0].length == 10 and logits[0].shape == (10, 300) and used[0].shape == (10,)
