"""Comparison metrics on hand-computable inputs."""

from __future__ import annotations

import pytest
import torch

from parity.core.metrics import support_equal


def test_support_equal_per_row() -> None:
    a = torch.tensor([[True, False], [True, True]])
    b = torch.tensor([[True, False], [True, False]])
    assert support_equal(a, b).tolist() == [True, False]
    with pytest.raises(ValueError, match="differ in shape"):
        support_equal(a, b[:1])
