"""Validating one batch of records rows (:func:`validate_batch`): bad input is refused with the file, row,
column, value and what is allowed; a good batch comes back as flat arrays (:class:`RecordsBatch`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from parity.core.error_model import UNIT_ROUNDOFF, WIDEST_VOCAB, normalisation_allowance
from parity.core.spec import PENALTY_OFF, SamplingSpec
from parity.records.arrays import (
    Ragged,
    RecordsBatch,
    cast_column,
    column_array,
    first_true,
    read_ragged,
    scalar_values,
    token_position,
    valid_rows,
)
from parity.records.casts import CastNote
from parity.records.routed import validate_routed
from parity.records.schema import (
    BY_NAME,
    KEPT_GROUP,
    NONNEGATIVE_COLUMNS,
    REQUIRED,
    SAMPLER_LOG_S_SOURCES,
    SUPPORTED_VERSIONS,
    TRAINER_TOKEN_COLUMNS,
    RecordsError,
    require_columns,
    where_in,
)

# Log-probabilities and log S are <= 0; a value above 0 beyond the rounding of a float32 normalisation over the
# widest vocabulary in use is refused (a sign flipped, a probability logged as its log, a raw logit).
LOGPROB_COLUMNS = ("trainer_logprobs", "trainer_full_logprobs", "trainer_replay_logprobs", "trainer_recompute_logprobs",
                   "trainer_log_s")
LOGPROB_ROUNDING = normalisation_allowance(WIDEST_VOCAB, UNIT_ROUNDOFF["float32"])


def validate_batch(batch: pa.RecordBatch | pa.Table, *, source: str = "batch", first_row: int = 0,
                   signs: bool = True) -> RecordsBatch:
    """Check one batch of records rows and return it as flat arrays; raise :class:`RecordsError` on bad input.
    ``source`` and ``first_row`` (the file, the row number of the batch's first row) let an error name the
    row to fix. ``signs``: refuse trainer log-probs above 0 (:data:`LOGPROB_COLUMNS`); off where parity judges
    what it scored itself (a planted fault or a trainer under test may go above 0, and its gates judge that)."""
    arrays, names, casts = _read_columns(batch, source, first_row)
    b = _Batch(arrays, source, first_row)
    _check_required(b)
    prompt, completion = b.ragged("prompt_ids"), b.ragged("completion_ids")
    b.nonnegative_ids(prompt, "prompt_ids")
    b.nonnegative_ids(completion, "completion_ids")
    b.lengths = completion.lengths
    sampler = b.token_column("sampler_logprobs")
    b.at_most_zero(sampler, "sampler_logprobs")
    n = batch.num_rows
    specs, spec_index = _specs(b, n)

    def ints(name: str) -> np.ndarray | None:  # an optional integer column, -1 where null
        return scalar_values(arrays[name], -1).astype(np.int64) if name in arrays else None

    out = RecordsBatch(
        source=source, first_row=first_row, n_rows=n, columns=tuple(sorted(names & set(BY_NAME))),
        ignored_columns=tuple(sorted(names - set(BY_NAME))), prompt=prompt, completion=completion,
        sampler_logprobs=sampler.values.astype(np.float32, copy=False), specs=specs, spec_index=spec_index,
        scenario=arrays["scenario"].to_pylist() if "scenario" in arrays else [None] * n,
        prompt_index=ints("prompt_index"), seed=ints("seed"), step=ints("step"),
        casts={k: v for k, v in casts.items() if k in arrays},
    )
    if "kept_ids" in arrays:
        _kept_set(b, out)
    else:
        for name in ("kept_incomplete", "trainer_kept_logits"):
            if name in arrays and bool(valid_rows(arrays[name]).any()):
                raise RecordsError(f"{source}: column {name} is set but there is no kept set (kept_ids, kept_offsets, kept_logprobs)")
    _trainer_columns(b, out, signs)
    _sampler_log_s(b, out)
    out.routed = validate_routed(arrays, prompt, completion.lengths, source, first_row)
    return out


@dataclass
class _Batch:
    """The cast columns of a batch being validated, and where its rows come from (for error messages)."""

    arrays: dict[str, pa.Array]
    source: str
    first_row: int
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # completion lengths per row

    def row(self, i: int) -> int:
        return self.first_row + int(i)

    def at(self, i: int, column: str | None = None, position: int | None = None) -> str:
        """Where row ``i`` of the batch (and a column, a position in it) is, for an error message."""
        return where_in(self.source, self.row(i), column, position)

    def ragged(self, name: str) -> Ragged:
        return read_ragged(self.arrays[name], name, self.source, self.first_row)

    def token_column(self, name: str, *, allow_inf: bool = True) -> Ragged:
        """A list column with one value per completion token (float values checked: no NaN, no +inf)."""
        rag = self.one_per_token(self.ragged(name), name)
        if rag.values.dtype.kind == "f":
            self.check_floats(rag, name, allow_inf)
        return rag

    def one_per_token(self, rag: Ragged, name: str) -> Ragged:
        wrong = rag.valid & (rag.lengths != self.lengths)
        if wrong.any():
            i = first_true(wrong)
            raise RecordsError(f"{self.at(i, name)}: {int(rag.lengths[i])} values for {int(self.lengths[i])} "
                               "completion_ids: allowed one value per completion token")
        return rag

    def check_floats(self, rag: Ragged, name: str, allow_inf: bool) -> None:
        vals = rag.values
        if not vals.size:
            return
        top = vals.max()  # NaN if any value is NaN: one pass where the values are good
        if not np.isnan(top) and top != np.inf and (allow_inf or vals.min() != -np.inf):
            return
        bad = np.isnan(vals)
        if not bad.any():  # then an infinity got past the fast check above
            bad = np.isposinf(vals) if allow_inf else ~np.isfinite(vals)
        i = first_true(bad)
        r, t = token_position(rag.offsets, i)
        value = "NaN" if np.isnan(vals[i]) else float(vals[i])
        raise RecordsError(f"{self.at(r, name, t)}: value is {value}: allowed a finite number"
                           + (" or -inf" if allow_inf else ""))

    def at_most_zero(self, rag: Ragged, name: str) -> None:
        """A log-probability (or log S) column: no value above 0 beyond :data:`LOGPROB_ROUNDING`."""
        vals = rag.values
        if not vals.size or not (vals.max() > LOGPROB_ROUNDING):
            return
        i = first_true(vals > LOGPROB_ROUNDING)
        r, t = token_position(rag.offsets, i)
        what = "a log S (the log of a probability mass)" if name == "trainer_log_s" else "a log-probability"
        raise RecordsError(
            f"{self.at(r, name, t)}: value {float(vals[i]):+.6g} is above 0: {what} is <= 0; "
            f"allowed values up to {LOGPROB_ROUNDING:.3g} above 0 (how far a float32 normalisation over "
            f"{WIDEST_VOCAB:,} tokens may move it up; parity.core.error_model.normalisation_allowance)")

    def nonnegative_ids(self, rag: Ragged, name: str) -> None:
        if rag.values.size and int(rag.values.min()) < 0:
            r, t = token_position(rag.offsets, first_true(rag.values < 0))
            raise RecordsError(f"{self.at(r, name, t)}: token id {int(rag.row(r)[t])} is negative: "
                               "allowed ids >= 0")


def _read_columns(batch: pa.RecordBatch | pa.Table, source: str,
                  first_row: int) -> tuple[dict[str, pa.Array], set[str], dict[str, CastNote]]:
    """The known columns cast to their types (optional ones with no value dropped), every column name
    present, and what casting float64 to float32 changed; refuses a missing required column or a partial kept set."""
    names = set(batch.schema.names)
    require_columns(names, source)
    casts: dict[str, CastNote] = {}
    arrays = {name: cast_column(column_array(batch, name), BY_NAME[name], source, first_row, casts) for name in names if name in BY_NAME}
    # An optional column with no value in this batch is as good as absent (writers emit every column).
    for name in [k for k, a in arrays.items() if not BY_NAME[k].required and a.null_count == len(a) and len(a)]:
        del arrays[name]
    names = set(arrays) | (names - set(BY_NAME))
    partial = [c for c in KEPT_GROUP if c in names]
    if partial and len(partial) != len(KEPT_GROUP):
        absent = [c for c in KEPT_GROUP if c not in names]
        raise RecordsError(f"{source}: column(s) {', '.join(partial)} present without (or with no value in) "
                           f"{', '.join(absent)}: a kept set needs {', '.join(KEPT_GROUP)} together")
    return arrays, names, casts


def _check_required(b: _Batch) -> None:
    """No null in a required column; every row's schema_version one this parity reads."""
    for name in REQUIRED:
        nulls = ~valid_rows(b.arrays[name])
        if nulls.any():
            raise RecordsError(f"{b.at(first_true(nulls), name)}: value is null: allowed {BY_NAME[name].doc}")
    version = scalar_values(b.arrays["schema_version"], 0)
    bad = ~np.isin(version, SUPPORTED_VERSIONS)
    if bad.any():
        i = first_true(bad)
        raise RecordsError(
            f"{b.at(i, 'schema_version')}: schema_version {int(version[i])} is not supported: this "
            f"parity reads schema_version {', '.join(map(str, SUPPORTED_VERSIONS))} (a newer parity may read it)"
        )


def _specs(b: _Batch, n: int) -> tuple[list[SamplingSpec], np.ndarray]:
    """The batch's distinct sampling specs (each checked once, by SamplingSpec itself) and each row's index into them."""
    spec_cols = [scalar_values(b.arrays[c], 0) for c in ("temperature", "top_k", "top_p", "min_p")]
    # The penalty columns are optional: absent (or null) means off, as in vLLM's SamplingParams.
    spec_cols += [scalar_values(b.arrays[c], off) if c in b.arrays else np.full(n, off, dtype=np.float64)
                  for c, off in PENALTY_OFF.items()]
    keys = np.stack([c.astype(np.float64) for c in spec_cols], axis=1)
    uniq, spec_index = np.unique(keys, axis=0, return_inverse=True) if n else (np.zeros((0, 7)), np.zeros(0, np.int64))
    specs: list[SamplingSpec] = []
    for j, (t, k, p, m, r, pres, freq) in enumerate(uniq):
        try:
            specs.append(SamplingSpec(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m),
                                      repetition_penalty=float(r), presence_penalty=float(pres), frequency_penalty=float(freq)))
        except ValueError as exc:
            i = first_true(np.asarray(spec_index).reshape(-1) == j)
            raise RecordsError(f"{b.at(i)}: {exc}") from None
    return specs, np.asarray(spec_index, dtype=np.int64).reshape(-1)


