"""Rollout capture cost: vLLM generation with log-probs requested, as a ratio to no capture.

Each cell times ``LLM.generate`` with one ``SamplingParams`` variant against the same generation with
no log-probs, interleaved round by round (conftest.paired), ROUNDS rounds after a warm-up, with the
harness's own settings (``detokenize=False, flat_logprobs=True``, parity/engines/vllm_offline.py).
Rows: what is captured (no log-probs; the sampled token's only, ``logprobs=0``; top-K for K in {top_k,
512}; the full vocabulary, ``logprobs=-1``). One fixture, llama-32k: a vocabulary of a real model's
order (the 400-token qwen2-tiny makes K=512 the whole vocabulary). The detokenize / flat_logprobs
combinations that once made more columns are gone: the harness runs one of them, and on this fixture
the others cost minutes of the session for a question no user of the harness asks.

The clock: on CPU the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the ratio's
basis is the process's CPU time (user + sys), which other jobs on a shared machine do not inflate the
way they inflate wall time; the wall-clock ratio is shown beside it. On CUDA the basis is wall time
(the GPU's work is not this process's CPU time).

The ``none`` row is no-capture against itself: the noise floor. After a fixture's cells have run,
``test_bench_capture_floor`` checks every floor cell of its table against 1 +- FLOOR_TOL; if one is
off, the table is marked invalid and every cell of it is measured again (same rounds, same clock),
while the session's time budget lasts, until the floors hold. An invalid table is rendered as such and
never read for a finding or a target.

The 32k full-vocabulary row runs a smaller workload (its own no-capture baseline on the same workload):
measured by hand at 7.56 s vs 1.16 s for 16 x 32 tokens. A K at or above the vocabulary is skipped (it is
the full-vocabulary request).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from parity.core.spec import SamplingSpec
from parity.engines.session import make_prompts
from parity.run import RunConfig

S = SamplingSpec
TOP_K = 50
SPEC = S(0.8, top_k=TOP_K, top_p=0.9)
FULL_VOCAB = -1
ROUNDS, WARMUP = 5, 1  # at least; every round interleaved with a no-capture round
MAX_ROUNDS, SIDE_S = 20, 3.0  # short generations get more rounds: about SIDE_S seconds per side
FLOOR_TOL = 0.05  # the noise floor (no capture against itself) must be within 1 +- this
MAX_RERUNS = 3  # reruns of an invalid table, if the time budget allows
# Capture only adds work: a ratio below this means the baseline rounds were disturbed (machine load).
DISTURBED_BELOW = 0.9


@dataclass(frozen=True)
class Workload:
    prompts: int
    tokens: int

    def label(self) -> str:
        return f"{self.prompts} prompts x {self.tokens} tokens"


MODELS = {"llama-32k": Workload(8, 32)}
SMALL = Workload(4, 8)  # full-vocabulary capture on a large vocabulary
LARGE_VOCAB = 4096  # above this, full-vocabulary capture runs the SMALL workload

# id -> (row label, logprobs: None = not requested)
CAPTURES: dict[str, tuple[str, int | None]] = {
    "none": ("none (noise floor)", None),
    "sampled": ("sampled token only (logprobs=0)", 0),
    "topk": (f"top-{TOP_K} (K = top_k)", TOP_K),
    "top512": ("top-512", 512),
    "full": ("full vocabulary (logprobs=-1)", FULL_VOCAB),
}
# id -> (column label, detokenize, flat_logprobs)
KNOBS: dict[str, tuple[str, bool, bool]] = {
    "fast": ("detok off, flat on (harness)", False, True),
}
CAPTURE_TARGET = f"capture overhead at K = top_k = {TOP_K} reported, llama-32k (valid table, CPU time)"
GPU_TARGET = ("capture overhead <= 1.05x at K <= 64 on CUDA", 1.05)
# (table key, row, col) -> a function that measures the cell again (paired_plain, same rounds and clock)
REMEASURE: dict[tuple[str, str, str], Callable[[], Any]] = {}


def sampling_kwargs(capture: str, knob: str, *, max_tokens: int, seed: int) -> dict[str, Any]:
    """``SamplingParams`` keyword arguments of one variant (no vLLM import: the smoke test checks them)."""
    _, logprobs = CAPTURES[capture]
    _, detokenize, flat = KNOBS[knob]
    kw: dict[str, Any] = {
        **SPEC.sampling_params_kwargs(),
        "max_tokens": max_tokens,
        "seed": seed,
        "ignore_eos": True,  # fixed-length completions: every variant generates the same tokens
        "detokenize": detokenize,
    }
    if logprobs is not None:
        kw["logprobs"] = logprobs
        kw["flat_logprobs"] = flat
    return kw


def skip_reason(capture: str, knob: str, vocab: int) -> str | None:
    """Why a cell is not run, or None."""
    _, logprobs = CAPTURES[capture]
    if logprobs is not None and logprobs >= vocab:
        return f"K={logprobs} >= V={vocab}: the same request as full-vocabulary capture"
    return None


def workload_for(capture: str, model: str, vocab: int) -> Workload:
    _, logprobs = CAPTURES[capture]
    return SMALL if logprobs == FULL_VOCAB and vocab > LARGE_VOCAB else MODELS[model]


def check_outputs(outputs: Sequence[Any], capture: str, knob: str, *, vocab: int, tokens: int) -> None:
    """The engine did what the variant asked (entries per position, flat or nested, decoded or not)."""
    _, logprobs = CAPTURES[capture]
    _, detokenize, flat = KNOBS[knob]
    for i, out in enumerate(outputs):
        comp = out.outputs[0]
        assert len(comp.token_ids) == tokens, f"{capture}/{knob}: prompt {i} generated {len(comp.token_ids)} tokens"
        lp = comp.logprobs
        if logprobs is None:
            assert not lp, f"{capture}/{knob}: log-probs returned although none were requested"
            continue
        heads = vocab if logprobs == FULL_VOCAB else logprobs
        if flat:
            counts = [b - a for a, b in zip(lp.start_indices, lp.end_indices, strict=True)]
            decoded = lp.decoded_tokens
        else:
            counts = [len(d) for d in lp]
            decoded = [e.decoded_token for d in lp for e in d.values()]
        assert len(counts) == tokens, f"{capture}/{knob}: {len(counts)} positions for {tokens} tokens"
        # Flat: the sampled entry, then the top-K. Nested: a dict, where a sampled token in the head merges.
        bad = [c for c in counts if not (c == heads + 1 or (not flat and c == heads))]
        assert not bad, f"{capture}/{knob}: {bad[:3]} entries at a position, asked for the sampled token + {heads}"
        has_text = any(d is not None for d in decoded)
        assert has_text == detokenize, f"{capture}/{knob}: decoded candidates {'missing' if detokenize else 'present'}"


def title(model: str, vocab: int, device: str = "cpu") -> str:
    where = "" if device == "cpu" else f" on {device.upper()}"
    return f"Rollout capture{where}: {model} (V={vocab}), ratio to no log-probs"


def intro(model: str, vocab: int) -> str:
    text = (
        f"vLLM offline engine, {MODELS[model].label()}, {SPEC.label()}, float32. Each cell: generation "
        "with that capture / generation with no log-probs, the harness's detokenize=False and flat_logprobs=True."
    )
    if vocab > LARGE_VOCAB:
        text += f" The full-vocabulary row runs {SMALL.label()} (with its own no-capture baseline)."
    return text


def basis_for(device: str) -> str:
    return "cpu" if device == "cpu" else "wall"


def rounds_for(baseline: Callable[[], Any]) -> int:
    """ROUNDS, or more for a short generation (one untimed call of the baseline sizes it): a 0.1 s
    round is moved by a single time slice of another job, a 3 s series much less."""
    t0 = time.perf_counter()
    baseline()
    return max(ROUNDS, min(MAX_ROUNDS, math.ceil(SIDE_S / max(time.perf_counter() - t0, 1e-3))))


def table_key_for(model: str, device: str = "cpu") -> str:
    return f"rollout-{device}-{model}"


def run_case(
    report: Any,
    timer: Callable[..., Any],
    llm: Any,
    model: str,
    capture: str,
    knob: str,
    *,
    device: str = "cpu",
    table_key: str | None = None,
    params_cls: Callable[..., Any] | None = None,
    prompt_cls: Callable[..., Any] | None = None,
    remeasure: Callable[..., Any] | None = None,
) -> Any:
    """Time one capture variant against no capture, check what came back, report the ratio.

    ``params_cls`` / ``prompt_cls`` default to vLLM's ``SamplingParams`` / ``TokensPrompt`` (the smoke
    test passes stand-ins and a fake engine, so no engine starts in CI). ``remeasure``: how a rerun of
    an invalid table measures the cell again (the benchmarks pass conftest.paired_plain); None: the
    cell is not rerun.
    """
    if params_cls is None or prompt_cls is None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params_cls, prompt_cls = params_cls or SamplingParams, prompt_cls or TokensPrompt
    vocab = int(llm.llm_engine.model_config.get_vocab_size())
    row, col = CAPTURES[capture][0], KNOBS[knob][0]
    key = table_key or table_key_for(model, device)
    table = report.table(
        key,
        title(model, vocab, device),
        "capture",
        intro(model, vocab),
        rows=[label for label, _ in CAPTURES.values()],
        cols=[label for label, _, _ in KNOBS.values()],
    )
    why = skip_reason(capture, knob, vocab)
    if why is not None:
        table.skip(row, col, why)
        pytest.skip(why)
    w = workload_for(capture, model, vocab)
    prompts = [prompt_cls(prompt_token_ids=p) for p in make_prompts(llm.get_tokenizer(), w.prompts)]

    def params(cap: str) -> list[Any]:
        return [params_cls(**sampling_kwargs(cap, knob, max_tokens=w.tokens, seed=i)) for i in range(w.prompts)]

    target, base = params(capture), params("none")
    note = f"[{w.label()}]" if w != MODELS[model] else ""

    def gen_target() -> Any:
        return llm.generate(prompts, target, use_tqdm=False)

    def gen_base() -> Any:
        return llm.generate(prompts, base, use_tqdm=False)

    kw = {"rounds": rounds_for(gen_base), "warmup_rounds": WARMUP, "basis": basis_for(device)}

    def record(pair: Any) -> Any:
        check_outputs(pair.result, capture, knob, vocab=vocab, tokens=w.tokens)
        pair.result = None
        table.put_pair(row, col, pair, note=note)
        return pair

    if remeasure is not None:
        REMEASURE[(key, row, col)] = lambda: record(remeasure(gen_target, gen_base, **kw))
    return record(timer(gen_target, gen_base, **kw))


def floor_cells(table: Any) -> list[tuple[str, Any]]:
    """(column, cell) of the table's noise-floor row (no capture against no capture)."""
    row = CAPTURES["none"][0]
    return [(c, cell) for (r, c), cell in table.cells.items() if r == row and not isinstance(cell, str)]


