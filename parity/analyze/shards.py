"""The map step of ``parity analyze``: a records file, batch by batch, into a mergeable
:class:`~parity.judge.accumulators.Summary` (re-scored with a transformers model under ``--model``),
and files or shards over local processes (``--jobs``). :mod:`parity.analyze.cluster` runs the same step on
Ray; :mod:`parity.analyze.report` merges and judges."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from parity.errors import SetupError, TimedOut, UsageError

try:  # the records format needs pyarrow (the records extra); say so instead of a traceback
    import pyarrow  # noqa: F401
except ModuleNotFoundError as _exc:
    if _exc.name != "pyarrow":
        raise
    raise SetupError("records (Parquet) need pyarrow: pip install 'parity[records]'") from None

from parity.judge.accumulators import Summary
from parity.judge.token_columns import LOGIT_BUDGET, Options, TokenColumns, summarize_batch, token_columns
from parity.records.read import RecordsFile, open_records
from parity.records.schema import RecordsError

if TYPE_CHECKING:
    from parity.engines.transformers_trainer import TransformersTrainer
    from parity.records.arrays import RecordsBatch

# -- re-scoring with a transformers model (--model) ------------------------------------------------

_TRAINERS: dict[tuple[str, str, str], TransformersTrainer] = {}


def _trainer(model: str, dtype: str, device: str) -> TransformersTrainer:
    if (key := (model, dtype, device)) not in _TRAINERS:
        from parity.engines.transformers_trainer import TransformersTrainer
        from parity.fixtures import resolve_model

        _TRAINERS[key] = TransformersTrainer(resolve_model(model), dtype=dtype, device=device)
    return _TRAINERS[key]


def rescored_columns(batch: RecordsBatch, trainer: TransformersTrainer, dtypes: tuple[str, str]) -> TokenColumns:
    """Token columns with every trainer-side estimate and bound computed from ``trainer``'s logits (parity run's table)."""
    import torch

    from parity.core.token_table import build_table
    from parity.engines.trainer_under_test import reference_views
    from parity.judge.token_values import divergence_over_kept, segments
    from parity.records.convert import to_sequence_records

    vocab = int(trainer.vocab_size)
    cols = token_columns(batch, vocab_size=vocab)  # sampler-side flags and the trainer under test, if any
    for name, rag in (("prompt_ids", batch.prompt), ("completion_ids", batch.completion), ("kept_ids", batch.kept)):
        if rag is not None and rag.values.size and int(rag.values.max()) >= vocab:
            flat = int(np.flatnonzero(rag.values >= vocab)[0])
            r = int(np.searchsorted(rag.offsets, flat, side="right") - 1)
            raise RecordsError(f"{batch.source} row {batch.first_row + r} column {name}: token id {int(rag.values[flat])} is "
                               f"outside the vocabulary of --model ({vocab} tokens): allowed ids < {vocab} (is this the model that sampled?)")
    empty = np.flatnonzero(batch.prompt.lengths == 0)
    if empty.size:
        raise RecordsError(f"{batch.source} row {batch.first_row + int(empty[0])} column prompt_ids: empty: re-scoring with "
                           f"--model needs the prompt (its last position predicts completion token 0)")
    records = to_sequence_records(batch)
    kto = batch.kept_token_offsets
    kept_logits = None if batch.kept is None or kto is None else np.zeros(batch.kept.values.size, dtype=np.float32)
    filtered_spec = np.array([s.effective().filtered for s in batch.specs], dtype=bool)
    view_parts: dict[frozenset[str], np.ndarray] = {}
    has_user = cols.have["user"]
    for j, spec in enumerate(batch.specs):
        rows = np.flatnonzero(batch.spec_index == j)
        start = 0
        while start < rows.size:
            # As many sequences as fit the logit budget (at least one).
            stop, held = start, 0
            while stop < rows.size and (stop == start or held + int(batch.completion.lengths[rows[stop]]) * vocab <= LOGIT_BUDGET):
                held += int(batch.completion.lengths[rows[stop]]) * vocab
                stop += 1
            part = rows[start:stop]
            start = stop
            recs = [records[i] for i in part]
            logits = trainer.logits(recs)
            table = build_table(recs, logits, spec, dtype=dtypes)
            tok = np.concatenate([np.arange(batch.token_offsets[i], batch.token_offsets[i + 1]) for i in part])
            # A filtering spec without a kept set: build_table would take S_q as the whole vocabulary.
            known = np.repeat(batch.kept_rows()[part] | ~filtered_spec[j], batch.completion.lengths[part])
            cols.recompute_boundary[tok] = table.recompute_boundary.numpy()
            for name in ("full", "recompute", "forced", "bound_full", "penalty"):
                getattr(cols, name)[tok] = getattr(table, name).numpy()
                cols.have[name][tok] = True
            cols.systematic[tok] = np.where(known, table.systematic.numpy(), cols.systematic[tok])
            for name in ("replay", "log_s", "bound"):
                getattr(cols, name)[tok] = np.where(known, getattr(table, name).numpy(), 0.0)
                cols.have[name][tok] = known
            cols.recompute_support_equal[tok] = table.recompute_support_equal.numpy()
            cols.recompute_support_size[tok] = np.where(known, table.recompute_support_size.numpy(), -1)
            cols.have["recompute_support"][tok] = known
            cols.have["kl"][tok] = known
            if kept_logits is not None and kto is not None:
                for q, i in enumerate(part):
                    ids, at = table.kept_seen[q]
                    if ids is not None and at is not None:
                        e0, e1 = int(kto[batch.token_offsets[i]]), int(kto[batch.token_offsets[i + 1]])
                        kept_logits[e0:e1] = at[ids >= 0].numpy()
            if bool(has_user[tok].any()):
                ys = [torch.tensor(r.completion_ids, dtype=torch.long) for r in recs]
                views = reference_views(logits, ys, spec, [r.kept_ids for r in recs], [r.prompt_ids for r in recs])
                for bugs, v in views.items():
                    if bugs:
                        view_parts.setdefault(bugs, np.full(batch.tokens, np.nan))[tok] = np.where(known, v.numpy(), np.nan)
    if kept_logits is not None and kto is not None:
        # KL / TV and the logit drift over S_q from the model's logits at the kept ids, as from the records'
        # trainer_kept_logits (parity.judge.token_values, the one derivation); 0, 0, NaN where nothing is kept.
        row = batch.row_of_token()
        assert batch.kept_logprobs is not None
        cols.kl, cols.tv, cols.logit_drift = divergence_over_kept(
            batch, segments(kto), batch.kept_logprobs.astype(np.float64), kept_logits, batch.kept_rows()[row], row)
    cols.views = {frozenset(): cols.views[frozenset()], **view_parts}
    return cols


# -- files, shards, processes ----------------------------------------------------------------------


def file_header(path: str, records: RecordsFile) -> Summary:
    """What an open records file (:func:`parity.records.read.open_records`) adds to a summary before any
    of its rows: its name, its metadata, whether its pages carry checksums."""
    return Summary(files=[str(path)], metadata=[{"file": str(path), **records.metadata}],
                   page_checksums={str(path): records.page_checksums})


def as_int(x: object) -> int:
    """``int(x)`` of a value read from JSON metadata, refusing what is not a number or a string."""
    if isinstance(x, (int, float, str)):
        return int(x)
    raise TypeError(f"int() argument must be a string or a real number, not '{type(x).__name__}'")


def batch_summarizer(metadata: Mapping[str, object], file_index: int, options: Options) -> Callable[[RecordsBatch], Summary]:
    """The map step for the validated batches of one file: dtypes and vocabulary size from the file's
    metadata, the trainer's values re-scored with ``options.model`` when set (what every worker runs:
    local processes, Ray)."""
    sampler = str(metadata.get("dtype") or "float32")
    dtypes = (sampler, options.dtype if options.model else str(metadata.get("trainer_dtype") or sampler))
    stated = (str(metadata.get("dtype") or ""), options.dtype if options.model else str(metadata.get("trainer_dtype") or ""))
    stated_vocab = metadata.get("vocab_size")  # user metadata: checked here
    vocab = as_int(stated_vocab) if stated_vocab else None
    columns: Callable[[RecordsBatch], TokenColumns] | None = None
    if options.model:
        trainer = _trainer(options.model, options.dtype, options.device)

        def columns(b: RecordsBatch) -> TokenColumns:
            return rescored_columns(b, trainer, dtypes)

    def summarize(rb: RecordsBatch) -> Summary:
        return summarize_batch(rb, file_index=file_index, options=options, dtypes=dtypes,
                               vocab_size=vocab, columns=columns, stated_dtypes=stated)

    return summarize


def summarize_file(path: str, file_index: int, options: Options) -> Summary:
    """Summary of one records file, streamed batch by batch (what a worker process runs)."""
    rf = open_records(path)
    out = file_header(str(path), rf)
    summarize = batch_summarizer(rf.metadata, file_index, options)
    for rb in rf.batches(batch_rows=options.batch_rows):
        out.merge(summarize(rb))
    return out


def _worker_init(threads: int, model: bool) -> None:
    if model:  # torch only where a model scores (importing it costs a worker seconds of its start)
        import torch

        torch.set_num_threads(threads)


def summarize_paths(
    paths: Sequence[Path], options: Options, *, jobs: int = 1, timeout_s: float = 3600.0,
    progress: Callable[[str], None] | None = None,
) -> Summary:
    """Summaries of every file, merged; with ``jobs > 1`` in that many local processes (spawned)."""
    if jobs < 1:
        raise UsageError(f"--jobs {jobs} is invalid: allowed an integer >= 1")
    total = Summary()
    if jobs == 1 or len(paths) == 1:
        for i, p in enumerate(paths):
            total.merge(summarize_file(str(p), i, options))
            if progress:
                progress(f"parity analyze: [{i + 1}/{len(paths)}] {p}")
        return total
    import multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // jobs)
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(processes=min(jobs, len(paths)), initializer=_worker_init, initargs=(threads, bool(options.model)))
    try:
        pending = [pool.apply_async(summarize_file, (str(p), i, options)) for i, p in enumerate(paths)]
        deadline = time.monotonic() + timeout_s
        for i, (p, res) in enumerate(zip(paths, pending, strict=True)):
            left = deadline - time.monotonic()
            try:
                total.merge(res.get(timeout=max(left, 0.001)))
            except mp.TimeoutError:
                raise TimedOut(f"parity analyze: shard {p} did not finish within {timeout_s:.0f} s (raise --timeout)") from None
            if progress:
                progress(f"parity analyze: [{i + 1}/{len(paths)}] {p}")
        pool.close()
        pool.join()
    finally:
        pool.terminate()
    return total