def _one_per_kept_id(b: _Batch, kept: Ragged, rag: Ragged, name: str, what: str) -> None:
    wrong = rag.valid & (rag.lengths != kept.lengths)
    if wrong.any():
        i = first_true(wrong)
        raise RecordsError(f"{b.at(i, name)}: {int(rag.lengths[i])} values for {int(kept.lengths[i])} "
                           f"kept_ids: allowed one {what} per kept id")


def _kept_set(b: _Batch, out: RecordsBatch) -> None:
    """The kept set (CSR per row): kept_ids, kept_offsets and kept_logprobs on the same rows, consistent, into ``out``."""
    kept, offs, klp = b.ragged("kept_ids"), b.ragged("kept_offsets"), b.ragged("kept_logprobs")
    for name, rag in (("kept_offsets", offs), ("kept_logprobs", klp)):
        mismatch = rag.valid != kept.valid
        if mismatch.any():
            i = first_true(mismatch)
            have, lack = ("kept_ids", name) if kept.valid[i] else (name, "kept_ids")
            raise RecordsError(f"{b.at(i)}: {have} is set but {lack} is null: allowed both or neither")
    _one_per_kept_id(b, kept, klp, "kept_logprobs", "log-prob")  # klp.valid == kept.valid, checked above
    lengths = b.lengths
    wrong = kept.valid & (offs.lengths != lengths + 1)
    if wrong.any():
        i = first_true(wrong)
        raise RecordsError(f"{b.at(i, 'kept_offsets')}: {int(offs.lengths[i])} offsets for {int(lengths[i])} "
                           f"completion_ids: allowed L + 1 = {int(lengths[i]) + 1} (position t's ids are "
                           "kept_ids[o[t]:o[t+1]])")
    if kept.values.size and int(kept.values.min()) < 0:
        r, t = token_position(kept.offsets, first_true(kept.values < 0))
        raise RecordsError(f"{b.at(r, 'kept_ids')} entry {t}: id {int(kept.row(r)[t])} is negative: "
                           "allowed ids >= 0")
    b.check_floats(klp, "kept_logprobs", True)
    b.at_most_zero(klp, "kept_logprobs")
    ov, ends = _check_kept_offsets(b, kept, offs)
    # Token -> kept entries, in flat (batch) coordinates; rows without a kept set get empty ranges.
    counts = np.zeros(out.tokens, dtype=np.int64)
    tok_row = out.row_of_token()
    per_tok = np.diff(ov)
    per_tok = np.delete(per_tok, ends[:-1]) if int(kept.valid.sum()) > 1 else per_tok
    have = kept.valid[tok_row]
    counts[have] = per_tok
    kto = np.zeros(out.tokens + 1, dtype=np.int64)
    np.cumsum(counts, out=kto[1:])
    out.kept = kept
    out.kept_logprobs = klp.values.astype(np.float32, copy=False)
    out.kept_token_offsets = kto
    _kept_extras(b, out, kept)


