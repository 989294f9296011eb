"""The map step of the records analysis: one validated batch of records in, its mergeable
:class:`~parity.judge.accumulators.Summary` out, with numpy alone (no torch at import; docs/records.md, section 5).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from parity.core.error_model import SUPPORT_MASS_TOL, UNIT_ROUNDOFF, unit_roundoff
from parity.core.gates import Thresholds
from parity.core.spec import SPEC_FIELDS, SamplingSpec
from parity.judge.accumulate import accumulate
from parity.judge.accumulators import ScenarioAcc, Summary
from parity.judge.token_values import (
    LOGIT_BUDGET,
    KeptValues,
    TokenColumns,
    kept_values,
    min_kept_logprob,
    sampler_log_s,
)
from parity.records.arrays import RecordsBatch
from parity.records.validate import validate_batch

# TokenColumns and LOGIT_BUDGET live in token_values; the map step's callers import them from here.
__all__ = ["LOGIT_BUDGET", "Options", "TokenColumns", "summarize_batch", "token_columns"]


@dataclass
class Options:
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    n_listed: int = Thresholds().max_violations_listed
    batch_rows: int = 1024


def _row_float(batch: RecordsBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A trainer column as per-token float64 values and where it is held (zeros and False where not)."""
    rag = batch.trainer.get(name)
    if rag is None:
        return np.zeros(batch.tokens, dtype=np.float64), np.zeros(batch.tokens, dtype=bool)
    if bool(rag.valid.all()):  # every row has the column: its values are the token column
        return rag.values.astype(np.float64), np.ones(batch.tokens, dtype=bool)
    have = np.repeat(rag.valid, batch.completion.lengths)
    vals = np.zeros(batch.tokens, dtype=np.float64)
    vals[have] = rag.values.astype(np.float64)
    return vals, have


def _row_bool(batch: RecordsBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    vals, have = _row_float(batch, name)
    return vals.astype(bool), have


def _trainer_values(
    batch: RecordsBatch, have: dict[str, np.ndarray], captured: np.ndarray, filtered: np.ndarray, kept: KeptValues
) -> dict[str, np.ndarray]:
    """The trainer's columns, each where the records hold it (``have``), else derived where a rule allows."""
    v: dict[str, np.ndarray] = {}
    for key, column in (("full", "trainer_full_logprobs"), ("recompute", "trainer_recompute_logprobs"),
                        ("user", "trainer_logprobs"), ("bound", "trainer_bound"),
                        ("bound_full", "trainer_bound_full"), ("penalty", "trainer_penalty_term")):
        v[key], have[key] = _row_float(batch, column)
    replay_v, have_rep = _row_float(batch, "trainer_replay_logprobs")
    # Derived replay: over S_q from the trainer's kept logits; unfiltered without a kept set: the full value.
    use_derived = ~have_rep & kept.with_logits
    replay_v = np.where(use_derived, kept.replay, replay_v)
    unfilt = ~captured & ~filtered
    use_full = ~have_rep & ~use_derived & unfilt & have["full"]
    v["replay"] = np.where(use_full, v["full"], replay_v)
    have["replay"] = have_rep | use_derived | use_full
    log_s_v, have_ls = _row_float(batch, "trainer_log_s")
    # log S = 0 when nothing is filtered; from the kept logits, log S = full - replay (the trainer's mass on S_q).
    zero_ls = ~have_ls & unfilt
    derive_ls = ~have_ls & captured & have["full"] & use_derived
    v["log_s"] = np.where(zero_ls, 0.0, np.where(derive_ls, v["full"] - v["replay"], log_s_v))
    have["log_s"] = have_ls | zero_ls | derive_ls
    v["forced"], have["forced"] = _row_bool(batch, "trainer_recompute_forced")
    v["rec_eq"], have["recompute_support"] = _row_bool(batch, "trainer_recompute_support_equal")
    size, have_size = _row_float(batch, "trainer_recompute_support_size")
    v["rec_size"] = np.where(have_size, size, -1).astype(np.int64)
    have["kl"] = kept.with_logits | (unfilt & ~captured)
    # Absent: 0, the sets taken as equal where trainer_recompute_support_equal says so (older records).
    v["recompute_boundary"], _ = _row_float(batch, "trainer_recompute_boundary")
    return v


def token_columns(batch: RecordsBatch, *, vocab_size: int | None = None) -> TokenColumns:
    """Sampler-side flags and the trainer's values read (or derived) from the records themselves; ``vocab_size``
    (records metadata, or the re-scoring model) lets the top_p bracket be derived (docs/records.md, section 5)."""
    T = batch.tokens
    row = batch.row_of_token()
    lengths = batch.completion.lengths
    y = batch.completion.values.astype(np.int64)
    filtered_spec = np.array([s.effective().filtered for s in batch.specs], dtype=bool)
    filtered = filtered_spec[batch.spec_index][row] if T else np.zeros(0, dtype=bool)
    false = np.zeros(T, dtype=bool)
    captured = batch.kept_rows()[row] if T else false.copy()
    incomplete = batch.kept_incomplete.copy() if batch.kept_incomplete is not None else false.copy()
    incomplete &= captured
    kept = kept_values(batch, row, captured)
    mass_ok = np.abs(kept.mass - 1.0) <= SUPPORT_MASS_TOL
    have: dict[str, np.ndarray] = {"kept": captured | ~filtered}
    v = _trainer_values(batch, have, captured, filtered, kept)
    # Without trainer_systematic only the last float32 operations are known to point one way (2 u32 |lp|);
    # a float32 kernel's normalisation offset needs the trainer's logits (parity run --records writes it).
    sys_v, have_sys = _row_float(batch, "trainer_systematic")
    vllm = batch.sampler_logprobs.astype(np.float64)
    v_abs = np.abs(vllm)
    storage = 2.0 * UNIT_ROUNDOFF["float32"] * np.where(np.isfinite(v_abs), v_abs, 0.0)
    s_lo, s_hi, have["sampler_log_s"], s_source = sampler_log_s(
        batch, row, filtered, captured, incomplete, lambda: min_kept_logprob(batch, kept.support_size), vocab_size)
    tt = batch.trainer.get("trainer_token_ids")
    trainer_token = y.copy()
    if tt is not None:
        trainer_token[np.repeat(tt.valid, lengths)] = tt.values.astype(np.int64)
    views: dict[frozenset[str], np.ndarray] = {frozenset(): vllm}  # read only, like every column here
    if bool((captured & have["full"]).any()):
        views[frozenset({"full_vocabulary"})] = np.where(captured & have["full"], v["full"], np.nan)
    return TokenColumns(
        n_rows=batch.n_rows, row=row, token=y,
        position=np.arange(T, dtype=np.int64) - np.repeat(batch.token_offsets[:-1], lengths),
        trainer_token=trainer_token, vllm=vllm, have=have, full=v["full"], replay=v["replay"],
        recompute=v["recompute"], log_s=v["log_s"], user=v["user"], forced=v["forced"],
        recompute_support_equal=v["rec_eq"], recompute_support_size=v["rec_size"], captured=captured,
        incomplete=incomplete, sampled_outside=captured & ~kept.contains & ~incomplete,
        replay_support_ok=np.where(captured, ~incomplete & kept.contains & mass_ok, True),
        support_size=kept.support_size, mass=kept.mass, kl=kept.kl, tv=kept.tv, bound=v["bound"],
        bound_full=v["bound_full"], recompute_boundary=v["recompute_boundary"],
        systematic=np.where(have_sys, sys_v, storage), s_lo=s_lo, s_hi=s_hi, s_source=s_source,
        logit_drift=kept.drift, views=views, penalty=v["penalty"],
    )


def _row_groups(batch: RecordsBatch) -> list[tuple[str, tuple[str, tuple[float, ...]], np.ndarray]]:
    """The batch's scenarios: ``(name, (label, spec values), rows)``, rows ascending, in the order of each
    scenario's first row. A row's label is its ``scenario``, else its spec's label."""
    n, n_specs = batch.n_rows, max(len(batch.specs), 1)
    names: dict[str, int] = {}
    code = np.zeros(n, dtype=np.int64)  # 0: no scenario name
    if any(batch.scenario):
        for i, name in enumerate(batch.scenario):
            if name:
                code[i] = names.setdefault(str(name), len(names) + 1)
    label_of: list[str] = ["", *names]  # code 0: no scenario name (the spec's label stands for it)
    pair = code * n_specs + batch.spec_index
    uniq, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    groups: dict[str, tuple[tuple[str, tuple[float, ...]], list[np.ndarray]]] = {}
    for u in np.argsort(first, kind="stable"):
        c, j = divmod(int(uniq[u]), n_specs)
        spec = batch.specs[j]
        key = (label_of[c] if c else spec.label(), tuple(spec.to_dict().values()))
        name = f"{key[0]}\x1f{json.dumps(key[1])}"
        groups.setdefault(name, (key, []))[1].append(np.flatnonzero(inverse == u))
    return [(g, key, parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts)))
            for g, (key, parts) in groups.items()]


