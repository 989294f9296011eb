"""One run: a scenario matrix through the vLLM rollout and the transformers trainer, compared, gated, reported.

The command line is :mod:`parity.cli.run`; the engines and prompts come from :mod:`parity.engines.session`.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from parity.core.capture import DEFAULT_MAX_HEAD
from parity.core.gates import Thresholds
from parity.core.matrix import Matrix, Scenario, default_matrix, load_matrix
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.core.token_table import TokenTable, TrainerFaults, build_table
from parity.engines.session import EnginePool, Rollout, Trainer, make_prompts
from parity.engines.settings import EngineSettings

# The default cap of prompts per scenario when a verdict needs more tokens to resolve |log S| (--max-prompts).
DEFAULT_MAX_PROMPTS = 64

if TYPE_CHECKING:  # pragma: no cover
    import pyarrow as pa
    import torch

    from parity.determinism.knobs import DeterminismState
    from parity.engines.routing_replay import RouterTrace
    from parity.engines.trainer_under_test import TrainerFn
    from parity.engines.vllm_offline import VllmRollout
    from parity.judge.accumulators import Summary
    from parity.judge.verdict import ScenarioVerdict
    from parity.report.blocks import Json, JsonObject, ReportJson, Routing, ScenarioFacts


@dataclass
class RunConfig:
    model: str
    trainer_model: str | None = None
    matrix: str | Matrix = "default"  # "default", a TOML path, or a Matrix
    out: Path = Path("reports/parity")
    device: str = "cpu"
    dtype: str = "float32"
    trainer_dtype: str | None = None
    prompts: int | None = None
    max_tokens: int | None = None
    seed: int = 0
    thresholds: Thresholds = field(default_factory=Thresholds)
    faults: TrainerFaults = field(default_factory=TrainerFaults)
    capture_head: int | None = None
    max_capture_head: int | None = None  # cap of S_q capture (--max-capture-head); None: no cap offline
    timeout_s: float = 900.0
    prefix_caching: bool = False
    max_num_batched_tokens: int | None = None  # chunked prefill at this step budget (scenarios may set their own)
    trainer: str | TrainerFn | None = None  # trainer under test: "full" | "recompute" | "replay" | "module:function"
    invariance: bool = False  # run the batch-invariance checks on both sides and report them
    batch_invariant: bool = False  # turn on every batch-invariance knob available on the device
    capture: str = "topk"  # "topk" | "native" (vLLM return_sampling_mask, CUDA) | "both" (and compare them)
    server: str | None = None  # None: offline engine; "spawn": a local vLLM server; or a URL to attach to
    plots: bool = True
    sampler_log_s: bool = True  # a raw-logits pass for a log S from the sampler's side (small vocabularies)
    records: Path | None = None  # also write what was sampled and scored, per token (parity.records.write)
    max_prompts: int | None = None  # cap of the prompts sampled for a mean-bias verdict's power (None: the default)
    recompute_precision: str = "trainer"  # "sampler": recompute chooses its kept set on logits rounded to the sampler's dtype

    def engine_settings(self) -> EngineSettings:
        """The part of this configuration the engines are started with (every EngineSettings field is one of ours)."""
        return EngineSettings(**{f.name: getattr(self, f.name) for f in fields(EngineSettings)})


def resolve_matrix(cfg: RunConfig) -> Matrix:
    if isinstance(cfg.matrix, Matrix):
        m = cfg.matrix
    elif cfg.matrix == "default":
        m = default_matrix()
    else:
        m = load_matrix(cfg.matrix)
    if cfg.prompts or cfg.max_tokens:
        m = Matrix(m.name, tuple(replace(s, prompts=cfg.prompts or s.prompts,
                                         max_tokens=cfg.max_tokens or s.max_tokens) for s in m.scenarios))
    return m


@dataclass
class ScenarioResult:
    scenario: Scenario
    records: list[SequenceRecord]
    table: TokenTable
    verdict: ScenarioVerdict  # the scenario as judged (its progress line and its report entry)
    seconds: float
    export: pa.Table  # the scenario's rows in the records format
    part: Summary  # their streamed summary (merged into the run's, in matrix order)
    facts: ScenarioFacts  # what the records do not hold: the capture plan, dtypes, the RL view (records metadata)


def scenario_engines(engines: EngineSettings, sc: Scenario) -> EngineSettings:
    """The run's engine settings with the scenario's own prefix caching and chunked-prefill budget."""
    pc = engines.prefix_caching if sc.prefix_caching is None else sc.prefix_caching
    return replace(engines, prefix_caching=pc, max_num_batched_tokens=sc.max_num_batched_tokens or engines.max_num_batched_tokens)


def wants_sampler_log_s(rollout: Rollout, sc: Scenario, cfg: RunConfig) -> bool:
    """A raw-logits pass is run when it can give the whole row: offline engine, vocabulary within the capture cap."""
    return (
        cfg.sampler_log_s
        and not cfg.server
        and sc.spec.effective().filtered
        # vLLM's raw log-probs are taken before the penalties; the penalised row cannot be rebuilt from them.
        and not sc.spec.penalised
        and rollout.vocab_size <= (sc.max_capture_head or cfg.max_capture_head or DEFAULT_MAX_HEAD)
    )


def attach_sampler_log_s(
    records: list[SequenceRecord], raw: VllmRollout, prompts: list[list[int]], sc: Scenario, seed: int
) -> JsonObject:
    """Sample again with the raw-logits engine (same seeds) and put the sampler-side log S on each record.

    A record whose second draw differs from the first gets none (counted, never guessed).
    """
    import torch

    from parity.core.log_s import log_s_from_raw_logits

    again = raw.generate(prompts, sc.spec, max_tokens=sc.max_tokens, seed=seed, logprobs=-1)
    mismatched: list[Json] = []
    for r, a in zip(records, again, strict=True):
        if list(a.completion_ids) != list(r.completion_ids) or r.kept_ids is None or a.kept_ids is None:
            mismatched.append(r.prompt_index)
            continue
        assert a.kept_logprobs is not None  # captured with its kept set
        rows = torch.full((a.length, raw.vocab_size), float("-inf"), dtype=torch.float64)
        rows.scatter_(1, a.kept_ids.clamp(min=0), a.kept_logprobs.double().masked_fill(a.kept_ids < 0, float("-inf")))
        r.extras["sampler_log_s"] = log_s_from_raw_logits(rows, r.kept_ids, sc.spec)
    return {"raw_logits_pass": True, "sequences": len(records), "redrawn_differently": mismatched}


def preflight(matrix: Matrix, cfg: RunConfig) -> None:
    """Check every scenario's capture plan against its model's vocabulary before any engine starts (an
    engine start costs tens of seconds, and a spec the plan refuses would stop the run after it)."""
    from parity.core.capture import plan_capture
    from parity.engines.engine_log import waiting
    from parity.errors import UsageError
    from parity.fixtures import config_vocab_size, resolve_model

    vocab: dict[str, int] = {}
    problems = []
    for sc in matrix.scenarios:
        if cfg.device == "cpu" and (sc.max_num_batched_tokens or cfg.max_num_batched_tokens) and not sc.spec.greedy:
            problems.append(f"scenario {sc.name!r}: max_num_batched_tokens (chunked prefill) at temperature "
                            f"{sc.spec.temperature:g} on CPU: vLLM 0.32's CPU engine fails a seeded request whose prefill "
                            f"is chunked ('CPU Generator does not use offset', GPUModelRunner._bookkeeping_sync); "
                            f"allowed: temperature 0 on CPU")
        name = str(sc.model or cfg.model)
        if name not in vocab:
            vocab[name] = config_vocab_size(resolve_model(name, wait=waiting))
        size_v = vocab[name]
        head = sc.capture_head if sc.capture_head is not None else cfg.capture_head
        try:
            plan_capture(sc.spec, size_v, head=head,
                         max_head=sc.max_capture_head or cfg.max_capture_head or DEFAULT_MAX_HEAD)
        except UsageError as exc:
            problems.append(f"scenario {sc.name!r} on {name} (V={size_v}): {exc}")
    if problems:
        raise UsageError("; ".join(problems))


def score_scenario(
    rollout: Rollout, trainer: Trainer, sc: Scenario, cfg: RunConfig, raw: VllmRollout | None = None
) -> ScenarioResult:
    """Sample with vLLM, score with the trainer, then judge the scenario's records: one scenario. The verdict is
    the records analysis's (:func:`parity.judge.scenario.scenario_summary`) on the rows ``--records`` writes, so
    a run and an analysis of its records agree by construction. ``raw``: the raw-logits engine for the
    sampler-side log S (see :func:`wants_sampler_log_s`)."""
    from parity.judge.scenario import rl_view, scenario_summary
    from parity.judge.verdict import judge
    from parity.records.convert import from_sequence_records

    t0 = time.perf_counter()
    prompts = make_prompts(trainer.tokenizer(), sc.prompts, shared_prefix=sc.shared_prefix)
    rollout.head = sc.capture_head if sc.capture_head is not None else cfg.capture_head
    rollout.max_head = sc.max_capture_head or cfg.max_capture_head
    seed = cfg.seed + sc.seed
    if getattr(rollout, "prefix_caching", False):  # warm the cache: the scenario's prompts then hit it
        history = rollout.capture_history
        rollout.generate(prompts, sc.spec, max_tokens=1, seed=seed)
        rollout.capture_history = history
    records = rollout.generate(prompts, sc.spec, max_tokens=sc.max_tokens, seed=seed)
    raw_pass = attach_sampler_log_s(records, raw, prompts, sc, seed) if raw is not None else None
    moe = bool(records) and "routed_experts" in records[0].extras
    with _routers_traced(trainer, moe) as own:  # MoE: the scoring pass's routing is the trainer's side of the gates
        logits = trainer.logits(records)
    dtypes = (cfg.dtype, cfg.trainer_dtype or cfg.dtype)
    table = build_table(records, logits, sc.spec, faults=cfg.faults, dtype=dtypes,
                        recompute_dtype=dtypes[0] if cfg.recompute_precision == "sampler" else None)
    views = score_trainer_under_test(table, records, logits, sc, cfg.trainer, trainer) if cfg.trainer else None
    # The records carry the trainer's logits at the kept ids after the penalties and any planted fault (what its
    # replay renormalises), from the table's one application of the faults.
    export = from_sequence_records(records, scenario=sc.name, table=table)
    part = scenario_summary(export, dtypes=dtypes, vocab_size=rollout.vocab_size, views=views,
                            n_listed=cfg.thresholds.max_violations_listed, source=str(cfg.records or "parity run"))
    native = native_mismatches(records) if any("native_kept_ids" in r.extras for r in records) else None
    # MoE: routing agreement and replay (the trainer's routers run again, traced and then forced).
    routing = routing_section(records, table, trainer, rollout, sc, cfg, dtypes, own) if own is not None else None
    (verdict,) = judge(part, cfg.thresholds, trainer_name=table.user_name,
                       native=None if native is None else {sc.name: native},
                       routing=None if routing is None else {sc.name: routing})
    # What the capture did (parity.core.capture.CaptureStats): the head it started with, what it widened,
    # the largest |S_q| met, positions unproven at the cap, resamples that came back different.
    assert rollout.last_capture is not None  # set by generate()
    facts: ScenarioFacts = {"rl_view": rl_view(table), "capture_plan": rollout.last_capture.to_dict(),
                             "dtypes": {"sampler": dtypes[0], "trainer": dtypes[1]}}
    if raw_pass is not None:
        facts["raw_logits_pass"] = raw_pass
    if native is not None:
        facts["native_capture"] = {"mode": cfg.capture, "mismatched_positions": len(native),
                                   "positions": [list(p) for p in native]}
    if routing is not None:
        facts["routing"] = routing
    return ScenarioResult(sc, records, table, verdict, time.perf_counter() - t0, export, part, facts)


def max_prompts(cfg: RunConfig, sc: Scenario) -> int:
    """The most prompts a scenario is sampled with to give its mean-bias verdict power (``--max-prompts``)."""
    return max(sc.prompts, DEFAULT_MAX_PROMPTS if cfg.max_prompts is None else cfg.max_prompts)


def score_with_power(rollout: Rollout, trainer: Trainer, sc: Scenario, cfg: RunConfig, raw: VllmRollout | None,
                     progress: Callable[[str], None]) -> ScenarioResult:
    """:func:`score_scenario`, sampled again with more prompts while its verdict lacks the power to fail the
    bias it exists to catch (:mod:`parity.core.power`) and more tokens would give it, up to :func:`max_prompts`;
    as adaptive capture widens a head the first batch could not prove."""
    from parity.core.display import ordered
    from parity.core.power import SAMPLING_MARGIN, about

    res = score_scenario(rollout, trainer, sc, cfg, raw)
    cap, spent = max_prompts(cfg, sc), res.seconds
    while True:
        v, p = res.verdict, res.verdict.entry.get("power")
        if (v.verdict != "none" or v.violations or p is None or p["resolved"] or p["tokens_needed"] is None
                or sc.prompts >= cap):
            res.seconds = spent
            return res
        want = max(math.ceil(sc.prompts * p["tokens_needed"] * SAMPLING_MARGIN / max(p["tokens"], 1)), sc.prompts + 1)
        res_s, bias_s = ordered(float(p["resolution"]), float(p["class_bias"] or 0.0))
        head = (f"    power: resolution {res_s} of {p['gate']} is not below |log S| {bias_s} over {p['tokens']} "
                f"tokens; about {about(p['tokens_needed'])} would resolve it")
        if want > cap:  # the cap cannot reach it: the verdict says what would
            progress(f"{head}: {about(want)} prompts, above the cap of {cap} (--max-prompts)")
            res.seconds = spent
            return res
        progress(f"{head}: sampling {sc.name!r} again with {want} prompts (cap {cap}, --max-prompts)")
        sc = replace(sc, prompts=want)
        res = score_scenario(rollout, trainer, sc, cfg, raw)
        spent += res.seconds


def native_mismatches(records: list[SequenceRecord]) -> list[tuple[int, int]]:
    """(prompt, position) where vLLM's native sampling mask and the top-K capture differ on S_q (CUDA,
    ``--capture both``; the engine adapter records them in ``extras["native_vs_topk_mismatch"]``)."""
    return [(r.prompt_index, int(t)) for r in records for t in r.extras.get("native_vs_topk_mismatch", [])]


def _routers_traced(trainer: Trainer, moe: bool) -> AbstractContextManager[RouterTrace | None]:
    """Around the scoring pass: on a MoE scenario, trace the trainer's routers (read again by routing_section)."""
    if not moe:
        return nullcontext(None)
    from parity.engines.routing_replay import trace_routers

    return trace_routers(trainer.model, batch_size=int(getattr(trainer, "batch_size", 8)))


