"""The reference filters and estimators against vLLM's real ``Sampler`` (in-process, CPU).

One property test draws batches of logits and specs (tests/strategies.py), runs them through vLLM's
own ``Sampler`` (parity.engines.vllm_sampler.VllmSampler: real Sampler, real MinPLogitsProcessor, hand-built
SamplingMetadata) and through the reference, and checks every property of parity.testing.properties. Each
branch a case reaches is a ``hypothesis.event``; ``test_every_branch_reached`` then proves that the
drawn cases (not only the hand-picked ``@example``s) reached all of them under the ci profile.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import event, example, given, settings
from strategies import cases, example_case, example_logits

from parity.core.estimators import recompute
from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec
from parity.testing.cases import REQUIRED_LABELS, Case, RowPlan, case_labels
from parity.testing.properties import (
    check_kept_equal,
    check_log_s_identity,
    check_processed_close,
    check_recompute_finite,
    check_replay,
    check_sampled_in_kept,
    check_top_p_mass,
)

pytestmark = pytest.mark.sampler

S = SamplingSpec
NEG_INF = float("-inf")

# Labels reached, split by where the case came from; read by test_every_branch_reached.
SEEN: dict[str, Counter[str]] = {"drawn": Counter(), "example": Counter()}
RUNS = Counter()


def trainer_logits(case: Case, z: torch.Tensor, noise: float = 1e-3) -> torch.Tensor:
    """The sampler's (penalised) logits ``z`` plus small seeded noise: a trainer whose numerics moved the boundaries."""
    gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    return z + noise * torch.randn(case.logits.shape, generator=gen)


@given(case=cases())
# Hand-picked corners; the drawn cases reach the same branches (test_every_branch_reached).
@example(case=example_logits([[2.0, 1.0, 1.0, 1.0, 0.0]], S(1.0, top_k=2)))  # 3-way tie at k = 2
@example(case=example_logits([[2.0, 1.0, 1.0, 1.0, 0.0]], S(1.0, top_k=2, top_p=0.99)))  # same, sort path
@example(case=example_logits([[0.0, 0.0, 0.0, 0.0]], S(1.0, top_p=0.6)))  # top_p cut inside a full tie
@example(case=example_logits([[1.0, NEG_INF, NEG_INF]], S(0.7, top_k=2, top_p=0.5, min_p=0.3)))  # single finite
@example(case=example_logits([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0]], S(0.0), S(0.5, top_p=0.9)))  # greedy + random
@example(case=example_logits([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0]], S(0.0), S(0.0)))  # all greedy
@example(case=example_logits([[5.0, 4.9, 0.0]], S(5e-6, top_k=1)))  # T < 1e-5 but > 0: vLLM samples at 0.01
@example(case=example_logits([[1.0, 0.5, -1.0, 2.0]], S(1.0, top_k=4), S(1.0, top_k=100)))  # k == V, k > V
@example(case=example_logits([[1.0, 1.0, 0.5, -2.0]], S(1.0, min_p=1.0)))  # min_p = 1 keeps the tied max
@example(case=example_case(64, RowPlan(S(0.05, top_p=0.95), std=20.0), RowPlan(S(1.0), std=20.0)))  # underflow, p=1 row on the sort path
@example(case=example_logits([[3.0, 1.0, 0.0], [100.0, 0.0, -100.0]], S(1.0, top_p=0.9), S(1.0)))  # exp(-200) underflows: certain
@example(case=example_case(4096, RowPlan(S(1.0, top_k=50, top_p=0.9, min_p=0.05), std=0.1, top_k_tie=3, top_p_tie=3)))
# Penalties: a greedy row whose argmax the repetition penalty moves, r < 1 with additive terms, mixed with an
# unpenalised row on the sort path.
@example(case=example_case(64, RowPlan(S(0.0, repetition_penalty=3.0), std=1.0, prompt_len=5, output_len=3, history_top=0.9),
                           RowPlan(S(0.8, top_p=0.9, repetition_penalty=0.6, presence_penalty=0.5, frequency_penalty=-0.3),
                                   std=2.0, prompt_len=10, output_len=20, history_top=0.5),
                           RowPlan(S(1.0, top_k=5, top_p=0.95), std=2.0)))
