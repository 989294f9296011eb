"""The harness's case builder and property messages, without vLLM.

The planted features must be what their names say (exact ties, a top_p cut inside a tied block),
otherwise the sampler-level tests would claim coverage they do not have.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from strategies import case_plans

from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec
from parity.engines.vllm_sampler import SamplerOutput
from parity.testing.cases import CasePlan, RowPlan, build_case, case_labels, random_plan
from parity.testing.properties import check_kept_equal, check_processed_close

S = SamplingSpec


def test_build_case_is_deterministic() -> None:
    plan = random_plan(random.Random(5))
    a, b = build_case(plan), build_case(plan)
    assert torch.equal(a.logits, b.logits) and a.specs == b.specs


def test_top_k_tie_is_exact_and_kept() -> None:
    case = build_case(CasePlan(100, (RowPlan(S(1.0, top_k=7), std=3.0, top_k_tie=3),), seed=1))
    z = case.logits[0]
    kth = z.sort(descending=True).values[6]
    assert int((z == kth).sum()) == 4  # the k-th and three below it share one value
    assert int(reference_filter(case.logits, case.specs).support_size[0]) == 10
    assert "tie at the top_k boundary (|S|>k)" in case_labels(case, reference_filter(case.logits, case.specs).kept)


def test_top_p_tie_puts_the_cut_inside_the_block() -> None:
    hits = 0
    for seed in range(20):
        case = build_case(CasePlan(64, (RowPlan(S(0.8, top_p=0.9), std=1.0, top_p_tie=4),), seed=seed))
        if case.specs[0].top_p == 0.9:  # no block with enough mass: the spec is left alone
            continue
        ref = reference_filter(case.logits, case.specs)
        scaled, kept = ref.scaled[0], ref.kept[0]
        shared = torch.isin(scaled[~kept], scaled[kept])
        assert bool(shared.any()), f"seed {seed}: the top_p cut did not split the tied block"
        assert "split tie at the top_p boundary" in case_labels(case, ref.kept)
        hits += 1
    assert hits >= 10


def test_single_finite_row() -> None:
    case = build_case(CasePlan(10, (RowPlan(S(1.0), single_finite=True),), seed=3))
    assert int(torch.isfinite(case.logits[0]).sum()) == 1
    assert "row with a single finite value" in case_labels(case)


@settings(max_examples=60)  # a sanity check of the builder; the sampler tests draw the full 300
@given(plan=case_plans())
def test_drawn_cases_are_valid_inputs(plan: CasePlan) -> None:
    case = build_case(plan)
    assert case.logits.dtype == torch.float32
    assert case.logits.shape == (len(plan.rows), plan.vocab)
    assert bool(torch.isfinite(case.logits).any(dim=-1).all())
    reference_filter(case.logits, case.specs)  # refuses NaN, +inf and all -inf rows


def _out(kept: torch.Tensor, logprobs: torch.Tensor) -> SamplerOutput:
    return SamplerOutput(kept=kept, logprobs=logprobs, sampled=torch.zeros(kept.shape[0], dtype=torch.long))


def test_kept_mismatch_message_names_row_token_and_sides() -> None:
    z = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    ref = reference_filter(z, S(1.0, top_k=2))
    other = ref.kept.clone()
    other[0, 3] = True
    with pytest.raises(AssertionError) as info:
        check_kept_equal(ref, _out(other, ref.logprobs))
    msg = str(info.value)
    assert "row 0 (T=1 top_k=2): token 3 kept by vLLM, dropped by the reference" in msg
    assert "|S| reference 3 vs vLLM 4" in msg


def test_processed_mismatch_message_gives_both_values_and_gap() -> None:
    z = torch.tensor([[2.0, 1.0, 0.0]])
    ref = reference_filter(z, S(1.0))
    moved = ref.logprobs.clone()
    moved[0, 1] += 1e-4
    check_processed_close(ref, _out(ref.kept, ref.logprobs))
    with pytest.raises(AssertionError, match=r"token 1: reference -?[0-9.]+ vs vLLM -?[0-9.]+, gap 0.0001 > tol [0-9.e-]+"):
        check_processed_close(ref, _out(ref.kept, moved))
