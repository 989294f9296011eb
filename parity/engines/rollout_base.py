"""What the two vLLM rollout adapters share: the checkpoint, the engine settings and the capture plan.

:class:`~parity.engines.vllm_offline.VllmRollout` (in-process engine) and
:class:`~parity.engines.vllm_server.client.ServerRollout` (OpenAI-compatible server) take the same
settings with the same defaults, validate the checkpoint the same way and plan the capture of S_q
with the same :func:`~parity.core.capture.plan_capture` call; both inherit them from here.
"""

from __future__ import annotations

from pathlib import Path

from parity.core.capture import CapturePlan, plan_capture
from parity.core.spec import SamplingSpec
from parity.errors import PathNotFound


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
        full_vocab_limit: int = 4096,
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
        self.full_vocab_limit = full_vocab_limit
        self.tie_margin = tie_margin
        self.head = head
        self.timeout_s = timeout_s
        self.prefix_caching = prefix_caching
        self.capture = capture
        self.capture_s = 0.0
        self.init_s = 0.0
        self.vocab_size = 0  # set by the adapter once it knows the engine's vocabulary

    def plan(self, spec: SamplingSpec) -> CapturePlan:
        """The top-K head that captures S_q for ``spec`` under this adapter's capture settings."""
        return plan_capture(
            spec, self.vocab_size, head=self.head, tie_margin=self.tie_margin, full_vocab_limit=self.full_vocab_limit
        )
