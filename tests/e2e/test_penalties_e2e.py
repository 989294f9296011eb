"""End-to-end: penalised sampling on the real vLLM CPU engine against a transformers trainer (qwen2-tiny).

Replay and recompute apply the penalty from each sequence's own prompt and earlier tokens and pass every gate; a
trainer that leaves the penalty out fails the drift gates, and a trainer under test that does is diagnosed by its
class. One engine pool for the module.
"""

from __future__ import annotations

import pytest

from parity.core.matrix import Scenario
from parity.core.spec import SamplingSpec
from parity.core.token_table import TrainerFaults
from parity.engines.session import EnginePool
from parity.run import RunConfig, score_scenario

pytestmark = pytest.mark.e2e

MODEL = "qwen2-tiny"
SPECS = (
    SamplingSpec(1.0, repetition_penalty=1.3),
    SamplingSpec(0.0, repetition_penalty=1.2),
    SamplingSpec(0.7, top_k=20, top_p=0.8, repetition_penalty=1.05),
    SamplingSpec(1.0, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.5),
)


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


def _score(pool, spec: SamplingSpec, cfg: RunConfig):
    rollout, trainer = pool.get(MODEL, cfg, lambda s: None)
    sc = Scenario(spec.label(), spec, prompts=4, max_tokens=12)
    return score_scenario(rollout, trainer, sc, cfg)


@pytest.mark.parametrize("spec", SPECS, ids=SamplingSpec.label)
def test_penalised_scenarios_pass_for_replay_and_recompute(pool, spec: SamplingSpec) -> None:
    res = _score(pool, spec, RunConfig(model=MODEL))
    assert res.verdict.violations == [], [str(v) for v in res.verdict.violations]
    assert bool((res.table.penalty != 0).any()), "the penalty should touch some sampled token"


@pytest.mark.parametrize("spec", SPECS[:1], ids=SamplingSpec.label)
def test_a_trainer_that_ignores_the_penalty_fails(pool, spec: SamplingSpec) -> None:
    res = _score(pool, spec, RunConfig(model=MODEL, faults=TrainerFaults(ignore_penalty=True)))
    gates = {v.gate for v in res.verdict.violations}
    assert {"replay_drift", "recompute_drift"} <= gates | {"replay_mean_bias", "recompute_mean_bias"} and gates, gates


def test_a_penalty_ignoring_trainer_under_test_is_named(pool) -> None:
    spec = SamplingSpec(0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    res = _score(pool, spec, RunConfig(model=MODEL, trainer="replay-ignoring-penalties"))
    entry = res.verdict.entry
    assert {"trainer_under_test_drift", "trainer_under_test_mean_bias"} & {v.gate for v in res.verdict.violations}
    assert "ignores the repetition penalty" in entry["trainer_under_test"]["diagnosis"]
    ok = _score(pool, spec, RunConfig(model=MODEL, trainer="replay"))
    assert ok.verdict.violations == [] and ok.verdict.entry["trainer_under_test"]["diagnosis"] == (
        "matches the sampler's processed log-probs")


def test_rescoring_fills_the_penalty_term_that_logs_lack(pool, tmp_path) -> None:
    """Records without trainer_penalty_term, as TRL logs them: alone they leave the verdict's power unknown;
    ``parity analyze --model`` computes the term from the model's logits, as the run did, and assesses it."""
    from parity.analyze import analyze
    from parity.judge.token_columns import Options
    from parity.records.write import records_table, write_records

    res = _score(pool, SPECS[0], RunConfig(model=MODEL))
    vocab = pool.get(MODEL, RunConfig(model=MODEL), lambda s: None)[0].vocab_size
    rows = [{k: v for k, v in r.items() if k != "trainer_penalty_term"} for r in res.export.to_pylist()]
    path = write_records(tmp_path / "logs.parquet", records_table(rows),
                         metadata={"dtype": "float32", "trainer_dtype": "float32", "vocab_size": vocab})
    (alone,) = analyze(path, plots=False)["scenarios"]
    assert "penalty_term_mean" not in alone["naive"]
    assert alone["power"] is not None and alone["power"]["class_bias"] is None, alone["power"]
    (rescored,) = analyze(path, plots=False, options=Options(model=MODEL))["scenarios"]
    want = res.verdict.entry["naive"]["penalty_term_mean"]
    assert isinstance(want, float) and abs(want) > 1e-3
    assert rescored["naive"]["penalty_term_mean"] == pytest.approx(want, abs=1e-6)
    assert rescored["power"]["class_bias"] == pytest.approx(abs(want), abs=1e-6)