def routing_section(records: list[SequenceRecord], table: TokenTable, trainer: Trainer, rollout: Rollout,
                    sc: Scenario, cfg: RunConfig, dtypes: tuple[str, str], own: RouterTrace) -> Routing:
    """A MoE scenario's routing section (:func:`parity.engines.routing_replay.routing_report`), with the positions
    each routing gate names, for the gate table to judge (in :func:`parity.judge.verdict.judge`)."""
    from parity.engines.routing_replay import routing_report

    section = routing_report(records, table, trainer, sc.spec, dtypes, scenario=sc.name,
                             n_listed=cfg.thresholds.max_violations_listed, own=own)
    section["capture"] = getattr(rollout, "last_routes", None)  # the engine adapter's record of the capture route
    return section


def score_trainer_under_test(
    table: TokenTable,
    records: list[SequenceRecord],
    logits: list[torch.Tensor],
    sc: Scenario,
    name: str | TrainerFn,
    trainer: Trainer,
) -> dict[frozenset[str], torch.Tensor]:
    """Run the trainer under test on the sampled batch and attach its values to the table; return the
    reference views its diagnosis compares them with (:func:`parity.engines.trainer_under_test.reference_views`)."""
    import torch

    from parity.engines.trainer_under_test import call_trainer, load_trainer, make_batch, reference_views

    label, fn = load_trainer(name)
    batch = make_batch(records, logits, sc.spec, getattr(trainer, "model", None), getattr(trainer, "model_path", ""))
    table.user = call_trainer(fn, label, batch)
    table.user_name = label
    ys = [torch.tensor(r.completion_ids, dtype=torch.long) for r in records]
    return reference_views(logits, ys, sc.spec, [r.kept_ids for r in records], [r.prompt_ids for r in records])


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cfg: RunConfig, progress: Callable[[str], None] = _progress, pool: EnginePool | None = None) -> ReportJson:
    """Run the matrix; return the report dict (also written under ``cfg.out``).

    With ``pool`` the engines outlive the run (tests share them); without, they are closed at the end.
    """
    from parity.determinism.knobs import batch_invariant_mode

    matrix = resolve_matrix(cfg)
    import parity.judge.scenario  # noqa: F401  (every verdict is judged on records: refuses a missing pyarrow before any engine starts)
    # Entered before any engine starts: on CUDA, VLLM_BATCH_INVARIANT is read at engine start-up.
    # With the mode off the context changes nothing and records the knobs as they are.
    with batch_invariant_mode(cfg.batch_invariant, device=cfg.device) as state:
        return _run(cfg, matrix, progress, pool, state)


