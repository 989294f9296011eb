"""Negative controls: every property must fail on a reference with a deliberate fault.

Each test builds an input that exposes one fault, shows that the correct reference passes the
property on it against vLLM's real Sampler, and that the faulty variant makes the property raise.
A check that cannot fail proves nothing.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import Phase, find, settings
from strategies import cases

from parity.core.estimators import recompute
from parity.core.filters import FilterFaults, reference_filter
from parity.core.spec import SamplingSpec
from parity.testing.properties import (
    check_kept_equal,
    check_log_s_identity,
    check_processed_close,
    check_recompute_finite,
    check_replay,
    check_top_p_mass,
)

pytestmark = pytest.mark.sampler

S = SamplingSpec
DROP_TIES = FilterFaults(drop_top_k_ties=True)
P_FIRST = FilterFaults(top_p_before_top_k=True)
MIN_P_LOG = FilterFaults(min_p_in_log_space=True)


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


# Three tokens tied at the k-th value (k = 2): vLLM keeps all of them, |S| = 4.
TIED = logits([2.0, 1.0, 1.0, 1.0, 0.0, -1.0])


@pytest.mark.parametrize(
    "specs",
    [
        pytest.param([S(1.0, top_k=2)], id="top_k-only path"),
        pytest.param([S(1.0, top_k=2), S(1.0, top_k=2, top_p=0.95)], id="sort path (a top_p row in the batch)"),
    ],
)
def test_dropped_ties_fail_kept_and_processed(sampler, specs) -> None:
    z = TIED.expand(len(specs), -1).clone()
    out = sampler(z, specs)
    assert int(out.kept[0].sum()) == 4, "vLLM should keep every token tied with the k-th value"
    check_kept_equal(reference_filter(z, specs), out)
    check_processed_close(reference_filter(z, specs), out)
    faulty = reference_filter(z, specs, faults=DROP_TIES)
    with pytest.raises(AssertionError, match=r"(?s)kept sets differ .*row 0 .*kept by vLLM, dropped by the reference"):
        check_kept_equal(faulty, out)
    with pytest.raises(AssertionError, match=r"(?s)processed log-probs differ .*reference -inf vs vLLM"):
        check_processed_close(faulty, out)


def test_dropped_ties_fail_log_s_identity_and_replay(sampler) -> None:
    """A kept set that lost the tied tokens gives the wrong log S and the wrong replay value."""
    specs = [S(1.0, top_k=2)]
    out = sampler(TIED, specs)
    check_log_s_identity(TIED, specs, out.kept, out.logprobs, out.sampled)
    check_replay(TIED, specs, out.kept, out.logprobs, out.sampled)
    short = reference_filter(TIED, specs, faults=DROP_TIES).kept
    with pytest.raises(AssertionError, match=r"(?s)full - processed != log S"):
        check_log_s_identity(TIED, specs, short, out.logprobs)
    # Token 0 is in both kept sets, so replay scores it, over the wrong support.
    y = torch.tensor([0])
    with pytest.raises(AssertionError, match=r"(?s)replay \(mask\) .* vs sampler"):
        check_replay(TIED, specs, short, out.logprobs, y)


def test_top_p_before_top_k_fails(sampler) -> None:
    """probs (0.4, 0.3, 0.2, 0.1), top_k 2, top_p 0.5.

    vLLM: top_k keeps (0.4, 0.3), renormalised (4/7, 3/7); ascending cumsum 3/7 <= 0.5 drops 0.3: S = {0}.
    top_p first: cumsum (0.1, 0.3, 0.6, 1) drops the two smallest, then top_k keeps {0, 1}.
    """
    z = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    specs = [S(1.0, top_k=2, top_p=0.5)]
    out = sampler(z, specs)
    assert out.kept[0].tolist() == [True, False, False, False]
    check_kept_equal(reference_filter(z, specs), out)
    with pytest.raises(AssertionError, match=r"(?s)token 1 kept by the reference, dropped by vLLM"):
        check_kept_equal(reference_filter(z, specs, faults=P_FIRST), out)


def test_no_force_include_fails_recompute(sampler) -> None:
    """top_k = 1: vLLM samples its argmax (token 1); the trainer's logits put token 0 on top."""
    specs = [S(1.0, top_k=1)]
    z_sampler = logits([1.0, 1.0001, -5.0])
    z_trainer = logits([1.0001, 1.0, -5.0])
    out = sampler(z_sampler, specs)
    assert out.sampled.tolist() == [1]
    forced = recompute(z_trainer, out.sampled, specs)
    assert forced.forced.tolist() == [True]
    check_recompute_finite(forced, out.sampled, specs)
    naive = recompute(z_trainer, out.sampled, specs, force_include=False)
    with pytest.raises(AssertionError, match=r"sampled token 1 scores -inf \(it lies outside the recomputed support"):
        check_recompute_finite(naive, out.sampled, specs)


def test_too_small_support_fails_top_p_mass(sampler) -> None:
    """A support holding only the argmax of a flat row carries far less than top_p."""
    z = torch.zeros(1, 50)
    z[0, 7] = 0.01
    specs = [S(1.0, top_p=0.9)]
    out = sampler(z, specs)
    check_top_p_mass(z, specs, out.kept)
    only_max = torch.zeros_like(out.kept)
    only_max[0, 7] = True
    with pytest.raises(AssertionError, match=r"kept mass S = .* < top_p 0.9"):
        check_top_p_mass(z, specs, only_max)


