"""Batch layouts of token sequences for a causal LM, as the trainer-side invariance property draws them.

A layout packs sequences into rows, pads the rows on one side and passes them through one of four
masks (``2d``, ``4d-bool``, ``4d-additive``, ``position-ids``; what each means: docs/batch_invariance.md,
section 4). ``build`` makes the model inputs, ``sequence_logits`` runs a model and cuts out each
sequence's logits; a layout is checked by comparing those logits with each sequence run alone,
bitwise (tests/unit/test_cpu_kernel_property.py). The model is any callable taking ``input_ids``,
``attention_mask`` and ``position_ids``; no engine is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parity.errors import UsageError

MASKS = ("2d", "4d-bool", "4d-additive", "position-ids")
SIDES = ("right", "left")


@dataclass(frozen=True)
class BatchLayout:
    """Which sequence goes where: ``rows[r]`` lists the sequence indices packed into row r, in order."""

    rows: tuple[tuple[int, ...], ...]
    side: str = "right"
    extra_pad: int = 0
    mask: str = "2d"

    def __post_init__(self) -> None:
        if not self.rows or any(not r for r in self.rows):
            raise UsageError(
                f"rows={self.rows!r} is invalid: allowed one or more rows, each with >= 1 sequence"
            )
        flat = [i for r in self.rows for i in r]
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in flat) or len(set(flat)) != len(
            flat
        ):
            raise UsageError(f"rows={self.rows!r} is invalid: allowed distinct sequence indices >= 0")
        if self.side not in SIDES:
            raise UsageError(f"side={self.side!r} is invalid: allowed {', '.join(SIDES)}")
        if isinstance(self.extra_pad, bool) or not isinstance(self.extra_pad, int) or self.extra_pad < 0:
            raise UsageError(f"extra_pad={self.extra_pad!r} is invalid: allowed an int >= 0")
        if self.mask not in MASKS:
            raise UsageError(f"mask={self.mask!r} is invalid: allowed {', '.join(MASKS)}")
        if self.mask == "2d" and any(len(r) > 1 for r in self.rows):
            raise UsageError(
                f"mask='2d' with rows={self.rows!r}: a 2D padding mask cannot separate packed sequences; "
                "allowed one sequence per row, or mask='4d-bool', '4d-additive' or 'position-ids'"
            )

    @property
    def sequences(self) -> list[int]:
        return [i for r in self.rows for i in r]

    def describe(self, lengths: Sequence[int] | None = None) -> str:
        rows = [[f"{i}" + (f"({lengths[i]})" if lengths is not None else "") for i in r] for r in self.rows]
        return f"{len(self.rows)} row(s) {rows}, {self.side}-padded +{self.extra_pad}, mask {self.mask}"


@dataclass
class Inputs:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    use_cache: bool | None
    spans: dict[int, tuple[int, int, int]]  # sequence index -> (row, offset, length)


def build(
    layout: BatchLayout, seqs: Sequence[Sequence[int]], *, pad_id: int = 0, dtype: torch.dtype = torch.float32
) -> Inputs:
    """Model inputs for ``layout`` over ``seqs`` (token id lists; every index in the layout must exist)."""
    missing = [i for i in layout.sequences if i >= len(seqs)]
    if missing:
        raise UsageError(
            f"layout names sequence(s) {missing}: allowed indices below {len(seqs)} (the sequences given)"
        )
    if any(len(seqs[i]) == 0 for i in layout.sequences):
        raise UsageError("an empty sequence cannot be laid out: allowed sequences of >= 1 token")
    totals = [sum(len(seqs[i]) for i in r) for r in layout.rows]
    width = max(totals) + layout.extra_pad
    b = len(layout.rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    seg = torch.full((b, width), -1, dtype=torch.long)  # segment id per position; padding runs get their own
    pos = torch.zeros(b, width, dtype=torch.long)
    valid = torch.zeros(b, width, dtype=torch.long)
    spans: dict[int, tuple[int, int, int]] = {}
    next_seg = 0
    for r, (row, total) in enumerate(zip(layout.rows, totals, strict=True)):
        start = width - total if layout.side == "left" else 0
        pads = [(0, start)] if layout.side == "left" else [(total, width)]
        at = start
        for i in row:
            n = len(seqs[i])
            ids[r, at : at + n] = torch.tensor(list(seqs[i]), dtype=torch.long)
            seg[r, at : at + n] = next_seg
            pos[r, at : at + n] = torch.arange(n)
            valid[r, at : at + n] = 1
            spans[i] = (r, at, n)
            next_seg += 1
            at += n
        for lo, hi in pads:
            if hi > lo:
                seg[r, lo:hi] = next_seg
                pos[r, lo:hi] = torch.arange(hi - lo)
                next_seg += 1
    mask: torch.Tensor | None
    use_cache: bool | None = None
    if layout.mask == "2d":
        mask = valid
        pos = (valid.cumsum(-1) - 1).clamp(min=0)  # as a padded trainer batch derives them
    elif layout.mask == "position-ids":
        mask, use_cache = None, False
    else:
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        allowed = (seg[:, :, None] == seg[:, None, :]) & causal
        if layout.mask == "4d-bool":
            mask = allowed[:, None]
        else:
            mask = torch.zeros(b, 1, width, width, dtype=dtype)
            mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return Inputs(ids, mask, pos, use_cache, spans)


@torch.no_grad()
def sequence_logits(
    model: Callable[..., Any], layout: BatchLayout, seqs: Sequence[Sequence[int]]
) -> dict[int, torch.Tensor]:
    """float32 logits ``[L, V]`` of every sequence in ``layout``, by sequence index."""
    dtype = next(model.parameters()).dtype if hasattr(model, "parameters") else torch.float32
    inp = build(layout, seqs, dtype=dtype)
    kwargs: dict[str, Any] = {
        "input_ids": inp.input_ids,
        "attention_mask": inp.attention_mask,
        "position_ids": inp.position_ids,
    }
    if inp.use_cache is not None:
        kwargs["use_cache"] = inp.use_cache
    logits = model(**kwargs).logits.float()
    return {i: logits[r, o : o + n].clone() for i, (r, o, n) in inp.spans.items()}


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| in float64; equal entries (equal infinities included) count 0."""
    if a.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    return float(torch.where(a == b, torch.zeros_like(a), (a - b).abs()).max())
