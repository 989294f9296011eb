"""Adaptive capture on the real trained checkpoint smollm2-135m (V=49,152): top_p and min_p without top_k.

Before the adaptive plan these specs were refused above 4096 tokens (the full vocabulary per position
took 28.8 s and 5.7 GB for 64 tokens). Here ``parity run`` scores both through the default plan: every
position's kept set is proven complete, by its head (a dropped token ends it) or by the sampler's own
row, and the gates pass.
One engine pair for the module (the run's pool); the invariance check that samples with T=1 top_p=0.9
(what ``--invariance`` runs) is marked slow.
"""

from __future__ import annotations

import pytest

from parity.core.matrix import Matrix, Scenario
from parity.core.spec import SamplingSpec
from parity.engines.session import EnginePool
from parity.run import RunConfig, run

pytestmark = pytest.mark.e2e

SCENARIOS = (
    Scenario("top_p=0.9 T=1", SamplingSpec(1.0, top_p=0.9), prompts=4, max_tokens=12),
    Scenario("min_p=0.1 T=0.7", SamplingSpec(0.7, min_p=0.1), prompts=4, max_tokens=12),
)


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


@pytest.fixture(scope="module")
def report(smollm2_dir, pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("smollm2-adaptive")
    cfg = RunConfig(model=str(smollm2_dir), matrix=Matrix("adaptive", SCENARIOS), out=out, plots=False)
    lines: list[str] = []
    rep = run(cfg, progress=lines.append, pool=pool)
    rep["_progress"] = lines
    return rep


def test_top_p_and_min_p_without_top_k_pass_with_complete_kept_sets(report) -> None:
    failures = [v["message"] for s in report["scenarios"] for v in s["violations"]]
    assert report["passed"], "\n".join(failures)
    for s in report["scenarios"]:
        plan = s["capture_plan"]
        print(f"\n{s['name']}: {plan}")
        assert plan["adaptive"] and plan["max_head"] == 4096, s["name"]
        assert plan["incomplete_positions"] == 0 and s["incomplete_positions"] == 0, s["name"]
        assert plan["resampled_differently"] == 0, s["name"]
        assert plan["positions"] == s["tokens"] == 4 * 12
        # A head of K proves at most K - 1 tokens: anything wider came from the sampler's rows.
        assert 1 <= plan["largest_support"] < plan["widest_head"] or plan["widest_head"] == -1 or plan["row_positions"]
    top_p, min_p = report["scenarios"]
    # The offline engine asks a head of 64 (ROWS_HEAD) and reads the kept sets it cannot prove from the
    # sampler's rows, in the same generation.
    assert top_p["capture_plan"]["logprobs"] == min_p["capture_plan"]["logprobs"] == 64
    assert top_p["capture_plan"]["rounds"] == 0 and top_p["capture_plan"]["row_positions"] > 0
    assert top_p["log_s"]["mean"] < -0.01 and min_p["log_s"]["mean"] < 0.0
    assert any(line.strip().startswith("capture: adaptive") for line in report["_progress"])


def test_a_second_run_starts_from_what_the_first_needed(report, smollm2_dir, pool) -> None:
    """Within one run the history carries over; a new run starts again from the spec."""
    rollout, _ = pool.get(str(smollm2_dir), RunConfig(model=str(smollm2_dir)), lambda _s: None)
    need = report["scenarios"][0]["capture_plan"]["largest_support"] + 1
    suggested = rollout.capture_history.start(SCENARIOS[0].spec)
    assert suggested is not None and suggested >= need and suggested < 2 * need + 16


@pytest.mark.slow
def test_rollout_invariance_check_runs_on_the_real_checkpoint(report, smollm2_dir, pool) -> None:
    """--invariance samples T=1 top_p=0.9 with no top_k at batch sizes 2..32: adaptive capture on 49,152 tokens."""
    from parity.determinism.checks import check_rollout_invariance
    from parity.engines.session import make_prompts

    rollout, trainer = pool.get(str(smollm2_dir), RunConfig(model=str(smollm2_dir)), lambda _s: None)
    res = check_rollout_invariance(rollout, make_prompts(trainer.tokenizer(), 4), SamplingSpec(1.0, top_p=0.9),
                                   max_tokens=4, seed=0)
    assert "invariant" in res
    assert rollout.last_capture.incomplete_positions == 0