def _min_p_boundary() -> tuple[torch.Tensor, SamplingSpec]:
    """A row where comparing log-probs and comparing probabilities round differently at min_p.

    z = (0, fl32(log min_p) nudged by a few ulps, -3): the second token sits on the min_p boundary.
    Searched, not hard-coded: the first (min_p, nudge) whose two rules disagree.
    """
    for min_p in (0.1, 0.05, 0.2, 0.3, 0.5, 0.7):
        base = torch.tensor(math.log(min_p), dtype=torch.float32)
        for nudge in range(0, 41):
            for direction in (math.inf, -math.inf):
                z1 = base
                for _ in range(nudge):
                    z1 = torch.nextafter(z1, torch.tensor(direction))
                z = torch.stack([torch.tensor(0.0), z1, torch.tensor(-3.0)]).unsqueeze(0)
                spec = S(1.0, min_p=min_p)
                if not torch.equal(reference_filter(z, spec).kept, reference_filter(z, spec, faults=MIN_P_LOG).kept):
                    return z, spec
    raise AssertionError("no min_p boundary case where the log-space rule rounds differently")


def test_min_p_in_log_space_fails_at_the_boundary(sampler) -> None:
    """vLLM's MinPLogitsProcessor compares probabilities; the algebraically equal log rule does not match it."""
    z, spec = _min_p_boundary()
    out = sampler(z, [spec])
    check_kept_equal(reference_filter(z, spec), out)
    with pytest.raises(AssertionError, match=r"kept sets differ"):
        check_kept_equal(reference_filter(z, spec, faults=MIN_P_LOG), out)


def test_hypothesis_finds_a_case_that_exposes_dropped_ties(sampler) -> None:
    """Without hand-picking: the drawn cases expose the dropped-ties fault on their own."""

    def exposes(case) -> bool:
        out = _vllm(sampler, case)
        try:
            check_kept_equal(_ref(case, DROP_TIES), out)
        except AssertionError:
            return True
        return False

    # No shrinking: the first exposing case is enough, and shrinking would cost hundreds of Sampler calls.
    quick = settings(max_examples=300, database=None, deadline=None, phases=[Phase.generate])
    case = find(cases(max_rows=4), exposes, settings=quick)
    out = _vllm(sampler, case)
    check_kept_equal(_ref(case), out)  # the correct reference agrees


def _vllm(sampler, case):
    prompts, outputs = case.histories
    return sampler(case.logits, case.specs, seed=case.seed, prompt_ids=prompts, output_ids=outputs)


def _ref(case, faults=None):
    prompts, outputs = case.histories
    return reference_filter(case.logits, case.specs, faults=faults, prompt_ids=prompts, output_ids=outputs)


# A penalised row: token 0 (logit 2) was in the prompt, token 2 (logit 0.5) in the output twice.
PEN_Z = logits([2.0, 1.9, 0.5, -1.0, -3.0])
PEN_PROMPT, PEN_OUTPUT = [[0, 3]], [[2, 2]]


@pytest.mark.parametrize(
    ("spec", "fault"),
    [
        pytest.param(S(1.0, top_k=1, repetition_penalty=1.5), FilterFaults(penalty_ignores_prompt=True), id="rep ignores the prompt"),
        # The repetition factor commutes with 1/T (up to rounding): only the additive terms expose the order.
        pytest.param(S(0.5, top_p=0.99, repetition_penalty=1.3, frequency_penalty=0.5), FilterFaults(penalty_after_temperature=True), id="rep+freq after temperature"),
        pytest.param(S(0.5, presence_penalty=0.4, frequency_penalty=0.3), FilterFaults(penalty_after_temperature=True), id="additive after temperature"),
    ],
)
def test_penalty_faults_fail_kept_or_processed(sampler, spec: SamplingSpec, fault: FilterFaults) -> None:
    out = sampler(PEN_Z, [spec], prompt_ids=PEN_PROMPT, output_ids=PEN_OUTPUT)
    good = reference_filter(PEN_Z, spec, prompt_ids=PEN_PROMPT, output_ids=PEN_OUTPUT)
    check_kept_equal(good, out)
    check_processed_close(good, out)
    bad = reference_filter(PEN_Z, spec, faults=fault, prompt_ids=PEN_PROMPT, output_ids=PEN_OUTPUT)
    with pytest.raises(AssertionError, match=r"kept sets differ|processed log-probs differ"):
        check_kept_equal(bad, out)
        check_processed_close(bad, out)


def test_penalty_ignored_fails_processed(sampler) -> None:
    """A reference without the penalty step (the spec's penalty dropped) disagrees with vLLM's processed log-probs."""
    spec = S(1.0, repetition_penalty=1.2, presence_penalty=0.5)
    out = sampler(PEN_Z, [spec], prompt_ids=PEN_PROMPT, output_ids=PEN_OUTPUT)
    with pytest.raises(AssertionError, match=r"processed log-probs differ"):
        check_processed_close(reference_filter(PEN_Z, spec.without_penalties()), out)


def test_hypothesis_finds_a_case_that_exposes_a_prompt_blind_penalty(sampler) -> None:
    """The drawn penalties and histories expose a repetition penalty that ignores the prompt on their own."""
    fault = FilterFaults(penalty_ignores_prompt=True)

    def exposes(case) -> bool:
        out = _vllm(sampler, case)
        try:
            check_processed_close(_ref(case, fault), out)
        except AssertionError:
            return True
        return False

    quick = settings(max_examples=300, database=None, deadline=None, phases=[Phase.generate])
    case = find(cases(max_rows=4), exposes, settings=quick)
    check_processed_close(_ref(case), _vllm(sampler, case))  # the correct reference agrees
