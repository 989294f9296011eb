"""Tie characterization on the real CPU engine with the tie fixture."""

from __future__ import annotations

import pytest

from parity.cli.ties import parse_batch_sizes
from parity.determinism.ties import characterize_ties, render
from parity.engines.session import EnginePool, make_prompts
from parity.fixtures import fixture_metadata, resolve_model
from parity.run import RunConfig

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def rollout():
    pool = EnginePool()
    r, _ = pool.get("qwen2-tiny-ties", RunConfig(model="qwen2-tiny-ties"), lambda s: None)
    yield r
    pool.close()


def test_cpu_engine_keeps_every_tie_at_every_batch_size(rollout) -> None:
    groups = fixture_metadata(resolve_model("qwen2-tiny-ties"))["tie_plan"]
    prompts = make_prompts(rollout.tokenizer(), 8)
    res = characterize_ties(rollout, prompts, top_k=2, batch_sizes=[1, 4, 8], max_tokens=6, tie_groups=groups)
    assert res["boundary_ties_seen"] > 0, "the tie fixture never put a tie at the k-th value"
    assert res["batch_sizes_dropping_ties"] == []
    assert "every tie at the k-th value was kept" in render(res)
    # Negative control: without the vLLM top-K margin the ties beyond k cannot be captured, and a
    # tie plan with a token that never co-occurs with its "twin" must register as a dropped tie.
    fake = [[g[0], 0] for g in groups]
    fake_res = characterize_ties(rollout, prompts, top_k=2, batch_sizes=[8], max_tokens=6, tie_groups=fake)
    assert fake_res["batch_sizes_dropping_ties"] == [8]


def test_parse_batch_sizes() -> None:
    assert parse_batch_sizes("1-4,8") == [1, 2, 3, 4, 8]
    with pytest.raises(ValueError, match="--batch-sizes"):
        parse_batch_sizes("x")
    with pytest.raises(ValueError, match=">= 1"):
        parse_batch_sizes("0")
