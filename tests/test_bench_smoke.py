"""CI smoke test of the benchmark code (tests/bench): every code path on tiny sizes, nothing timed.

CI runs with ``--benchmark-disable``, so the benchmarks themselves skip; this test drives the same
functions they call (workloads, estimator cases, capture variants and their output checks, the
property loop, the report, bench.md, ratios.json, the ratio regression guard) with stand-ins where a
benchmark would start an engine: a fake ``LLM`` that returns outputs shaped as vLLM's, and a "sampler"
that answers with the reference filters. No vLLM import, no engine start. Ratios come out, but no
assertion reads a duration.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from parity.core.filters import reference_filter

BENCH = Path(__file__).parent / "bench"


def _load(name: str, filename: str) -> ModuleType:
    """Load a tests/bench file under its own module name (both conftest.py files are ``conftest``)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def lib() -> ModuleType:
    return _load("parity_bench_conftest", "conftest.py")


def quick(lib: ModuleType) -> Any:
    """paired_plain without the gc.collect() per interval: nothing here is a measurement."""
    return lambda target, baseline, **kw: lib.paired_plain(target, baseline, collect=False, **kw)


@pytest.fixture(scope="module")
def trainer() -> ModuleType:
    return _load("parity_bench_trainer", "test_bench_trainer.py")


@pytest.fixture(scope="module")
def rollout() -> ModuleType:
    return _load("parity_bench_rollout", "test_bench_rollout.py")


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    return _load("parity_bench_harness", "test_bench_harness.py")


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    return _load("parity_bench_kernels", "test_bench_kernels.py")


def test_trainer_cases_run_and_check_themselves(lib, trainer) -> None:
    report = lib.BenchReport()
    for name in trainer.ESTIMATORS:
        pair = trainer.run_case(report, quick(lib), name, 16, 300)
        assert pair.ratio > 0
    table = report.tables["trainer"]
    assert set(table.rows) == {label for label, _, _ in trainer.ESTIMATORS.values()}
    assert all((r, "T=16 V=300") in table.cells for r in table.rows)
    assert report.targets[trainer.RECOMPUTE_TARGET[0]].measured, "recompute rows with top_k feed the 2x target"
    findings = trainer.trainer_findings(report)
    assert any("through the reference full-row sort" in f for f in findings) and any("replay costs" in f for f in findings)
    assert any("recompute with top_p alone costs" in f for f in findings), findings
    # The correctness check inside the bench can fail: a wrong kept set is caught.
    w = trainer.workload(16, 300)
    bad = E_recompute_with_a_dropped_token(w, trainer)
    with pytest.raises(AssertionError, match="kept set differs"):
        trainer.check_result("recompute-k-p", bad, w)
    warm = trainer.estimator_fn("full-warm", trainer.SPEC, w)()
    with pytest.raises(AssertionError, match="not full's log-probs"):
        trainer.check_result("full-warm", warm + 1e-3, w)


def E_recompute_with_a_dropped_token(w: dict, trainer: ModuleType) -> Any:
    from parity.core.estimators import recompute

    res = recompute(w["logits"], w["sampled"], trainer.ESTIMATORS["recompute-k-p"][2])
    row = int(res.kept.sum(dim=1).argmax())
    res.kept[row, res.kept[row].nonzero()[0, 0]] = False
    return res


def test_trainer_sort_rows_skip_by_design_above_the_cpu_limit(lib, trainer) -> None:
    report = lib.BenchReport()
    with pytest.raises(pytest.skip.Exception, match="run at T=512 only"):
        trainer.run_case(report, lib.paired_plain, "reference-sort-k-p", trainer.SORT_MAX_T + 1, 300)
    assert report.skipped(), "the skip is recorded for bench.md"
    # At a wide vocabulary the CPU runs the targets' rows only (the skip comes before any logits are made).
    for name in ("recompute-p", "recompute-minp", "part-topk"):
        with pytest.raises(pytest.skip.Exception, match="run at V=32000 on CPU"):
            trainer.run_case(report, lib.paired_plain, name, 16, trainer.CPU_WIDE_V)
    assert all(trainer.cpu_wide_row(n) for n in ("full", "replay", "recompute-k-p", "recompute-k-minp"))


# -- rollout: a fake engine shaped like vLLM's outputs ---------------------------------------------


@dataclass
class FakeParams:
    kw: dict = field(default_factory=dict)

    def __init__(self, **kw: Any) -> None:
        self.kw = kw


@dataclass
class FakeFlat:
    start_indices: list
    end_indices: list
    token_ids: list
    logprobs: list
    decoded_tokens: list


class FakeLogprob:
    def __init__(self, lp: float, text: str | None) -> None:
        self.logprob, self.decoded_token = lp, text


