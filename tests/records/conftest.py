"""A local Ray cluster for the engine tests: one per test session, shut down at its end.

The fixture skips, with what to install, where Ray is missing; under ``nox -s tests``, which installs
it (the ray extra) and sets PARITY_ENGINES_REQUIRED, it fails instead, so CI never passes by skipping.
"""

from __future__ import annotations

import importlib.util
import os

import pytest


def _missing(why: str) -> None:
    if os.environ.get("PARITY_ENGINES_REQUIRED"):
        pytest.fail(why + " (PARITY_ENGINES_REQUIRED is set)")
    pytest.skip(why)


@pytest.fixture(scope="session")
def ray_cluster():
    if importlib.util.find_spec("ray") is None:
        _missing("needs ray: pip install 'parity[ray]' (nox -s tests installs it)")
    import ray

    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=256 * 2**20, log_to_driver=False,
             logging_level="WARNING")
    try:
        yield ray
    finally:
        ray.shutdown()
