"""Kept sets read from the sampler's rows: how a row is put on its position, and the cutoff band of
the recompute support check (a set that differs only where drift can move the cutoff)."""

from __future__ import annotations

import math

import torch

from parity.core.capture import Heads, support_from_heads
from parity.core.metrics import boundary_only
from parity.engines.sampler_rows import Row, SamplerRows


def _heads(tokens, logprobs) -> Heads:
    n = len(tokens)
    return Heads(list(tokens), list(logprobs), [[9] * 3 for _ in range(n)], [[-1.0] * 3 for _ in range(n)])


def _wide(token: int, lp: float, k: int = 5) -> Row:
    ids = torch.arange(k)
    return Row(token, lp, k, ids, torch.full((k,), -math.log(k), dtype=torch.float32))


def test_a_row_lands_on_its_position_only_when_token_and_value_match() -> None:
    h = _heads([1, 2, 3], [-0.5, -0.25, -0.125])
    rows = {"7": [Row(0, -9.0, 400), _wide(1, -0.5), Row(2, -0.25, 2), _wide(3, -0.126)]}
    # The first row is a chunked prefill's discarded sample: the completion's rows are the last three.
    mismatched = SamplerRows.attach([h], ["7"], rows)
    assert sorted(h.rows) == [0] and mismatched == 1  # position 2's value differs from what vLLM returned
    assert torch.equal(h.rows[0][0], torch.arange(5))


def test_too_few_rows_attach_nothing_and_count_the_wide_ones() -> None:
    h = _heads([1, 2, 3], [-0.5, -0.25, -0.125])
    assert SamplerRows.attach([h], ["a"], {"a": [_wide(1, -0.5), _wide(2, -0.25)]}) == 2
    assert h.rows == {}
    assert SamplerRows.attach([h], ["b"], {}) == 0 and h.rows == {}


def test_rows_replace_the_head_and_prove_the_position() -> None:
    h = _heads([1, 7], [-0.5, -1.0])
    h.rows = {0: (torch.tensor([4, 1, 0, 3]), torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1])))}
    sup = support_from_heads(h.completion_ids, h.head_ids, h.head_logprobs, requested=3, vocab_size=100, rows=h.rows)
    assert sup.kept_ids.shape == (2, 4)
    assert sup.kept_ids[0].tolist() == [4, 1, 0, 3] and not bool(sup.incomplete[0]) and not bool(sup.sampled_missing[0])
    assert bool(sup.incomplete[1]) and bool(sup.sampled_missing[1])  # a full head of finite values, 7 unlisted
    assert sup.kept_ids[1].tolist() == [9, 9, 9, -1]


def _row(v: int = 20000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, v, generator=g, dtype=torch.float64) * 2.0


def _nucleus(z: torch.Tensor, top_p: float) -> torch.Tensor:
    p = torch.softmax(z, dim=-1)
    sp, order = p.sort(dim=-1, descending=True)
    keep_sorted = (sp.cumsum(-1) - sp) < top_p
    return torch.zeros_like(keep_sorted).scatter(1, order, keep_sorted)


def test_the_cutoff_band_forgives_drift_and_catches_a_moved_filter() -> None:
    """A planted cutoff shift at 3x the band fails; at 0.1x it passes (the band is 2 expm1(2 b) of mass)."""
    z = _row()
    b = torch.tensor([1e-4])
    eps = math.expm1(2e-4)
    q = _nucleus(z, 0.9)
    assert bool(boundary_only(q, q, z, b))
    for frac, ok in ((0.1, True), (3.0, False)):
        moved = _nucleus(z, 0.9 + frac * 2 * eps)
        assert not bool((moved == q).all())
        assert bool(boundary_only(moved, q, z, b)) is ok, frac
    # A filter off by a real amount (top_p 0.95 for 0.9) is far outside the band.
    assert not bool(boundary_only(_nucleus(z, 0.95), q, z, b))
    # Logits drifted within b move the cutoff by tokens inside the band.
    drift = z + (torch.rand(z.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) - 0.5) * 1e-4
    assert bool(boundary_only(_nucleus(drift, 0.9), q, z, b))