class FakeLLM:
    """``generate`` returns what vLLM returns for each variant: flat or nested, decoded or not."""

    def __init__(self, vocab: int, *, drop_one: bool = False) -> None:
        self.vocab, self.drop_one, self.calls = vocab, drop_one, 0
        self.llm_engine = type("E", (), {"model_config": type("C", (), {"get_vocab_size": lambda _s: vocab})()})()

    def get_tokenizer(self) -> Any:
        return type("T", (), {"encode": lambda _s, text, add_special_tokens=False: [1, 2, 3]})()

    def generate(self, prompts: list, params: list, use_tqdm: bool = False) -> list:
        self.calls += 1
        outs = []
        for p in params:
            kw = p.kw
            n = kw["max_tokens"]
            ids = [7] * n
            k = kw.get("logprobs")
            heads = None if k is None else (self.vocab if k == -1 else k)
            text = "x" if kw["detokenize"] else None
            if heads is None:
                lp = None
            elif kw["flat_logprobs"]:
                per = 1 + heads - (1 if self.drop_one else 0)
                lp = FakeFlat([i * per for i in range(n)], [(i + 1) * per for i in range(n)], [], [], [text] * (per * n))
            else:
                lp = [{j: FakeLogprob(-1.0, text) for j in range(heads + 1)} for _ in range(n)]  # sampled + head
            comp = type("Comp", (), {"token_ids": ids, "logprobs": lp})()
            outs.append(type("Out", (), {"outputs": [comp]})())
        return outs


@pytest.mark.parametrize("vocab", [400, 5000])  # 400: K=512 is the whole vocabulary; 5000 > LARGE_VOCAB
def test_rollout_cases_on_a_fake_engine(lib, rollout, monkeypatch, vocab) -> None:
    (model,) = rollout.MODELS
    monkeypatch.setattr(rollout, "MODELS", {m: rollout.Workload(2, 3) for m in rollout.MODELS})
    monkeypatch.setattr(rollout, "SMALL", rollout.Workload(1, 2))
    report = lib.BenchReport()
    llm = FakeLLM(vocab)
    ran = skipped = 0
    monkeypatch.setattr(rollout, "REMEASURE", {})
    for m, capture, knob in rollout.CASES:
        if m != model:
            continue
        try:
            rollout.run_case(
                report, quick(lib), llm, model, capture, knob, params_cls=FakeParams, prompt_cls=dict, remeasure=quick(lib)
            )
            ran += 1
        except pytest.skip.Exception:
            skipped += 1
    assert ran >= 4 and llm.calls >= 2 * ran
    table = report.tables[f"rollout-cpu-{model}"]
    assert all(c.basis == "cpu" and c.other is not None for c in table.cells.values() if not isinstance(c, str))
    assert len(rollout.REMEASURE) == ran, "every measured cell can be measured again"
    full_row = rollout.CAPTURES["full"][0]
    if vocab > rollout.LARGE_VOCAB:
        assert skipped == 0 and "[1 prompts x 2 tokens]" in table.cells[(full_row, rollout.KNOBS["fast"][0])].render()
    else:
        assert skipped == 1, "K=512 >= V=400 is the full vocabulary: skipped"
    # Fake-engine timings are arbitrary: give the K = top_k cell a known ratio.
    cell = table.cells[(rollout.CAPTURES["topk"][0], rollout.KNOBS["fast"][0])]
    cell.value = 1.05
    # An impossible ratio (capture cheaper than none) is noted as disturbed under the table, not a finding.
    cell.value = 0.3
    assert any(f"top-{rollout.TOP_K}" in line and "0.30x" in line for line in rollout.disturbed_cells(report))
    assert any("0.30x" in n for n in table.notes)
    cell.value = 1.05

    floor = rollout.floor_cells(table)
    assert {c for c, _ in floor} == {rollout.KNOBS["fast"][0]}
    # Noise floor within 1 +- FLOOR_TOL: the table is valid and feeds the target.
    for _, f in floor:
        f.value = 1.0 + rollout.FLOOR_TOL / 2
    assert rollout.finish_table(report, model, max_reruns=0) is table and table.invalid is None
    assert report.targets[rollout.CAPTURE_TARGET].measured
    assert any(k.startswith(f"rollout-cpu-{model} |") for k in report.ratios())
    # A floor off by 2x the tolerance, no rerun allowed: invalid, out of ratios.json, findings, bench.md.
    floor[0][1].value = 1.0 + 2 * rollout.FLOOR_TOL
    report.targets.clear()
    assert rollout.finish_table(report, model, max_reruns=0).invalid.startswith("noise floor outside 1 +- 0.05")
    assert not any(k.startswith(f"rollout-cpu-{model} |") for k in report.ratios())
    assert not rollout.disturbed_cells(report)
    assert rollout.CAPTURE_TARGET not in report.targets
    text = report.render({})
    assert "**INVALID, not a measurement: noise floor outside" in text and "## Invalid tables" in text
    # A rerun measures every cell again (floors first) while the budget lasts.
    before = llm.calls
    rollout.finish_table(report, model, max_reruns=1)
    assert llm.calls >= before + 2 * ran
    assert table.invalid is None or "after 1 rerun(s)" in table.invalid
    before = llm.calls
    rollout.floor_cells(table)[0][1].value = 2.0  # the rerun put new cells in the table
    rollout.finish_table(report, model, budget_left=lambda: 0.0)
    assert llm.calls == before and "the time budget was spent" in table.invalid


