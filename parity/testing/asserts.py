"""Assert that a trainer's log-prob function scores what the vLLM sampler drew from:
``assert_trainer_parity(my_logprob_fn, spec=SamplingSpec(temperature=0.7, top_p=0.9))`` samples with the
real engine on a fixture (or your checkpoint) and fails with ``parity run``'s verdict.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from parity.core.gates import Thresholds
from parity.core.spec import SamplingSpec

if TYPE_CHECKING:  # pragma: no cover
    from parity.engines.session import EnginePool
    from parity.engines.trainer_under_test import TrainerFn


@functools.cache
def _pool() -> EnginePool:
    from parity.engines.session import EnginePool

    return EnginePool()


def check_trainer(
    fn: TrainerFn | str,
    *,
    spec: SamplingSpec,
    model: str = "qwen2-tiny",
    prompts: int = 4,
    max_tokens: int = 8,
    seed: int = 0,
    thresholds: Thresholds | None = None,
    dtype: str = "float32",
    pool: EnginePool | None = None,
) -> dict[str, Any]:
    """Score ``fn`` on one sampled batch; return the scenario summary with ``violations``."""
    from parity.core.matrix import Scenario
    from parity.run import RunConfig, score_scenario

    cfg = RunConfig(model=model, dtype=dtype, seed=seed, thresholds=thresholds or Thresholds.for_dtype(dtype), trainer=fn)
    pool = pool or _pool()
    rollout, trainer = pool.get(model, cfg, lambda s: None)
    sc = Scenario(f"trainer-under-test {spec.label()}", spec, prompts=prompts, max_tokens=max_tokens)
    res = score_scenario(rollout, trainer, sc, cfg)
    # Only the trainer-under-test gate speaks for the user's function; the harness's own estimators
    # are reported but do not fail the user's test.
    mine = [v for v in res.verdict.violations if v.gate.startswith("trainer_under_test")]
    harness = [v for v in res.verdict.violations if v not in mine] + list(res.verdict.reference_violations)
    return {**res.verdict.entry, "violations": mine, "harness_violations": harness}


def assert_trainer_parity(fn: TrainerFn | str, *, spec: SamplingSpec, **kwargs: Any) -> dict[str, Any]:
    """Raise ``AssertionError`` with parity's verdict if ``fn`` does not score the sampler's distribution."""
    result = check_trainer(fn, spec=spec, **kwargs)
    if result["violations"]:
        raise AssertionError("trainer parity failed:\n" + "\n".join(f"  {v}" for v in result["violations"]))
    return result
