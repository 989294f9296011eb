"""CUDA-only checks (skipped with a reason on machines without CUDA; run by `nox -s gpu`)."""

from __future__ import annotations

import pytest

from parity.core.matrix import Matrix, Scenario
from parity.core.spec import SamplingSpec
from parity.engines.session import EnginePool
from parity.run import RunConfig, run, score_scenario

pytestmark = pytest.mark.gpu

MODEL = "qwen2-tiny"


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


def test_native_sampling_mask_equals_top_k_capture(pool) -> None:
    cfg = RunConfig(model=MODEL, device="cuda", capture="both")
    rollout, trainer = pool.get(MODEL, cfg, lambda s: None)
    sc = Scenario("native", SamplingSpec(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05), prompts=8, max_tokens=16)
    res = score_scenario(rollout, trainer, sc, cfg)
    assert res.facts["native_capture"]["mismatched_positions"] == 0, res.verdict.violations
    assert res.verdict.violations == []


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_run_passes_the_thresholds_file(pool, dtype, tmp_path) -> None:
    from pathlib import Path

    from parity.core.gates import Thresholds

    th = Thresholds.from_toml(Path(__file__).resolve().parents[2] / "ci" / "thresholds.toml", dtype)
    m = Matrix("cuda", (Scenario("top_p", SamplingSpec(0.7, 0, 0.9, 0.0), prompts=8, max_tokens=16),
                        Scenario("top_k", SamplingSpec(1.0, 20, 1.0, 0.05), prompts=8, max_tokens=16)))
    rep = run(RunConfig(model=MODEL, device="cuda", dtype=dtype, matrix=m, thresholds=th, out=tmp_path, plots=False),
              progress=lambda s: None, pool=pool)
    assert rep["passed"], [v for s in rep["scenarios"] for v in s["violations"]]


def test_batch_invariant_mode_makes_the_rollout_invariant(tmp_path) -> None:
    m = Matrix("bi", (Scenario("top_p", SamplingSpec(1.0, 0, 0.9, 0.0), prompts=4, max_tokens=8),))
    rep = run(RunConfig(model=MODEL, device="cuda", matrix=m, batch_invariant=True, invariance=True, out=tmp_path, plots=False),
              progress=lambda s: None)
    det = rep["determinism"]
    assert det["required"] and det["rollout"]["invariant"], det["violations"]
