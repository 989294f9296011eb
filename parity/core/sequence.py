"""The one record type every engine produces, so comparisons never special-case an engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parity.core.spec import SamplingSpec
from parity.errors import UsageError


@dataclass
class SequenceRecord:
    """One sampled sequence as one side saw it: ``logprobs[t]`` is this side's log-prob of ``completion_ids[t]``;
    ``kept_ids`` the support it used per position (``[L, K]``, ``-1`` padded; ``None`` = the whole vocabulary)."""

    source: str  # "vllm", "vllm-server", "trainer:full", "trainer:replay", "trainer:recompute", ...
    prompt_index: int
    prompt_ids: list[int]
    completion_ids: list[int]
    spec: SamplingSpec
    seed: int
    logprobs: torch.Tensor  # float32 [L]
    kept_ids: torch.Tensor | None = None  # long [L, K]
    kept_logprobs: torch.Tensor | None = None  # float32 [L, K]: this side's processed log-probs of kept_ids
    incomplete: torch.Tensor | None = None  # bool [L]: kept_ids may not hold the whole support
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token side data (forced, log_s)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if self.logprobs.shape != (n,):
            raise UsageError(
                f"{self.source} record {self.prompt_index}: logprobs has shape {tuple(self.logprobs.shape)}, "
                f"allowed ({n},) — one value per completion token"
            )
        if self.kept_ids is not None and self.kept_ids.shape[0] != n:
            raise UsageError(
                f"{self.source} record {self.prompt_index}: kept_ids has {self.kept_ids.shape[0]} rows for {n} tokens"
            )

    @property
    def length(self) -> int:
        return len(self.completion_ids)
