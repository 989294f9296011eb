"""A validated batch of records rows as flat numpy arrays (:class:`RecordsBatch`, :class:`Ragged`), and the
Arrow-to-numpy conversions the validator reads columns through (casts, null masks, ragged lists)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from parity.core.spec import SamplingSpec
from parity.records.casts import CastNote
from parity.records.schema import BY_NAME, Column, RecordsError, where_in


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
    """Rows of a records file after validation, as flat numpy arrays (their layout: docs/records.md, section 2)."""

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
    routed: tuple[Ragged, np.ndarray] | None = None  # MoE routed_experts and [n, 3] (layers, top_k, experts) per row

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


def column_array(batch: pa.RecordBatch | pa.Table, name: str) -> pa.Array:
    col = batch.column(name)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    return col


def cast_column(arr: pa.Array, col: Column, source: str, first_row: int, notes: dict[str, CastNote] | None = None) -> pa.Array:
    """``arr`` as the column's type: other integer and float widths are cast (an integer out of range and
    a float that is not a whole number where an integer is wanted are refused); a float64 column read as
    float32 is rounded, and what that changed is noted in ``notes``."""
    if arr.type.equals(col.type):
        return arr
    target = col.type
    ok_source = _is_list(arr.type) == pa.types.is_list(target)
    if ok_source and pa.types.is_null(arr.type):
        return pa.nulls(len(arr), target)
    try:
        if not ok_source:
            raise pa.ArrowInvalid("list vs scalar")
        out = arr.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        rows = f"rows {first_row}..{first_row + len(arr) - 1}"
        raise RecordsError(f"{where_in(source, column=col.name)}: type {arr.type} cannot be read as {target} "
                           f"({exc}): allowed {target} ({col.doc}), {rows}") from None
    if notes is not None:
        note = _narrowing(arr, out, col.name)
        if note is not None:
            notes[col.name] = note
    return out


def _is_list(t: pa.DataType) -> bool:
    return bool(pa.types.is_list(t) or pa.types.is_large_list(t))


def _narrowing(arr: pa.Array, out: pa.Array, name: str) -> CastNote | None:
    """What reading float64 values as float32 changed (rounding, tiny values to 0, huge ones to +-inf)."""
    nested = _is_list(arr.type)
    src, dst = (arr.type.value_type, out.type.value_type) if nested else (arr.type, out.type)
    if not (pa.types.is_float64(src) and pa.types.is_float32(dst)):
        return None

    def values(x: pa.Array) -> np.ndarray:
        flat = x.flatten() if nested else x
        return np.asarray(flat.drop_null().to_numpy(zero_copy_only=False), dtype=np.float64)

    a, b = values(arr), values(out)
    with np.errstate(invalid="ignore"):
        changed = ~((a == b) | (np.isnan(a) & np.isnan(b)))
        overflow = np.isfinite(a) & ~np.isfinite(b)
        rounded = changed & ~overflow
        max_change = float(np.abs(a[rounded] - b[rounded]).max()) if rounded.any() else 0.0
    return CastNote(column=name, source_type=str(src), target_type=str(dst), values=int(a.size),
                    changed=int(changed.sum()), overflowed=int(overflow.sum()), max_change=max_change)


def valid_rows(arr: pa.Array) -> np.ndarray:
    if arr.null_count == 0:
        return np.ones(len(arr), dtype=bool)
    return _np(arr.is_valid()).astype(bool)


# Arrow types whose value buffer has numpy's layout.
_NUMPY_LAYOUT: dict[pa.DataType, np.dtype[np.generic]] = {
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


def read_ragged(arr: pa.Array, name: str, source: str, first_row: int) -> Ragged:
    valid = valid_rows(arr)
    # Lengths from the list offsets (a null row may span values in Arrow: it counts 0 here, and flatten skips them).
    lengths = np.diff(_np(arr.offsets).astype(np.int64))
    if arr.null_count:
        lengths = np.where(valid, lengths, 0)
    offsets = np.zeros(len(arr) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = arr.flatten()  # skips the slices behind null rows
    if values.null_count:
        nulls = ~valid_rows(values)
        r, t = token_position(offsets, first_true(nulls))
        raise RecordsError(f"{where_in(source, first_row + r, name, t)}: a null inside the list: allowed "
                           f"{BY_NAME[name].doc}, no null entries (a whole row may be null where the column "
                           "is optional)")
    return Ragged(offsets, _np(values), valid)


def scalar_values(arr: pa.Array, fill: float) -> np.ndarray:
    raw = _raw(arr)
    if raw is None:
        return np.asarray(arr.fill_null(fill).to_numpy(zero_copy_only=False))
    return raw if arr.null_count == 0 else np.where(valid_rows(arr), raw, np.asarray(fill, dtype=raw.dtype))


def first_true(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def token_position(offsets: np.ndarray, flat_index: int) -> tuple[int, int]:
    """Row and position within the row of a flat index into a ragged column."""
    row = int(np.searchsorted(offsets, flat_index, side="right") - 1)
    return row, flat_index - int(offsets[row])
