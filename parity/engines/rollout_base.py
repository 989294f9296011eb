"""What the two vLLM rollout adapters (:class:`~parity.engines.vllm_offline.VllmRollout`,
:class:`~parity.engines.vllm_server.client.ServerRollout`) share: settings and defaults, the checkpoint check,
the capture plan (:func:`~parity.core.capture.plan_capture`) and its :class:`~parity.core.capture.CaptureHistory`,
and how a capture's heads become records (:meth:`RolloutBase.records`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypedDict

import torch

from parity.core.capture import (
    DEFAULT_MAX_HEAD,
    CaptureHistory,
    CapturePlan,
    CaptureResult,
    CaptureStats,
    Heads,
    plan_capture,
    support_from_heads,
)
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.errors import PathNotFound

# What a sampler record carries of S_q: kept ids, their log-probs, incomplete positions, extras.
Support = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, dict[str, torch.Tensor]]


class RolloutSettings(TypedDict, total=False):
    """The keyword settings of :class:`RolloutBase`, as the adapters pass them on (``**settings``)."""

    dtype: str
    device: str
    seed: int
    max_model_len: int
    max_head: int | None
    start_head: int | None
    tie_margin: int
    head: int | None
    timeout_s: float
    prefix_caching: bool
    max_num_batched_tokens: int | None
    capture: str


class RolloutBase:
    """Settings common to every rollout adapter (no engine is started here)."""

    name = "rollout"  # the records' source; each adapter names itself

    def __init__(self, model: str | Path, *, dtype: str = "float32", device: str = "cpu", seed: int = 0,
                 max_model_len: int = 512, max_head: int | None = None, start_head: int | None = None,
                 tie_margin: int = 16, head: int | None = None, timeout_s: float = 900.0,
                 prefix_caching: bool = False, max_num_batched_tokens: int | None = None,
                 capture: str = "topk") -> None:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise PathNotFound(f"model path {str(model)!r} has no config.json: allowed a Hugging Face "
                               "checkpoint directory")
        self.path = path
        self.model = str(path)
        self.dtype = dtype
        self.device = device
        self.seed = seed
        self.max_model_len_arg = max_model_len
        # --max-capture-head: None is no cap where the engine's sampler rows are read (the offline engine),
        # and the widest head of the head route (DEFAULT_MAX_HEAD) elsewhere.
        self.max_head = max_head
        self.start_head = start_head  # force the first head of adaptive plans (None: spec and history)
        self.capture_history = CaptureHistory()
        self.last_capture: CaptureStats | None = None  # what the latest generate() captured
        self.tie_margin = tie_margin
        self.head = head
        self.timeout_s = timeout_s
        self.prefix_caching = prefix_caching
        self.max_num_batched_tokens = max_num_batched_tokens  # None: the engine's; set: chunked prefill at that budget
        self.capture = capture
        self.vocab_size = 0  # set by the adapter once it knows the engine's vocabulary

    def plan(self, spec: SamplingSpec) -> CapturePlan:
        """The top-K head that captures S_q for ``spec`` under this adapter's capture settings; adaptive plans start
        from ``start_head`` when set, else this adapter's history, else the spec (:func:`~parity.core.capture.start_head`)."""
        return plan_capture(spec, self.vocab_size, head=self.head, tie_margin=self.tie_margin,
                            max_head=self.max_head or DEFAULT_MAX_HEAD, start=self.start_head,
                            suggested=self.capture_history.start(spec))

    def support(self, i: int, h: Heads, requested: int, spec: SamplingSpec) -> Support:
        """S_q of sequence ``i`` from its top-K heads (``None`` and no extras when none was asked, 0). The offline
        engine adds vLLM's native sampling mask, the server client the check that the values are processed log-probs."""
        if requested == 0:
            return None, None, None, {}
        cap = support_from_heads(h.completion_ids, h.head_ids, h.head_logprobs, requested=requested,
                                 vocab_size=self.vocab_size, rows=h.rows)
        return cap.kept_ids, cap.kept_logprobs, cap.incomplete, {"sampled_missing": cap.sampled_missing}

    def records(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, seed: int,
                result: CaptureResult) -> list[SequenceRecord]:
        """One record per prompt of a capture (prompt ``i`` sampled with ``seed + i``), S_q from
        :meth:`support`; what the capture did is left in ``last_capture``."""
        self.last_capture = result.stats
        records = []
        for i, (h, requested) in enumerate(zip(result.heads, result.requested, strict=True)):
            kept, kept_lp, incomplete, extras = self.support(i, h, requested, spec)
            logprobs = torch.tensor(h.sampled_logprobs, dtype=torch.float32)
            records.append(SequenceRecord(
                source=self.name, spec=spec, prompt_index=i, seed=seed + i, prompt_ids=list(prompts[i]),
                completion_ids=h.completion_ids, logprobs=logprobs,
                kept_ids=kept, kept_logprobs=kept_lp, incomplete=incomplete, extras=extras,
            ))
        return records