def _run(
    cfg: RunConfig, matrix: Matrix, progress: Callable[[str], None], pool: EnginePool | None, state: DeterminismState
) -> ReportJson:
    from parity.core.capture import CaptureHistory
    from parity.determinism.checks import check_rollout_invariance, check_trainer_invariance
    from parity.determinism.gate import determinism_section
    from parity.determinism.knobs import batch_invariant_mode
    from parity.report.schema import write_report

    preflight(matrix, cfg)
    engines = cfg.engine_settings()
    own_pool = pool is None
    pool = pool or EnginePool()
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    # Scenarios run grouped by model so that each engine starts once, then are reported in matrix order.
    order = sorted(range(len(matrix.scenarios)), key=lambda i: (matrix.scenarios[i].model or cfg.model) != cfg.model)
    by_index: dict[int, ScenarioResult] = {}
    vocab: dict[int, int] = {}
    fresh: set[int] = set()
    try:
        for done, idx in enumerate(order, start=1):
            sc = matrix.scenarios[idx]
            model_name = sc.model or cfg.model
            rollout, trainer = pool.get(model_name, scenario_engines(engines, sc), progress)
            if id(rollout) not in fresh:  # start heads learnt within this run only (the pool may outlive it)
                rollout.capture_history = CaptureHistory()
                fresh.add(id(rollout))
            raw = pool.raw(model_name, engines, progress) if wants_sampler_log_s(rollout, sc, cfg) else None
            # The trainer-side knobs (the CPU kernels; eager attention elsewhere) need the model, so they nest
            # around scoring.
            with batch_invariant_mode(cfg.batch_invariant, device=cfg.device, models=[trainer.model]):
                res = score_with_power(rollout, trainer, sc, cfg, raw, progress)
            by_index[idx], vocab[idx] = res, rollout.vocab_size
            timings[f"scenario_s[{sc.name}]"] = res.seconds
            s = res.verdict.entry
            word = {"pass": "PASS", "fail": "FAIL", "none": "NO VERDICT"}[s["verdict"]]
            progress(
                f"[{done}/{len(matrix.scenarios)}] {sc.name:<28} {word}  "
                f"log S mean {s['log_s']['mean']:+.4f}  replay max|d| {s['replay']['max_abs_diff']:.1e} "
                f"({s['headroom']['replay']:.2f} of its bound)  "
                f"({s['tokens']} tokens, {res.seconds:.1f} s)"
            )
            if res.facts["capture_plan"].get("adaptive") and rollout.last_capture is not None:
                progress(f"    {rollout.last_capture.summary()}")
        determinism: JsonObject | None = None
        if cfg.invariance:
            rollout, trainer = pool.get(cfg.model, engines, progress)
            progress("parity: invariance checks (rollout batch sizes 2..32, trainer padding and packing)")
            t0 = time.perf_counter()
            prompts = make_prompts(trainer.tokenizer(), 8)
            spec = SamplingSpec(temperature=1.0, top_p=0.9)
            with batch_invariant_mode(cfg.batch_invariant, device=cfg.device, models=[trainer.model]) as inner:
                ro = check_rollout_invariance(rollout, prompts, spec, max_tokens=8, seed=cfg.seed)
                tr = check_trainer_invariance(trainer, rollout.generate(prompts, spec, max_tokens=8, seed=cfg.seed))
            replay_max = max((d for r in by_index.values() if isinstance(d := r.verdict.entry["replay"]["max_abs_diff"], float)),
                             default=None)
            # The inner state: it also holds the trainer-side knobs (the CPU kernels and their calls).
            determinism = determinism_section(
                inner, rollout=ro, trainer=tr, required=cfg.batch_invariant, replay_max_abs_diff=replay_max
            )
            timings["invariance_s"] = time.perf_counter() - t0
            progress(
                f"parity: invariance: rollout {'bitwise' if ro['invariant'] else 'NOT invariant'}, "
                f"trainer {'bitwise' if tr['invariant'] else 'NOT invariant'}"
                f"{' (required: batch-invariant mode is on)' if cfg.batch_invariant else ' (reported, not required)'}"
            )
    finally:
        if own_pool:
            pool.close()
    results = [by_index[i] for i in range(len(matrix.scenarios))]
    vocabs = {vocab[i] for i in range(len(matrix.scenarios))}
    report = run_report(cfg, matrix, results, state, determinism, vocabs.pop() if len(vocabs) == 1 else None)
    timings["total_s"] = time.perf_counter() - t_start
    report["timings"] = timings
    write_report(report, cfg.out, plots=cfg.plots)
    return report


