"""Shared test configuration: Hypothesis profiles, markers that skip with a reason."""

from __future__ import annotations

import importlib.util
import os

import pytest
from hypothesis import HealthCheck, settings

# dev: quick local iteration. ci: the built-in ci profile (derandomized, no database, print_blob)
# with more examples, so every strategy branch (ties, -inf, greedy, mixed batch) is reached.
settings.register_profile("dev", max_examples=30, deadline=None)
settings.register_profile(
    "ci",
    parent=settings.get_profile("ci"),
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    no_cuda = pytest.mark.skip(reason="needs CUDA: torch.cuda.is_available() is False on this machine")
    no_vllm = pytest.mark.skip(reason="needs vLLM: install parity[cpu] (nox -s tests does)")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_cuda)
        if ("sampler" in item.keywords or "e2e" in item.keywords) and not HAVE_VLLM:
            item.add_marker(no_vllm)
