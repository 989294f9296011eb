"""Synthetic records at scale (the records benchmark and its smoke test): numpy straight into Arrow.

Each position keeps exactly K distinct ids with processed log-probs that sum to probability 1 in
float64 (a log-softmax over K random logits), the sampled token is one of them, and the trainer-side
columns agree with the sampler to float32 rounding, so every gate the file supports passes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from parity.records.schema import SCHEMA_VERSION, records_schema
from parity.records.write import RecordsWriter

CHUNK_TOKENS = 65_536


def _lists(offsets: np.ndarray, values: np.ndarray, value_type: pa.DataType) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=value_type))


def chunk(n_seq: int, length: int, k: int, vocab: int, rng: np.random.Generator, *, first_prompt: int = 0) -> pa.Table:
    """``n_seq`` sequences of ``length`` tokens, K kept ids per position, spec T=0.8 top_k=K."""
    t = n_seq * length
    stride = vocab // k
    ids = (rng.integers(0, stride, size=(t, k)) + np.arange(k) * stride).astype(np.int32)
    z = rng.standard_normal((t, k)).astype(np.float64) * 2.0
    lp = z - np.log(np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)) - z.max(1, keepdims=True)
    lp32 = lp.astype(np.float32)
    pick = rng.integers(0, k, size=t)
    y = ids[np.arange(t), pick]
    sampled = lp32[np.arange(t), pick]
    log_s = (-rng.random(t) * 0.3).astype(np.float32)
    tok_off = np.arange(n_seq + 1, dtype=np.int64) * length
    kept_off = np.arange(n_seq + 1, dtype=np.int64) * length * k
    per_pos = np.tile(np.arange(length + 1, dtype=np.int64) * k, n_seq)
    pos_off = np.arange(n_seq + 1, dtype=np.int64) * (length + 1)
    data = {
        "schema_version": pa.array(np.full(n_seq, SCHEMA_VERSION, dtype=np.int32)),
        "prompt_ids": _lists(np.arange(n_seq + 1) * 4, rng.integers(0, vocab, n_seq * 4).astype(np.int32), pa.int32()),
        "completion_ids": _lists(tok_off, y, pa.int32()),
        "temperature": pa.array(np.full(n_seq, 0.8)),
        "top_k": pa.array(np.full(n_seq, k, dtype=np.int64)),
        "top_p": pa.array(np.ones(n_seq)),
        "min_p": pa.array(np.zeros(n_seq)),
        "sampler_logprobs": _lists(tok_off, sampled, pa.float32()),
        "prompt_index": pa.array(np.arange(first_prompt, first_prompt + n_seq, dtype=np.int64)),
        "kept_ids": _lists(kept_off, ids.reshape(-1), pa.int32()),
        "kept_offsets": pa.ListArray.from_arrays(pa.array(pos_off.astype(np.int32)), pa.array(per_pos)),
        "kept_logprobs": _lists(kept_off, lp32.reshape(-1), pa.float32()),
        "kept_incomplete": _lists(tok_off, np.zeros(t, dtype=bool), pa.bool_()),
        "trainer_full_logprobs": _lists(tok_off, sampled + log_s, pa.float32()),
        "trainer_replay_logprobs": _lists(tok_off, sampled, pa.float32()),
        "trainer_log_s": _lists(tok_off, log_s, pa.float32()),
        # What a training run logs: the trainer's log-prob of each sampled token (here a correct one's).
        "trainer_logprobs": _lists(tok_off, sampled.astype(np.float64), pa.float64()),
    }
    return pa.table(data)


def write_file(
    path: Path, tokens: int, *, k: int = 64, vocab: int = 32_768, length: int = 256, seed: int = 0,
    one_row_group: bool = False,
) -> Path:
    """A records file of ``tokens`` tokens (rounded to whole sequences), written chunk by chunk.

    Row groups are the writer's (:class:`~parity.records.write.RecordsWriter`, bounded in tokens);
    ``one_row_group`` writes the whole file as a single row group instead (a writer that never cuts
    one: the reader must still hold only a batch of rows at a time).
    """
    rng = np.random.default_rng(seed)
    per_chunk = max(1, CHUNK_TOKENS // length)
    n_seq = max(1, tokens // length)
    metadata = {"producer": "records benchmark", "trainer_dtype": "float32"}
    starts = range(0, n_seq, per_chunk)
    if not one_row_group:
        with RecordsWriter(path, metadata=metadata) as w:
            for done in starts:
                w.write(chunk(min(per_chunk, n_seq - done), length, k, vocab, rng, first_prompt=done))
        return path
    table = pa.concat_tables([chunk(min(per_chunk, n_seq - done), length, k, vocab, rng, first_prompt=done) for done in starts])
    schema = records_schema(metadata)  # every column, as RecordsWriter writes them (absent ones null)
    full = pa.table({f.name: table.column(f.name).cast(f.type) if f.name in table.schema.names else pa.nulls(len(table), f.type)
                     for f in schema}, schema=schema)
    pq.write_table(full, path, row_group_size=len(full), compression="zstd", write_page_checksum=True)
    return path
