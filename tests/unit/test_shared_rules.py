"""The rules several layers share, checked where they live: the comparison rule and the underflow band."""

from __future__ import annotations

import math

import torch

from parity.core.metrics import abs_difference, difference, max_abs_difference
from parity.core.tolerances import LOG_ZERO_PROB, UNDERFLOW_BAND, underflow_decision

INF, NAN = math.inf, math.nan


def test_the_comparison_rule_for_infinities_and_nan() -> None:
    a = torch.tensor([1.0, -INF, INF, -INF, NAN, NAN, 2.0])
    b = torch.tensor([1.0, -INF, INF, 0.0, NAN, 3.0, NAN])
    d = difference(a, b)
    assert d.tolist() == [0.0, 0.0, 0.0, -INF, INF, INF, INF]
    assert abs_difference(a, b).tolist() == [0.0, 0.0, 0.0, INF, INF, INF, INF]
    assert max_abs_difference(a[:3], b[:3]) == 0.0 and max_abs_difference(a[:0], b[:0]) == 0.0
    assert max_abs_difference(a[4:5], b[4:5]) == INF, "NaN against NaN is never agreement"


def test_underflow_band_brackets_float32_softmax_zeros() -> None:
    """Outside the band, 'dropped' is exactly whether vLLM's float32 softmax gives probability 0.

    Rows hold a dominant logit, ``n`` tokens at one level (they set log S) and one probe token swept
    across the band; float32 ``softmax`` is what the sort path's ``cumsum <= 0`` reads.
    """
    lo, hi = UNDERFLOW_BAND
    checked = ambiguous = 0
    for n in (0, 10, 1000, 30_000):
        for gap in torch.arange(-140.0, -60.0, 0.5).tolist():
            z = torch.cat([torch.zeros(1), torch.full((n,), -1.0), torch.tensor([gap])])
            zero32 = bool(torch.softmax(z.unsqueeze(0), dim=-1)[0, -1] == 0)
            log_q = torch.log_softmax(z.double(), dim=-1)[-1:]
            dropped, near = underflow_decision(log_q)
            if bool(near):
                ambiguous += 1
                continue
            checked += 1
            assert bool(dropped) == zero32, f"n={n}, x-m={gap}: log q {float(log_q):.2f} outside [{lo}, {hi}]"
    assert checked > 300 and ambiguous > 50
    assert lo < LOG_ZERO_PROB < hi