def test_rollout_output_check_catches_a_short_head(lib, rollout) -> None:
    llm = FakeLLM(400, drop_one=True)
    with pytest.raises(AssertionError, match="entries at a position"):
        rollout.run_case(lib.BenchReport(), quick(lib), llm, "llama-32k", "topk", "fast", params_cls=FakeParams, prompt_cls=dict)


def test_sampling_kwargs_match_the_variant(rollout) -> None:
    kw = rollout.sampling_kwargs("none", "fast", max_tokens=4, seed=1)
    assert "logprobs" not in kw and kw["detokenize"] is False and kw["ignore_eos"] is True
    kw = rollout.sampling_kwargs("full", "fast", max_tokens=4, seed=1)
    assert kw["logprobs"] == -1 and kw["flat_logprobs"] is True and kw["detokenize"] is False
    assert kw["top_k"] == rollout.TOP_K


# -- harness ---------------------------------------------------------------------------------------


def reference_sampler(logits: torch.Tensor, specs: Any, *, seed: int = 0, prompt_ids: Any = None,
                      output_ids: Any = None) -> Any:
    """Stands in for vLLM's Sampler in this smoke test of the benchmark's plumbing (the real comparison is
    ``parity sampler``): the reference's kept set and log-probs after the penalties, a draw from the kept set."""
    from parity.engines.vllm_sampler import SamplerOutput

    ref = reference_filter(logits, specs, prompt_ids=prompt_ids, output_ids=output_ids)
    g = torch.Generator().manual_seed(seed)
    sampled = torch.multinomial(ref.kept.float(), 1, generator=g).squeeze(1)
    return SamplerOutput(kept=ref.kept, logprobs=ref.logprobs, sampled=sampled)


def test_harness_property_loop_and_tokens(lib, harness) -> None:
    report = lib.BenchReport()
    harness.run_property_case(report, quick(lib), reference_sampler, n=3)
    cell = report.tables["harness"].cells[("sampler property cases", "throughput")]
    assert cell.unit == "cases/s" and cell.value > 0
    result = type("R", (), {"records": [type("S", (), {"completion_ids": [1, 2, 3]})()] * 4})()
    assert harness.tokens_compared(result) == 12


# -- report, bench.md, ratios.json, regression guard -----------------------------------------------


def _report(lib, replay_ratio: float) -> Any:
    report = lib.BenchReport()
    t = report.table("trainer", "Trainer side", "estimator", rows=["full", "replay"], cols=["T=8 V=64"])
    t.put("replay", "T=8 V=64", replay_ratio, seconds=0.001, baseline_seconds=0.1)
    t.put("full", "T=8 V=64", 1.0, seconds=0.1, baseline_seconds=0.1)
    t.skip("full", "T=9 V=64", "too big for the smoke test")
    report.check("replay <= 0.05x", 0.05, "T=8 V=64", replay_ratio)
    report.table("harness", "Harness", "what").put("cases", "throughput", 50.0, unit="cases/s", seconds=0.2)
    return report


def test_bench_md_and_ratio_baseline(lib, tmp_path) -> None:
    md, regressed = lib.write_outputs(_report(lib, 0.01), tmp_path / "base", env={"machine": "smoke"})
    text = md.read_text()
    assert "| replay <= 0.05x | T=8 V=64: 0.01x (worst 0.01x) | met |" in text
    assert "| replay | 0.010x (1.0 ms) |" in text and "50.0 cases/s" in text
    assert "Skipped by design" in text and "too big for the smoke test" in text
    assert "time budget" not in text
    over = _report(lib, 0.01)
    over.over_budget, over.budget_s = ["test_bench_capture[llama-32k-top512-detok]"], 660.0
    md, _ = lib.write_outputs(over, tmp_path / "over", env={})
    assert "## Not run: time budget spent" in md.read_text() and "llama-32k-top512-detok" in md.read_text()
    assert regressed == []
    saved = json.loads((tmp_path / "base" / "ratios.json").read_text())
    assert saved["ratios"] == {"trainer | replay | T=8 V=64": 0.01, "trainer | full | T=8 V=64": 1.0}

    # Same ratios: nothing regressed. Replay 0.01 -> 0.5 (+4900 %, +0.49): regressed, target NOT met.
    _, regressed = lib.write_outputs(_report(lib, 0.011), tmp_path / "same", baseline=tmp_path / "base" / "ratios.json", env={})
    assert regressed == [], "0.01 -> 0.011 is +10 % and +0.001 absolute: inside the slack"
    md, regressed = lib.write_outputs(_report(lib, 0.5), tmp_path / "worse", baseline=tmp_path / "base" / "ratios.json", env={})
    assert regressed == ["trainer | replay | T=8 V=64"]
    text = md.read_text()
    assert "REGRESSED: trainer | replay | T=8 V=64: 0.01x -> 0.5x" in text and "| NOT met |" in text


