"""Capture on real vocabularies: top_p and min_p without top_k on smollm2-135m (V=49,152) and on the
qwen2-152k fixture (V=151,936), against plain generation.

Each cell times ``VllmRollout.generate`` (the harness's whole capture: the adaptive plan, widening rounds,
the kept sets as tensors) against ``LLM.generate`` of the same prompts and seeds with ``logprobs=20``
(what an RL stack asks for anyway), rounds interleaved (conftest.paired), on the process's CPU time
(the engine runs in this process). 8 prompts x 24 tokens, float32.

Rows: top_p=0.9 at T=1 from a fresh history (the first call of a run), top_p=0.95 at T=1.3 and
min_p=0.02 at T=1 (hot specs whose nuclei pass 4096 tokens: the sampler's rows prove them), the same
top_p rows at V=151,936, and top_k=50 (a fixed head of 66) for comparison. Peak RSS per row (VmHWM
after a reset of the process's high-water mark) is compared with the top_k=50 row's. Targets: every
top_p/min_p row within 1.5x the logprobs=20 generation, peak RSS of top_p=0.9 within 1.2x that of
top_k=50. Nothing here asserts a duration.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from parity.core.capture import CaptureHistory
from parity.core.spec import SamplingSpec

MODEL = "smollm2-135m"
PROMPTS, TOKENS = 8, 24
ROUNDS, WARMUP = 2, 1  # a round is 4-6 s of smollm2 generation per side
BASE_LOGPROBS = 20
WIDE = "qwen2-152k"
CASES: dict[str, tuple[str, SamplingSpec, bool, int | None]] = {
    # id -> (row label, spec, keep the history between rounds, forced start head); ids starting with
    # "152k" run on the qwen2-152k fixture, the others on smollm2-135m.
    "top_k": ("top_k=50 T=1 (fixed head 66)", SamplingSpec(1.0, top_k=50), True, None),
    "top_p-cold": ("top_p=0.9 T=1, fresh history", SamplingSpec(1.0, top_p=0.9), False, None),
    "top_p-hot": ("top_p=0.95 T=1.3", SamplingSpec(1.3, top_p=0.95), False, None),
    "min_p": ("min_p=0.02 T=1", SamplingSpec(1.0, min_p=0.02), False, None),
    "152k-top_k": ("V=151,936: top_k=50 T=1 (fixed head 66)", SamplingSpec(1.0, top_k=50), True, None),
    "152k-top_p": ("V=151,936: top_p=0.9 T=1", SamplingSpec(1.0, top_p=0.9), False, None),
    "152k-hot": ("V=151,936: top_p=0.95 T=1.3", SamplingSpec(1.3, top_p=0.95), False, None),
}
TIME_TARGET = ("capture of top_p / min_p without top_k <= 1.5x generation with logprobs=20 (each row)", 1.5)
RSS_TARGET = ("peak RSS of top_p=0.9 T=1 capture <= 1.2x that of top_k=50, smollm2-135m", 1.2)
TABLE = "adaptive-cpu-smollm2"
COLS = ("CPU time ratio", "peak RSS", "peak RSS / top_k=50 (same model)")
_RSS: dict[str, float] = {}


def reset_peak_rss() -> bool:
    """Reset the process's high-water RSS mark (Linux: ``5`` into /proc/self/clear_refs); False if unsupported."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float | None:
    """VmHWM of this process in MB, or None where /proc is not there."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def describe(stats: Any) -> str:
    """One cell: what the capture did (start head, widening, largest |S_q|, unproven positions)."""
    if stats is None:
        return ""
    if not stats.adaptive:
        return f"K={stats.logprobs}, incomplete {stats.incomplete_positions}"
    text = (f"start K={stats.logprobs}, widened {stats.widened_sequences}/{stats.sequences} in {stats.rounds} "
            f"round(s), largest |S_q| {stats.largest_support}, incomplete at the cap {stats.incomplete_positions}")
    if stats.resampled_differently:
        text += f", {stats.resampled_differently} resample(s) differed"
    return text


def run_cell(report: Any, timer: Callable[..., Any], rollout: Any, base: Callable[[], Any], prompts: list,
             case: str) -> Any:
    """Time one row against ``base`` (generation with logprobs=20), measure its peak RSS, report both."""
    label, spec, keep, start = CASES[case]
    table = report.table(TABLE, f"Capture: {MODEL} (V=49,152) and {WIDE} (V=151,936), ratio to generation with "
                         f"logprobs={BASE_LOGPROBS}",
                         "capture", __doc__.split("\n\n")[1].replace("\n", " "), rows=[c[0] for c in CASES.values()],
                         cols=list(COLS))

    def target() -> Any:
        if not keep:
            rollout.capture_history = CaptureHistory()
        return rollout.generate(prompts, spec, max_tokens=TOKENS, seed=0)

    rollout.capture_history = CaptureHistory()
    rollout.start_head = start
    try:
        reset = reset_peak_rss()
        target()  # untimed: the peak RSS of one call (and the history a warm row starts from)
        rss = peak_rss_mb() if reset else None
        pair = timer(target, base, rounds=ROUNDS, warmup_rounds=WARMUP, basis="cpu")
    finally:
        rollout.start_head = None
    recs = pair.result
    pair.result = None
    assert len(recs) == PROMPTS and all(r.length == TOKENS for r in recs)
    table.put_pair(label, COLS[0], pair)
    stats = rollout.last_capture
    table.notes.append(f"{label}: {describe(stats)}")
    if rss is not None:
        _RSS[case] = rss
        table.put(label, COLS[1], rss, unit="MB")
        ref = "152k-top_k" if case.startswith("152k") else "top_k"  # the same model's top_k=50 row
        if ref in _RSS and not case.endswith("top_k"):
            table.put(label, COLS[2], rss / _RSS[ref])
            if case == "top_p-cold":
                report.check(*RSS_TARGET, "cold", rss / _RSS[ref])
    if not case.endswith("top_k"):
        report.check(*TIME_TARGET, case, pair.ratio)
    return pair, stats


@pytest.fixture(scope="module")
def engines(engine_pool, smollm2_dir):
    """One engine per model of the table, each on its own (no trainer beside it); ``engine_pool`` only for
    its skip under --benchmark-disable."""
    from parity.engines.vllm_offline import VllmRollout, configure_cpu_env
    from parity.fixtures import resolve_model

    configure_cpu_env()
    opened: dict[str, VllmRollout] = {}

    def get(case: str) -> VllmRollout:
        name = WIDE if case.startswith("152k") else MODEL
        if name not in opened:
            opened[name] = VllmRollout(smollm2_dir if name == MODEL else resolve_model(name))
        return opened[name]

    yield get
    for r in opened.values():
        r.close()


@pytest.mark.parametrize("case", list(CASES))
def test_bench_adaptive_capture(timer, bench_report, engines, case) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from parity.engines.session import make_prompts

    rollout = engines(case)
    prompts = make_prompts(rollout.tokenizer(), PROMPTS)
    spec = CASES[case][1]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    params = [SamplingParams(**spec.sampling_params_kwargs(), max_tokens=TOKENS, seed=i, logprobs=BASE_LOGPROBS,
                             detokenize=False, flat_logprobs=True, ignore_eos=True) for i in range(PROMPTS)]

    def base() -> Any:
        return rollout.llm.generate(inputs, params, use_tqdm=False)

    run_cell(bench_report, timer, rollout, base, prompts, case)
