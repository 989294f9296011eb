"""parity: does the trainer score the exact distribution the vLLM sampler drew from?

The package holds the engine-free math core, imported on first use: ``import parity`` (and so
``parity --help``) does not import torch until one of these names is read."""

from __future__ import annotations

import importlib
from collections.abc import Callable
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


def lazy_module(owner: str, names: dict[str, str], namespace: dict[str, Any]) -> tuple[
        Callable[[str], Any], Callable[[], list[str]]]:
    """A module's ``__getattr__`` and ``__dir__`` that import each of ``names`` (name -> defining module) on
    first read and keep it in ``namespace``, so ``import`` of ``owner`` costs nothing until then."""

    def getattr_(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {owner!r} has no attribute {name!r}; its names: {', '.join(sorted(names))}")
        value = getattr(importlib.import_module(names[name]), name)
        namespace[name] = value  # later reads skip this function
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(names))

    return getattr_, dir_


__getattr__, __dir__ = lazy_module("parity", _LAZY, globals())
