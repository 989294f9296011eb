"""The records file format: per-token rollout data recorded anywhere, as Apache Parquet (schema_version 1).

One row per sampled sequence, list columns for per-token values: the sampler's side (required), its
kept sets S_q in CSR layout, the trainer's side and a sampler-side log S (optional); README's "The
records format" lists every column. ``schema_version`` is a column too, so a file rewritten by a tool
that drops Parquet key-value metadata is still recognised. The reader validates each batch as it
streams and refuses bad input with the file, row, column, value and what is allowed; statistical
problems of valid data are left to the analysis, which counts and gates them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from parity.core.spec import SamplingSpec
from parity.errors import PathNotFound, UsageError
from parity.records.accumulators import CastNote

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = (1,)
METADATA_KEY = b"parity.records"
# A row group holds at most this many tokens (or kept entries, whichever fills first), so a reader's
# memory is bounded by one row group whatever the file's size.
ROW_GROUP_TOKENS = 65_536
ROW_GROUP_KEPT = 4_194_304
# Reading: rows per validated batch (the analysis holds one batch at a time, so memory grows with it),
# and the read buffer that streams a column chunk page by page instead of loading it whole: a batch's
# memory does not depend on how large the writer made its row groups.
MAX_BATCH_ROWS = 16_384
READ_BUFFER_BYTES = 1 << 20


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    required: bool
    per: str  # "sequence", "token" (one value per completion token), "kept" (aligned with kept_ids), "offsets"
    doc: str


_I32 = pa.list_(pa.int32())
_F32 = pa.list_(pa.float32())
_F64 = pa.list_(pa.float64())
_BOOL = pa.list_(pa.bool_())

COLUMNS: tuple[Column, ...] = (
    Column("schema_version", pa.int32(), True, "sequence", "format version of this row; this parity reads 1"),
    Column("prompt_ids", _I32, True, "sequence", "prompt token ids (may be empty unless re-scoring with --model)"),
    Column("completion_ids", _I32, True, "sequence", "sampled token ids, L of them"),
    Column("temperature", pa.float64(), True, "sequence", "sampling temperature in [0, 2]; 0 = greedy"),
    Column("top_k", pa.int64(), True, "sequence", "0 or -1 = off, else >= 1"),
    Column("top_p", pa.float64(), True, "sequence", "in (0, 1]; 1 = off"),
    Column("min_p", pa.float64(), True, "sequence", "in [0, 1]; 0 = off"),
    Column("sampler_logprobs", _F32, True, "token", "the sampler's processed log-prob of each sampled token"),
    Column("scenario", pa.string(), False, "sequence", "group name in the report (default: the spec's label)"),
    Column("prompt_index", pa.int64(), False, "sequence", "prompt number, used to name positions in verdicts"),
    Column("seed", pa.int64(), False, "sequence", "per-request sampling seed"),
    Column("step", pa.int64(), False, "sequence", "training step the rollout belongs to"),
    Column("kept_ids", _I32, False, "kept", "the sampler's kept set S_q of every position, back to back"),
    Column("kept_offsets", pa.list_(pa.int64()), False, "offsets", "L + 1 offsets into kept_ids: position t is [o[t], o[t+1])"),
    Column("kept_logprobs", _F32, False, "kept", "the sampler's processed log-probs of kept_ids"),
    Column("kept_incomplete", _BOOL, False, "token", "True where the captured head may not hold the whole support"),
    Column("trainer_logprobs", _F64, False, "token", "the trainer under test's log-prob of each sampled token"),
    Column("trainer_token_ids", _I32, False, "token", "the token the trainer scored at each position (absent: completion_ids)"),
    Column("trainer_full_logprobs", _F64, False, "token", "log_softmax(z / T)[y] over the whole vocabulary"),
    Column("trainer_replay_logprobs", _F64, False, "token", "trainer logits renormalised over S_q"),
    Column("trainer_recompute_logprobs", _F64, False, "token", "trainer logits renormalised over the recomputed filters"),
    Column("trainer_log_s", _F64, False, "token", "log S predicted from the trainer's logits: logsumexp over S_q - logsumexp"),
    Column("trainer_recompute_forced", _BOOL, False, "token", "recompute had to force-include the sampled token"),
    Column("trainer_recompute_support_equal", _BOOL, False, "token", "the recomputed support equals S_q"),
    Column("trainer_bound", _F64, False, "token", "rounding bound on |trainer - sampler| over S_q, >= 0 "
           "(parity.core.error_model.logprob_bound on the trainer's scaled logits)"),
    Column("trainer_bound_full", _F64, False, "token", "the same bound over the whole vocabulary (the naive estimator's), >= 0"),
    Column("trainer_systematic", _F64, False, "token", "what of |trainer - sampler| can point one way, >= 0 "
           "(parity.core.error_model.systematic_bound); absent: the float32 storage term 2 u |lp| alone"),
    Column("sampler_log_s_lo", _F64, False, "token", "log S from the sampler's side lies in [lo, hi] (raw-logits pass or the "
           "top_p bracket); lo may be -inf"),
    Column("sampler_log_s_hi", _F64, False, "token", "upper end of the sampler-side log S interval; may be +inf"),
    Column("sampler_log_s_source", pa.string(), False, "sequence", "where the sampler-side log S comes from: raw_logits, "
           "top_p_bracket or unfiltered"),
    Column("trainer_kept_logits", _F32, False, "kept", "the trainer's raw logits (before temperature) at kept_ids"),
)
BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}
REQUIRED = tuple(c.name for c in COLUMNS if c.required)
KEPT_GROUP = ("kept_ids", "kept_offsets", "kept_logprobs")  # present together or not at all
TRAINER_TOKEN_COLUMNS = tuple(c.name for c in COLUMNS if c.name.startswith("trainer_") and c.per == "token")
NONNEGATIVE_COLUMNS = ("trainer_bound", "trainer_bound_full", "trainer_systematic")  # finite and >= 0
SAMPLER_LOG_S_SOURCES = ("raw_logits", "top_p_bracket", "unfiltered")


def records_schema(metadata: Mapping[str, Any] | None = None) -> pa.Schema:
    """The pyarrow schema of a records file (every column; optional ones nullable)."""
    fields = [pa.field(c.name, c.type, nullable=not c.required) for c in COLUMNS]
    return pa.schema(fields, metadata={METADATA_KEY: _meta_blob(metadata)})


def _meta_blob(metadata: Mapping[str, Any] | None) -> bytes:
    return json.dumps({"schema_version": SCHEMA_VERSION, "metadata": dict(metadata or {})}, sort_keys=True).encode()


class RecordsError(UsageError):
    """Bad records input. The message names the file, the row, the column, the value and what is allowed."""


def _where(source: str, row: int | None = None, column: str | None = None, position: int | None = None) -> str:
    out = source
    if row is not None:
        out += f" row {row}"
    if column is not None:
        out += f" column {column}"
    if position is not None:
        out += f" position {position}"
    return out


# ==================================================================================================
# a validated batch
# ==================================================================================================


@dataclass
class Ragged:
    """A list column as flat values and per-row offsets (null rows: ``valid`` False, no values)."""

    offsets: np.ndarray  # int64 [n + 1] into values
    values: np.ndarray
    valid: np.ndarray  # bool [n]

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row(self, i: int) -> np.ndarray:
        return self.values[self.offsets[i] : self.offsets[i + 1]]


@dataclass
class RecordsBatch:
    """Rows of a records file after validation, as flat numpy arrays.

    Token arrays are aligned with ``completion.values`` (``token_offsets`` maps rows to tokens); kept
    arrays with ``kept.values``, and ``kept_token_offsets`` maps tokens to their kept entries.
    """

    source: str
    first_row: int
    n_rows: int
    columns: tuple[str, ...]  # known columns present in the batch
    ignored_columns: tuple[str, ...]  # columns this version does not read
    prompt: Ragged
    completion: Ragged
    sampler_logprobs: np.ndarray  # float32 [T]
    specs: list[SamplingSpec]  # unique specs of the batch
    spec_index: np.ndarray  # int64 [n]: row -> specs
    scenario: list[str | None]
    prompt_index: np.ndarray | None  # int64 [n] (-1 where null) or None
    seed: np.ndarray | None
    step: np.ndarray | None
    kept: Ragged | None = None  # kept ids (valid where the row has a kept set)
    kept_logprobs: np.ndarray | None = None  # float32, aligned with kept.values
    kept_token_offsets: np.ndarray | None = None  # int64 [T + 1] into kept.values (rows without a set: empty)
    kept_incomplete: np.ndarray | None = None  # bool [T] (False where absent)
    trainer: dict[str, Ragged] = field(default_factory=dict)  # token columns trainer_*, sampler_log_s_* (validity per row)
    sampler_log_s_source: list[str | None] | None = None
    trainer_kept_logits: Ragged | None = None  # aligned with kept.values; valid per row
    casts: dict[str, CastNote] = field(default_factory=dict)  # column -> what reading float64 as float32 changed

    @property
    def tokens(self) -> int:
        return int(self.completion.offsets[-1])

    @property
    def token_offsets(self) -> np.ndarray:
        return self.completion.offsets

    def row_of_token(self) -> np.ndarray:
        return np.repeat(np.arange(self.n_rows, dtype=np.int64), self.completion.lengths)

    def spec_of(self, i: int) -> SamplingSpec:
        return self.specs[int(self.spec_index[i])]

    def kept_rows(self) -> np.ndarray:
        return self.kept.valid if self.kept is not None else np.zeros(self.n_rows, dtype=bool)


def _as_array(batch: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    col = batch.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col


def _cast(arr: pa.Array, col: Column, source: str, first_row: int, notes: dict[str, CastNote] | None = None) -> pa.Array:
    """``arr`` as the column's type: other integer and float widths are cast (an integer out of range and
    a float that is not a whole number where an integer is wanted are refused); a float64 column read as
    float32 is rounded, and what that changed is noted in ``notes``."""
    if arr.type.equals(col.type):
        return arr
    target = col.type
    ok_source = (
        (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) if pa.types.is_list(target) else not (
            pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)
        )
    )
    if ok_source and pa.types.is_null(arr.type):
        return pa.nulls(len(arr), target)
    try:
        if not ok_source:
            raise pa.ArrowInvalid("list vs scalar")
        out = arr.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise RecordsError(
            f"{_where(source, column=col.name)}: type {arr.type} cannot be read as {target} ({exc}): allowed {target} "
            f"({col.doc}), rows {first_row}..{first_row + len(arr) - 1}"
        ) from None
    if notes is not None:
        note = _narrowing(arr, out, col.name)
        if note is not None:
            notes[col.name] = note
    return out


def _element_type(t: pa.DataType) -> pa.DataType:
    return t.value_type if pa.types.is_list(t) or pa.types.is_large_list(t) else t


def _narrowing(arr: pa.Array, out: pa.Array, name: str) -> CastNote | None:
    """What reading float64 values as float32 changed (rounding, tiny values to 0, huge ones to +-inf)."""
    src, dst = _element_type(arr.type), _element_type(out.type)
    if not (pa.types.is_float64(src) and pa.types.is_float32(dst)):
        return None
    nested = pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)
    a = np.asarray((arr.flatten() if nested else arr).drop_null().to_numpy(zero_copy_only=False), dtype=np.float64)
    b = np.asarray((out.flatten() if nested else out).drop_null().to_numpy(zero_copy_only=False), dtype=np.float64)
    with np.errstate(invalid="ignore"):
        changed = ~((a == b) | (np.isnan(a) & np.isnan(b)))
        overflow = np.isfinite(a) & ~np.isfinite(b)
        rounded = changed & ~overflow
        max_change = float(np.abs(a[rounded] - b[rounded]).max()) if rounded.any() else 0.0
    return CastNote(column=name, source_type=str(src), target_type=str(dst), values=int(a.size),
                    changed=int(changed.sum()), overflowed=int(overflow.sum()), max_change=max_change)


def _valid(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return _np(arr.is_valid()).astype(bool)


# Arrow types whose value buffer has numpy's layout.
_NUMPY_LAYOUT: dict[pa.DataType, np.dtype[Any]] = {
    t: np.dtype(d)
    for t, d in ((pa.int8(), np.int8), (pa.int16(), np.int16), (pa.int32(), np.int32), (pa.int64(), np.int64),
                 (pa.uint8(), np.uint8), (pa.uint16(), np.uint16), (pa.uint32(), np.uint32), (pa.uint64(), np.uint64),
                 (pa.float16(), np.float16), (pa.float32(), np.float32), (pa.float64(), np.float64))
}


def _raw(arr: pa.Array) -> np.ndarray | None:
    """A read-only view of a fixed-width array's values, null slots included (whatever they hold); None for
    other types. Arrow's own conversion (``to_numpy``) imports pandas on first use: 0.4 s of a command's start."""
    dtype = _NUMPY_LAYOUT.get(arr.type)
    if dtype is None:
        return None
    if len(arr) == 0:
        return np.zeros(0, dtype=dtype)
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _np(arr: pa.Array) -> np.ndarray:
    """Values as numpy (booleans through int8)."""
    if pa.types.is_boolean(arr.type):
        return _np(arr.cast(pa.int8())).astype(bool)
    raw = _raw(arr) if arr.null_count == 0 else None
    return raw if raw is not None else np.asarray(arr.to_numpy(zero_copy_only=False))


def _ragged(arr: pa.Array, name: str, source: str, first_row: int) -> Ragged:
    valid = _valid(arr)
    # Lengths from the list offsets (a null row may span values in Arrow: it counts 0 here, and flatten skips them).
    lengths = np.diff(_np(arr.offsets).astype(np.int64))
    if arr.null_count:
        lengths = np.where(valid, lengths, 0)
    offsets = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = arr.flatten()  # skips the slices behind null rows
    if values.null_count:
        nulls = ~_valid(values)
        r, t = _token_position(offsets, _first(nulls))
        raise RecordsError(
            f"{_where(source, first_row + r, name, t)}: a null inside the list: allowed {BY_NAME[name].doc}, "
            f"no null entries (a whole row may be null where the column is optional)"
        )
    return Ragged(offsets, _np(values), valid)


def _scalar(arr: pa.Array, fill: Any) -> np.ndarray:
    raw = _raw(arr)
    if raw is None:
        return np.asarray(arr.fill_null(fill).to_numpy(zero_copy_only=False))
    return raw if arr.null_count == 0 else np.where(_valid(arr), raw, np.asarray(fill, dtype=raw.dtype))


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _token_position(offsets: np.ndarray, flat_index: int) -> tuple[int, int]:
    """Row and position within the row of a flat index into a ragged column."""
    row = int(np.searchsorted(offsets, flat_index, side="right") - 1)
    return row, flat_index - int(offsets[row])


def validate_batch(
    batch: pa.RecordBatch | pa.Table,
    *,
    source: str = "batch",
    first_row: int = 0,
) -> RecordsBatch:
    """Check one batch of records rows and return it as flat arrays; raise :class:`RecordsError` on bad input.

    ``source`` and ``first_row`` name where the rows come from (a file and the row number of the batch's
    first row), so an error points at the row to fix.
    """
    names = set(batch.schema.names)
    missing = [c for c in REQUIRED if c not in names]
    if missing:
        raise RecordsError(
            f"{source}: missing required column(s) {', '.join(missing)}: a records file (schema_version "
            f"{SCHEMA_VERSION}) needs {', '.join(REQUIRED)}"
        )
    n = batch.num_rows
    casts: dict[str, CastNote] = {}
    arrays = {name: _cast(_as_array(batch, name), BY_NAME[name], source, first_row, casts) for name in names if name in BY_NAME}
    # An optional column with no value in this batch is as good as absent (writers emit every column).
    for name in [k for k, a in arrays.items() if not BY_NAME[k].required and a.null_count == len(a) and len(a)]:
        del arrays[name]
    names = set(arrays) | (names - set(BY_NAME))
    partial = [c for c in KEPT_GROUP if c in names]
    if partial and len(partial) != len(KEPT_GROUP):
        absent = [c for c in KEPT_GROUP if c not in names]
        raise RecordsError(
            f"{source}: column(s) {', '.join(partial)} present without (or with no value in) {', '.join(absent)}: a kept set needs "
            f"{', '.join(KEPT_GROUP)} together"
        )
    ignored = tuple(sorted(names - set(BY_NAME)))

    def row(i: int) -> int:
        return first_row + int(i)

    for name in REQUIRED:
        nulls = ~_valid(arrays[name])
        if nulls.any():
            raise RecordsError(f"{_where(source, row(_first(nulls)), name)}: value is null: allowed {BY_NAME[name].doc}")

    version = _scalar(arrays["schema_version"], 0)
    bad = ~np.isin(version, SUPPORTED_VERSIONS)
    if bad.any():
        i = _first(bad)
        raise RecordsError(
            f"{_where(source, row(i), 'schema_version')}: schema_version {int(version[i])} is not supported: this "
            f"parity reads schema_version {', '.join(map(str, SUPPORTED_VERSIONS))} (a newer parity may read it)"
        )

    prompt = _ragged(arrays["prompt_ids"], "prompt_ids", source, first_row)
    completion = _ragged(arrays["completion_ids"], "completion_ids", source, first_row)
    lengths = completion.lengths
    for name, rag in (("prompt_ids", prompt), ("completion_ids", completion)):
        if rag.values.size and int(rag.values.min()) < 0:
            r, t = _token_position(rag.offsets, _first(rag.values < 0))
            raise RecordsError(
                f"{_where(source, row(r), name, t)}: token id {int(rag.row(r)[t])} is negative: allowed ids >= 0"
            )

    def token_column(name: str, *, allow_inf: bool = True) -> Ragged:
        rag = _ragged(arrays[name], name, source, first_row)
        rag_len = rag.lengths
        wrong = rag.valid & (rag_len != lengths)
        if wrong.any():
            i = _first(wrong)
            raise RecordsError(
                f"{_where(source, row(i), name)}: {int(rag_len[i])} values for {int(lengths[i])} completion_ids: "
                f"allowed one value per completion token"
            )
        if rag.values.dtype.kind == "f":
            _check_floats(rag, name, allow_inf)
        return rag

    def _check_floats(rag: Ragged, name: str, allow_inf: bool) -> None:
        vals = rag.values
        if not vals.size:
            return
        top = vals.max()  # NaN if any value is NaN: one pass where the values are good
        if not np.isnan(top) and top != np.inf and (allow_inf or vals.min() != -np.inf):
            return
        nan = np.isnan(vals)
        if nan.any():
            r, t = _token_position(rag.offsets, _first(nan))
            raise RecordsError(
                f"{_where(source, row(r), name, t)}: value is NaN: allowed a finite number"
                + (" or -inf" if allow_inf else "")
            )
        bad_inf = np.isposinf(vals) if allow_inf else ~np.isfinite(vals)
        if bad_inf.any():
            r, t = _token_position(rag.offsets, _first(bad_inf))
            raise RecordsError(
                f"{_where(source, row(r), name, t)}: value is {float(vals[_first(bad_inf)])}: allowed a finite number"
                + (" or -inf" if allow_inf else "")
            )

    sampler = token_column("sampler_logprobs")

    # -- the sampling spec: each distinct spec is checked once, by SamplingSpec itself -----------------
    spec_cols = [_scalar(arrays[c], 0) for c in ("temperature", "top_k", "top_p", "min_p")]
    keys = np.stack([spec_cols[0].astype(np.float64), spec_cols[1].astype(np.float64),
                     spec_cols[2].astype(np.float64), spec_cols[3].astype(np.float64)], axis=1)
    uniq, spec_index = np.unique(keys, axis=0, return_inverse=True) if n else (np.zeros((0, 4)), np.zeros(0, np.int64))
    specs: list[SamplingSpec] = []
    for j, (t, k, p, m) in enumerate(uniq):
        try:
            specs.append(SamplingSpec(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m)))
        except ValueError as exc:
            i = _first(np.asarray(spec_index).reshape(-1) == j)
            raise RecordsError(f"{_where(source, row(i))}: {exc}") from None

    out = RecordsBatch(
        source=source,
        first_row=first_row,
        n_rows=n,
        columns=tuple(sorted(names & set(BY_NAME))),
        ignored_columns=ignored,
        prompt=prompt,
        completion=completion,
        sampler_logprobs=sampler.values.astype(np.float32, copy=False),
        specs=specs,
        spec_index=np.asarray(spec_index, dtype=np.int64).reshape(-1),
        scenario=arrays["scenario"].to_pylist() if "scenario" in arrays else [None] * n,
        prompt_index=_scalar(arrays["prompt_index"], -1).astype(np.int64) if "prompt_index" in arrays else None,
        seed=_scalar(arrays["seed"], -1).astype(np.int64) if "seed" in arrays else None,
        step=_scalar(arrays["step"], -1).astype(np.int64) if "step" in arrays else None,
        casts={k: v for k, v in casts.items() if k in arrays},
    )

    # -- the kept set (CSR per row) ---------------------------------------------------------------
    if "kept_ids" in arrays:
        kept = _ragged(arrays["kept_ids"], "kept_ids", source, first_row)
        offs = _ragged(arrays["kept_offsets"], "kept_offsets", source, first_row)
        klp = _ragged(arrays["kept_logprobs"], "kept_logprobs", source, first_row)
        for name, rag in (("kept_offsets", offs), ("kept_logprobs", klp)):
            mismatch = rag.valid != kept.valid
            if mismatch.any():
                i = _first(mismatch)
                have, lack = ("kept_ids", name) if kept.valid[i] else (name, "kept_ids")
                raise RecordsError(f"{_where(source, row(i))}: {have} is set but {lack} is null: allowed both or neither")

        def one_per_kept_id(rag: Ragged, name: str, what: str) -> None:
            wrong = rag.valid & (rag.lengths != kept.lengths)
            if wrong.any():
                i = _first(wrong)
                raise RecordsError(
                    f"{_where(source, row(i), name)}: {int(rag.lengths[i])} values for {int(kept.lengths[i])} "
                    f"kept_ids: allowed one {what} per kept id"
                )

        one_per_kept_id(klp, "kept_logprobs", "log-prob")  # klp.valid == kept.valid, checked above
        wrong = kept.valid & (offs.lengths != lengths + 1)
        if wrong.any():
            i = _first(wrong)
            raise RecordsError(
                f"{_where(source, row(i), 'kept_offsets')}: {int(offs.lengths[i])} offsets for {int(lengths[i])} "
                f"completion_ids: allowed L + 1 = {int(lengths[i]) + 1} (position t's ids are kept_ids[o[t]:o[t+1]])"
            )
        if kept.values.size and int(kept.values.min()) < 0:
            r, t = _token_position(kept.offsets, _first(kept.values < 0))
            raise RecordsError(f"{_where(source, row(r), 'kept_ids')} entry {t}: id {int(kept.row(r)[t])} is negative: allowed ids >= 0")
        _check_floats(klp, "kept_logprobs", True)
        # Offsets: start at 0, never decrease, end at len(kept_ids). Null rows have no offsets at all.
        ov = offs.values.astype(np.int64, copy=False)
        starts = offs.offsets[:-1][kept.valid]
        ends = offs.offsets[1:][kept.valid] - 1
        rows_valid = np.flatnonzero(kept.valid)
        if rows_valid.size:
            bad0 = ov[starts] != 0
            if bad0.any():
                i = int(rows_valid[_first(bad0)])
                raise RecordsError(f"{_where(source, row(i), 'kept_offsets')}: first offset {int(ov[starts[_first(bad0)]])}: allowed 0")
            badn = ov[ends] != kept.lengths[kept.valid]
            if badn.any():
                j = _first(badn)
                i = int(rows_valid[j])
                raise RecordsError(
                    f"{_where(source, row(i), 'kept_offsets')}: last offset {int(ov[ends[j]])} for {int(kept.lengths[i])} "
                    f"kept_ids: allowed the number of kept ids"
                )
            steps = np.diff(ov)
            inner = np.ones(steps.size, dtype=bool)
            inner[ends[:-1]] = False  # the step from one row's last offset to the next row's first is not a step
            dec = inner & (steps < 0)
            if dec.any():
                r, t = _token_position(offs.offsets, _first(dec))
                raise RecordsError(f"{_where(source, row(r), 'kept_offsets', t)}: offsets decrease: allowed non-decreasing offsets")
        # Token -> kept entries, in flat (batch) coordinates; rows without a kept set get empty ranges.
        counts = np.zeros(out.tokens, dtype=np.int64)
        tok_row = out.row_of_token()
        per_tok = np.diff(ov)
        per_tok = np.delete(per_tok, ends[:-1]) if rows_valid.size > 1 else per_tok
        have = kept.valid[tok_row]
        counts[have] = per_tok
        kto = np.zeros(out.tokens + 1, dtype=np.int64)
        np.cumsum(counts, out=kto[1:])
        out.kept = kept
        out.kept_logprobs = klp.values.astype(np.float32, copy=False)
        out.kept_token_offsets = kto
        inc = np.zeros(out.tokens, dtype=bool)
        if "kept_incomplete" in arrays:
            rag = token_column("kept_incomplete")
            stray = rag.valid & ~kept.valid
            if stray.any():
                raise RecordsError(f"{_where(source, row(_first(stray)), 'kept_incomplete')}: set on a row without kept_ids: allowed only with a kept set")
            inc[np.repeat(rag.valid, lengths)] = rag.values.astype(bool)
        out.kept_incomplete = inc
        if "trainer_kept_logits" in arrays:
            tkl = _ragged(arrays["trainer_kept_logits"], "trainer_kept_logits", source, first_row)
            stray = tkl.valid & ~kept.valid
            if stray.any():
                raise RecordsError(f"{_where(source, row(_first(stray)), 'trainer_kept_logits')}: set on a row without kept_ids")
            one_per_kept_id(tkl, "trainer_kept_logits", "logit")
            _check_floats(tkl, "trainer_kept_logits", True)
            out.trainer_kept_logits = tkl
    else:
        for name in ("kept_incomplete", "trainer_kept_logits"):
            if name in arrays and bool(_valid(arrays[name]).any()):
                raise RecordsError(f"{source}: column {name} is set but there is no kept set (kept_ids, kept_offsets, kept_logprobs)")

    for name in TRAINER_TOKEN_COLUMNS:
        if name in arrays:
            out.trainer[name] = token_column(name, allow_inf=name not in NONNEGATIVE_COLUMNS)
    if "trainer_token_ids" in out.trainer:
        rag = out.trainer["trainer_token_ids"]
        if rag.values.size and int(rag.values.min()) < 0:
            r, t = _token_position(rag.offsets, _first(rag.values < 0))
            raise RecordsError(
                f"{_where(source, row(r), 'trainer_token_ids', t)}: token id {int(rag.row(r)[t])} is negative: allowed ids >= 0"
            )
    for name in NONNEGATIVE_COLUMNS:
        opt = out.trainer.get(name)
        if opt is not None and opt.values.size and bool((opt.values < 0).any()):
            r, t = _token_position(opt.offsets, _first(opt.values < 0))
            raise RecordsError(
                f"{_where(source, row(r), name, t)}: value {float(opt.row(r)[t])} is negative: allowed a finite bound >= 0"
            )
    # The sampler-side log S interval: lo and hi together, lo <= hi, lo never +inf, hi never -inf.
    partial = [c for c in ("sampler_log_s_lo", "sampler_log_s_hi") if c in arrays]
    if len(partial) == 1:
        raise RecordsError(f"{source}: column {partial[0]} without its other end: allowed sampler_log_s_lo and "
                           f"sampler_log_s_hi together")
    if partial:
        lo = token_column("sampler_log_s_lo")
        hi_arr = arrays["sampler_log_s_hi"]
        hi = _ragged(hi_arr, "sampler_log_s_hi", source, first_row)
        wrong = hi.valid != lo.valid
        if wrong.any():
            raise RecordsError(f"{_where(source, row(_first(wrong)))}: sampler_log_s_lo and sampler_log_s_hi are not set on "
                               f"the same rows: allowed both or neither")
        wrong = hi.valid & (hi.lengths != lengths)
        if wrong.any():
            i = _first(wrong)
            raise RecordsError(f"{_where(source, row(i), 'sampler_log_s_hi')}: {int(hi.lengths[i])} values for "
                               f"{int(lengths[i])} completion_ids: allowed one value per completion token")
        bad = np.isnan(hi.values) | np.isneginf(hi.values) | (hi.values < lo.values)
        if bad.any():
            r, t = _token_position(hi.offsets, _first(bad))
            raise RecordsError(
                f"{_where(source, row(r), 'sampler_log_s_hi', t)}: value {float(hi.row(r)[t])} with sampler_log_s_lo "
                f"{float(lo.row(r)[t])}: allowed hi >= lo (hi may be +inf)"
            )
        out.trainer["sampler_log_s_lo"], out.trainer["sampler_log_s_hi"] = lo, hi
    if "sampler_log_s_source" in arrays:
        src = arrays["sampler_log_s_source"].to_pylist()
        for i, v in enumerate(src):
            if v is not None and v not in SAMPLER_LOG_S_SOURCES:
                raise RecordsError(f"{_where(source, row(i), 'sampler_log_s_source')}: {v!r} is not a source: allowed "
                                   f"{', '.join(SAMPLER_LOG_S_SOURCES)}")
        out.sampler_log_s_source = src
    return out


# ==================================================================================================
# reading
# ==================================================================================================


@dataclass
class RecordsFile:
    """An open records file: checked footer, schema and version; rows are streamed by :meth:`batches`.

    ``page_checksums``: whether the file's pages carry CRC checksums (:func:`page_checksums`); without
    them a corrupt page may read as data, and the analysis cannot tell it from a sampler or trainer fault.
    """

    path: Path
    parquet: pq.ParquetFile
    metadata: dict[str, Any]
    page_checksums: bool | None = None

    @property
    def num_rows(self) -> int:
        return int(self.parquet.metadata.num_rows)

    @property
    def columns(self) -> list[str]:
        return list(self.parquet.schema_arrow.names)

    def batches(self, *, columns: Sequence[str] | None = None, batch_rows: int = 1024) -> Iterator[RecordsBatch]:
        """Validated batches of at most ``batch_rows`` whole rows (sequences), never spanning a row group.

        The file is read through a buffer of :data:`READ_BUFFER_BYTES` (page by page), so one batch's
        memory follows ``batch_rows`` (at most :data:`MAX_BATCH_ROWS`), not the writer's row-group size.
        ``columns`` limits what is read (required columns are always read).
        """
        check_batch_rows(batch_rows, "batch_rows")
        names = self.columns
        wanted = names if columns is None else [c for c in names if c in set(columns) | set(REQUIRED)]
        md = self.parquet.metadata
        first = 0
        for g in range(md.num_row_groups):
            rows = md.row_group(g).num_rows
            try:
                # Columns decode on pyarrow's threads (what a plain scan gets): 0.4 s of 4 s on 2M tokens over
                # two cores, for about 10 % more memory per batch.
                it = self.parquet.iter_batches(batch_size=batch_rows, row_groups=[g], columns=wanted, use_threads=True)
                start = first
                for rb in it:
                    yield validate_batch(rb, source=str(self.path), first_row=start)
                    start += rb.num_rows
            except RecordsError:
                raise
            except (OSError, pa.ArrowException) as exc:
                raise RecordsError(
                    f"{self.path}: rows {first}..{first + rows - 1} (row group {g}) cannot be read, the file is "
                    f"truncated or corrupt: {exc}"
                ) from None
            first += rows


def check_batch_rows(value: int, name: str = "batch_rows") -> int:
    """``value`` if it is a row count a batch may hold (1..:data:`MAX_BATCH_ROWS`); else a UsageError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH_ROWS:
        raise UsageError(
            f"{name} {value!r} is out of range: allowed an integer from 1 to {MAX_BATCH_ROWS:,} (rows per streamed "
            f"batch; the analysis holds one batch at a time, so its memory grows with this number)"
        )
    return value


