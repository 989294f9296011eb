"""The test suite's strategies: the exported ones (parity.testing.strategies), so users test with the same;
the specs the end-to-end runs draw, the hand-picked cases for ``@example``, and the batch layouts the
trainer-side invariance property draws."""

import torch
from hypothesis import strategies as st
from layouts import MASKS, SIDES, BatchLayout

from parity.core.spec import SamplingSpec
from parity.testing.cases import Case, CasePlan, RowPlan, build_case
from parity.testing.strategies import *  # noqa: F401,F403
from parity.testing.strategies import (  # noqa: F401
    case_plans,
    cases,
    row_plans,
    specs,
    top_ks,
)

# -- end-to-end specs and hand-picked cases ------------------------------------------------------


@st.composite
def engine_specs(draw: st.DrawFn, vocab: int) -> SamplingSpec:
    """Specs for end-to-end runs on a real engine: T in [0.05, 2], top_k off or 1..V, top_p in (0, 1],
    min_p in [0, 1), alone and combined (each filter is off half the time); a third of them with penalties
    (repetition in [0.5, 2], presence and frequency in [-2, 2])."""
    t = draw(st.floats(0.05, 2.0))
    k = draw(st.one_of(st.just(0), st.integers(1, vocab)))
    p = draw(st.one_of(st.just(1.0), st.floats(0.01, 1.0)))
    m = draw(st.one_of(st.just(0.0), st.floats(0.0, 0.99)))
    if draw(st.integers(0, 2)):
        return SamplingSpec(t, k, p, m)
    return SamplingSpec(t, k, p, m, draw(st.floats(0.5, 2.0)), draw(st.floats(-2.0, 2.0)), draw(st.floats(-2.0, 2.0)))


def example_case(vocab: int, *rows: RowPlan, seed: int = 0) -> Case:
    """A hand-picked case for ``@example``: built like a drawn one, tagged ``source="example"``."""
    case = build_case(CasePlan(vocab, tuple(rows), seed))
    case.source = "example"
    return case


def example_logits(logits: list[list[float]], *specs_: SamplingSpec, seed: int = 0) -> Case:
    """A hand-written logits batch for ``@example`` (one spec, or one per row)."""
    z = torch.tensor(logits, dtype=torch.float32)
    row_specs = list(specs_) if len(specs_) == z.shape[0] else [specs_[0]] * z.shape[0]
    return Case(z, row_specs, seed, None, source="example")


# -- batch layouts of token sequences (trainer-side invariance) ------------------------------------


@st.composite
def batch_layout_cases(
    draw: st.DrawFn,
    *,
    max_len: int = 40,
    long_len: tuple[int, int] = (41, 600),
    max_rows: int = 4,
    max_per_row: int = 3,
    max_extra_pad: int = 5,
) -> tuple[list[int], int, BatchLayout]:
    """(sequence lengths, token seed, layout): 1..max_rows rows of 1..max_per_row sequences in a drawn
    order (so a sequence lands at any offset of a packed row), padded left or right, with any mask form
    the layout allows; sometimes one sequence is long (``long_len``)."""
    per_row = draw(st.lists(st.integers(1, max_per_row), min_size=1, max_size=max_rows))
    n = sum(per_row)
    lengths = draw(st.lists(st.integers(1, max_len), min_size=n, max_size=n))
    if draw(st.integers(0, 3)) == 0:
        lengths[draw(st.integers(0, n - 1))] = draw(st.integers(*long_len))
    order = draw(st.permutations(range(n)))
    rows, at = [], 0
    for k in per_row:
        rows.append(tuple(order[at : at + k]))
        at += k
    masks = MASKS if all(k == 1 for k in per_row) else tuple(m for m in MASKS if m != "2d")
    layout = BatchLayout(
        tuple(rows), draw(st.sampled_from(SIDES)), draw(st.integers(0, max_extra_pad)), draw(st.sampled_from(masks))
    )
    return lengths, draw(st.integers(0, 2**31 - 1)), layout
