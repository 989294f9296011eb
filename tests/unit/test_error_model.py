"""The rounding bound on per-token log-probs: what it is made of, and that it bounds what it claims."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.core.error_model import (
    KERNEL_SIDES,
    LOGIT_ULPS,
    UNIT_ROUNDOFF,
    headroom,
    kernel_offset,
    log_softmax_bound,
    logprob_bound,
    logprob_bound_terms,
    normalisation_errors,
    systematic_bound,
    unit_roundoff,
)


def test_the_looser_side_sets_the_roundoff() -> None:
    assert unit_roundoff("float32") == 2.0**-24
    assert unit_roundoff(["float32", "bfloat16"]) == 2.0**-8
    assert unit_roundoff([torch.float32, torch.float16]) == 2.0**-11


def test_unknown_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"dtype='int8' has no unit roundoff: allowed \['bfloat16'"):
        unit_roundoff("int8")
    with pytest.raises(ValueError, match="dtypes is empty"):
        unit_roundoff([])


def test_bound_grows_with_the_scaled_logits_and_the_support() -> None:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(4, 100, generator=g)
    y = torch.arange(4)
    base = logprob_bound(z, y)
    hot = logprob_bound(z / 0.25, y)  # T = 0.25: four times the magnitude
    u = UNIT_ROUNDOFF["float32"]
    # The logit term is linear in the row magnitude (4x at T = 0.25); the float32 normalisation's depends on the
    # row's shape, not its scale alone (a hotter row is more peaked), so it is set apart.
    logit_term = 4 * LOGIT_ULPS * u * z.abs().amax(-1).double()
    assert bool((base > logit_term).all())
    sums = KERNEL_SIDES * normalisation_errors(z)["bound"]
    sums_hot = KERNEL_SIDES * normalisation_errors(z / 0.25)["bound"]
    assert bool(((hot - sums_hot) - (base - sums) >= 3 * logit_term * (1 - 1e-12)).all())
    small = torch.zeros(4, 100, dtype=torch.bool)
    small[:, :4] = True
    assert bool((logprob_bound(z, y, small) < base).all())  # log2 |S| is smaller
    assert bool((logprob_bound(z, y, dtype="bfloat16") > 1000 * base).all())


def test_minus_inf_logits_do_not_poison_the_bound() -> None:
    z = torch.tensor([[0.0, -math.inf, 3.0], [1.0, 2.0, -math.inf]])
    b = logprob_bound(z, torch.tensor([0, 1]))
    assert bool(torch.isfinite(b).all()) and bool((b > 0).all())


def test_headroom_is_the_worst_ratio_and_nan_is_infinite() -> None:
    b = torch.tensor([1e-5, 2e-5])
    assert headroom(torch.tensor([5e-6, -3e-5]), b) == pytest.approx(1.5)
    assert headroom(torch.tensor([0.0, float("nan")]), b) == math.inf
    assert headroom(torch.zeros(0), torch.zeros(0)) == 0.0


def _two_sides(z: torch.Tensor, y: torch.Tensor, rel: float, seed: int) -> torch.Tensor:
    """|lp_a - lp_b|: side a exact (float64), side b in float32 on logits moved by up to rel * max|z|."""
    g = torch.Generator().manual_seed(seed)
    a = torch.log_softmax(z.double(), -1).gather(1, y[:, None]).squeeze(1)
    scale = z.abs().amax(-1, keepdim=True)
    noise = (torch.rand(z.shape, generator=g, dtype=torch.float64) * 2 - 1) * rel * scale.double()
    zb = (z.double() + noise).float()
    b = torch.log_softmax(zb, -1).gather(1, y[:, None]).squeeze(1).double()
    return (a - b).abs()


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(2, 4000),
    magnitude=st.floats(0.1, 300.0),
    seed=st.integers(0, 2**16),
)
def test_bound_covers_logit_noise_at_the_modelled_size(vocab: int, magnitude: float, seed: int) -> None:
    """Logits that differ by up to 2 LOGIT_ULPS roundoffs of the row magnitude, one side in float32: in bound."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(8, vocab, generator=g) * magnitude / 3).clamp(-magnitude, magnitude)
    y = torch.randint(0, vocab, (8,), generator=g)
    bound = logprob_bound(z, y)
    diff = _two_sides(z, y, 2 * LOGIT_ULPS * UNIT_ROUNDOFF["float32"], seed)  # both sides off, opposite ways
    assert headroom(diff, bound) <= 1.0


