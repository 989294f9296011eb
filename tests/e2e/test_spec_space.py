"""The gates over the whole spec space on the real engine: no false FAIL anywhere, a planted fault everywhere.

Hypothesis draws sampling specs (temperature, top_k, top_p, min_p, alone and combined) and the
fixture (the tiny Qwen2, or its copy with exact ties planted at top_k boundaries); each example is one
small generate and score on engines shared by the module. Every gate holds with the error-model
bounds at every drawn spec, and a trainer off by four rounding bounds at one token per sequence fails
at every drawn spec. Shrinking names the smallest failing spec.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import engine_specs

from parity.core.matrix import Scenario
from parity.core.token_table import TrainerFaults
from parity.engines.session import EnginePool
from parity.run import RunConfig, score_scenario, wants_sampler_log_s

pytestmark = pytest.mark.e2e

MODELS = ("qwen2-tiny", "qwen2-tiny-ties")
VOCAB = 400  # both fixtures


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


def _score(pool, model: str, spec, faults: TrainerFaults | None = None):
    cfg = RunConfig(model=model, faults=faults or TrainerFaults(), sampler_log_s=model == MODELS[0])
    rollout, trainer = pool.get(model, cfg, lambda s: None)
    sc = Scenario("drawn", spec, prompts=2, max_tokens=4)
    raw = pool.raw(model, cfg, lambda s: None) if wants_sampler_log_s(rollout, sc, cfg) else None
    return score_scenario(rollout, trainer, sc, cfg, raw)


SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(model=st.sampled_from(MODELS), spec=engine_specs(VOCAB))
def test_no_gate_fails_on_a_correct_trainer_at_any_spec(pool, model, spec) -> None:
    res = _score(pool, model, spec)
    assert res.verdict.violations == [], "\n".join(str(v) for v in res.verdict.violations)


@SETTINGS
@given(model=st.sampled_from(MODELS), spec=engine_specs(VOCAB))
def test_a_trainer_off_by_four_bounds_fails_at_any_spec(pool, model, spec) -> None:
    res = _score(pool, model, spec, TrainerFaults(shift_bounds=4.0))
    assert "replay_drift" in {v.gate for v in res.verdict.violations}, res.verdict.entry["headroom"]


@pytest.mark.slow
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from(MODELS), spec=engine_specs(VOCAB))
def test_no_gate_fails_on_a_correct_trainer_at_any_spec_long(pool, model, spec) -> None:
    """The same property with ten times the examples (``nox -s tests -- -m slow``)."""
    res = _score(pool, model, spec)
    assert res.verdict.violations == [], "\n".join(str(v) for v in res.verdict.violations)