def _check_kept_offsets(b: _Batch, kept: Ragged, offs: Ragged) -> tuple[np.ndarray, np.ndarray]:
    """Offsets start at 0, never decrease and end at len(kept_ids) (null rows have none); returns the flat
    offsets and the flat index of each kept row's last offset."""
    ov = offs.values.astype(np.int64, copy=False)
    starts = offs.offsets[:-1][kept.valid]
    ends = offs.offsets[1:][kept.valid] - 1
    rows_valid = np.flatnonzero(kept.valid)
    if rows_valid.size:
        bad0 = ov[starts] != 0
        if bad0.any():
            i = int(rows_valid[first_true(bad0)])
            first = int(ov[starts[first_true(bad0)]])
            raise RecordsError(f"{b.at(i, 'kept_offsets')}: first offset {first}: allowed 0")
        badn = ov[ends] != kept.lengths[kept.valid]
        if badn.any():
            j = first_true(badn)
            i = int(rows_valid[j])
            raise RecordsError(f"{b.at(i, 'kept_offsets')}: last offset {int(ov[ends[j]])} for "
                               f"{int(kept.lengths[i])} kept_ids: allowed the number of kept ids")
        steps = np.diff(ov)
        inner = np.ones(steps.size, dtype=bool)
        inner[ends[:-1]] = False  # the step from one row's last offset to the next row's first is not a step
        dec = inner & (steps < 0)
        if dec.any():
            r, t = token_position(offs.offsets, first_true(dec))
            raise RecordsError(f"{b.at(r, 'kept_offsets', t)}: offsets decrease: "
                               "allowed non-decreasing offsets")
    return ov, ends


