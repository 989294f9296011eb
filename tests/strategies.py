"""The test suite's strategies: the exported ones (parity.testing.strategies), so users test with the same,
and the batch layouts the trainer-side invariance property draws."""

from hypothesis import strategies as st

from parity.determinism.layouts import MASKS, SIDES, BatchLayout
from parity.testing.strategies import *  # noqa: F401,F403
from parity.testing.strategies import (  # noqa: F401
    case_plans,
    cases,
    example_case,
    example_logits,
    row_plans,
    specs,
    top_ks,
)

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
