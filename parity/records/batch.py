"""Records as model input: token id lists padded into one batch (both trainers score them this way)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def right_pad(seqs: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists → right-padded ``input_ids`` (pad 0) and ``attention_mask``, both ``[B, S]``."""
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        mask[i, : len(s)] = 1
    return ids, mask
