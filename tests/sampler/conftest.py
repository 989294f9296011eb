"""One vLLM Sampler for every sampler-level test module (importing vLLM takes ~15 s)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def sampler():
    from parity.engines.sampler import VllmSampler

    return VllmSampler()
