"""Records on the real engine: ``parity run --records`` then ``parity analyze`` gives the run's verdicts and
numbers, and the README's "records from your own vLLM engine" block works as written."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from parity.analyze import analyze
from parity.core.matrix import Matrix, Scenario
from parity.core.spec import SamplingSpec
from parity.core.token_table import TrainerFaults
from parity.engines.session import EnginePool
from parity.judge.token_columns import Options
from parity.judge.verdict import USER_GATES
from parity.records.validate import validate_batch
from parity.run import RunConfig, run

pytestmark = pytest.mark.e2e

MODEL = "qwen2-tiny"
ROOT = Path(__file__).resolve().parents[2]


def small_matrix(name: str = "records") -> Matrix:
    kw = dict(prompts=4, max_tokens=8)
    return Matrix(
        name,
        (
            Scenario("baseline T=1", SamplingSpec(), **kw),
            Scenario("greedy T=0", SamplingSpec(temperature=0.0), **kw),
            Scenario("top_p=0.9 T=0.7", SamplingSpec(temperature=0.7, top_p=0.9), **kw),
            Scenario("top_k=20 T=1.3", SamplingSpec(temperature=1.3, top_k=20), **kw),
            Scenario("min_p=0.1", SamplingSpec(min_p=0.1), **kw),
            Scenario("all filters T=0.7", SamplingSpec(temperature=0.7, top_k=50, top_p=0.95, min_p=0.05), **kw),
        ),
    )


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


# What a run reports that an analysis does not reproduce: the RL view needs every token at once; the
# capture plan, the dtypes and the raw-logits pass are facts of the run around its table.
RUN_ONLY = ("rl_view", "capture_plan", "dtypes", "raw_logits_pass")


def same(a, b, path="", exact=False) -> list[str]:
    """Run numbers against analysis numbers: exact or float64 rounding; p99 within its histogram bin.
    ``exact``: every key on both sides (the run-only ones too)."""
    bad = []
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            bad += same(x, y, f"{path}[{i}]", exact)
    elif isinstance(a, dict):
        for k, v in a.items():
            if k in RUN_ONLY and not exact:
                continue
            if k not in b:
                bad.append(f"{path}.{k} missing")
            else:
                bad += same(v, b[k], f"{path}.{k}", exact)
        bad += [f"{path}.{k} only in the analysis" for k in b if k not in a and exact]
    elif isinstance(a, float) and isinstance(b, float):
        tol = 0.013 * abs(a) if "p99" in path else 1e-12 * max(1.0, abs(a))
        if not (a == b or (math.isnan(a) and math.isnan(b)) or abs(a - b) <= tol):
            bad.append(f"{path}: {a!r} vs {b!r}")
    elif a != b:
        bad.append(f"{path}: {a!r} vs {b!r}")
    return bad


def round_trip(pool, tmp_path: Path, **cfg):
    records = tmp_path / "run.parquet"
    rep = run(RunConfig(model=MODEL, out=tmp_path / "run", records=records, plots=False, **cfg), progress=lambda s: None, pool=pool)
    ana = analyze(records, out=tmp_path / "analyze", plots=False)
    return rep, ana


@pytest.mark.parametrize(
    ("faults", "trainer"), [(TrainerFaults(), "full"), (TrainerFaults(perturb_logits=0.05), None)], ids=["clean", "planted"]
)
def test_run_records_then_analyze_gives_the_same_report(pool, tmp_path: Path, faults, trainer) -> None:
    rep, ana = round_trip(pool, tmp_path, matrix=small_matrix(), faults=faults, trainer=trainer)
    # report.json itself, timings aside: one report builder over the same records and their metadata.
    written = [json.loads((tmp_path / d / "report.json").read_text()) for d in ("run", "analyze")]
    for w in written:
        w.pop("timings")
    assert same(written[0], written[1], "report.json", exact=True) == []
    assert [s["name"] for s in ana["scenarios"]] == [s["name"] for s in rep["scenarios"]]
    assert ana["passed"] == rep["passed"]
    for r, a in zip(rep["scenarios"], ana["scenarios"], strict=True):
        assert same(r, a, r["name"]) == [], r["name"]  # verdicts, violation messages and every number
    if faults.perturb_logits:
        assert not rep["passed"] and all(s["verdict"] == "fail" for s in ana["scenarios"])
    else:
        # Only the trainer under test fails (the full-vocabulary trainer, where the sampler truncates).
        assert all(v["gate"] in USER_GATES for s in rep["scenarios"] for v in s["violations"])
        assert {s["name"] for s in rep["scenarios"] if s["verdict"] == "pass"} == {"baseline T=1", "greedy T=0"}
        # The trainer under test ('full') is diagnosed the same way from the records alone.
        top_p = next(s for s in ana["scenarios"] if s["name"] == "top_p=0.9 T=0.7")
        assert "full-vocabulary distribution" in top_p["trainer_under_test"]["diagnosis"]
    # Every gate of the run was evaluated from its records (the export carries the bounds and log S).
    for a in ana["scenarios"]:
        assert a["not_evaluated"] == [], a["name"]
    assert ana["environment"]["vllm"] == rep["environment"]["vllm"]


def readme_block() -> str:
    text = (ROOT / "docs" / "records_format.md").read_text()
    block = re.search(r"<!-- own-vllm:start -->\s*```python\n(.*?)```\s*<!-- own-vllm:end -->", text, re.S)
    assert block, "README lost its own-vLLM records example"
    return block.group(1)


def test_readme_records_from_your_own_engine(pool, tmp_path: Path, monkeypatch) -> None:
    rollout, _ = pool.get(MODEL, RunConfig(model=MODEL), lambda s: None)
    prompts = ["The sampler and the trainer must agree", "Once upon a time", "def log_softmax(logits):"]
    monkeypatch.chdir(tmp_path)
    exec(compile(readme_block(), "docs/records_format.md", "exec"), {"llm": rollout.llm, "prompts": prompts})
    path = tmp_path / "rollouts.parquet"
    ana = analyze(path, options=Options(model=MODEL), out=tmp_path / "report", plots=False)
    (sc,) = ana["scenarios"]
    assert sc["verdict"] == "pass", sc["violations"]
    # top_k filters: no sampler-side log S without a raw-logits pass (and no trainer under test: its gates do not apply).
    assert {g["gate"] for g in sc["not_evaluated"]} == {"naive_vs_sampler_log_s"}
    assert sc["captured_positions"] == sc["tokens"] > 0 and sc["incomplete_positions"] == 0
    assert sc["log_s"]["mean"] < -1e-3  # top_k=20 truncates: the naive bias is measured and explained
    assert sc["naive"]["max_abs_gap_to_log_s"] <= 1e-5

    # vLLM's other log-prob container (flat_logprobs=True) gives the same records.
    import pyarrow.parquet as pq
    from vllm import SamplingParams

    from parity.records.convert import from_request_outputs

    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, logprobs=36, seed=0, flat_logprobs=True)
    flat = from_request_outputs(rollout.llm.generate(prompts, params, use_tqdm=False), params)
    a, b = validate_batch(pq.read_table(path)), validate_batch(flat)
    assert a.completion.values.tolist() == b.completion.values.tolist()
    assert a.kept_token_offsets.tolist() == b.kept_token_offsets.tolist()

    def kept(x, t):  # the dict container lists the sampled token first: compare each position as a set
        lo, hi = x.kept_token_offsets[t], x.kept_token_offsets[t + 1]
        return sorted(zip(x.kept.values[lo:hi].tolist(), x.kept_logprobs[lo:hi].tolist(), strict=True))

    assert all(kept(a, t) == kept(b, t) for t in range(a.tokens))
    assert a.sampler_logprobs.tolist() == b.sampler_logprobs.tolist()


def test_rescoring_fails_a_planted_fault_and_merges_shards(pool, tmp_path: Path) -> None:
    """--model on the engine's records: a sampler value moved by 3x its rounding bound fails the replay drift
    gate at that position, by a tenth of it passes; two shards in two processes give the single file's
    verdict and counts."""
    import pyarrow.parquet as pq
    from vllm import SamplingParams

    from parity.records.convert import from_request_outputs
    from parity.records.write import records_table, write_records

    rollout, _ = pool.get(MODEL, RunConfig(model=MODEL), lambda s: None)
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=12, logprobs=-1, seed=3, ignore_eos=True)
    rows = from_request_outputs(rollout.llm.generate(["Numbers: 1, 2, 3", "A kept set is", "In reinforcement learning"],
                                                     params, use_tqdm=False), params, vocab_size=rollout.vocab_size).to_pylist()
    def analysed(delta: float, name: str):
        moved = [dict(r, sampler_logprobs=list(r["sampler_logprobs"])) for r in rows]
        moved[1]["sampler_logprobs"][5] += delta
        path = write_records(tmp_path / f"{name}.parquet", records_table(moved))
        (sc,) = analyze(path, options=Options(model=MODEL))["scenarios"]
        return sc

    clean = analysed(0.0, "clean")
    assert clean["violations"] == [] and "replay_drift" in clean["gates_evaluated"]
    # KL / TV and the logit drift over S_q from the model's logits at the kept ids (the records carry none):
    # the same fp32 weights on both sides, so near 0, and present at every captured position.
    assert 0.0 <= clean["kl_over_support"]["max"] < 1e-4 and 0.0 <= clean["tv_over_support"]["max"] < 1e-2
    assert clean["drift_split"] is not None and 0.0 <= clean["drift_split"]["logit_drift_max"] < 1e-2
    bad = analysed(3 * clean["bound"]["max"], "big")  # at least 2x every token's bound away
    drift = next(v for v in bad["violations"] if v["gate"] == "replay_drift")
    planted = next(p for p in drift["worst"] if (p["prompt"], p["position"]) == (1, 5))
    token_bound = planted["bound"] / RunConfig(model=MODEL).thresholds.max_headroom
    assert abs(planted["gap"]) > token_bound  # the planted position is where the gate fails
    assert analysed(0.1 * token_bound, "small")["violations"] == []

    whole = write_records(tmp_path / "whole.parquet", records_table(rows))
    table = pq.read_table(whole)
    write_records(tmp_path / "shards" / "a.parquet", table.slice(0, 2))
    write_records(tmp_path / "shards" / "b.parquet", table.slice(2))
    (one,) = analyze(whole, options=Options(model=MODEL))["scenarios"]
    (two,) = analyze(tmp_path / "shards", options=Options(model=MODEL), jobs=2)["scenarios"]
    assert one["verdict"] == two["verdict"] == "pass"
    # Counts are exact; the trainer's values may move with how rows are batched (right padding is not
    # batch-invariant on every CPU), so those are held to the gate, not to equality.
    for key in ("tokens", "compared_tokens", "sequences", "captured_positions", "incomplete_positions",
                "sampled_outside_support", "max_support_size"):
        assert one[key] == two[key], key
    assert max(one["headroom"]["replay"], two["headroom"]["replay"]) <= RunConfig(model=MODEL).thresholds.max_headroom