def _only_with_kept(b: _Batch, rag: Ragged, kept: Ragged, name: str) -> None:
    stray = rag.valid & ~kept.valid
    if stray.any():
        raise RecordsError(f"{b.at(first_true(stray), name)}: set on a row without kept_ids: allowed only "
                           "with a kept set")


def _kept_extras(b: _Batch, out: RecordsBatch, kept: Ragged) -> None:
    """kept_incomplete and trainer_kept_logits: only on rows with a kept set."""
    inc = np.zeros(out.tokens, dtype=bool)
    if "kept_incomplete" in b.arrays:
        rag = b.token_column("kept_incomplete")
        _only_with_kept(b, rag, kept, "kept_incomplete")
        inc[np.repeat(rag.valid, b.lengths)] = rag.values.astype(bool)
    out.kept_incomplete = inc
    if "trainer_kept_logits" in b.arrays:
        tkl = b.ragged("trainer_kept_logits")
        _only_with_kept(b, tkl, kept, "trainer_kept_logits")
        _one_per_kept_id(b, kept, tkl, "trainer_kept_logits", "logit")
        b.check_floats(tkl, "trainer_kept_logits", True)
        out.trainer_kept_logits = tkl


def _trainer_columns(b: _Batch, out: RecordsBatch, signs: bool) -> None:
    """The trainer's token columns: one value per token, ids >= 0, bounds finite and >= 0."""
    for name in TRAINER_TOKEN_COLUMNS:
        if name in b.arrays:
            out.trainer[name] = b.token_column(name, allow_inf=name not in NONNEGATIVE_COLUMNS)
    if "trainer_token_ids" in out.trainer:
        b.nonnegative_ids(out.trainer["trainer_token_ids"], "trainer_token_ids")
    for name in LOGPROB_COLUMNS if signs else ():
        if name in out.trainer:
            b.at_most_zero(out.trainer[name], name)
    for name in NONNEGATIVE_COLUMNS:
        opt = out.trainer.get(name)
        if opt is not None and opt.values.size and bool((opt.values < 0).any()):
            r, t = token_position(opt.offsets, first_true(opt.values < 0))
            raise RecordsError(f"{b.at(r, name, t)}: value {float(opt.row(r)[t])} is negative: "
                               "allowed a finite bound >= 0")


