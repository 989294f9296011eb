"""Capture pinned exactly: the plan and its reason at every boundary, the heads → S_q rules, the messages."""

from __future__ import annotations

import pytest
import torch

from parity.core.capture import (
    FULL_VOCAB,
    CapturePlan,
    compare_supports,
    padded_ids,
    plan_capture,
    support_from_heads,
    support_mass,
    validate_native_mask,
)
from parity.core.spec import SamplingSpec

NEG = float("-inf")


@pytest.mark.parametrize(
    ("spec", "vocab", "kwargs", "plan"),
    [
        (SamplingSpec(), 100, {}, (None, "no filter: the support is the whole vocabulary")),
        (SamplingSpec(top_k=100), 100, {}, (FULL_VOCAB, "top_k=100 >= V=100: full vocabulary")),
        (SamplingSpec(top_k=10), 100, {}, (26, "top_k=10 + 16 to catch ties at the k-th value")),
        (SamplingSpec(top_k=10), 100, {"tie_margin": 3}, (13, "top_k=10 + 3 to catch ties at the k-th value")),
        (SamplingSpec(top_k=84), 100, {}, (FULL_VOCAB, "top_k=84 + tie margin covers the vocabulary")),
        (SamplingSpec(top_k=83), 100, {}, (99, "top_k=83 + 16 to catch ties at the k-th value")),
        (SamplingSpec(top_k=99), 100, {}, (FULL_VOCAB, "top_k=99 + tie margin covers the vocabulary")),
        (SamplingSpec(min_p=0.1), 4096, {}, (64, "top_p/min_p without top_k: adaptive, top-64 first, sequences with an "
                                                "unproven position asked again with x4 the head and the same seed, up to "
                                                "the vocabulary (V=4096)", FULL_VOCAB)),
        (SamplingSpec(top_p=0.5), 50, {"max_head": 50}, (FULL_VOCAB, "top_p/min_p without top_k: full vocabulary (V=50)",
                                                         FULL_VOCAB)),
        (SamplingSpec(top_p=0.9), 5000, {}, (4096, "top_p/min_p without top_k: adaptive, top-4096 first, which is the cap "
                                             "max_head=4096: positions it does not prove are flagged", 4096)),
        (SamplingSpec(0.5, top_p=0.9), 5000, {"start": 100, "max_head": 300},
         (100, "top_p/min_p without top_k: adaptive, top-100 first, sequences with an unproven position asked again "
               "with x4 the head and the same seed, up to max_head=300", 300)),
        (SamplingSpec(0.5, top_p=0.9), 5000, {"start": 1000, "max_head": 300},
         (300, "top_p/min_p without top_k: adaptive, top-300 first, which is the cap max_head=300: positions it does "
               "not prove are flagged", 300)),
        (SamplingSpec(0.5, top_p=0.9), 5000, {"start": 1}, (2, "top_p/min_p without top_k: adaptive, top-2 first, "
                                                           "sequences with an unproven position asked again with x4 the "
                                                           "head and the same seed, up to max_head=4096", 4096)),
        (SamplingSpec(top_k=10), 100, {"head": 10}, (10, "top-10 (forced)")),
        (SamplingSpec(top_k=10), 100, {"head": 99}, (99, "top-99 (forced)")),
        (SamplingSpec(top_k=10), 100, {"head": 100}, (FULL_VOCAB, "full vocabulary (forced)")),
        (SamplingSpec(top_k=10), 100, {"head": FULL_VOCAB}, (FULL_VOCAB, "full vocabulary (forced)")),
        (SamplingSpec(top_p=0.9), 100, {"head": 1}, (1, "top-1 (forced)")),
        (SamplingSpec(top_k=200, top_p=0.9), 100, {"head": 5}, (5, "top-5 (forced)")),  # k >= V: no k to respect
    ],
)
def test_plan_and_reason(spec: SamplingSpec, vocab: int, kwargs: dict, plan: tuple) -> None:
    assert plan_capture(spec, vocab, **kwargs) == CapturePlan(*plan)


def test_plan_reads_the_effective_spec() -> None:
    assert plan_capture(SamplingSpec(0.0, top_k=5, top_p=0.5), 100).logprobs is None
    assert plan_capture(SamplingSpec(1.0, top_k=-1, top_p=0.5), 100).logprobs == FULL_VOCAB


