"""The one road from a producer to a verdict: a scenario's records in, their streamed summary out.

Why one road, and the RL view's second pass over the same values (:func:`rl_view`): docs/records.md, section 1.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from parity.judge.token_columns import Options, summarize_batch, token_columns
from parity.records.validate import validate_batch

if TYPE_CHECKING:
    import pyarrow as pa
    import torch

    from parity.core.rl_catalogue import TrainerSummary
    from parity.core.token_table import TokenTable
    from parity.judge.accumulators import Summary
    from parity.judge.token_columns import TokenColumns
    from parity.records.arrays import RecordsBatch


def scenario_summary(
    export: pa.Table,
    *,
    dtypes: tuple[str, str],
    vocab_size: int | None,
    n_listed: int,
    views: dict[frozenset[str], torch.Tensor] | None = None,
    source: str = "run",
) -> Summary:
    """The streamed summary of one scenario's records (``export``); ``source`` names the file in messages.
    ``views``: a trainer under test's reference views by bug set, from the producer's logits
    (:func:`parity.engines.trainer_under_test.reference_views`), for its diagnosis; without them the records' own
    views are used (the sampler's values, and the full-vocabulary view where the records hold it)."""
    import numpy as np

    def columns(rb: RecordsBatch) -> TokenColumns:
        cols = token_columns(rb, vocab_size=vocab_size)
        if views:
            cols.views = {frozenset(): cols.views[frozenset()],
                          **{b: v.double().numpy().astype(np.float64) for b, v in views.items() if b}}
        return cols

    # parity's own scores: a value above 0 (a planted fault, a trainer under test) is for the gates to judge.
    checked = validate_batch(export, source=source, signs=False)
    return summarize_batch(checked, options=Options(n_listed=n_listed), source=source, dtypes=dtypes,
                           vocab_size=vocab_size, columns=columns)


def rl_view(table: TokenTable) -> dict[str, TrainerSummary]:
    """Each framework's mismatch metric and each IS correction for the naive, the fixed and a trainer under
    test (:func:`parity.core.rl_catalogue.summarize_trainers`), over the positions the gates compare."""
    from parity.core.rl_catalogue import summarize_trainers

    t = table.select(~table.incomplete)
    trainers = {"naive": t.full, "replay": t.replay, "recompute": t.recompute}
    trainers |= {} if t.user is None else {"trainer_under_test": t.user}
    return summarize_trainers(t.vllm, trainers, t.seq_lengths)
