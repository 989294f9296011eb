"""Hypothesis strategies for logits batches and sampling specs, exported for users' property tests.

Needs ``hypothesis`` (the ``test`` extra). A strategy draws a :class:`parity.testing.cases.CasePlan`, so
shrinking works on the choices; checking your own filters with them: docs/internals.md, section 10."""

from __future__ import annotations

try:
    from hypothesis import strategies as st
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError("parity.testing.strategies needs Hypothesis: pip install 'parity[test]'") from exc

from parity.core.spec import SamplingSpec
from parity.testing.cases import Case, CasePlan, RowPlan, build_case, without_top_p

vocab_sizes = st.one_of(st.integers(2, 16), st.integers(17, 512), st.sampled_from([1000, 2048, 4096]))

temperatures = st.one_of(
    st.just(0.0),  # greedy
    st.floats(1e-7, 9.9e-6),  # below vLLM's greedy epsilon, yet SamplingParams raises it to 0.01
    st.floats(1e-5, 0.0099),  # also raised to 0.01
    st.floats(0.01, 0.99),
    st.just(1.0),
    st.floats(1.01, 2.0),  # vLLM refuses T > 2
)

top_ps = st.one_of(st.just(1.0), st.floats(0.01, 0.3), st.floats(0.6, 0.99))
min_ps = st.one_of(st.just(0.0), st.floats(0.01, 0.3), st.just(1.0))
stds = st.one_of(st.just(0.1), st.floats(0.5, 5.0), st.just(20.0))


def top_ks(vocab: int) -> st.SearchStrategy[int]:
    return st.one_of(
        st.sampled_from([0, -1]),  # off
        st.just(1),
        st.integers(2, max(2, vocab - 1)),  # k < V (k == V when V == 2)
        st.integers(vocab, vocab + 100),  # k >= V: vLLM turns the filter off for the row
    )


repetition_penalties = st.one_of(st.just(1.0), st.floats(1.0, 1.3), st.floats(0.5, 2.0), st.floats(0.05, 5.0))
additive_penalties = st.one_of(st.just(0.0), st.floats(-2.0, 2.0))  # presence / frequency: vLLM allows [-2, 2]


@st.composite
def specs(draw: st.DrawFn, vocab: int) -> SamplingSpec:
    base = (draw(temperatures), draw(top_ks(vocab)), draw(top_ps), draw(min_ps))
    if not draw(st.booleans()):
        return SamplingSpec(*base)
    return SamplingSpec(*base, draw(repetition_penalties), draw(additive_penalties), draw(additive_penalties))


@st.composite
def row_plans(draw: st.DrawFn, vocab: int, spec: SamplingSpec | None = None) -> RowPlan:
    return RowPlan(
        spec=spec if spec is not None else draw(specs(vocab)),
        std=draw(stds),
        quantum=draw(st.sampled_from([0.0, 0.0, 0.0, 0.25, 1.0])),
        neg_inf=draw(st.one_of(st.just(0.0), st.just(0.0), st.floats(0.1, 0.9))),
        single_finite=draw(st.integers(0, 9)) == 0,
        top_k_tie=draw(st.sampled_from([0, 1, 2, 4])),
        top_p_tie=draw(st.sampled_from([0, 0, 2, 3, 5])),
        prompt_len=draw(st.one_of(st.just(1), st.integers(2, 40))),
        output_len=draw(st.one_of(st.just(0), st.integers(1, 10), st.integers(11, 60))),
        history_top=draw(st.sampled_from([0.0, 0.5, 0.9])),
    )


@st.composite
def case_plans(draw: st.DrawFn, max_rows: int = 6) -> CasePlan:
    vocab = draw(vocab_sizes)
    n = draw(st.integers(1, max_rows))
    if draw(st.booleans()):  # mixed per-row specs, as vLLM batches requests with different settings
        rows = tuple(draw(row_plans(vocab)) for _ in range(n))
    else:  # one spec for the batch (planting a top_p tie may still give one row its own top_p)
        spec = draw(specs(vocab))
        rows = tuple(draw(row_plans(vocab, spec)) for _ in range(n))
    if draw(st.integers(0, 3)) == 0:  # no row uses top_p: vLLM takes its top_k-only path
        rows = without_top_p(rows)
    return CasePlan(vocab, rows, draw(st.integers(0, 2**31 - 1)))


def cases(max_rows: int = 6) -> st.SearchStrategy[Case]:
    """Logits ``[N, V]`` float32 with one spec per row."""
    return case_plans(max_rows).map(build_case)
