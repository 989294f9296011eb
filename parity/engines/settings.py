"""What the engines of a run are started with: the settings :class:`~parity.engines.session.EnginePool` reads.
:meth:`~parity.run.RunConfig.engine_settings` hands them out of ``parity run``'s :class:`~parity.run.RunConfig`
(which holds more), so the engines never import the run layer above them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class EngineSettings:
    """The rollout engine and trainer settings of one run (each is a ``parity run`` option)."""

    model: str  # the run's model; its scenarios are scored by ``trainer_model`` when that is set
    trainer_model: str | None = None
    dtype: str = "float32"  # the sampler's dtype
    trainer_dtype: str | None = None  # None: the sampler's
    device: str = "cpu"
    seed: int = 0
    capture_head: int | None = None  # None: the capture plan's head
    max_capture_head: int | None = None  # cap of S_q capture (None: none offline, DEFAULT_MAX_HEAD's head elsewhere)
    timeout_s: float = 900.0
    prefix_caching: bool = False
    max_num_batched_tokens: int | None = None  # chunked prefill at this step budget (None: the engine's default)
    capture: str = "topk"  # "topk" | "native" | "both"
    server: str | None = None  # None: offline engine; "spawn": a local vLLM server; or a URL to attach to


class HasEngineSettings(Protocol):
    """A configuration that carries engine settings (``parity run``'s ``RunConfig``)."""

    def engine_settings(self) -> EngineSettings: ...


def as_engine_settings(settings: EngineSettings | HasEngineSettings) -> EngineSettings:
    """``settings`` itself, or the engine settings of a run configuration."""
    return settings if isinstance(settings, EngineSettings) else settings.engine_settings()
