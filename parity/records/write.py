"""Writing records: rows (dicts, tables or batches) validated, then written as Parquet in row groups bounded in tokens."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from parity.records.arrays import column_array
from parity.records.schema import BY_NAME, COLUMNS, SCHEMA_VERSION, RecordsError, records_schema
from parity.records.validate import validate_batch

# A row group holds at most this many tokens (or kept entries, whichever fills first), so a reader's
# memory is bounded by one row group whatever the file's size.
ROW_GROUP_TOKENS = 65_536
ROW_GROUP_KEPT = 4_194_304


def _listify(v: object) -> list[object] | None:
    if v is None:
        return None
    if hasattr(v, "detach"):  # torch tensor
        v = v.detach().cpu().numpy()
    if isinstance(v, np.ndarray):
        return v.reshape(-1).tolist()
    if not isinstance(v, Iterable):  # as list() refuses it
        raise TypeError(f"{type(v).__name__!r} object is not iterable")
    return list(v)


def records_table(rows: Sequence[Mapping[str, object]]) -> pa.Table:
    """Rows (dicts keyed by column name; lists, numpy arrays or tensors as values) → a records table.
    ``schema_version`` is filled in; unknown keys are refused (a typo would otherwise drop a column), and only
    the columns some row sets are kept."""
    present: list[str] = []
    for i, r in enumerate(rows):
        if unknown := set(r) - set(BY_NAME):
            raise RecordsError(f"row {i}: unknown column(s) {sorted(unknown)}: allowed {', '.join(BY_NAME)}")
        present += [k for k in r if k not in present]
    names = [c.name for c in COLUMNS if c.name in present or c.required]
    data: dict[str, list[object]] = {name: [] for name in names}
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
    ``metadata``: free-form JSON-able facts (model, engine versions, step) for the file's key-value metadata."""

    def __init__(self, path: str | Path, *, metadata: Mapping[str, object] | None = None) -> None:
        """Rows are validated as they are written; trainer log-probs above 0 are refused unless ``metadata``
        names ``planted_faults`` (what ``parity run --plant-*`` writes)."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.schema = records_schema(metadata)
        self._writer = pq.ParquetWriter(self.path, self.schema, compression="zstd", write_page_checksum=True)
        self.rows = 0
        self.tokens = 0
        self.planted = bool((metadata or {}).get("planted_faults"))

    def write(self, data: pa.Table | pa.RecordBatch | Sequence[Mapping[str, object]]) -> None:
        table = data if isinstance(data, pa.Table) else (
            pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else records_table(data))
        if table.num_rows == 0:
            return
        checked = validate_batch(table, source=f"{self.path} (being written)", first_row=self.rows,
                                 signs=not self.planted)
        if checked.ignored_columns:
            raise RecordsError(f"{self.path} (being written): unknown column(s) "
                               f"{list(checked.ignored_columns)}: allowed {', '.join(BY_NAME)} (a records "
                               "file holds no other column)")
        present = table.schema.names
        full = pa.table({c.name: column_array(table, c.name).cast(c.type) if c.name in present
                         else pa.nulls(table.num_rows, c.type) for c in COLUMNS}, schema=self.schema)
        for part in _row_groups(full):
            self._writer.write_table(part, row_group_size=part.num_rows)
        self.rows += table.num_rows
        self.tokens += int(pc.sum(pc.list_value_length(column_array(table, "completion_ids"))).as_py() or 0)

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> RecordsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _row_groups(table: pa.Table) -> Iterator[pa.Table]:
    """Slices of ``table`` holding at most ROW_GROUP_TOKENS tokens / ROW_GROUP_KEPT kept ids (>= 1 row)."""
    tok = np.asarray(pc.list_value_length(column_array(table, "completion_ids")).fill_null(0), dtype=np.int64)
    kept = np.asarray(pc.list_value_length(column_array(table, "kept_ids")).fill_null(0), dtype=np.int64)
    start, n_tok, n_kept = 0, 0, 0
    for i in range(table.num_rows):
        if i > start and (n_tok + tok[i] > ROW_GROUP_TOKENS or n_kept + kept[i] > ROW_GROUP_KEPT):
            yield table.slice(start, i - start)
            start, n_tok, n_kept = i, 0, 0
        n_tok += int(tok[i])
        n_kept += int(kept[i])
    if start < table.num_rows:
        yield table.slice(start, table.num_rows - start)


def write_records(path: str | Path, data: pa.Table | pa.RecordBatch | Sequence[Mapping[str, object]], *,
                  metadata: Mapping[str, object] | None = None) -> Path:
    """Validate ``data`` and write it as one records file; returns the path."""
    with RecordsWriter(path, metadata=metadata) as w:
        w.write(data)
    return Path(path)
