"""The streamed analysis' per-batch shortcuts give what the plain computation gives, bit for bit.

``token_columns`` judges a kept set's mass from a float32 screen and computes the float64 mass only where
it may be off 1; membership of the sampled token comes from a segmented OR; ``summarize_batch`` groups
rows by (scenario, spec) codes; ``_accumulate`` counts lacking rows as runs. Each is checked here
against the direct formula on data built to sit at the edges (masses at the tolerance, empty and
single-entry positions, overflowing log-probs, scenario names that equal a spec's label).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pytest

from parity.core.error_model import SUPPORT_MASS_TOL
from parity.judge import token_columns as ra
from parity.judge import token_values
from parity.records.validate import validate_batch


def _exact_mass(klp: np.ndarray, kto: np.ndarray) -> np.ndarray:
    seg = np.repeat(np.arange(kto.size - 1), np.diff(kto))
    return np.bincount(seg, weights=np.exp(klp.astype(np.float64)), minlength=kto.size - 1)


@pytest.mark.parametrize("seed", range(6))
def test_the_mass_screen_decides_as_the_float64_mass(seed: int) -> None:
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 70, size=4000)
    counts[rng.random(counts.size) < 0.1] = 1
    kto = np.zeros(counts.size + 1, dtype=np.int64)
    np.cumsum(counts, out=kto[1:])
    klp = np.empty(int(kto[-1]), dtype=np.float32)
    # Each position's log-probs sum to a mass placed around 1 +- the tolerance (and a few far off or overflowing).
    target = 1.0 + rng.choice([0.0, 1.0, -1.0], counts.size) * SUPPORT_MASS_TOL * rng.choice([0.5, 0.999, 1.0, 1.001, 3.0],
                                                                                             counts.size)
    for t in np.flatnonzero(counts):
        z = rng.standard_normal(counts[t]) * 3
        lp = z - np.log(np.exp(z).sum()) + np.log(target[t])
        klp[kto[t]:kto[t + 1]] = lp.astype(np.float32)
    klp[rng.random(klp.size) < 0.02] = -np.inf
    klp[: min(3, klp.size)] = 120.0  # float32 exp overflows: the exact path
    nonempty = np.flatnonzero(counts > 0)
    got = token_values.kept_mass(klp, kto, counts, nonempty)
    exact = _exact_mass(klp, kto)
    ok_got = np.abs(got - 1.0) <= SUPPORT_MASS_TOL
    ok_exact = np.abs(exact - 1.0) <= SUPPORT_MASS_TOL
    assert (ok_got == ok_exact).all()
    off = ~ok_exact
    assert off.any() and ok_exact.any()
    assert np.array_equal(got[off], exact[off])  # bit for bit where a mass can reach a result
    assert np.allclose(got, exact, rtol=1e-5, atol=0.0)
    assert (got != exact).any()  # the screen decided somewhere (its value is float32-accurate only)
    assert (got[counts == 0] == 0.0).all()


def _batch(rows: list[dict]) -> pa.Table:
    from parity.records.write import records_table

    return records_table(rows)


def _row(i: int, length: int, k: int, rng: np.random.Generator, **kw) -> dict:
    ids = [list(rng.choice(64, size=k, replace=False)) for _ in range(length)]
    y = [int(rng.choice(ids[t])) if rng.random() < 0.9 else 99 for t in range(length)]
    lp = [list(np.full(k, -np.log(k), dtype=np.float32)) for _ in range(length)]
    offsets = [k * t for t in range(length + 1)]
    return {
        "schema_version": 1, "prompt_ids": [1, 2], "completion_ids": y, "temperature": kw.get("t", 0.8),
        "top_k": kw.get("top_k", k), "top_p": 1.0, "min_p": 0.0, "sampler_logprobs": [float(-np.log(k))] * length,
        "prompt_index": i, "kept_ids": [x for row in ids for x in row], "kept_offsets": offsets,
        "kept_logprobs": [x for row in lp for x in row], "scenario": kw.get("scenario"),
        "trainer_full_logprobs": None if kw.get("no_full") else [-3.0] * length,
    }


def test_membership_and_groups_match_the_per_row_formulas() -> None:
    rng = np.random.default_rng(3)
    spec_label = "T=0.8 top_k=4"
    rows = [
        _row(0, 5, 4, rng), _row(1, 0, 4, rng), _row(2, 3, 4, rng, scenario="a"), _row(3, 4, 4, rng, t=1.0),
        _row(4, 2, 4, rng, scenario=spec_label), _row(5, 6, 4, rng, scenario="a", no_full=True), _row(6, 1, 4, rng),
    ]
    rb = validate_batch(_batch(rows))
    cols = ra.token_columns(rb)
    y = rb.completion.values
    kto = rb.kept_token_offsets
    contains = np.array([y[t] in rb.kept.values[kto[t]:kto[t + 1]] for t in range(rb.tokens)], dtype=bool)
    assert np.array_equal(cols.sampled_outside, cols.captured & ~contains & ~cols.incomplete)
    groups = ra._row_groups(rb)
    plain: dict[str, list[int]] = {}
    for i in range(rb.n_rows):
        spec = rb.spec_of(i)
        label = str(rb.scenario[i]) if rb.scenario[i] else spec.label()
        plain.setdefault(f"{label}\x1f{json.dumps(tuple(spec.to_dict().values()))}", []).append(i)
    assert [(g, list(r)) for g, _, r in groups] == list(plain.items())  # the scenario named like a spec joins it
    summary = ra.summarize_batch(rb)
    for gname, acc in summary.groups.items():
        member = np.isin(cols.row, plain[gname])
        for k in acc.lacking:
            assert acc.lacking[k] == np.unique(cols.row[member & ~cols.have[k]]).size, (gname, k)


def test_penalty_columns_are_optional_validated_and_group_by_spec() -> None:
    from parity.records.schema import RecordsError

    rng = np.random.default_rng(5)
    plain = _row(0, 3, 4, rng)
    rep = {**_row(1, 3, 4, rng), "repetition_penalty": 1.2, "presence_penalty": 0.0, "frequency_penalty": 0.5}
    rb = validate_batch(_batch([{**plain, "repetition_penalty": None, "presence_penalty": None, "frequency_penalty": None}, rep]))
    assert rb.spec_of(0).penalised is False  # a null penalty is off, as an absent column is
    assert (rb.spec_of(1).repetition_penalty, rb.spec_of(1).frequency_penalty) == (1.2, 0.5)
    assert len({g for g, _, _ in ra._row_groups(rb)}) == 2
    assert not validate_batch(_batch([plain])).spec_of(0).penalised
    with pytest.raises(RecordsError, match=r"repetition_penalty=-1\.0.*allowed a finite number > 0"):
        validate_batch(_batch([{**plain, "repetition_penalty": -1.0}]))
