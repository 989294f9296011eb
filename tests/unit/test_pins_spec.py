"""SamplingSpec pinned exactly: every message, every boundary, the normalised types, the vLLM kwargs."""

from __future__ import annotations

import pytest

from parity.core.spec import SamplingSpec, per_row


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", 2.5, "SamplingSpec.temperature=2.5 is invalid: allowed a finite number in [0, 2] (0 means greedy)"),
        ("top_k", -3, "SamplingSpec.top_k=-3 is invalid: allowed an integer: 0 or -1 (off) or >= 1"),
        ("top_p", 0.0, "SamplingSpec.top_p=0.0 is invalid: allowed a number in (0, 1]"),
        ("min_p", 1.5, "SamplingSpec.min_p=1.5 is invalid: allowed a number in [0, 1]"),
    ],
)
def test_each_message_in_full(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingSpec(**{field: value})
    assert str(info.value) == message


@pytest.mark.parametrize("field", ["top_p", "min_p"])
@pytest.mark.parametrize("value", [True, "0.5", None])
def test_bools_and_non_numbers_are_refused_for_the_fractions(field: str, value: object) -> None:
    """True is an int in Python (and 1 is in range), so only the explicit bool check refuses it."""
    with pytest.raises(ValueError, match=rf"SamplingSpec\.{field}="):
        SamplingSpec(**{field: value})


@pytest.mark.parametrize(("field", "value"), [("top_p", 1), ("min_p", 0), ("min_p", 1), ("temperature", 1), ("temperature", 0)])
def test_integer_fractions_at_the_edges_are_accepted_and_become_floats(field: str, value: int) -> None:
    spec = SamplingSpec(**{field: value})
    assert type(getattr(spec, field)) is float and getattr(spec, field) == value
    assert spec.to_dict()[field] == value and type(spec.to_dict()[field]) is float


def test_every_numeric_field_is_stored_as_float() -> None:
    spec = SamplingSpec(1, top_k=3, top_p=1, min_p=0)
    assert [type(v) for v in (spec.temperature, spec.top_p, spec.min_p)] == [float, float, float]
    assert type(spec.top_k) is int
    assert repr(spec) == (
        "SamplingSpec(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)"
    )


def test_greedy_effective_is_the_all_default_spec() -> None:
    eff = SamplingSpec(0, top_k=7, top_p=0.3, min_p=0.2).effective()
    assert (eff.temperature, eff.top_k, eff.top_p, eff.min_p) == (0.0, 0, 1.0, 0.0)


def test_effective_returns_itself_when_nothing_changes() -> None:
    spec = SamplingSpec(0.7, top_k=5, top_p=0.9, min_p=0.1)
    assert spec.effective() is spec
    off = SamplingSpec(0.7, top_k=-1, top_p=0.9)
    assert off.effective() == SamplingSpec(0.7, top_k=0, top_p=0.9) and off.effective() is not off


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (SamplingSpec(0.5, top_k=1, top_p=0.8, min_p=0.05), {"temperature": 0.5, "top_k": 1, "top_p": 0.8, "min_p": 0.05}),
        (SamplingSpec(1.0, top_k=40), {"temperature": 1.0, "top_k": 40, "top_p": 1.0, "min_p": 0.0}),
        (SamplingSpec(1.0, top_k=-1), {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
        (SamplingSpec(0.0), {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}),
    ],
)
def test_sampling_params_kwargs_exactly(spec: SamplingSpec, expected: dict) -> None:
    neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    assert spec.sampling_params_kwargs() == {**expected, **neutral}


@pytest.mark.parametrize(
    ("spec", "uses"),
    [
        (SamplingSpec(1.0, top_k=1), (True, False, False)),
        (SamplingSpec(1.0, top_p=0.999), (False, True, False)),
        (SamplingSpec(1.0, min_p=1e-9), (False, False, True)),
        (SamplingSpec(0.0, top_k=1, top_p=0.5, min_p=0.5), (False, False, False)),
        (SamplingSpec(0.01, top_k=1, top_p=0.5, min_p=0.5), (True, True, True)),
    ],
)
def test_uses_flags_at_their_edges(spec: SamplingSpec, uses: tuple[bool, bool, bool]) -> None:
    assert (spec.uses_top_k, spec.uses_top_p, spec.uses_min_p) == uses
    assert spec.filtered == any(uses)


@pytest.mark.parametrize(("temperature", "greedy"), [(0.0, True), (1e-12, False), (0.01, False)])
def test_greedy_only_at_zero(temperature: float, greedy: bool) -> None:
    assert SamplingSpec(temperature).greedy is greedy


def test_label_lists_only_active_filters() -> None:
    assert SamplingSpec(0.5, top_k=3).label() == "T=0.5 top_k=3"
    assert SamplingSpec(0.5, top_p=0.25).label() == "T=0.5 top_p=0.25"
    assert SamplingSpec(0.5, min_p=0.125).label() == "T=0.5 min_p=0.125"
    assert SamplingSpec(0.0, top_k=3, top_p=0.5).label() == "T=0"


def test_per_row() -> None:
    spec = SamplingSpec(0.0, top_k=3)
    rows = per_row(spec, 3)
    assert rows == [SamplingSpec(0.0)] * 3
    mixed = per_row([SamplingSpec(0.5, top_k=-1), SamplingSpec(1.0)], 2)
    assert mixed == [SamplingSpec(0.5), SamplingSpec(1.0)]
    with pytest.raises(ValueError) as info:
        per_row([SamplingSpec()], 2)
    assert str(info.value) == "specs has 1 entries for 2 logit rows: allowed one spec or one per row"