def _first_page_has_crc(f: BinaryIO, offset: int) -> bool | None:
    """Whether the Parquet page header at ``offset`` carries its ``crc`` (field 4 of the Thrift compact
    ``PageHeader``, after the three i32 fields type and the two page sizes); None if it cannot be told."""
    f.seek(offset)
    head = f.read(64)
    pos, field_id = 0, 0
    while pos < len(head):
        byte = head[pos]
        pos += 1
        if byte == 0:  # end of the struct: no crc
            return False
        delta, kind = byte >> 4, byte & 0x0F
        if delta == 0:  # long-form field header: not what a Parquet writer emits for these fields
            return None
        field_id += delta
        if field_id == 4:
            return kind == 5  # i32
        if field_id > 4:
            return False
        if kind != 5:
            return None
        while pos < len(head) and head[pos] & 0x80:  # the i32's varint
            pos += 1
        pos += 1
    return None


def page_checksums(path: str | Path, md: pq.FileMetaData) -> bool | None:
    """Whether the pages of ``path`` carry CRC checksums (pyarrow writes them with ``write_page_checksum=True``).

    Read from the first page header of every column chunk of the first row group (a writer checksums
    every page or none): False if any lacks one, None if the file has no row group or a header cannot
    be read.
    """
    if md.num_row_groups == 0:
        return None
    rg = md.row_group(0)
    seen: list[bool | None] = []
    try:
        with open(path, "rb") as f:
            for i in range(rg.num_columns):
                c = rg.column(i)
                offset = c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset
                seen.append(_first_page_has_crc(f, int(offset)))
    except OSError:
        return None
    if False in seen:
        return False
    return None if None in seen or not seen else True