def test_a_logit_fault_at_a_few_times_the_bound_exceeds_it_and_a_tenth_does_not() -> None:
    """Planted fault: the sampled token's logit moved by 4x / 0.1x its bound on one side."""
    g = torch.Generator().manual_seed(3)
    z = torch.randn(32, 3000, generator=g) * 5
    y = torch.randint(0, 3000, (32,), generator=g)
    bound = logprob_bound(z, y)
    exact = torch.log_softmax(z.double(), -1).gather(1, y[:, None]).squeeze(1)
    for factor, fails in ((4.0, True), (0.1, False)):
        moved = z.double().clone()
        moved[torch.arange(32), y] += factor * bound
        got = torch.log_softmax(moved, -1).gather(1, y[:, None]).squeeze(1)
        # The shift of lp is (1 - p_y) * delta; p_y is tiny at V = 3000, so it is ~delta.
        assert (headroom(got - exact, bound) > 1.0) is fails


def _wide_peaked(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4.0


def test_this_machines_log_softmax_lies_within_the_bound() -> None:
    """torch's float32 log_softmax on this machine's kernel path (whichever ATEN_CPU_CAPABILITY) against float64:
    every token of a wide row within the per-token bound, for any order the bound covers."""
    for seed, std in ((0, 4.0), (1, 0.1), (2, 20.0)):
        z = torch.randn(8, 32000, generator=torch.Generator().manual_seed(seed)) * std
        lp32 = torch.log_softmax(z, dim=-1).double()
        exact = torch.log_softmax(z.double(), dim=-1)
        assert headroom((lp32 - exact).flatten(), log_softmax_bound(z).flatten()) <= 1.0


def test_the_kernel_offset_over_a_support_is_the_masked_rows() -> None:
    z = _wide_peaked(4, 4096, 1)
    keep = z >= z.topk(50, dim=-1).values[:, -1:]
    masked = z.masked_fill(~keep, -math.inf)
    assert torch.equal(kernel_offset(z, keep), kernel_offset(masked))
    # Fifty terms: the float32 sum loses nothing that matters.
    assert bool((kernel_offset(z, keep).abs() <= 1e-6).all())


def test_systematic_bound_holds_each_term() -> None:
    z = _wide_peaked(6, 8192, 2)
    y = z.argmax(dim=-1)
    keep = z >= z.topk(20, dim=-1).values[:, -1:]
    u = 2.0**-24
    lp = (z.double().gather(1, y[:, None]).squeeze(1) - torch.logsumexp(z.double().masked_fill(~keep, -math.inf), -1)).abs()
    sys32 = systematic_bound(z, y, keep, dtype="float32")
    floor = 2 * torch.maximum(kernel_offset(z, keep).abs(), kernel_offset(z).abs()) + 2 * u * lp
    assert torch.allclose(sys32, floor, rtol=1e-12, atol=0.0)
    # Below float32 the second-order rounding of the logits is one-signed too.
    sys16 = systematic_bound(z, y, keep, dtype=["float32", "bfloat16"])
    e2 = (torch.softmax(z.double(), -1) * z.double() ** 2).sum(-1)
    assert torch.allclose(sys16 - sys32, (2.0**-8) ** 2 * e2, rtol=1e-9)


def test_the_per_token_bound_carries_the_normalisation_bound() -> None:
    z = _wide_peaked(4, 32000, 3)
    y = z.argmax(dim=-1)
    zd = z.double()
    lse = torch.logsumexp(zd, -1)
    plain = logprob_bound_terms(zd.abs().amax(-1), lse, zd.gather(1, y[:, None]).squeeze(1) - lse,
                                torch.full((4,), 32000.0), 2.0**-24)
    want = plain + KERNEL_SIDES * normalisation_errors(z)["bound"]
    assert torch.allclose(logprob_bound(z, y), want, rtol=1e-12, atol=0.0)
