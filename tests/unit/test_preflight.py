"""A spec the capture plan refuses stops parity run before any engine starts, naming the scenario."""

from __future__ import annotations

import pytest

from parity.core.matrix import Matrix, Scenario
from parity.core.spec import SamplingSpec
from parity.errors import UsageError
from parity.run import RunConfig, run


class NoEngines:
    """An engine pool that must not be asked for an engine."""

    def get(self, *a, **k):
        raise AssertionError("an engine was started before the matrix was checked")

    raw = get

    def close(self) -> None:
        pass


def test_a_refused_capture_plan_fails_before_any_engine(tmp_path) -> None:
    bad = Matrix("m", (Scenario(name="fine", spec=SamplingSpec(1.0, top_k=20)),
                       Scenario(name="too wide", spec=SamplingSpec(1.0, top_k=300))))
    cfg = RunConfig(model="qwen2-tiny", matrix=bad, out=tmp_path, max_capture_head=128)
    with pytest.raises(UsageError) as info:
        run(cfg, progress=lambda s: None, pool=NoEngines())
    msg = str(info.value)
    assert "scenario 'too wide' on qwen2-tiny (V=400)" in msg and "--max-capture-head" in msg
    assert "'fine'" not in msg
