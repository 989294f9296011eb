"""Trainer-side estimators on hand-computable rows (expected values from the definitions)."""

from __future__ import annotations

import math

import pytest
import torch

from parity.core.estimators import full, ids_to_mask, mask_to_ids, predicted_log_s, recompute, replay, scale
from parity.core.spec import SamplingSpec

S = SamplingSpec
P = (0.5, 0.3, 0.2)
Z = torch.log(torch.tensor([P], dtype=torch.float32))


def test_full_is_the_whole_vocabulary_log_softmax() -> None:
    assert float(full(Z, torch.tensor([1]), S(1.0, top_k=1))) == pytest.approx(math.log(0.3), abs=1e-6)
    # At T = 0.5 the probabilities go as p^2.
    w = [p * p for p in P]
    assert float(full(Z, torch.tensor([2]), S(0.5))) == pytest.approx(math.log(w[2] / sum(w)), abs=1e-6)


def test_replay_renormalises_over_the_kept_set_mask_or_ids() -> None:
    kept = torch.tensor([[True, True, False]])
    for form in (kept, mask_to_ids(kept)):
        res = replay(Z, torch.tensor([0]), form, S(1.0))
        assert float(res.logprobs[0]) == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)
        assert int(res.outside.sum()) == 0


def test_replay_flags_a_sampled_token_outside_the_kept_set() -> None:
    res = replay(Z, torch.tensor([2]), torch.tensor([[True, True, False]]), S(1.0))
    assert res.outside.tolist() == [True]


def test_log_s_is_the_gap_between_full_and_replay() -> None:
    kept = torch.tensor([[True, True, False]])
    log_s = predicted_log_s(Z, kept, S(1.0))
    assert float(log_s[0]) == pytest.approx(math.log(0.8), abs=1e-6)
    y = torch.tensor([1])
    gap = full(Z, y, S(1.0)) - replay(Z, y, kept, S(1.0)).logprobs
    assert float(gap[0]) == pytest.approx(float(log_s[0]), abs=1e-6)


def test_recompute_force_includes_the_sampled_token() -> None:
    """top_k 1 keeps token 0; the sampler drew token 1: forced in, scored over {0, 1}."""
    res = recompute(Z, torch.tensor([1]), S(1.0, top_k=1))
    assert res.forced.tolist() == [True] and int(res.forced.sum()) == 1
    assert float(res.logprobs[0]) == pytest.approx(math.log(0.3 / 0.8), abs=1e-6)
    naive = recompute(Z, torch.tensor([1]), S(1.0, top_k=1), force_include=False)
    assert naive.logprobs.tolist() == [float("-inf")]


def test_recompute_inside_the_support_needs_no_force() -> None:
    res = recompute(Z, torch.tensor([0]), S(1.0, top_p=0.6))  # keeps {0, 1}
    assert int(res.forced.sum()) == 0
    assert float(res.logprobs[0]) == pytest.approx(math.log(0.5 / 0.8), abs=1e-6)


def test_small_temperature_keeps_float32_precision() -> None:
    """z' = z / 0.01 ~ 2000, where a float32 ulp is 1.2e-4: the estimators must still agree with a
    float64 log-softmax of the same float32 z' to ~1e-6 (subtracting two rounded logsumexps did not)."""
    g = torch.Generator().manual_seed(0)
    z = 20 + 0.02 * torch.randn(4, 300, generator=g)
    spec = S(0.01)
    zs = scale(z, spec)
    exact = torch.log_softmax(zs.double(), dim=-1)
    kept = torch.ones_like(z, dtype=torch.bool)
    kept[:, 150:] = False
    y = torch.tensor([3, 10, 77, 149])
    want = exact.gather(1, y.unsqueeze(1)).squeeze(1) - torch.logsumexp(exact[:, :150], dim=-1)
    got = replay(z, y, kept, spec).logprobs.double()
    assert (got - want).abs().max() < 2e-6
    log_s = predicted_log_s(z, kept, spec).double()
    assert (log_s - torch.logsumexp(exact[:, :150], dim=-1)).abs().max() < 2e-6


def test_mask_ids_round_trip_and_bad_ids() -> None:
    kept = torch.tensor([[True, False, True, False], [False, False, False, True]])
    ids = mask_to_ids(kept)
    assert ids.tolist() == [[0, 2], [3, -1]]
    assert torch.equal(ids_to_mask(ids, 4), kept)
    with pytest.raises(ValueError, match=r"kept ids must lie in \[0, 4\): got 4"):
        ids_to_mask(torch.tensor([[4]]), 4)


def test_sampled_ids_are_validated() -> None:
    with pytest.raises(ValueError, match=r"sampled ids must lie in \[0, 3\)"):
        full(Z, torch.tensor([3]), S(1.0))
    with pytest.raises(ValueError, match=r"sampled has shape \(2,\): allowed a 1-D tensor of 1 token ids"):
        full(Z, torch.tensor([0, 1]), S(1.0))
