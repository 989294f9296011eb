"""Metrics pinned exactly: the comparison rule, support equality, KL/TV."""

from __future__ import annotations

import math

import pytest
import torch

from parity.core.metrics import (
    abs_difference,
    difference,
    max_abs_difference,
    support_equal,
)

INF, NAN = math.inf, math.nan


def test_difference_rule_and_dtype() -> None:
    a = torch.tensor([2.0, INF, -INF, NAN, 1.0], dtype=torch.float32)
    b = torch.tensor([0.5, -INF, 1.0, 0.0, NAN], dtype=torch.float32)
    d = difference(a, b)
    assert d.dtype == torch.float64 and d.tolist() == [1.5, INF, -INF, INF, INF]
    assert abs_difference(a, b).tolist() == [1.5, INF, INF, INF, INF]
    assert max_abs_difference(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 1.0])) == 3.0
    assert isinstance(max_abs_difference(torch.zeros(1), torch.zeros(1)), float)


def test_support_equal_message() -> None:
    with pytest.raises(ValueError) as info:
        support_equal(torch.zeros(1, 2, dtype=torch.bool), torch.zeros(1, 3, dtype=torch.bool))
    assert str(info.value) == "kept masks differ in shape: (1, 2) vs (1, 3)"
    a = torch.tensor([[True, False, True]])
    assert support_equal(a, a).tolist() == [True]
    assert support_equal(a, torch.tensor([[True, False, False]])).tolist() == [False]