def floor_problem(table: Any) -> str | None:
    """Why the table's noise floor does not hold (None: it holds)."""
    cells = floor_cells(table)
    if not cells:
        return "its noise floor (no capture against no capture) was not measured"
    off = [(c, cell) for c, cell in cells if abs(cell.value - 1) > FLOOR_TOL]
    if not off:
        return None
    shown = "; ".join(f"{c}: {cell.value:.3f}x" for c, cell in off)
    return f"noise floor outside 1 +- {FLOOR_TOL} ({shown})"


def finish_table(
    report: Any,
    model: str,
    *,
    device: str = "cpu",
    budget_left: Callable[[], float] = lambda: float("inf"),
    max_reruns: int = MAX_RERUNS,
) -> Any:
    """Check a fixture's table against its noise floor; rerun an invalid one while the budget lasts.

    A rerun measures every cell of the table again (the floors included) with the same rounds and
    clock. The table ends valid (targets recorded from it) or marked invalid with the reason.
    """
    key = table_key_for(model, device)
    table = report.tables.get(key)
    if table is None:
        return None
    problem = floor_problem(table)
    reruns = 0
    while problem is not None and reruns < max_reruns and budget_left() > 0:
        reruns += 1
        todo = [k for k in REMEASURE if k[0] == key]
        for k in sorted(todo, key=lambda k: k[1] != CAPTURES["none"][0]):  # floors first
            if budget_left() <= 0:
                break
            REMEASURE[k]()
        problem = floor_problem(table)
    floors = ", ".join(f"{c}: {cell.value:.3f}x" for c, cell in floor_cells(table))
    if problem is None:
        table.invalid = None
        table.notes.append(
            f"noise floor within 1 +- {FLOOR_TOL} ({floors})" + (f" after {reruns} rerun(s) of the table" if reruns else "")
        )
        for (r, c), cell in table.cells.items():
            logprobs = next((lp for lab, lp in CAPTURES.values() if lab == r), None)
            if isinstance(cell, str) or c != KNOBS["fast"][0] or logprobs is None or not 0 < logprobs <= 64:
                continue
            if device == "cpu":
                report.check(CAPTURE_TARGET, None, f"{model} top-{logprobs}", cell.value)
            else:
                report.check(*GPU_TARGET, f"{model} top-{logprobs}", cell.value)
    else:
        table.invalid = problem + (f", still after {reruns} rerun(s) of the table" if reruns else "") + (
            "; the time budget was spent" if budget_left() <= 0 else ""
        )
    return table