def file_metadata(raw: bytes, source: str) -> dict[str, Any]:
    """The facts of a file's ``parity.records`` key-value metadata, in either layout README documents:
    ``{"schema_version": 1, "metadata": {facts}}`` (what parity writes) or the facts next to the version,
    ``{"schema_version": 1, "model": ..., "dtype": ...}``. The version must be one this parity reads."""
    key = METADATA_KEY.decode()
    layouts = '{"schema_version": 1, "model": ..., ...} or {"schema_version": 1, "metadata": {"model": ..., ...}}'
    try:
        blob = json.loads(raw)
    except ValueError:
        raise RecordsError(f"{source}: key-value metadata {key!r} is not JSON: allowed a JSON object, {layouts}") from None
    if not isinstance(blob, dict):
        raise RecordsError(f"{source}: key-value metadata {key!r} is a JSON {type(blob).__name__}: allowed a JSON object, {layouts}")
    version = blob.get("schema_version")
    if version not in SUPPORTED_VERSIONS:
        said = (f"file metadata {key!r} has no schema_version" if "schema_version" not in blob
                else f"schema_version {version!r} (file metadata) is not supported")
        raise RecordsError(
            f"{source}: {said}: this parity reads schema_version {', '.join(map(str, SUPPORTED_VERSIONS))} (a newer "
            f"parity may read it), {layouts}"
        )
    nested = blob.get("metadata", {})
    if nested is None:
        nested = {}
    if not isinstance(nested, dict):
        raise RecordsError(
            f"{source}: key-value metadata {key!r} field 'metadata' is a JSON {type(nested).__name__}: allowed an object of facts"
        )
    flat = {k: v for k, v in blob.items() if k not in ("schema_version", "metadata")}
    clash = sorted(k for k in flat if k in nested and nested[k] != flat[k])
    if clash:
        raise RecordsError(
            f"{source}: key-value metadata {key!r} gives {', '.join(clash)} twice with different values (next to "
            f"schema_version and under 'metadata'): allowed one value per fact"
        )
    return {**flat, **nested}