def summarize_batch(
    batch: Any,
    *,
    file_index: int = 0,
    options: Options | None = None,
    source: str = "batch",
    first_row: int = 0,
    dtypes: tuple[str, str] = ("float32", "float32"),
    vocab_size: int | None = None,
    columns: Callable[[RecordsBatch], TokenColumns] | None = None,
    stated_dtypes: tuple[str, str] | None = None,
) -> Summary:
    """The map step: one batch of records (pyarrow, validated here, or a ``RecordsBatch``) -> its :class:`Summary`.

    ``dtypes``: the two sides' dtypes; ``columns``: how the per-token values are obtained (re-scoring passes its own);
    ``stated_dtypes``: what the records state ("" where not). How each is used: docs/records.md, section 5."""
    opts = options or Options()
    rb = batch if isinstance(batch, RecordsBatch) else validate_batch(batch, source=source, first_row=first_row)
    out = Summary()
    out.rows = rb.n_rows
    out.tokens = rb.tokens
    out.columns = set(rb.columns)
    out.ignored_columns = set(rb.ignored_columns)
    out.casts = {f"{rb.source}\x1f{k}": note for k, note in rb.casts.items()}
    if rb.n_rows == 0:
        return out
    cols = columns(rb) if columns is not None else token_columns(rb, vocab_size=vocab_size)
    u = unit_roundoff(dtypes)
    for gname, (label, spec), rows in _row_groups(rb):
        acc = ScenarioAcc(
            name=label,
            spec=SamplingSpec.from_dict(dict(zip(SPEC_FIELDS, spec, strict=True))).to_dict(),
            first_order=(file_index, rb.first_row + int(rows[0]), 0),
            n_listed=opts.n_listed,
            roundoff=u,
            vocab_size=int(vocab_size or 0),
            dtypes=list(stated_dtypes if stated_dtypes is not None else dtypes),
        )
        accumulate(acc, rb, cols, rows.astype(np.int64, copy=False), file_index)
        out.groups[gname] = acc
    return out