# flat_logprobs means nothing without log-probs: no-capture runs once per detokenize setting.
def disturbed_cells(report: Any) -> list[str]:
    """Cells of valid tables whose ratio is physically impossible (capture cheaper than none): the
    machine's load moved a baseline. Listed under the table (a note), never as a finding."""
    lines = []
    for table in report.tables.values():
        if not table.key.startswith("rollout-") or table.invalid:
            continue
        for (row, col), cell in table.cells.items():
            if isinstance(cell, str) or row == CAPTURES["none"][0] or cell.value >= DISTURBED_BELOW:
                continue
            line = (
                f"disturbed by machine load, rerun: {row} / {col}: {cell.value:.2f}x "
                f"(baseline min {cell.baseline_seconds or 0:.3f} s, target min {cell.seconds or 0:.3f} s)"
            )
            if line not in table.notes:
                table.notes.append(line)
            lines.append(line)
    return lines


CASES = [(m, c, k) for m in MODELS for c in CAPTURES for k in KNOBS if c != "none" or KNOBS[k][2]]


@pytest.fixture(scope="module")
def engines(engine_pool):
    """The vLLM engine per fixture model (started once per session by conftest's EnginePool)."""

    def get(model: str) -> Any:
        rollout, _ = engine_pool.get(model, RunConfig(model=model), lambda msg: None)
        return rollout.llm

    return get


