"""Sampler-side log S: from raw logits, and the nucleus bracket from processed log-probs alone."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.core.estimators import mask_to_ids, predicted_log_s
from parity.core.filters import reference_filter
from parity.core.log_s import log_s_from_raw_logits, top_p_bracket, top_p_bracket_applies
from parity.core.spec import SamplingSpec as S


def _kept_lp(z: torch.Tensor, spec: S) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference filters' S_q (padded ids), its processed log-probs, and the exact float64 log S."""
    res = reference_filter(z, spec)
    ids = mask_to_ids(res.kept)
    lp = res.logprobs.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -math.inf)
    zs = z.double() / spec.temperature
    exact = torch.logsumexp(zs.masked_fill(~res.kept, -math.inf), -1) - torch.logsumexp(zs, -1)
    return ids, lp, exact


def distance_outside(values: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """How far each value lies outside ``[lo, hi]`` (0 inside), in float64."""
    v = values.double()
    return (lo - v).clamp(min=0.0) + (v - hi).clamp(min=0.0)


def test_raw_logits_give_the_same_log_s_as_the_trainer_side_formula_on_the_same_logits() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(16, 300, generator=g) * 3
    spec = S(0.7, top_k=20, top_p=0.9)
    ids, _, exact = _kept_lp(z, spec)
    got = log_s_from_raw_logits(z, ids, spec)
    assert torch.allclose(got, exact, atol=1e-6, rtol=0)
    assert torch.allclose(got, predicted_log_s(z, reference_filter(z, spec).kept, spec).double(), atol=1e-5, rtol=0)
    # A different temperature moves it: the formula uses the spec's T.
    assert (log_s_from_raw_logits(z, ids, S(1.0, top_k=20, top_p=0.9)) - got).abs().max() > 1e-3


def test_raw_logits_shape_errors_name_both_shapes() -> None:
    with pytest.raises(ValueError, match=r"raw_logits \(3, 5\) and kept_ids \(2, 4\)"):
        log_s_from_raw_logits(torch.zeros(3, 5), torch.zeros(2, 4, dtype=torch.long), S(1.0, top_p=0.9))


def test_the_bracket_applies_to_top_p_alone() -> None:
    assert top_p_bracket_applies(S(1.0, top_p=0.9), 100)
    assert top_p_bracket_applies(S(0.7, top_p=0.9, top_k=100), 100)  # top_k >= V is off
    assert not top_p_bracket_applies(S(1.0, top_p=0.9, top_k=50), 100)
    assert not top_p_bracket_applies(S(1.0, top_p=0.9, min_p=0.05), 100)
    assert not top_p_bracket_applies(S(1.0), 100)
    assert not top_p_bracket_applies(S(0.0, top_p=0.9), 100)  # greedy ignores filters


@settings(max_examples=80, deadline=None)
@given(
    vocab=st.integers(2, 3000),
    top_p=st.floats(0.05, 0.99),
    temperature=st.floats(0.1, 2.0),
    scale=st.floats(0.1, 20.0),
    seed=st.integers(0, 2**16),
)
def test_true_log_s_lies_in_the_bracket(vocab: int, top_p: float, temperature: float, scale: float, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(6, vocab, generator=g) * scale
    spec = S(temperature, top_p=top_p)
    _, lp, exact = _kept_lp(z, spec)
    lo, hi = top_p_bracket(lp, top_p, vocab)
    assert bool((distance_outside(exact, lo, hi) == 0).all())


def test_a_log_s_that_is_not_the_samplers_falls_outside() -> None:
    """Planted faults: log S shifted by a few bracket widths, or the mass of another nucleus."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(64, 2000, generator=g) * 0.5  # flat: S sits right above top_p
    spec = S(1.0, top_p=0.8)
    _, lp, exact = _kept_lp(z, spec)
    lo, hi = top_p_bracket(lp, 0.8, 2000)
    width = float((hi - lo).min())
    assert bool((distance_outside(exact - 3 * width, lo, hi) > 0).all())  # below log p by more than the slack
    assert bool((distance_outside(exact, lo, hi) == 0).all())
    _, _, other = _kept_lp(z, S(1.0, top_p=0.6))  # the mass another nucleus keeps
    assert bool((distance_outside(other, lo, hi) > 0).all())


def test_single_token_rows_have_no_upper_end_and_empty_rows_are_refused() -> None:
    lo, hi = top_p_bracket(torch.tensor([[0.0, -math.inf]]), 0.5, 2)
    assert math.isinf(float(hi[0])) and float(lo[0]) < math.log(0.5)
    with pytest.raises(ValueError, match="without any finite entry"):
        top_p_bracket(torch.tensor([[-math.inf, -math.inf]]), 0.5, 2)
