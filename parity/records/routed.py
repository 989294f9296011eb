"""Validating the four MoE routed-experts columns of a records batch: a bad length or id is refused naming the
row, column, position, layer and what is allowed (layout: README, "The records format"; docs/records.md, section 2).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from parity.records.arrays import Ragged, first_true, read_ragged, scalar_values, valid_rows
from parity.records.schema import ROUTED_GROUP, RecordsError, where_in


def validate_routed(arrays: dict[str, pa.Array], prompt: Ragged, lengths: np.ndarray, source: str,
                    first_row: int) -> tuple[Ragged, np.ndarray] | None:
    """The routed experts and their ``[n, 3]`` shape (layers, top_k, experts) per row; None when absent."""
    present = [c for c in ROUTED_GROUP if c in arrays]
    if not present:
        return None
    if len(present) != len(ROUTED_GROUP):
        raise RecordsError(f"{source}: column(s) {', '.join(present)} without {', '.join(c for c in ROUTED_GROUP if c not in present)}: "
                           f"allowed {', '.join(ROUTED_GROUP)} together")
    rag = read_ragged(arrays["routed_experts"], "routed_experts", source, first_row)
    shape = np.stack([scalar_values(arrays[c], 0).astype(np.int64) for c in ROUTED_GROUP[1:]], 1)
    for j, name in enumerate(ROUTED_GROUP[1:]):
        given = valid_rows(arrays[name])
        lo = shape[:, 1] + 1 if name == "routed_num_experts" else 1
        bad = rag.valid & (~given | (shape[:, j] < lo))
        if bad.any():
            i = first_true(bad)
            allowed = "an integer > routed_top_k" if name == "routed_num_experts" else "an integer >= 1"
            value = int(shape[i, j]) if given[i] else None
            raise RecordsError(f"{where_in(source, first_row + i, name)}: value {value}: allowed {allowed} on a row with routed_experts")
    rows = np.maximum(prompt.lengths + lengths - 1, 0)
    want = rows * shape[:, 0] * shape[:, 1]
    wrong = rag.valid & (rag.lengths != want)
    if wrong.any():
        i = first_true(wrong)
        raise RecordsError(
            f"{where_in(source, first_row + i, 'routed_experts')}: {int(rag.lengths[i])} ids: allowed (len(prompt_ids) + "
            f"len(completion_ids) - 1) x routed_layers x routed_top_k = {int(rows[i])} x {int(shape[i, 0])} x "
            f"{int(shape[i, 1])} = {int(want[i])} (a wrong layer count or top-k shows here)")
    limit = np.repeat(shape[:, 2], np.where(rag.valid, rag.lengths, 0))
    bad = (rag.values < -1) | (rag.values >= limit)
    if bad.any():
        flat = first_true(bad)
        r = int(np.searchsorted(rag.offsets, flat, side="right") - 1)
        at, (layers, k, experts) = flat - int(rag.offsets[r]), shape[r]
        raise RecordsError(
            f"{where_in(source, first_row + r, 'routed_experts', at // (layers * k))} layer {at // k % layers}: expert id "
            f"{int(rag.values[flat])}: allowed -1 (no forward ran) or 0 <= id < routed_num_experts = {int(experts)}")
    return rag, shape
