"""Comparison metrics on hand-computable inputs."""

from __future__ import annotations

import math

import pytest
import torch

from parity.core.metrics import kl_tv_over_support, support_equal

INF = math.inf


def test_support_equal_per_row() -> None:
    a = torch.tensor([[True, False], [True, True]])
    b = torch.tensor([[True, False], [True, False]])
    assert support_equal(a, b).tolist() == [True, False]
    with pytest.raises(ValueError, match="differ in shape"):
        support_equal(a, b[:1])


def test_kl_tv_on_two_point_distributions() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    logq = torch.log(torch.tensor([[0.25, 0.75]], dtype=torch.float64))
    kl, tv = kl_tv_over_support(logp, logq)
    assert float(kl[0]) == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75))
    assert float(tv[0]) == pytest.approx(0.25)
    kl0, tv0 = kl_tv_over_support(logp, logp)
    assert float(kl0[0]) == 0.0 and float(tv0[0]) == 0.0


def test_kl_is_infinite_when_q_misses_mass_of_p() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.5, 0.0]]))
    logq = torch.tensor([[0.0, -INF, -INF]])
    kl, tv = kl_tv_over_support(logp, logq)
    assert float(kl[0]) == INF and float(tv[0]) == pytest.approx(0.5)
