"""Harness throughput: sampler-level property cases per second, end-to-end tokens compared per second.

* Property cases (``parity sampler``'s loop): draw a random batch (``random_plan`` + ``build_case``),
  run vLLM's real ``Sampler`` on it, check every property of ``parity.testing.properties.run_properties``. The
  baseline interleaved with it is vLLM's Sampler alone on the same cases, so the ratio is what the
  reference filters and properties add. One torch thread, as ``parity sampler`` defaults to.
* End to end (``parity run``'s per-scenario work): ``score_scenario`` on qwen2-tiny (vLLM samples with
  top-K capture, transformers scores, tables, gates). The baseline is the same generation with no
  log-probs, so the ratio is the whole harness over plain sampling.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch

from parity.core.matrix import Scenario
from parity.core.spec import SamplingSpec
from parity.engines.session import make_prompts
from parity.run import RunConfig, score_scenario
from parity.testing.cases import build_case, random_plan
from parity.testing.properties import run_properties

CASES_PER_ROUND = 40
ROUNDS, WARMUP = 3, 1
E2E_MODEL = "qwen2-tiny"
E2E_SCENARIO = Scenario("bench top_k=50 top_p=0.9", SamplingSpec(0.8, top_k=50, top_p=0.9), prompts=8, max_tokens=32)
TITLE = "Harness throughput"
INTRO = (
    "Property cases: random batches (V <= 4096, <= 6 rows) through vLLM's Sampler + every harness "
    "property, one torch thread. End to end: score_scenario (sample, capture, score, compare, gate)."
)


def draw_cases(n: int, seed: int = 0) -> list[Any]:
    rng = random.Random(seed)
    return [build_case(random_plan(rng)) for _ in range(n)]


def property_loop(sampler: Callable[..., Any], cases: list[Any]) -> int:
    """The ``parity sampler`` loop body over pre-drawn cases; returns the failing-case count."""
    failed = 0
    for case in cases:
        prompts, outputs = case.histories
        out = sampler(case.logits, case.specs, seed=case.seed, prompt_ids=prompts, output_ids=outputs)
        failed += not run_properties(case, out).ok
    return failed


def sampler_loop(sampler: Callable[..., Any], cases: list[Any]) -> None:
    for case in cases:
        prompts, outputs = case.histories
        sampler(case.logits, case.specs, seed=case.seed, prompt_ids=prompts, output_ids=outputs)


def run_property_case(report: Any, timer: Callable[..., Any], sampler: Callable[..., Any], *, n: int = CASES_PER_ROUND) -> Any:
    cases = draw_cases(n)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pair = timer(lambda: property_loop(sampler, cases), lambda: sampler_loop(sampler, cases), rounds=ROUNDS, warmup_rounds=WARMUP)
    finally:
        torch.set_num_threads(before)
    assert pair.result == 0, f"{pair.result} of {n} property cases failed: run `parity sampler` to see them"
    rows = sum(c.logits.shape[0] for c in cases)
    report.table("harness", TITLE, "what", INTRO).put(
        "sampler property cases",
        "throughput",
        n / pair.seconds,
        unit="cases/s",
        seconds=pair.seconds,
        note=f"({rows} rows per {n} cases; {pair.ratio:.2f}x vLLM's Sampler alone, {n / pair.baseline_seconds:,.0f} cases/s)",
    )
    return pair


def tokens_compared(result: Any) -> int:
    return sum(len(r.completion_ids) for r in result.records)


def run_e2e_case(report: Any, timer: Callable[..., Any], rollout: Any, trainer: Any, cfg: RunConfig) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sc = E2E_SCENARIO
    prompts = [TokensPrompt(prompt_token_ids=p) for p in make_prompts(trainer.tokenizer(), sc.prompts)]
    plain = [
        SamplingParams(**sc.spec.sampling_params_kwargs(), max_tokens=sc.max_tokens, seed=i, ignore_eos=True, detokenize=False)
        for i in range(sc.prompts)
    ]
    pair = timer(
        lambda: score_scenario(rollout, trainer, sc, cfg),
        lambda: rollout.llm.generate(prompts, plain, use_tqdm=False),
        rounds=ROUNDS,
        warmup_rounds=WARMUP,
    )
    res = pair.result
    assert not res.verdict.violations, res.verdict.violations
    tokens = tokens_compared(res)
    report.table("harness", TITLE, "what", INTRO).put(
        f"end to end, {E2E_MODEL}",
        "throughput",
        tokens / pair.seconds,
        unit="tokens/s",
        seconds=pair.seconds,
        note=f"({sc.prompts} x {sc.max_tokens} tokens, {sc.spec.label()}; {pair.ratio:.2f}x generation alone)",
    )
    return pair


def test_bench_sampler_properties(timer, bench_report) -> None:
    from parity.engines.vllm_sampler import VllmSampler

    run_property_case(bench_report, timer, VllmSampler())


def test_bench_end_to_end(timer, bench_report, engine_pool) -> None:
    cfg = RunConfig(model=E2E_MODEL)
    rollout, trainer = engine_pool.get(E2E_MODEL, cfg, lambda msg: None)
    run_e2e_case(bench_report, timer, rollout, trainer, cfg)


@pytest.mark.gpu
def test_bench_end_to_end_cuda(timer, bench_report) -> None:
    """The same scenario with both engines on CUDA (a pool of its own: its engines are CUDA ones)."""
    from parity.engines.session import EnginePool

    cfg = RunConfig(model=E2E_MODEL, device="cuda")
    pool = EnginePool()
    try:
        rollout, trainer = pool.get(E2E_MODEL, cfg, lambda msg: None)
        run_e2e_case(bench_report, timer, rollout, trainer, cfg)
    finally:
        pool.close()
