"""Reading records: files, shard directories and their key-value metadata; rows stream as validated batches.

Bad input is refused with the file, row, column, value and what is allowed (docs/records.md, section 3)."""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import pyarrow as pa
import pyarrow.parquet as pq

from parity.errors import PathNotFound, UsageError
from parity.records.arrays import RecordsBatch
from parity.records.schema import METADATA_KEY, REQUIRED, SUPPORTED_VERSIONS, RecordsError, require_columns
from parity.records.validate import validate_batch

# Reading: rows per validated batch (the analysis holds one batch at a time, so memory grows with it),
# and the read buffer that streams a column chunk page by page instead of loading it whole: a batch's
# memory does not depend on how large the writer made its row groups.
MAX_BATCH_ROWS = 16_384
READ_BUFFER_BYTES = 1 << 20
T = TypeVar("T")


@dataclass
class RecordsFile:
    """An open records file: checked footer, schema and version; rows are streamed by :meth:`batches`.
    ``page_checksums``: whether its pages carry CRC checksums (:func:`page_checksums`; docs/records.md,
    section 3)."""

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
        """Validated batches of at most ``batch_rows`` whole rows (sequences), never spanning a row group; ``columns``
        limits what is read, the required columns always included (memory: docs/records.md, section 3). The next
        batches are decoded and validated on a thread while the caller works on this one (:func:`read_ahead`)."""
        check_batch_rows(batch_rows, "batch_rows")
        names = self.columns
        wanted = names if columns is None else [c for c in names if c in set(columns) | set(REQUIRED)]
        return read_ahead(self._validated(wanted, batch_rows))

    def _validated(self, wanted: list[str], batch_rows: int) -> Iterator[RecordsBatch]:
        # A file parity run wrote with planted faults holds log-probs moved on purpose: they are judged, not refused.
        signs = not self.metadata.get("planted_faults")
        for start, rb in self._decoded(wanted, batch_rows):
            yield validate_batch(rb, source=str(self.path), first_row=start, signs=signs)

    def _decoded(self, wanted: list[str], batch_rows: int) -> Iterator[tuple[int, pa.RecordBatch]]:
        """Each batch with its first row, row group by row group (columns decode on pyarrow's threads, what a plain
        scan gets); a read error names the row group's rows."""
        md = self.parquet.metadata
        first = 0
        for g in range(md.num_row_groups):
            rows = md.row_group(g).num_rows
            try:
                start = first
                for rb in self.parquet.iter_batches(batch_size=batch_rows, row_groups=[g], columns=wanted,
                                                    use_threads=True):
                    yield start, rb
                    start += rb.num_rows
            except (OSError, pa.ArrowException) as exc:
                raise RecordsError(f"{self.path}: rows {first}..{first + rows - 1} (row group {g}) cannot be "
                                   f"read, the file is truncated or corrupt: {exc}") from None
            first += rows


def read_ahead(items: Iterator[T], depth: int = 1, poll_s: float = 0.5) -> Iterator[T]:
    """``items`` produced on a thread, at most ``depth`` ahead of the consumer: decoding and validating the next
    batch (pyarrow and numpy, which release the GIL) overlaps the caller's work on this one. An error raised
    there is raised here; closing this generator early stops the thread at its next item."""
    q: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((True, item), timeout=poll_s)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((False, None))
        except BaseException as exc:  # handed to the consumer, raised there
            q.put((False, exc))

    thread = threading.Thread(target=produce, name="parity-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            more, item = q.get()  # the producer always ends with (False, ...): no item is waited for forever
            if not more:
                if isinstance(item, BaseException):
                    raise item
                return
            yield cast("T", item)
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(poll_s)


def check_batch_rows(value: int, name: str = "batch_rows") -> int:
    """``value`` if it is a row count a batch may hold (1..:data:`MAX_BATCH_ROWS`); else a UsageError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_BATCH_ROWS:
        raise UsageError(f"{name} {value!r} is out of range: allowed an integer from 1 to {MAX_BATCH_ROWS:,} "
                         "(rows per streamed batch; the analysis holds one batch at a time, so its memory "
                         "grows with this number)")
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
    """Whether the pages of ``path`` carry CRC checksums (pyarrow's ``write_page_checksum=True``); None when it
    cannot be told (how it is read: docs/records.md, section 3)."""
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
        versions = ", ".join(map(str, SUPPORTED_VERSIONS))
        raise RecordsError(f"{source}: {said}: this parity reads schema_version {versions} (a newer "
                           f"parity may read it), {layouts}")
    nested = {} if blob.get("metadata") is None else blob["metadata"]
    if not isinstance(nested, dict):
        raise RecordsError(f"{source}: key-value metadata {key!r} field 'metadata' is a JSON "
                           f"{type(nested).__name__}: allowed an object of facts")
    flat = {k: v for k, v in blob.items() if k not in ("schema_version", "metadata")}
    clash = sorted(k for k in flat if k in nested and nested[k] != flat[k])
    if clash:
        raise RecordsError(f"{source}: key-value metadata {key!r} gives {', '.join(clash)} twice with "
                           "different values (next to schema_version and under 'metadata'): allowed one "
                           "value per fact")
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
    require_columns(pf.schema_arrow.names, str(p))
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