def test_plan_messages_in_full() -> None:
    with pytest.raises(ValueError) as info:
        plan_capture(SamplingSpec(top_k=10), 100, head=0)
    assert str(info.value) == "capture head=0 is invalid: allowed -1 (full vocabulary) or >= 1"
    with pytest.raises(ValueError) as info:
        plan_capture(SamplingSpec(top_k=10), 100, head=-2)
    assert str(info.value) == "capture head=-2 is invalid: allowed -1 (full vocabulary) or >= 1"
    with pytest.raises(ValueError) as info:
        plan_capture(SamplingSpec(top_k=10), 100, head=9, tie_margin=4)
    assert str(info.value) == (
        "capture head=9 is smaller than top_k=10: allowed head >= top_k (a head of top_k + 4 also captures ties at the k-th value)"
    )
    with pytest.raises(ValueError) as info:
        plan_capture(SamplingSpec(0.5, top_k=5000), 49152)
    assert str(info.value) == (
        "spec T=0.5 top_k=5000 needs a capture head of 5016 (top_k=5000 + 16 for ties), above the cap max_head=4096: "
        "raise --max-capture-head to 5016 or more, or lower top_k"
    )
    with pytest.raises(ValueError) as info:
        plan_capture(SamplingSpec(0.5, top_k=5000), 5010)
    assert str(info.value) == (
        "spec T=0.5 top_k=5000 needs a capture head of 5010 (top_k=5000 + 16 for ties, the whole vocabulary), above "
        "the cap max_head=4096: raise --max-capture-head to 5010 or more, or lower top_k"
    )
    with pytest.raises(ValueError) as info:
        plan_capture(SamplingSpec(1.0, top_k=60000), 49152)
    assert str(info.value) == (
        "spec T=1 top_k=60000 keeps the whole vocabulary (top_k=60000 >= V=49152): its support is every token, and "
        "capturing it needs logprobs=-1, above the cap max_head=4096: drop top_k (the spec is then unfiltered) or "
        "raise --max-capture-head to 49152"
    )
    for bad in (1, 0, -1, True, 2.5):
        with pytest.raises(ValueError) as info:
            plan_capture(SamplingSpec(top_p=0.9), 100, max_head=bad)
        assert str(info.value) == (
            f"max capture head={bad!r} is invalid: allowed an integer >= 2 (a head proves itself complete only by "
            f"ending in a dropped token, so it needs room for one)"
        )
    assert plan_capture(SamplingSpec(top_k=10), 100, max_head=26).logprobs == 26  # the cap itself is allowed
    assert plan_capture(SamplingSpec(top_k=10), 100, head=99, max_head=2).logprobs == 99  # a forced head is not capped


@pytest.mark.parametrize(("logprobs", "captures"), [(None, False), (0, False), (FULL_VOCAB, True), (1, True), (40, True)])
def test_captures_support(logprobs: int | None, captures: bool) -> None:
    assert CapturePlan(logprobs, "").captures_support is captures


def test_heads_to_support_types_values_and_flags() -> None:
    cap = support_from_heads(
        [4, 2, 9, 0],
        [[4, 1], [3, 5], [9, 8], [7, 6]],
        [[-0.25, -1.5], [-0.125, NEG], [-0.5, -1.0], [NEG, NEG]],
        requested=2,
        vocab_size=10,
    )
    assert cap.kept_ids.dtype == torch.long and cap.kept_logprobs.dtype == torch.float32
    assert cap.incomplete.dtype == torch.bool and cap.sampled_missing.dtype == torch.bool
    assert cap.kept_ids.tolist() == [[4, 1], [3, -1], [9, 8], [-1, -1]]
    assert cap.kept_logprobs.tolist() == [[-0.25, -1.5], [-0.125, NEG], [-0.5, -1.0], [NEG, NEG]]
    # Full heads of finite values on a partial vocabulary: rows 0 and 2.
    assert cap.incomplete.tolist() == [True, False, True, False]
    # Row 1 samples 2, which the head does not hold; row 3 holds nothing.
    assert cap.sampled_missing.tolist() == [False, True, False, True]


def test_a_listed_but_infinite_sampled_token_is_missing() -> None:
    cap = support_from_heads([5], [[3, 5]], [[-0.01, NEG]], requested=4, vocab_size=10)
    assert cap.sampled_missing.tolist() == [True] and cap.kept_ids.tolist() == [[3]]


@pytest.mark.parametrize(("requested", "incomplete"), [(FULL_VOCAB, False), (3, False), (4, False), (2, True)])
def test_a_head_as_wide_as_the_vocabulary_is_complete(requested: int, incomplete: bool) -> None:
    """requested >= V or -1 is the full vocabulary; a full head of V entries hides nothing either way."""
    ids, lps = ([0, 1, 2], [-1.0, -1.5, -2.0]) if requested != 2 else ([0, 1], [-1.0, -1.5])
    cap = support_from_heads([0], [ids], [lps], requested=requested, vocab_size=3)
    assert cap.incomplete.tolist() == [incomplete]


def test_a_head_of_v_entries_is_complete_whatever_was_requested() -> None:
    cap = support_from_heads([0], [[0, 1, 2]], [[-1.0, -1.5, -2.0]], requested=2, vocab_size=3)
    assert cap.incomplete.tolist() == [False]


def test_requesting_v_is_the_full_vocabulary() -> None:
    cap = support_from_heads([0], [[0, 1]], [[-0.5, -1.0]], requested=5, vocab_size=5)
    assert cap.incomplete.tolist() == [False]


def test_a_head_whose_ids_and_log_probs_differ_in_length_is_refused() -> None:
    with pytest.raises(ValueError, match="zip"):
        support_from_heads([0], [[0, 1, 2]], [[-0.5, -1.0]], requested=3, vocab_size=10)