def _sampler_log_s(b: _Batch, out: RecordsBatch) -> None:
    """The sampler-side log S interval: lo and hi together, lo <= hi, lo never +inf, hi never -inf; and its source."""
    source, arrays = b.source, b.arrays
    partial = [c for c in ("sampler_log_s_lo", "sampler_log_s_hi") if c in arrays]
    if len(partial) == 1:
        raise RecordsError(f"{source}: column {partial[0]} without its other end: allowed sampler_log_s_lo and "
                           f"sampler_log_s_hi together")
    if partial:
        lo = b.token_column("sampler_log_s_lo")
        hi = b.ragged("sampler_log_s_hi")
        wrong = hi.valid != lo.valid
        if wrong.any():
            raise RecordsError(f"{b.at(first_true(wrong))}: sampler_log_s_lo and sampler_log_s_hi are not "
                               "set on the same rows: allowed both or neither")
        b.one_per_token(hi, "sampler_log_s_hi")
        bad = np.isnan(hi.values) | np.isneginf(hi.values) | (hi.values < lo.values)
        if bad.any():
            r, t = token_position(hi.offsets, first_true(bad))
            raise RecordsError(f"{b.at(r, 'sampler_log_s_hi', t)}: value {float(hi.row(r)[t])} with "
                               f"sampler_log_s_lo {float(lo.row(r)[t])}: allowed hi >= lo (hi may be +inf)")
        out.trainer["sampler_log_s_lo"], out.trainer["sampler_log_s_hi"] = lo, hi
    if "sampler_log_s_source" in arrays:
        src = arrays["sampler_log_s_source"].to_pylist()
        for i, v in enumerate(src):
            if v is not None and v not in SAMPLER_LOG_S_SOURCES:
                raise RecordsError(f"{b.at(i, 'sampler_log_s_source')}: {v!r} is not a source: allowed "
                                   f"{', '.join(SAMPLER_LOG_S_SOURCES)}")
        out.sampler_log_s_source = src