def open_records(path: str | Path) -> RecordsFile:
    """Open a records file, refusing what is not one (with the file named) before any row is read."""
    p = Path(path)
    if not p.is_file():
        raise PathNotFound(f"records file {str(p)!r} does not exist")
    try:
        pf = pq.ParquetFile(p, page_checksum_verification=True, pre_buffer=False, buffer_size=READ_BUFFER_BYTES)
    except (OSError, pa.ArrowException) as exc:
        raise RecordsError(f"{p}: not a readable Parquet file, refused before row 0 (truncated or corrupt?): {exc}") from None
    meta: dict[str, Any] = {}
    raw = (pf.schema_arrow.metadata or {}).get(METADATA_KEY)
    if raw is not None:
        meta = file_metadata(raw, str(p))
    missing = [c for c in REQUIRED if c not in pf.schema_arrow.names]
    if missing:
        raise RecordsError(
            f"{p}: missing required column(s) {', '.join(missing)}: a records file (schema_version {SCHEMA_VERSION}) "
            f"needs {', '.join(REQUIRED)}"
        )
    return RecordsFile(p, pf, meta, page_checksums(p, pf.metadata))


def records_paths(path: str | Path) -> list[Path]:
    """A records file, or every ``*.parquet`` file under a directory (sorted, so shard order is stable)."""
    p = Path(path)
    if p.is_dir():
        found = sorted(q for q in p.rglob("*.parquet") if q.is_file())
        if not found:
            raise PathNotFound(f"records directory {str(p)!r} holds no *.parquet file")
        return found
    if not p.exists():
        raise PathNotFound(f"records path {str(p)!r} does not exist")
    return [p]


