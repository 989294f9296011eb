"""The one road from a producer to a verdict: a scenario's records in, their streamed summary out.

Every producer writes records (:mod:`parity.records.format`): ``parity run`` converts its sampled and
scored tokens (:func:`parity.records.convert.from_sequence_records`), the TRL capture its steps, a user
their own file. The streamed analysis of :mod:`parity.records.token_columns` and :mod:`parity.records.verdict` computes every statistic and
every gate from them, and :func:`parity.analyze.report.build_report` writes the one report, so ``parity run``
gives what ``parity run --records`` then ``parity analyze`` gives. The RL view needs every token at
once; it is a second pass over the same values (:func:`rl_view`), not a second pipeline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.records.token_columns import Options, summarize_batch, token_columns

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from parity.core.rl_catalogue import TrainerSummary
    from parity.core.token_table import TokenTable
    from parity.records.accumulators import Summary
    from parity.records.arrays import RecordsBatch
    from parity.records.token_columns import TokenColumns


def scenario_summary(
    export: pa.Table,
    *,
    dtypes: tuple[str, str],
    vocab_size: int | None,
    n_listed: int,
    views: dict[frozenset[str], torch.Tensor] | None = None,
    source: str = "run",
) -> Summary:
    """The streamed summary of one scenario's records (``export``), as a file's analysis gets it (``source``
    names the file in messages).

    ``views``: the trainer-side reference views of a trainer under test, by bug set
    (:func:`parity.engines.trainer_under_test.reference_views`; the producer has the logits), for its
    diagnosis; without them the records' own views are used (the sampler's values, and the
    full-vocabulary view where the records hold it).
    """
    import numpy as np

    def columns(rb: RecordsBatch) -> TokenColumns:
        cols = token_columns(rb, vocab_size=vocab_size)
        if views:
            cols.views = {frozenset(): cols.views[frozenset()],
                          **{b: v.double().numpy().astype(np.float64) for b, v in views.items() if b}}
        return cols

    return summarize_batch(export, options=Options(n_listed=n_listed), source=source, dtypes=dtypes,
                           vocab_size=vocab_size, columns=columns)


def rl_view(table: TokenTable) -> dict[str, TrainerSummary]:
    """Each framework's mismatch metric and each IS correction for the naive, the fixed and a trainer under
    test (:func:`parity.core.rl_catalogue.summarize_trainers`), over the positions the gates compare."""
    from parity.core.rl_catalogue import summarize_trainers

    t = table.select(~table.incomplete)
    trainers = {"naive": t.full, "replay": t.replay, "recompute": t.recompute}
    trainers |= {} if t.user is None else {"trainer_under_test": t.user}
    return summarize_trainers(t.vllm, trainers, t.seq_lengths)
