"""SamplingSpec: validation names the field, the value and the allowed range; effective() mirrors vLLM."""

from __future__ import annotations

import math

import pytest

from parity.core.spec import SamplingSpec

BAD = [
    ("temperature", -0.1, "[0, 2]"),
    ("temperature", 2.5, "[0, 2]"),  # vLLM's SamplingParams refuses T > 2
    ("temperature", math.nan, "[0, 2]"),
    ("temperature", math.inf, "[0, 2]"),
    ("temperature", True, "[0, 2]"),
    ("temperature", "1.0", "[0, 2]"),
    ("top_k", -2, "0 or -1 (off) or >= 1"),
    ("top_k", 1.5, "0 or -1 (off) or >= 1"),
    ("top_k", True, "0 or -1 (off) or >= 1"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", -0.2, "(0, 1]"),
    ("top_p", math.nan, "(0, 1]"),
    ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.1, "[0, 1]"),
    ("min_p", math.nan, "[0, 1]"),
]


@pytest.mark.parametrize(("field", "value", "allowed"), BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_bad_value_names_field_value_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingSpec(**{field: value})
    msg = str(info.value)
    assert f"SamplingSpec.{field}={value!r}" in msg
    assert allowed in msg


@pytest.mark.parametrize("temperature", [0, 0.0, 5e-6, 0.01, 1, 2, 2.0])
def test_temperature_bounds_accepted(temperature: float) -> None:
    assert SamplingSpec(temperature).temperature == float(temperature)


def test_ints_normalise_so_equal_specs_hash_equal() -> None:
    a, b = SamplingSpec(1, 5, 1, 0), SamplingSpec(1.0, 5, 1.0, 0.0)
    assert a == b and hash(a) == hash(b)


def test_greedy_drops_every_filter() -> None:
    eff = SamplingSpec(0.0, top_k=5, top_p=0.5, min_p=0.3).effective()
    assert eff == SamplingSpec(0.0) and eff.greedy and not eff.filtered


@pytest.mark.parametrize("temperature", [1e-7, 5e-6, 1e-5, 0.005])
def test_small_positive_temperature_is_raised_to_0_01_not_greedy(temperature: float) -> None:
    """vLLM's SamplingParams.__post_init__ raises (0, 0.01) to 0.01 *before* deciding greedy."""
    spec = SamplingSpec(temperature, top_k=3, top_p=0.9, min_p=0.1)
    assert not spec.greedy
    assert spec.effective_temperature == 0.01
    eff = spec.effective()
    assert (eff.temperature, eff.top_k, eff.top_p, eff.min_p) == (0.01, 3, 0.9, 0.1)
    assert spec.uses_top_k and spec.uses_top_p and spec.uses_min_p
    assert spec.sampling_params_kwargs()["temperature"] == 0.01


def test_top_k_minus_one_means_off() -> None:
    spec = SamplingSpec(1.0, top_k=-1)
    assert not spec.uses_top_k and spec.effective().top_k == 0
    assert spec.sampling_params_kwargs()["top_k"] == 0


@pytest.mark.parametrize(("top_k", "vocab", "expected"), [(0, 10, 10), (-1, 10, 10), (3, 10, 3), (10, 10, 10), (50, 10, 10)])
def test_top_k_for_vocab(top_k: int, vocab: int, expected: int) -> None:
    assert SamplingSpec(1.0, top_k=top_k).top_k_for_vocab(vocab) == expected


def test_uses_flags_and_label() -> None:
    spec = SamplingSpec(0.7, top_k=20, top_p=0.9, min_p=0.05)
    assert spec.filtered
    assert spec.label() == "T=0.7 top_k=20 top_p=0.9 min_p=0.05"
    assert SamplingSpec(1.0).label() == "T=1" and not SamplingSpec(1.0).filtered


def test_dict_round_trip_and_unknown_field() -> None:
    spec = SamplingSpec(0.7, top_k=20, top_p=0.9, min_p=0.05)
    assert SamplingSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['top_q'\].*allowed temperature, top_k, top_p, min_p"):
        SamplingSpec.from_dict({"temperature": 1.0, "top_q": 0.5})