def test_reference_matches_vllm(sampler, case: Case) -> None:
    prompts, outputs = case.histories
    out = sampler(case.logits, case.specs, seed=case.seed, prompt_ids=prompts, output_ids=outputs)
    ref = reference_filter(case.logits, case.specs, prompt_ids=prompts, output_ids=outputs)
    z = case.penalised_logits()  # what the estimators read: the logits after the penalties
    labels = case_labels(case, out.kept)
    for label in sorted(labels):
        event(label)
    SEEN[case.source].update(labels)
    RUNS[case.source] += 1

    check_sampled_in_kept(out, case.specs)
    check_kept_equal(ref, out)
    check_processed_close(ref, out)
    check_log_s_identity(z, case.specs, out.kept, out.logprobs, out.sampled)
    check_replay(z, case.specs, out.kept, out.logprobs, out.sampled)
    check_top_p_mass(z, case.specs, out.kept)
    # recompute on the sampler's own logits gives the sampler's support and value; on moved (trainer)
    # logits it may have to force-include the token vLLM actually sampled, and must stay finite.
    same = recompute(z, out.sampled, case.specs)
    assert not bool(same.forced.any()), f"recompute on the sampler's own logits force-included rows {same.forced.nonzero().squeeze(1).tolist()}"
    check_recompute_finite(same, out.sampled, case.specs)
    moved = recompute(trainer_logits(case, z), out.sampled, case.specs)
    check_recompute_finite(moved, out.sampled, case.specs)


def test_every_branch_reached() -> None:
    """The drawn cases reached every branch under the ci profile (examples alone do not count)."""
    if not RUNS:
        pytest.skip("runs after test_reference_matches_vllm in the same session; it was deselected")
    print(f"\nsampler property cases: {RUNS['drawn']} drawn + {RUNS['example']} examples")
    for label in sorted(REQUIRED_LABELS):
        print(f"  {SEEN['drawn'][label]:>5} drawn  {SEEN['example'][label]:>3} examples  {label}")
    missing_everywhere = sorted(REQUIRED_LABELS - set(SEEN["drawn"]) - set(SEEN["example"]))
    assert not missing_everywhere, f"no case reached: {missing_everywhere}"
    if settings().max_examples >= 300:  # the ci profile: drawn cases alone must reach everything
        missing = sorted(REQUIRED_LABELS - set(SEEN["drawn"]))
        assert not missing, f"drawn cases never reached {missing} in {RUNS['drawn']} cases"


def test_sampler_run_is_reproducible(sampler) -> None:
    """Same logits, specs and seed: the same draw and bitwise the same log-probs (the harness relies on it)."""
    case = example_case(257, RowPlan(S(0.8, top_k=20, top_p=0.9)), RowPlan(S(1.3, min_p=0.1)), seed=11)
    a = sampler(case.logits, case.specs, seed=3)
    b = sampler(case.logits, case.specs, seed=3)
    assert torch.equal(a.sampled, b.sampled)
    assert torch.equal(a.logprobs, b.logprobs)



@pytest.mark.parametrize("spec", [S(1.0), S(1.0, top_p=0.9), S(0.0), S(1.0, min_p=0.1)], ids=SamplingSpec.label)
def test_all_neg_inf_row_vllm_reports_nan_and_the_reference_refuses(sampler, spec: SamplingSpec) -> None:
    """vLLM has no answer for a row without a finite logit: NaN log-probs, token 0 drawn, no error.

    The reference refuses such a row (ValueError) rather than agree with a NaN; the other rows of the
    batch are unaffected in vLLM.
    """
    z = torch.tensor([[NEG_INF] * 4, [1.0, 0.0, -1.0, -2.0]])
    out = sampler(z, [spec, spec])
    assert bool(torch.isnan(out.logprobs[0]).all())
    assert bool(torch.isfinite(out.logprobs[1]).any()) and not bool(torch.isnan(out.logprobs[1]).any())
    with pytest.raises(ValueError, match="row 0 is all -inf"):
        reference_filter(z, [spec, spec])
