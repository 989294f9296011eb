"""CUDA only: vLLM's native routed-experts capture (enable_return_routed_experts, Model Runner V2) on a MoE fixture."""

from __future__ import annotations

import pytest

from parity.core.matrix import Matrix, Scenario
from parity.core.spec import SamplingSpec
from parity.engines.routed_experts import NATIVE
from parity.engines.session import EnginePool
from parity.run import RunConfig, run

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


@pytest.mark.parametrize("model", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_native_routed_experts_agree_and_replay_is_exact(pool, tmp_path, model) -> None:
    m = Matrix("moe-cuda", (Scenario("T=1", SamplingSpec(temperature=1.0), prompts=8, max_tokens=16),))
    report = run(RunConfig(model=model, device="cuda", matrix=m, out=tmp_path, plots=False), progress=lambda s: None,
                 pool=pool)
    (s,) = report["scenarios"]
    g = s["routing"]
    assert g["capture"]["route"] == NATIVE and g["uncovered_rows"] == 0
    assert g["flips_above_bound"] == 0 and g["replay"]["forced_frac"] == 1.0, s["violations"]
    assert report["passed"], [v["message"] for v in s["violations"]]
