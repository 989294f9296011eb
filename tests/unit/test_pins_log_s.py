"""Sampler-side log S pinned: the raw-logits formula by hand, the bracket's ends and when it applies."""

from __future__ import annotations

import math

import pytest
import torch

from parity.core.log_s import log_s_from_raw_logits, top_p_bracket, top_p_bracket_applies
from parity.core.spec import SamplingSpec as S

NEG = -math.inf
U = 2.0**-24


def test_raw_logits_log_s_by_hand() -> None:
    z = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, NEG]])
    ids = torch.tensor([[3, 2, -1], [0, -1, -1]])
    got = log_s_from_raw_logits(z, ids, S(0.5, top_k=2))
    assert got.dtype == torch.float64
    zs = [0.0, 2.0, 4.0, 6.0]
    lse = math.log(sum(math.exp(v) for v in zs))
    want0 = math.log(math.exp(6) + math.exp(4)) - lse
    want1 = 2.0 - (2.0 + math.log(3))
    assert got.tolist() == pytest.approx([want0, want1], abs=1e-12)


@pytest.mark.parametrize(
    ("raw", "ids"),
    [((4, 5), (4,)), ((5,), (5, 2)), ((4, 5), (3, 2)), ((2, 4, 5), (2, 3))],
)
def test_raw_logits_shapes_are_checked(raw: tuple, ids: tuple) -> None:
    with pytest.raises(ValueError) as info:
        log_s_from_raw_logits(torch.zeros(raw), torch.zeros(ids, dtype=torch.long), S(1.0, top_k=2))
    assert str(info.value) == f"raw_logits {raw} and kept_ids {ids}: allowed [N, V] and [N, K]"


@pytest.mark.parametrize(
    ("spec", "vocab", "applies"),
    [
        (S(1.0, top_p=0.9), 10, True),
        (S(1.0, top_p=0.9, top_k=10), 10, True),  # k >= V is off
        (S(1.0, top_p=0.9, top_k=11), 10, True),
        (S(1.0, top_p=0.9, top_k=-1), 10, True),
        (S(1.0, top_p=0.9, top_k=9), 10, False),
        (S(1.0, top_p=0.9, top_k=1), 10, False),
        (S(1.0, top_p=0.9, min_p=0.01), 10, False),
        (S(1.0, top_p=1.0), 10, False),
        (S(0.0, top_p=0.9), 10, False),
        (S(1.0, top_k=3), 10, False),
    ],
)
def test_bracket_applies_only_to_top_p_alone(spec: S, vocab: int, applies: bool) -> None:
    assert top_p_bracket_applies(spec, vocab) is applies


def test_bracket_ends_by_hand() -> None:
    lp = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)], [0.0, NEG, NEG]], dtype=torch.float32)
    lo, hi = top_p_bracket(lp, 0.8, 100)
    slack = 100 * U / 0.8
    assert lo.dtype == torch.float64 and hi.dtype == torch.float64
    assert lo.tolist() == pytest.approx([math.log(0.8) - slack] * 2, abs=1e-15)
    r = float(lp[0, 2].double().exp())
    assert float(hi[0]) == pytest.approx(math.log(0.8) - math.log1p(-r) + slack, abs=1e-12)
    assert float(hi[1]) == math.inf  # a single kept token: no upper end
    # A lone kept token whose float32 log-prob rounded just above 0 still has no upper end (not NaN).
    _, hi_one = top_p_bracket(torch.tensor([[1e-7, NEG]]), 0.8, 100)
    assert hi_one.tolist() == [math.inf]
    lo16, hi16 = top_p_bracket(lp, 0.8, 100, dtype="bfloat16")
    assert float(lo16[0]) == pytest.approx(math.log(0.8) - 100 * 2.0**-8 / 0.8, abs=1e-12)


def test_bracket_refuses_a_row_without_a_kept_token() -> None:
    with pytest.raises(ValueError) as info:
        top_p_bracket(torch.tensor([[0.0, NEG], [NEG, NEG]]), 0.9, 10)
    assert str(info.value) == "kept_logprobs has a row without any finite entry: allowed rows with at least one kept token"