def test_paired_timing_pairs_rounds_without_pytest_benchmark(lib) -> None:
    calls: list[str] = []
    pair = lib.paired_plain(lambda: calls.append("t") or 42, lambda: calls.append("b"), rounds=2, warmup_rounds=1)
    assert calls == ["b", "t"] * 3 and pair.result == 42
    assert pair.ratio == pair.wall_ratio and pair.cpu_seconds is not None and pair.cpu_baseline_seconds is not None
    calls.clear()
    lib.paired_plain(lambda: calls.append("t"), lambda: calls.append("b"), rounds=3, warmup_rounds=1, baseline_rounds=1)
    assert calls == ["b", "t", "b", "t", "t", "t"], "the baseline runs in the warm-up and the first baseline_rounds only"


def test_cpu_kernel_cases_run_and_check_themselves(lib, kernels) -> None:
    report = lib.BenchReport()
    model = kernels.load("qwen2-tiny")
    for workload in kernels.WORKLOADS:
        cell, dist = kernels.run_case(report, quick(lib), model, "qwen2-tiny", workload, [9, 5, 7], rounds=1, warmup_rounds=0)
        assert cell.value > 0 and 0.0 <= dist < 1e-3
    table = report.tables["cpu-kernels"]
    assert {("qwen2-tiny", w) for w in kernels.WORKLOADS} <= set(table.cells)
    assert report.targets["batch-invariant trainer forward vs default (reported)"].verdict() == "reported"


def test_cpu_basis_reads_process_time(lib) -> None:
    """A target that sleeps costs wall time and next to no CPU time: the two clocks are told apart."""
    import time

    def spin() -> None:
        t0 = time.process_time()
        while time.process_time() - t0 < 0.02:
            pass

    pair = lib.paired_plain(lambda: time.sleep(0.05), spin, rounds=2, collect=False, basis="cpu")
    assert pair.basis == "cpu" and pair.ratio == pair.cpu_ratio
    # The sleep holds the wall clock for 50 ms and uses almost no CPU; the spin uses 20 ms of CPU (its wall
    # time depends on the machine's load, so no claim is made about the wall-clock ratio).
    assert pair.seconds >= 0.05 and pair.cpu_baseline_seconds >= 0.02
    assert pair.cpu_ratio < 0.5, pair
    cell = lib.Table("t", "T", "r").put_pair("sleep", "c", pair)
    assert cell.basis == "cpu" and "(wall " in cell.render()


def test_adaptive_capture_cells_on_a_fake_rollout(lib) -> None:
    """tests/bench/test_bench_adaptive.py's cell: timing, peak RSS, the capture note and the three targets."""
    from parity.core.capture import CaptureStats

    adaptive = _load("parity_bench_adaptive", "test_bench_adaptive.py")

    class Rec:
        length = adaptive.TOKENS

    class FakeRollout:
        capture_history = None
        start_head = None
        last_capture = None

        def generate(self, prompts, spec, *, max_tokens, seed):
            wide = spec.uses_top_p and not spec.uses_top_k
            self.last_capture = CaptureStats(4096 if wide else 66, "fake", adaptive=wide, max_head=4096,
                                             sequences=len(prompts), largest_support=2827 if wide else 50)
            return [Rec() for _ in prompts]

    report, rollout = lib.BenchReport(), FakeRollout()
    timer = quick(lib)
    for case in adaptive.CASES:
        pair, stats = adaptive.run_cell(report, lambda t, b, **kw: timer(t, b, rounds=1, warmup_rounds=0, basis="cpu"),
                                        rollout, lambda: None, [[1]] * adaptive.PROMPTS, case)
        assert pair.ratio > 0 and stats is rollout.last_capture
        assert rollout.start_head is None  # a forced start is put back
    table = report.tables[adaptive.TABLE]
    assert {r for r, _ in table.cells} == {label for label, *_ in adaptive.CASES.values()}
    assert any("largest |S_q| 2827" in n for n in table.notes)
    assert set(report.targets) >= {adaptive.TIME_TARGET[0]}
    if adaptive.peak_rss_mb() is not None and adaptive.reset_peak_rss():
        assert report.targets[adaptive.RSS_TARGET[0]].measured