# ==================================================================================================
# writing
# ==================================================================================================


def _listify(v: Any) -> Any:
    if v is None:
        return None
    if hasattr(v, "detach"):  # torch tensor
        v = v.detach().cpu().numpy()
    if isinstance(v, np.ndarray):
        return v.reshape(-1).tolist()
    return list(v)


def records_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows (dicts keyed by column name; lists, numpy arrays or tensors as values) → a records table.

    ``schema_version`` is filled in; unknown keys are refused (a typo would otherwise drop a column).
    Only the columns some row sets are kept.
    """
    present: list[str] = []
    for i, r in enumerate(rows):
        unknown = set(r) - set(BY_NAME)
        if unknown:
            raise RecordsError(f"row {i}: unknown column(s) {sorted(unknown)}: allowed {', '.join(BY_NAME)}")
        present += [k for k in r if k not in present]
    names = [c.name for c in COLUMNS if c.name in present or c.required]
    data: dict[str, list[Any]] = {name: [] for name in names}
    for r in rows:
        for name in names:
            col = BY_NAME[name]
            v = SCHEMA_VERSION if name == "schema_version" and name not in r else r.get(name)
            data[name].append(_listify(v) if pa.types.is_list(col.type) else v)
    schema = pa.schema([pa.field(n, BY_NAME[n].type, nullable=not BY_NAME[n].required) for n in names])
    try:
        return pa.Table.from_pydict(data, schema=schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise RecordsError(f"records rows do not fit the schema: {exc}") from None


class RecordsWriter:
    """Write records to one Parquet file, row groups bounded in tokens, every batch validated first.

    ``metadata``: free-form JSON-able facts (model, engine versions, step) stored in the file's
    key-value metadata next to the schema_version.
    """

    def __init__(self, path: str | Path, *, metadata: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.schema = records_schema(metadata)
        self._writer = pq.ParquetWriter(self.path, self.schema, compression="zstd", write_page_checksum=True)
        self.rows = 0
        self.tokens = 0

    def write(self, data: pa.Table | pa.RecordBatch | Sequence[Mapping[str, Any]]) -> None:
        table = data if isinstance(data, pa.Table) else (
            pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else records_table(data)
        )
        if table.num_rows == 0:
            return
        checked = validate_batch(table, source=f"{self.path} (being written)", first_row=self.rows)
        if checked.ignored_columns:
            raise RecordsError(
                f"{self.path} (being written): unknown column(s) {list(checked.ignored_columns)}: allowed "
                f"{', '.join(BY_NAME)} (a records file holds no other column)"
            )
        full = pa.table(
            {c.name: (_as_array(table, c.name).cast(c.type) if c.name in table.schema.names else pa.nulls(table.num_rows, c.type))
             for c in COLUMNS},
            schema=self.schema,
        )
        for part in _row_groups(full):
            self._writer.write_table(part, row_group_size=part.num_rows)
        self.rows += table.num_rows
        self.tokens += int(pc.sum(pc.list_value_length(_as_array(table, "completion_ids"))).as_py() or 0)

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> RecordsWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _row_groups(table: pa.Table) -> Iterator[pa.Table]:
    """Slices of ``table`` holding at most ROW_GROUP_TOKENS tokens / ROW_GROUP_KEPT kept ids (>= 1 row)."""
    tok = np.asarray(pc.list_value_length(_as_array(table, "completion_ids")).fill_null(0), dtype=np.int64)
    kept = np.asarray(pc.list_value_length(_as_array(table, "kept_ids")).fill_null(0), dtype=np.int64)
    start, n_tok, n_kept = 0, 0, 0
    for i in range(table.num_rows):
        if i > start and (n_tok + tok[i] > ROW_GROUP_TOKENS or n_kept + kept[i] > ROW_GROUP_KEPT):
            yield table.slice(start, i - start)
            start, n_tok, n_kept = i, 0, 0
        n_tok += int(tok[i])
        n_kept += int(kept[i])
    if start < table.num_rows:
        yield table.slice(start, table.num_rows - start)


def write_records(
    path: str | Path,
    data: pa.Table | pa.RecordBatch | Sequence[Mapping[str, Any]],
    *,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Validate ``data`` and write it as one records file; returns the path."""
    with RecordsWriter(path, metadata=metadata) as w:
        w.write(data)
    return Path(path)
