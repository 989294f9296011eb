"""The smallest planted fault a bitwise comparison must catch: one entry one float step off."""

from __future__ import annotations

import torch


def nudge_one_ulp(values: torch.Tensor, index: int = 0) -> torch.Tensor:
    """A copy of ``values`` with one entry moved one float step toward -inf (``torch.nextafter``).

    The negative controls use it where the CPU engine offers no cheap natural source of non-invariance.
    """
    out = values.clone()
    flat = out.view(-1)
    flat[index] = torch.nextafter(flat[index], torch.tensor(float("-inf"), dtype=out.dtype))
    return out
