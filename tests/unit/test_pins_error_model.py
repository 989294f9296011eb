"""The error model pinned: each term of the bound by hand, the roundoff rules, headroom and the mean limit."""

from __future__ import annotations

import math

import pytest
import torch

from parity.core.error_model import (
    KERNEL_SIDES,
    LOGIT_ULPS,
    MEAN_BIAS_Z,
    UNIT_ROUNDOFF,
    headroom,
    log_s_signature,
    logprob_bound,
    logprob_bound_terms,
    mean_bias_entry,
    mean_bias_limit,
    normalisation_errors,
    unit_roundoff,
)

U = 2.0**-24
INF = math.inf


def test_roundoff_table_and_constant() -> None:
    assert UNIT_ROUNDOFF == {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
    assert LOGIT_ULPS == 8.0


def test_roundoff_of_names_dtypes_and_mixtures() -> None:
    assert unit_roundoff("float64") == 2.0**-53 and unit_roundoff(torch.float64) == 2.0**-53
    assert unit_roundoff("torch.bfloat16") == 2.0**-8
    assert unit_roundoff(("float64", torch.float32)) == U
    assert unit_roundoff(iter(["float16", "float32"])) == 2.0**-11
    with pytest.raises(ValueError) as info:
        unit_roundoff(["float32", "int4"])
    assert str(info.value) == "dtype='int4' has no unit roundoff: allowed ['bfloat16', 'float16', 'float32', 'float64']"
    with pytest.raises(ValueError) as info:
        unit_roundoff(torch.int8)
    assert str(info.value).startswith("dtype=torch.int8 has no unit roundoff")
    with pytest.raises(ValueError) as info:
        unit_roundoff(())
    assert str(info.value) == "dtypes is empty: name at least one dtype"


def test_bound_terms_by_hand() -> None:
    t = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    got = logprob_bound_terms(t(10.0, -4.0, INF), t(2.0, -3.0, 1.0), t(-1.0, -0.5, -INF), t(8, 1, 0), U)
    assert got.dtype == torch.float64
    want = [
        4 * 8 * U * 10 + 2 * U * (2 + 1 + 3 + 2),
        4 * 8 * U * 4 + 2 * U * (3 + 0.5 + 0 + 2),
        0 + 2 * U * (1 + 0 + 0 + 2),  # non-finite magnitudes count 0, |S| = 0 counts as 1
    ]
    assert got.tolist() == pytest.approx(want, rel=1e-12)


def test_bound_from_logits_by_hand() -> None:
    z = torch.tensor([[1.0, -3.0, 0.0, -INF], [2.0, 2.0, 2.0, 2.0]])
    y = torch.tensor([0, 3])
    lse0 = math.log(math.e + math.exp(-3) + 1)
    lse1 = 2 + math.log(4)
    want = [
        4 * 8 * U * 3 + 2 * U * (lse0 + abs(1 - lse0) + math.log2(3) + 2),
        4 * 8 * U * 2 + 2 * U * (lse1 + abs(2 - lse1) + 2 + 2),
    ]
    # Each bound also carries the float32 normalisation's bound in every order, once per side.
    want = [w + KERNEL_SIDES * float(o) for w, o in zip(want, normalisation_errors(z)["bound"], strict=True)]
    assert logprob_bound(z, y).tolist() == pytest.approx(want, rel=1e-9)
    support = torch.tensor([[True, False, True, True], [False, False, True, True]])
    lse0s = math.log(math.e + 1)
    lse1s = 2 + math.log(2)
    want_s = [
        4 * 8 * U * 3 + 2 * U * (lse0s + abs(1 - lse0s) + 1 + 2),
        4 * 8 * U * 2 + 2 * U * (lse1s + abs(2 - lse1s) + 1 + 2),
    ]
    off = [KERNEL_SIDES * float(o) for o in normalisation_errors(z, support)["bound"]]
    assert logprob_bound(z, y, support).tolist() == pytest.approx([w + o for w, o in zip(want_s, off, strict=True)], rel=1e-9)
    b16 = logprob_bound(z, y, support, dtype=("float32", "bfloat16"))
    assert b16.tolist() == pytest.approx([w * 2.0**16 + o for w, o in zip(want_s, off, strict=True)], rel=1e-9)


def test_bound_shape_message() -> None:
    with pytest.raises(ValueError) as info:
        logprob_bound(torch.zeros(3), torch.tensor([0]))
    assert str(info.value) == "scaled_logits has shape (3,): allowed [N, V]"


def test_headroom() -> None:
    assert headroom(torch.zeros(0), torch.zeros(0)) == 0.0
    d = torch.tensor([1e-6, -4e-6, 0.0])
    b = torch.tensor([1e-6, 2e-6, 0.0])
    assert headroom(d, b) == pytest.approx(2.0)
    assert headroom(torch.tensor([math.nan]), torch.tensor([1.0])) == INF
    assert headroom(torch.tensor([1e-300], dtype=torch.float64), torch.tensor([0.0])) == pytest.approx(1e-300 / torch.finfo(torch.float64).tiny)
    assert isinstance(headroom(d, b), float)


def test_mean_bias_limit_by_hand() -> None:
    assert MEAN_BIAS_Z == 4.0
    assert mean_bias_limit(16, 1e-6, 2e-6) == pytest.approx(1e-6 + 4.0 * 2e-6 / 4.0, rel=1e-15)
    assert mean_bias_limit(1, 1e-6, 5.0) == 1e-6  # one token: no spread to measure
    assert mean_bias_limit(0, 1e-6, 2e-6) == INF
    e = mean_bias_entry(16, -3e-6, 1e-6, 2e-6)
    assert e["limit"] == mean_bias_limit(16, 1e-6, 2e-6)
    assert e["systematic"] == 1e-6 and e["statistical"] == pytest.approx(2e-6) and e["mean"] == -3e-6
    assert log_s_signature(4, -0.2, 0.4, 0.01) == {"slope": -0.5, "slope_se": 0.01 / math.sqrt(0.4)}
    assert log_s_signature(4, 0.0, 0.0, 0.01) is None
