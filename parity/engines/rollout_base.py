"""What the two vLLM rollout adapters share: the checkpoint, the engine settings and the capture plan.

:class:`~parity.engines.vllm_offline.VllmRollout` (in-process engine) and
:class:`~parity.engines.vllm_server.client.ServerRollout` (OpenAI-compatible server) take the same
settings with the same defaults, validate the checkpoint the same way and plan the capture of S_q
with the same :func:`~parity.core.capture.plan_capture` call, and remember what earlier captures
needed (:class:`~parity.core.capture.CaptureHistory`); both inherit them from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from parity.core.capture import DEFAULT_MAX_HEAD, CaptureHistory, CapturePlan, CaptureStats, plan_capture
from parity.core.spec import SamplingSpec
from parity.errors import PathNotFound


class RolloutSettings(TypedDict, total=False):
    """The keyword settings of :class:`RolloutBase`, as the adapters pass them on (``**settings``)."""

    dtype: str
    device: str
    seed: int
    max_model_len: int
    max_head: int
    start_head: int | None
    tie_margin: int
    head: int | None
    timeout_s: float
    prefix_caching: bool
    capture: str


class RolloutBase:
    """Settings common to every rollout adapter (no engine is started here)."""

    def __init__(
        self,
        model: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        max_model_len: int = 512,
        max_head: int = DEFAULT_MAX_HEAD,
        start_head: int | None = None,
        tie_margin: int = 16,
        head: int | None = None,
        timeout_s: float = 900.0,
        prefix_caching: bool = False,
        capture: str = "topk",
    ) -> None:
        path = Path(model)
        if not (path / "config.json").is_file():
            raise PathNotFound(
                f"model path {str(model)!r} has no config.json: allowed a Hugging Face checkpoint directory"
            )
        self.path = path
        self.model = str(path)
        self.dtype = dtype
        self.device = device
        self.seed = seed
        self.max_model_len_arg = max_model_len
        self.max_head = max_head  # the widest head an adaptive plan asks (top_p/min_p without top_k)
        self.start_head = start_head  # force the first head of adaptive plans (None: spec and history)
        self.capture_history = CaptureHistory()
        self.last_capture: CaptureStats | None = None  # what the latest generate() captured
        self.tie_margin = tie_margin
        self.head = head
        self.timeout_s = timeout_s
        self.prefix_caching = prefix_caching
        self.capture = capture
        self.capture_s = 0.0
        self.init_s = 0.0
        self.vocab_size = 0  # set by the adapter once it knows the engine's vocabulary

    def plan(self, spec: SamplingSpec) -> CapturePlan:
        """The top-K head that captures S_q for ``spec`` under this adapter's capture settings.

        Adaptive plans start from ``start_head`` when set, else from what this adapter's history
        suggests, else from the spec (:func:`~parity.core.capture.start_head`).
        """
        return plan_capture(
            spec, self.vocab_size, head=self.head, tie_margin=self.tie_margin, max_head=self.max_head,
            start=self.start_head, suggested=self.capture_history.start(spec),
        )
