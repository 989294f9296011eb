"""parity: does the trainer score the exact distribution the vLLM sampler drew from?

The package holds the engine-free math core, imported on first use: ``import parity`` (and so
``parity --help``) does not import torch until one of these names is read."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from parity.core.estimators import full, predicted_log_s, recompute, replay
    from parity.core.filters import FilterResult, reference_filter
    from parity.core.spec import SamplingSpec

__version__ = "0.1.0"

# name -> the module that defines it
_LAZY = {
    "FilterResult": "parity.core.filters",
    "SamplingSpec": "parity.core.spec",
    "full": "parity.core.estimators",
    "predicted_log_s": "parity.core.estimators",
    "recompute": "parity.core.estimators",
    "reference_filter": "parity.core.filters",
    "replay": "parity.core.estimators",
}

__all__ = [
    "FilterResult",
    "SamplingSpec",
    "__version__",
    "full",
    "predicted_log_s",
    "recompute",
    "reference_filter",
    "replay",
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'parity' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