@pytest.mark.parametrize(("model", "capture", "knob"), CASES, ids=["-".join(c) for c in CASES])
def test_bench_capture(timer, plain_timer, bench_report, engines, model, capture, knob) -> None:
    run_case(bench_report, timer, engines(model), model, capture, knob, remeasure=plain_timer)


@pytest.mark.filterwarnings("ignore:Benchmark fixture was not used")
@pytest.mark.parametrize("model", list(MODELS))
def test_bench_capture_floor(bench_budget, bench_report, model) -> None:
    """The fixture's table against its noise floor: valid, or rerun while the budget lasts, or invalid."""
    table = finish_table(bench_report, model, budget_left=bench_budget)
    if table is None:
        pytest.skip(f"no capture cell of {model} ran")
    disturbed_cells(bench_report)


# -- GPU: the same cases on CUDA, and vLLM's native kept-set return --------------------------------

_GPU: dict[str, Any] = {}


def _gpu_rollout(model: str, capture: str = "topk") -> Any:
    """CUDA engines of one model at a time (each reserves 30 % of GPU memory; two may coexist)."""
    from parity.engines.vllm_offline import VllmRollout
    from parity.fixtures import resolve_model

    for old in [k for k in _GPU if not k.startswith(f"{model}|")]:
        _GPU.pop(old).close()
    key = f"{model}|{capture}"
    if key not in _GPU:
        _GPU[key] = VllmRollout(
            resolve_model(model), device="cuda", capture=capture, engine_kwargs={"gpu_memory_utilization": 0.3}
        )
    return _GPU[key]


@pytest.mark.gpu
@pytest.mark.parametrize(("model", "capture", "knob"), CASES, ids=["-".join(c) for c in CASES])
def test_bench_capture_cuda(timer, plain_timer, bench_report, model, capture, knob) -> None:
    """The same table on CUDA (wall-clock basis); ``ci/gpu_gate.py`` runs it into reports/gpu/bench."""
    run_case(bench_report, timer, _gpu_rollout(model).llm, model, capture, knob, device="cuda", remeasure=plain_timer)


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:Benchmark fixture was not used")
@pytest.mark.parametrize("model", list(MODELS))
def test_bench_capture_floor_cuda(bench_budget, bench_report, model) -> None:
    if finish_table(bench_report, model, device="cuda", budget_left=bench_budget) is None:
        pytest.skip(f"no CUDA capture cell of {model} ran")


@pytest.mark.gpu
@pytest.mark.parametrize("model", list(MODELS))
def test_bench_native_mask_cuda(timer, bench_report, model) -> None:
    """``return_sampling_mask=True`` (Model Runner V2) against top-K capture, both through
    ``VllmRollout.generate`` (same spec, same records and post-processing), rounds interleaved."""
    w = MODELS[model]
    native, topk = _gpu_rollout(model, "native"), _gpu_rollout(model, "topk")
    prompts = make_prompts(native.tokenizer(), w.prompts)
    pair = timer(
        lambda: native.generate(prompts, SPEC, max_tokens=w.tokens, seed=0),
        lambda: topk.generate(prompts, SPEC, max_tokens=w.tokens, seed=0),
        rounds=ROUNDS,
        warmup_rounds=WARMUP,
    )
    assert all(r.kept_ids is not None for r in pair.result), "native capture returned no kept set"
    pair.result = None
    table = bench_report.table(
        "rollout-native-cuda",
        "Native kept-set capture on CUDA: return_sampling_mask vs top-K log-probs",
        "model",
        f"VllmRollout.generate, {SPEC.label()}; ratio = native mask / top-{TOP_K}+16 capture.",
    )
    table.put_pair(f"{model} ({w.label()})", "native / top-K", pair)
