"""pytest plugin (entry point ``pytest11``): opt-in fixtures for testing your own trainer against vLLM.
``parity_model`` (``--parity-model``) names the fixture model or checkpoint; ``parity_pool`` shares one
vLLM engine per test session; ``trainer_parity`` is :func:`parity.testing.asserts.assert_trainer_parity` bound to both.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from parity.core.spec import SamplingSpec
    from parity.engines.session import EnginePool
    from parity.engines.trainer_under_test import TrainerFn


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity", "rollout-trainer parity")
    group.addoption("--parity-model", default=None, help="fixture name or checkpoint dir for parity fixtures (default qwen2-tiny)")


@pytest.fixture(scope="session")
def parity_model(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--parity-model") or "qwen2-tiny"


@pytest.fixture(scope="session")
def parity_pool() -> Iterator[EnginePool]:
    from parity.engines.session import EnginePool
    from parity.engines.vllm_offline import configure_cpu_env

    configure_cpu_env()
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture
def trainer_parity(parity_pool: EnginePool, parity_model: str) -> Callable[..., dict[str, Any]]:
    from parity.testing.asserts import assert_trainer_parity

    def check(fn: TrainerFn | str, *, spec: SamplingSpec, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("model", parity_model)
        return assert_trainer_parity(fn, spec=spec, pool=parity_pool, **kwargs)

    return check
