"""The records file format (schema_version 1), as README documents it: ``from parity.records.format import ...``.

A thin module over :mod:`parity.records.schema`, ``arrays``, ``validate``, ``read`` and ``write``, which parity
itself imports (docs/records.md, section 1)."""

from __future__ import annotations

from parity.records.arrays import Ragged, RecordsBatch
from parity.records.read import (
    MAX_BATCH_ROWS,
    READ_BUFFER_BYTES,
    RecordsFile,
    check_batch_rows,
    file_metadata,
    open_records,
    page_checksums,
    records_paths,
)
from parity.records.schema import (
    BY_NAME,
    COLUMNS,
    KEPT_GROUP,
    METADATA_KEY,
    NONNEGATIVE_COLUMNS,
    REQUIRED,
    SAMPLER_LOG_S_SOURCES,
    SCHEMA_VERSION,
    SUPPORTED_VERSIONS,
    TRAINER_TOKEN_COLUMNS,
    Column,
    RecordsError,
    records_schema,
)
from parity.records.validate import validate_batch
from parity.records.write import ROW_GROUP_KEPT, ROW_GROUP_TOKENS, RecordsWriter, records_table, write_records

__all__ = [
    "BY_NAME", "COLUMNS", "KEPT_GROUP", "MAX_BATCH_ROWS", "METADATA_KEY", "NONNEGATIVE_COLUMNS", "READ_BUFFER_BYTES",
    "REQUIRED", "ROW_GROUP_KEPT", "ROW_GROUP_TOKENS", "SAMPLER_LOG_S_SOURCES", "SCHEMA_VERSION", "SUPPORTED_VERSIONS",
    "TRAINER_TOKEN_COLUMNS", "Column", "Ragged", "RecordsBatch", "RecordsError", "RecordsFile", "RecordsWriter",
    "check_batch_rows", "file_metadata", "open_records", "page_checksums", "records_paths", "records_schema",
    "records_table", "validate_batch", "write_records",
]
