"""The reference penalties (parity.core.penalties) on hand-computed rows, and the spec fields that carry them."""

from __future__ import annotations

import pytest
import torch

from parity.core.estimators import penalty_term
from parity.core.filters import reference_filter
from parity.core.matrix import load_matrix
from parity.core.penalties import penalise, penalise_sequence
from parity.core.spec import SamplingSpec
from parity.errors import UsageError

S = SamplingSpec


def test_each_rule_on_a_hand_computed_row() -> None:
    # token 0: prompt, positive -> 2 / 2; token 1: output twice, negative -> -1 * 2 - 0.1 * 2 - 0.2;
    # token 2: output once, positive -> 0.5 / 2 - 0.1 - 0.2; token 3: unseen -> unchanged.
    z = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    spec = S(1.0, repetition_penalty=2.0, frequency_penalty=0.1, presence_penalty=0.2)
    got = penalise(z, spec, [[0]], [[1, 1, 2]])
    want = torch.tensor([[1.0, -2.4, -0.05, 3.0]])
    assert torch.allclose(got, want, atol=1e-6), got


def test_positive_logits_multiply_by_the_float32_reciprocal() -> None:
    """vLLM multiplies by 1/r computed in float32; dividing by r rounds differently on some values."""
    z = torch.linspace(0.1, 50.0, 4001).unsqueeze(0)
    spec = S(1.0, repetition_penalty=1.1)
    got = penalise(z, spec, [list(range(4001))], [[]])
    recip = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(1.1, dtype=torch.float32)
    assert torch.equal(got, z * recip)
    assert not torch.equal(got, z / torch.tensor(1.1, dtype=torch.float32))  # the two roundings do differ here


def test_unpenalised_rows_are_bitwise_unchanged_and_minus_inf_stays() -> None:
    z = torch.tensor([[1.5, float("-inf"), -0.3], [1.5, float("-inf"), -0.3]])
    got = penalise(z, [S(1.0), S(1.0, repetition_penalty=1.3, frequency_penalty=-0.5)], [[0, 1], [0, 1]], [[2], [1, 2]])
    assert torch.equal(got[0], z[0])
    assert got[1, 1] == float("-inf")
    assert float(got[1, 2]) == pytest.approx(-0.3 * 1.3 + 0.5, abs=1e-6)


def test_sequence_penalty_reads_only_earlier_tokens() -> None:
    z = torch.zeros(3, 4) + torch.tensor([1.0, 1.0, 1.0, 1.0])
    out = penalise_sequence(z, S(1.0, presence_penalty=1.0), prompt_ids=[3], completion_ids=[0, 1, 0])
    # position 0 saw no output; position 1 saw token 0; position 2 saw tokens 0 and 1 (presence: once each)
    assert out.tolist() == [[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]]


def test_reference_filter_penalises_before_temperature_and_filters() -> None:
    z = torch.tensor([[2.0, 1.9, 0.0]])
    spec = S(0.5, top_k=1, repetition_penalty=1.5)
    res = reference_filter(z, spec, prompt_ids=[[0]], output_ids=[[]])
    assert res.kept.tolist() == [[False, True, False]]  # token 0's 2.0 became 1.333 before top_k
    with pytest.raises(UsageError, match="prompt_ids/output_ids"):
        reference_filter(z, spec)


def test_greedy_keeps_its_penalties() -> None:
    spec = S(0.0, top_k=5, repetition_penalty=1.2, presence_penalty=0.5).effective()
    assert spec.greedy and spec.top_k == 0 and spec.repetition_penalty == 1.2 and spec.presence_penalty == 0.5
    z = torch.tensor([[2.0, 1.9, 0.0]])
    res = reference_filter(z, spec, prompt_ids=[[0]], output_ids=[[]])
    assert int(res.logprobs.argmax()) == 1  # the argmax moved: greedy rows are penalised too


def test_penalty_term_is_the_gap_of_full_vocabulary_log_probs() -> None:
    z = torch.tensor([[2.0, 1.0, 0.0]])
    spec = S(1.0, repetition_penalty=2.0)
    pen = penalise(z, spec, [[0]], [[]])
    y = torch.tensor([1])
    term = float(penalty_term(z, pen, y, spec)[0])
    want = float(torch.log_softmax(pen, -1)[0, 1] - torch.log_softmax(z, -1)[0, 1])
    assert term == pytest.approx(want, abs=1e-6) and term > 0


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", float("inf"), "> 0"),
        ("repetition_penalty", True, "> 0"),
        ("presence_penalty", 2.5, r"\[-2, 2\]"),
        ("frequency_penalty", -2.01, r"\[-2, 2\]"),
        ("frequency_penalty", "0.1", r"\[-2, 2\]"),
    ],
)
def test_bad_penalties_name_field_value_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(UsageError, match=rf"SamplingSpec\.{field}={value!r}.*allowed.*{allowed}"):
        S(1.0, **{field: value})


def test_spec_round_trips_and_labels_penalties() -> None:
    spec = S(0.7, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.2, frequency_penalty=-0.3)
    assert S.from_dict(spec.to_dict()) == spec
    assert spec.label() == "T=0.7 top_p=0.9 rep=1.1 presence=0.2 freq=-0.3"
    kw = spec.sampling_params_kwargs()
    assert (kw["repetition_penalty"], kw["presence_penalty"], kw["frequency_penalty"]) == (1.1, 0.2, -0.3)
    assert S.from_dict({"temperature": 1.0}) == S(1.0)  # records without penalty columns stay readable


def test_matrix_accepts_penalties(tmp_path) -> None:
    f = tmp_path / "m.toml"
    f.write_text('[[scenario]]\nname = "rep"\nrepetition_penalty = 1.3\ntop_p = 0.9\n'
                 '[[scenario]]\nname = "bad"\nfrequency_penalty = 3.0\n')
    with pytest.raises(UsageError, match=r"frequency_penalty=3\.0"):
        load_matrix(f)
    f.write_text('[[scenario]]\nname = "rep"\nrepetition_penalty = 1.3\ntop_p = 0.9\n')
    [sc] = load_matrix(f).scenarios
    assert sc.spec == S(1.0, top_p=0.9, repetition_penalty=1.3)