def run_report(
    cfg: RunConfig, matrix: Matrix, results: list[ScenarioResult], state: DeterminismState,
    determinism: JsonObject | None, vocab_size: int | None,
) -> ReportJson:
    """The run's records (written with ``--records``) and their report, built as an analysis of them builds it
    (:func:`parity.analyze.report.build_report`): what the records do not hold travels in their metadata."""
    import json

    from parity.analyze.report import REPORT_FACTS, build_report
    from parity.core.matrix import pair_coverage
    from parity.core.rl_catalogue import catalogue as rl_catalogue
    from parity.core.settings_effect import settings_effect
    from parity.judge.accumulators import Summary
    from parity.judge.token_columns import Options
    from parity.records.write import RecordsWriter
    from parity.report.schema import environment

    env = environment(cfg.device, cfg.dtype, cfg.trainer_dtype or cfg.dtype)
    users = {r.table.user_name for r in results if r.table.user_name}
    config: dict[str, object] = {
        "model": cfg.model,
        "trainer_model": cfg.trainer_model or cfg.model,
        "matrix": matrix.name,
        "seed": cfg.seed,
        "prefix_caching": cfg.prefix_caching,
        "rollout": "vllm-server" if cfg.server else "vllm-offline",
        "trainer_under_test": cfg.trainer if cfg.trainer is None or isinstance(cfg.trainer, str)
        else getattr(cfg.trainer, "__qualname__", "callable"),
        "planted_faults": {k: v for k, v in cfg.faults.__dict__.items() if v},
    }
    facts: dict[str, object] = {
        "scenarios": {r.scenario.name: {"model": r.scenario.model or cfg.model, **r.facts} for r in results},
        "config": config,
        "environment": {"device": cfg.device, "batch_invariant_mode": state.to_dict()},
        "top": {"matrix_pair_coverage": pair_coverage(matrix), "rl_view": rl_catalogue(), "determinism": determinism,
                "engine_settings": settings_effect(matrix.scenarios, [r.records for r in results], cfg.model,
                                                   cfg.prefix_caching) or None},
    }
    metadata = json.loads(json.dumps({
        "producer": "parity run",
        **{k: config[k] for k in ("model", "trainer_model", "seed", "matrix", "rollout", "planted_faults")},
        "scenario_models": {r.scenario.name: r.scenario.model or cfg.model for r in results},
        "vllm": env.get("vllm"),
        "torch": env.get("torch"),
        "transformers": env.get("transformers"),
        "device": cfg.device,
        "dtype": cfg.dtype,
        "trainer_dtype": cfg.trainer_dtype or cfg.dtype,
        "vocab_size": vocab_size,
        "trainer_under_test": users.pop() if len(users) == 1 else None,
        REPORT_FACTS: facts,
    }, default=str))
    where = str(cfg.records) if cfg.records is not None else "parity run"
    if cfg.records is not None:
        with RecordsWriter(cfg.records, metadata=metadata) as writer:
            for r in results:
                writer.write(r.export)
    total = Summary(files=[where], metadata=[{"file": where, **metadata}],
                    page_checksums={where: True} if cfg.records is not None else {})
    first_row = 0
    for r in results:  # matrix order, each scenario's rows after the last one's (as in the file)
        for acc in r.part.groups.values():
            acc.first_order = (0, first_row + acc.first_order[1], 0)
        first_row += r.part.rows
        total.merge(r.part)
    return build_report(total, cfg.thresholds, options=Options(device=cfg.device, n_listed=cfg.thresholds.max_violations_listed),
                        paths=[where] if cfg.records is not None else [], verdicts=[r.verdict for r in results])