def test_log_probs_are_float32_whatever_the_default_dtype() -> None:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cap = support_from_heads([0, 1], [[0, 1], [1, 2]], [[-0.5, NEG], [-0.25, -2.0]], requested=2, vocab_size=10)
    finally:
        torch.set_default_dtype(old)
    assert cap.kept_logprobs.dtype == torch.float32 and cap.kept_ids.dtype == torch.long


def test_full_vocabulary_heads_are_never_incomplete_even_when_short() -> None:
    cap = support_from_heads([0], [[0, 1]], [[-0.5, -1.0]], requested=FULL_VOCAB, vocab_size=5)
    assert cap.incomplete.tolist() == [False]
    part = support_from_heads([0], [[0, 1]], [[-0.5, -1.0]], requested=2, vocab_size=5)
    assert part.incomplete.tolist() == [True]


def test_empty_heads_give_one_padding_column() -> None:
    cap = support_from_heads([1, 2], [[], []], [[], []], requested=3, vocab_size=10)
    assert cap.kept_ids.tolist() == [[-1], [-1]] and cap.kept_logprobs.tolist() == [[NEG], [NEG]]
    # An empty head is a full one (0 of 0 entries finite): it proves nothing about the support.
    assert cap.incomplete.tolist() == [True, True] and cap.sampled_missing.tolist() == [True, True]
    none = support_from_heads([], [], [], requested=3, vocab_size=10)
    assert tuple(none.kept_ids.shape) == (0, 1) and none.incomplete.tolist() == []


def test_heads_length_messages() -> None:
    with pytest.raises(ValueError) as info:
        support_from_heads([1, 2], [[1]], [[-0.1], [-0.2]], requested=3, vocab_size=10)
    assert str(info.value) == "capture has 1 heads and 2 log-prob rows for 2 sampled tokens"
    with pytest.raises(ValueError) as info:
        support_from_heads([1, 2], [[1], [2]], [[-0.1]], requested=3, vocab_size=10)
    assert str(info.value) == "capture has 2 heads and 1 log-prob rows for 2 sampled tokens"


def test_support_mass_is_the_float64_sum_of_probabilities() -> None:
    lps = torch.tensor([[-0.5, -1.25, NEG], [NEG, NEG, NEG]], dtype=torch.float32)
    m = support_mass(lps)
    assert m.dtype == torch.float64
    expected = torch.tensor([-0.5, -1.25], dtype=torch.float64).exp().sum()
    assert m.tolist() == [float(expected), 0.0]
    assert support_mass(lps[0]).tolist() == float(expected)  # one position's head: the last axis


def test_native_mask_messages_in_full() -> None:
    with pytest.raises(ValueError) as info:
        validate_native_mask(SamplingSpec(0.0, top_k=3))
    assert str(info.value) == (
        "native sampling-mask capture needs temperature > 0, got temperature=0.0: use top-K capture (--capture topk) "
        "for greedy scenarios"
    )
    for k in (0, -1):
        with pytest.raises(ValueError) as info:
            validate_native_mask(SamplingSpec(0.5, top_k=k))
        assert str(info.value) == (
            f"native sampling-mask capture needs top_k > 0 to bound the mask, got top_k={k}: set top_k or use top-K "
            "capture (--capture topk)"
        )
    validate_native_mask(SamplingSpec(0.01, top_k=1))


def test_padded_ids_sorts_pads_and_keeps_one_column() -> None:
    out = padded_ids([[7, 2, 5], [], [3]])
    assert out.dtype == torch.long and out.tolist() == [[2, 5, 7], [-1, -1, -1], [3, -1, -1]]
    assert padded_ids([[], []]).tolist() == [[-1], [-1]]
    assert tuple(padded_ids([]).shape) == (0, 1)


def test_compare_supports_ignores_order_and_padding_and_honours_skip() -> None:
    a = torch.tensor([[1, 2, -1, -1], [0, -1, -1, -1], [4, 5, 6, -1]])
    b = torch.tensor([[2, 1], [0, 3], [6, 5]])
    assert compare_supports(a, b) == [1, 2]
    assert compare_supports(a, b, skip=torch.tensor([False, True, False])) == [2]
    assert compare_supports(a, b, skip=torch.tensor([True, False, True])) == [1]
    assert compare_supports(a[:2], b[:2, :1].expand(2, 3)) == [0]  # 2 positions, 4 and 3 columns
    c = torch.tensor([[1, 2, 0, -1], [0, -1, -1, -1], [6, 4, 5, -1]])  # id 0 is a token, not padding
    assert compare_supports(a, c) == [0]
    assert compare_supports(torch.tensor([[3, 0]]), torch.tensor([[0, 3, -1, -1]])) == []
    with pytest.raises(ValueError) as info:
        compare_supports(a, torch.zeros(2, 5, dtype=torch.long))
    assert str(info.value) == "supports cover 3 and 2 positions"
