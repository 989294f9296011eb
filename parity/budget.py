"""``parity budget``: a setup's sampler–trainer mismatch split into its causes, one measured fix at a time.

Each scenario is sampled and scored as ``parity run`` does (:func:`parity.run.score_scenario`); then the passes a
fix needs run on the same tokens: a sampler at the trainer's dtype (same seeds), the trainer on each sequence alone,
routing replay, the engine without its settings. :mod:`parity.core.budget` turns the columns into the waterfall
(docs/budget.md).
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
import timeit
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

from parity.core.budget import (
    BOOTSTRAP,
    CAUSES,
    HEADLINE,
    LABELS,
    MEASURE_LABELS,
    Cause,
    Stage,
    Waterfall,
    check_order,
    order_notes,
    waterfall,
)
from parity.core.error_model import MEAN_BIAS_Z
from parity.core.matrix import Matrix, Scenario
from parity.core.penalties import penalise_sequence
from parity.core.spec import PENALTY_OFF, SamplingSpec
from parity.engines.session import EnginePool, Rollout, Trainer, make_prompts
from parity.engines.settings import EngineSettings
from parity.errors import UsageError
from parity.run import (
    RunConfig,
    ScenarioResult,
    preflight,
    resolve_matrix,
    run_report,
    scenario_engines,
    score_scenario,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from parity.core.sequence import SequenceRecord
    from parity.engines.trainer_under_test import TrainerFn
    from parity.report.blocks import BudgetBlock, BudgetScenario, ReportJson

NOISE_METHOD = (f"bootstrap over sequences ({BOOTSTRAP} resamples, fixed seed): a drop within {MEAN_BIAS_Z:g} standard "
                f"errors of 0 is within noise. It stands for run-to-run noise: on these CPU engines another engine "
                f"start with the same seeds draws the same tokens, so the sampling of sequences is what varies")


def budget_matrix(prompts: int = 8, max_tokens: int = 16) -> Matrix:
    """The default budget matrix: TRL's recipe (T=1, top_p=0.9) and the same without a filter."""
    return Matrix("budget", (
        Scenario("T=1 top_p=0.9", SamplingSpec(1.0, top_p=0.9), prompts=prompts, max_tokens=max_tokens),
        Scenario("T=1 top_p=1", SamplingSpec(1.0), prompts=prompts, max_tokens=max_tokens),
    ))


@dataclass
class BudgetConfig(RunConfig):
    order: tuple[str, ...] = CAUSES


def budget(cfg: BudgetConfig, progress: Callable[[str], None] | None = None,
           pool: EnginePool | None = None, samplers: SamplerCache | None = None) -> ReportJson:
    """Run the budget over the matrix; return the report dict (also written under ``cfg.out``) with its
    ``budget`` block. ``pool`` and ``samplers``: engines that outlive the call (tests share them)."""
    from parity.core.capture import CaptureHistory
    from parity.determinism.knobs import batch_invariant_mode
    from parity.report.schema import write_report

    say = progress or (lambda s: print(s, file=sys.stderr, flush=True))
    order = check_order(cfg.order)
    cfg = replace(cfg, matrix=budget_matrix() if cfg.matrix == "default" else cfg.matrix, sampler_log_s=False,
                  invariance=False)
    matrix = resolve_matrix(cfg)
    import parity.judge.scenario  # noqa: F401  (refuses a missing pyarrow before any engine starts)

    preflight(matrix, cfg)
    engines = cfg.engine_settings()
    own, own_samplers = pool is None, samplers is None
    pool = pool or EnginePool()
    t0 = time.perf_counter()
    results: list[ScenarioResult] = []
    blocks: list[BudgetScenario] = []
    timings: dict[str, float] = {}
    try:
        with batch_invariant_mode(cfg.batch_invariant, device=cfg.device) as state:
            samplers = samplers or SamplerCache(say)
            for i, sc in enumerate(matrix.scenarios, start=1):
                settings = scenario_engines(engines, sc)
                rollout, trainer = pool.get(sc.model or cfg.model, settings, say)
                rollout.capture_history = CaptureHistory()
                res = score_scenario(rollout, trainer, sc, cfg, None)
                results.append(res)
                t1 = time.perf_counter()
                block = scenario_budget(res, rollout, trainer, sc, cfg, settings, order, samplers, say)
                blocks.append(block)
                timings[f"scenario_s[{sc.name}]"] = res.seconds
                timings[f"budget_s[{sc.name}]"] = time.perf_counter() - t1
                say(f"[{i}/{len(matrix.scenarios)}] {sc.name:<24} {block['fix_first']}  ({block['tokens']} tokens, "
                    f"{res.seconds + timings[f'budget_s[{sc.name}]']:.1f} s)")
    finally:
        if own_samplers and samplers is not None:
            samplers.close()
        if own:
            pool.close()
    report = run_report(cfg, matrix, results, state, None, None)
    report["config"]["producer"] = "parity budget"
    report["budget"] = cast("BudgetBlock", {
        "order": list(order), "headline": HEADLINE, "measures": dict(MEASURE_LABELS), "noise_method": NOISE_METHOD,
        "scenarios": blocks})
    timings["total_s"] = time.perf_counter() - t0
    report["timings"] = timings
    write_report(report, cfg.out, plots=cfg.plots)
    return report


class SamplerCache:
    """Extra rollout engines a fix needs (the trainer's dtype, the engine's settings off), one per setting."""

    def __init__(self, say: Callable[[str], None] | None = None) -> None:
        self.say = say or (lambda s: None)
        self._engines: dict[tuple[str, EngineSettings], Rollout] = {}  # by (model, settings)

    def get(self, model: str, settings: EngineSettings) -> Rollout:
        from parity.engines.engine_log import waiting
        from parity.engines.session import rollout_settings
        from parity.engines.vllm_offline import VllmRollout
        from parity.fixtures import resolve_model

        if (model, settings) not in self._engines:
            self.say(f"parity: starting vLLM ({settings.device}, {settings.dtype}, prefix caching "
                     f"{'on' if settings.prefix_caching else 'off'}) on {model} for the budget")
            with waiting("vLLM engine start-up"):
                self._engines[model, settings] = VllmRollout(resolve_model(model), **rollout_settings(settings))
        return self._engines[model, settings]

    def close(self) -> None:
        for e in self._engines.values():
            e.close()
        self._engines.clear()


def _sample(rollout: Rollout, prompts: list[list[int]], sc: Scenario, cfg: RunConfig) -> tuple[list[SequenceRecord], float]:
    """One draw of the scenario's prompts with its seeds, as :func:`parity.run.score_scenario` draws them."""
    from parity.core.capture import CaptureHistory

    rollout.head = sc.capture_head if sc.capture_head is not None else cfg.capture_head
    rollout.max_head = sc.max_capture_head or cfg.max_capture_head
    rollout.capture_history = CaptureHistory()
    seed = cfg.seed + sc.seed
    if getattr(rollout, "prefix_caching", False):
        rollout.generate(prompts, sc.spec, max_tokens=1, seed=seed)
    t = time.perf_counter()
    out = rollout.generate(prompts, sc.spec, max_tokens=sc.max_tokens, seed=seed)
    return out, time.perf_counter() - t


def scenario_budget(
    res: ScenarioResult, rollout: Rollout, trainer: Trainer, sc: Scenario, cfg: BudgetConfig,
    settings: EngineSettings, order: Sequence[str], samplers: SamplerCache, say: Callable[[str], None],
) -> BudgetScenario:
    """One scenario's waterfall: the extra passes each fix needs, then :func:`parity.core.budget.waterfall`."""
    import torch

    from parity.core import estimators
    from parity.core.error_model import logprob_bound
    from parity.engines.routed_experts import ROUTED
    from parity.engines.routing_replay import routers

    spec = sc.spec.effective()
    trainer_dtype = cfg.trainer_dtype or cfg.dtype
    model = sc.model or cfg.model
    notes: list[str] = []
    causes: dict[str, Cause] = {}
    costs: dict[str, float] = {}

    # -- the sampler side: as configured, at the trainer's dtype, without its engine settings
    prompts = make_prompts(trainer.tokenizer(), sc.prompts, shared_prefix=sc.shared_prefix)
    draws: dict[tuple[bool, bool], list[SequenceRecord]] = {(False, False): res.records}
    precision = cfg.dtype != trainer_dtype
    engine_on = bool(settings.prefix_caching or settings.max_num_batched_tokens)
    for key in ((True, False), (False, True), (True, True)):
        if (key[0] and not precision) or (key[1] and not engine_on):
            continue
        s = replace(settings, dtype=trainer_dtype if key[0] else settings.dtype,
                    prefix_caching=False if key[1] else settings.prefix_caching,
                    max_num_batched_tokens=None if key[1] else settings.max_num_batched_tokens)
        draws[key], seconds = _sample(samplers.get(model, s), prompts, sc, cfg)
        costs[f"sample{key}"] = seconds
    mismatch = {k: _differs(res.records, v) for k, v in draws.items() if k != (False, False)}
    keep = [i for i, r in enumerate(res.records) if r.length and not _incomplete(r)
            and all(i not in diff for diff, _ in mismatch.values()) and all(not _incomplete(v[i]) for v in draws.values())]
    dropped_incomplete = sum(1 for r in res.records if not r.length or _incomplete(r))
    if dropped_incomplete:
        notes.append(f"{dropped_incomplete} sequence(s) left out: empty, or a kept set the capture could not prove")
    token_match: dict[str, object] = {}
    for k, (diff, ntok) in mismatch.items():
        token_match[_engine_name(k, cfg.dtype, trainer_dtype)] = {"sequences_differ": len(diff), "tokens_differ": ntok}
        if diff:
            notes.append(f"the sampler {_engine_name(k, cfg.dtype, trainer_dtype)} drew other tokens in {len(diff)} of "
                         f"{len(res.records)} sequences ({ntok} tokens): only the sequences both drew alike are compared")
    if not keep:
        raise UsageError(f"scenario {sc.name!r}: no sequence was drawn alike by every sampler the budget "
                         "needs, so nothing can be compared: allowed a setup whose samplers agree on some "
                         "sequences (more prompts)")

    # -- the trainer side: logits in its batch or alone, with or without routing replay
    moe = bool(routers(trainer.model))
    routed = moe and all(ROUTED in r.extras for v in draws.values() for r in v)
    logit_cache: dict[tuple[bool, tuple[bool, bool] | None], list[torch.Tensor]] = {}

    def logits(alone: bool, r3: tuple[bool, bool] | None) -> list[torch.Tensor]:
        key = (alone, r3)
        if key not in logit_cache:
            t = time.perf_counter()
            logit_cache[key] = _trainer_logits(trainer, res.records, alone, None if r3 is None else draws[r3])
            costs[f"logits{key}"] = time.perf_counter() - t
        return logit_cache[key]

    logits(False, None)  # the layout as configured, timed for the batch-composition fix's cost
    ys = [torch.tensor(res.records[i].completion_ids, dtype=torch.long) for i in keep]

    def sel(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [xs[i] for i in keep]

    recs0 = [draws[(False, False)][i] for i in keep]

    # -- what the trainer under test does (its own function), diagnosed against the reference views
    user_name = None
    # The starting trainer is the full-vocabulary one TRL's and verl's compute: log_softmax(z / T), the sampler's
    # penalties left out (TRL's trainer side applies the temperature alone).
    base_renorm, base_temperature, base_penalty = False, True, False
    user: dict[bool, torch.Tensor] = {}
    if cfg.trainer is not None:
        user_name, user, bugs = _user_columns(cfg.trainer, res.records, keep, logits, spec, trainer, costs)
        base_renorm = spec.filtered and "full_vocabulary" not in bugs
        base_temperature = "forgets_temperature" not in bugs
        base_penalty = "ignores_penalty" not in bugs
        notes.append(f"the trainer under test {user_name!r} is closest to the reference with "
                     f"{', '.join(sorted(bugs)) or 'no bug'}: its other causes are measured on the reference")
        if "off_by_one" in bugs:
            notes.append("it reads each log-prob one position late: no fix here removes that, it stays in the remainder")

    def reference(fixed: frozenset[str], *, trainer_math: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(trainer, sampler) flat columns at ``fixed``; ``trainer_math`` False keeps the base estimator."""
        skey = ("sampler_precision" in fixed and precision, "engine_settings" in fixed and engine_on)
        recs = [draws[skey][i] for i in keep]
        z = sel(logits("batch_composition" in fixed, skey if "moe_routing" in fixed and routed else None))
        renorm = base_renorm or (trainer_math and "truncation" in fixed)
        own_set = not (base_renorm or (trainer_math and "filter_boundary" in fixed))
        temp = base_temperature or (trainer_math and "logits_processors" in fixed)
        pen = spec.penalised and (base_penalty or (trainer_math and "logits_processors" in fixed))
        s = spec if temp or spec.greedy else replace(spec, temperature=1.0)
        cols = []
        for zi, y, r in zip(z, ys, recs, strict=True):
            if pen:
                zi = penalise_sequence(zi, spec, r.prompt_ids, r.completion_ids)
            if not renorm or r.kept_ids is None:
                cols.append(estimators.full(zi, y, s).double())
            elif own_set:
                cols.append(estimators.recompute(zi, y, s).logprobs.double())
            else:
                cols.append(estimators.replay(zi, y, r.kept_ids, s).logprobs.double())
        return torch.cat(cols), torch.cat([r.logprobs.double() for r in recs])

    lengths = tuple(len(y) for y in ys)

    @functools.cache  # both orders of the waterfall visit the same stages
    def stage(fixed: frozenset[str]) -> Stage:
        ref, sampler = reference(fixed)
        if user:
            base, _ = reference(fixed, trainer_math=False)
            ref = user["batch_composition" in fixed] + (ref - base)
        return Stage(ref, sampler, lengths)

    # -- which causes apply
    filtered = spec.filtered
    nofilter = "no filter (top_k, top_p, min_p off): the sampler normalises over the whole vocabulary"
    if not filtered:
        causes["truncation"] = causes["filter_boundary"] = Cause("not_applicable", nofilter)
    elif base_renorm:
        causes["truncation"] = Cause("not_applicable", "the trainer already renormalises over the kept set")
        causes["filter_boundary"] = Cause("measured", None, _est_cost(sel(logits(False, None)), ys, spec, recs0))
    else:
        causes["truncation"] = Cause("measured", None, _est_cost(sel(logits(False, None)), ys, spec, recs0))
        causes["filter_boundary"] = Cause("measured")
    causes["logits_processors"] = _processors_cause(spec, base_temperature, base_penalty)
    if precision:
        causes["sampler_precision"] = Cause("measured", None, f"sampling at {trainer_dtype}: "
                                            f"{costs[f'sample{(True, False)}']:.2f} s for this scenario")
    else:
        causes["sampler_precision"] = Cause("not_applicable", f"the sampler and the trainer both run {cfg.dtype}")
    alone_s = (logits(True, None), costs[f"logits{(True, None)}"])[1]
    batched_s = costs.get(f"logits{(False, None)}")
    causes["batch_composition"] = Cause("measured", None, f"scoring alone: {alone_s:.2f} s against "
                                        f"{batched_s if batched_s is not None else float('nan'):.2f} s batched")
    if not moe:
        causes["moe_routing"] = Cause("not_applicable", "dense model (no MoE router)")
    elif not routed:
        causes["moe_routing"] = Cause("not_measured", "the sampler's routed experts were not captured")
    else:
        causes["moe_routing"] = Cause("measured")
    if engine_on:
        causes["engine_settings"] = Cause("measured", None, f"sampling without them: {costs[f'sample{(False, True)}']:.2f} s")
    else:
        causes["engine_settings"] = Cause("not_applicable", "prefix caching and chunked prefill are off in this setup")

    measured = frozenset(c for c, v in causes.items() if v.status == "measured")
    final_key = ("sampler_precision" in measured and precision, "engine_settings" in measured and engine_on)
    zf = sel(logits("batch_composition" in measured, final_key if "moe_routing" in measured and routed else None))
    recs_f = [draws[final_key][i] for i in keep]
    if spec.penalised:  # the bound of the final stage, whose trainer applies the penalties
        zf = [penalise_sequence(z, spec, r.prompt_ids, r.completion_ids) for z, r in zip(zf, recs_f, strict=True)]
    bound = torch.cat([
        logprob_bound(estimators.scale(z, spec), y, None if r.kept_ids is None else estimators.ids_to_mask(r.kept_ids, z.shape[-1]),
                      dtype=(trainer_dtype if final_key[0] else cfg.dtype, trainer_dtype))
        for z, y, r in zip(zf, ys, recs_f, strict=True)])
    wf = waterfall(stage, causes, order, bound=bound)
    other = waterfall(stage, causes, CAUSES if tuple(order) != CAUSES else tuple(reversed(CAUSES)), bound=None)
    notes += order_notes(wf, other)
    return _block(sc, wf, notes, token_match, keep, res.records, user_name)


def _processors_cause(spec: SamplingSpec, divides: bool, penalises: bool) -> Cause:
    """The logits processors the starting trainer skips: the temperature (T != 1) and the penalties (docs/penalties.md)."""
    skipped: list[str] = []
    kept: list[str] = []
    if not spec.greedy and spec.effective_temperature != 1.0:
        (kept if divides else skipped).append(f"the division by T = {spec.effective_temperature:g}")
    if spec.penalised:
        named = [f"{n}={v:g}" for n, off in PENALTY_OFF.items() if (v := getattr(spec, n)) != off]
        (kept if penalises else skipped).append(f"the penalties ({', '.join(named)})")
    if skipped:
        return Cause("measured", "skipped: " + " and ".join(skipped), "none: elementwise on the logits")
    if kept:
        return Cause("not_applicable", "the trainer applies " + " and ".join(kept))
    return Cause("not_applicable", "T = 1 and no penalty: no logits processor to apply")


def _differs(a: Sequence[SequenceRecord], b: Sequence[SequenceRecord]) -> tuple[set[int], int]:
    """Sequences whose tokens differ between two draws, and how many token positions differ (length counted)."""
    diff, toks = set(), 0
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if list(x.completion_ids) != list(y.completion_ids):
            diff.add(i)
            toks += sum(p != q for p, q in zip(x.completion_ids, y.completion_ids, strict=False))
            toks += abs(x.length - y.length)
    return diff, toks


def _incomplete(r: SequenceRecord) -> bool:
    return r.incomplete is not None and bool(r.incomplete.any())


def _engine_name(key: tuple[bool, bool], dtype: str, trainer_dtype: str) -> str:
    without = " without prefix caching / chunked prefill" if key[1] else ""
    return f"at {trainer_dtype if key[0] else dtype}{without}"


def _trainer_logits(trainer: Trainer, records: Sequence[SequenceRecord], alone: bool,
                    routing: Sequence[SequenceRecord] | None) -> list[torch.Tensor]:
    """The trainer's logits for every record: in its batches (as configured) or one sequence at a time; with
    ``routing``, its MoE routers forced to those records' experts (:func:`parity.engines.routing_replay.trace_routers`)."""
    from contextlib import nullcontext

    from parity.engines.routing_replay import trace_routers

    bs = int(getattr(trainer, "batch_size", 8))
    size = 1 if alone else bs
    routed = [replace(r, extras={**r.extras, **({k: v for k, v in s.extras.items() if k == "routed_experts"})})
              for r, s in zip(records, routing, strict=True)] if routing is not None else None
    ctx = trace_routers(trainer.model, routed, size) if routed is not None else nullcontext()
    old = getattr(trainer, "batch_size", None)
    try:
        if old is not None:
            trainer.batch_size = size  # type: ignore[attr-defined]  # TransformersTrainer's layout
        with ctx:
            if old is None and alone:
                return [z for r in records for z in trainer.logits([r])]
            return trainer.logits(records)
    finally:
        if old is not None:
            trainer.batch_size = old  # type: ignore[attr-defined]


def _user_columns(
    name: str | TrainerFn, records: Sequence[SequenceRecord], keep: list[int],
    logits: Callable[[bool, tuple[bool, bool] | None], list[torch.Tensor]], spec: SamplingSpec, trainer: Trainer,
    costs: dict[str, float],
) -> tuple[str, dict[bool, torch.Tensor], frozenset[str]]:
    """The trainer under test's log-probs in its batch (False) and each sequence alone (True), over the kept
    sequences, and the reference view (bug set) it is closest to."""
    import torch

    from parity.engines.trainer_under_test import call_trainer, load_trainer, make_batch, reference_views

    label, fn = load_trainer(name)
    model, path = getattr(trainer, "model", None), getattr(trainer, "model_path", "")
    z_b = logits(False, None)
    t = time.perf_counter()
    batched = call_trainer(fn, label, make_batch(records, z_b, spec, model, path))
    costs["user_batched"] = time.perf_counter() - t
    z_a = logits(True, None)
    t = time.perf_counter()
    alone = torch.cat([call_trainer(fn, label, make_batch([r], [z], spec, model, path)) for r, z in zip(records, z_a, strict=True)])
    costs["user_alone"] = time.perf_counter() - t
    starts = [0, *itertools.accumulate(r.length for r in records)]
    pick = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in keep])
    ys = [torch.tensor(r.completion_ids, dtype=torch.long) for r in records]
    views = reference_views(z_b, ys, spec, [r.kept_ids for r in records], [r.prompt_ids for r in records])
    # off_by_one's view has no value at each sequence's last token (NaN): compared where it has one.
    dist = {b: float((batched - v).abs().nanmean()) for b, v in views.items()}
    bugs = min(dist, key=lambda b: (dist[b], len(b)))
    return label, {False: batched[pick], True: alone[pick]}, bugs


def _est_cost(z: list[torch.Tensor], ys: list[torch.Tensor], spec: SamplingSpec, recs: list[SequenceRecord]) -> str:
    """The fix's cost on these tokens: replay's estimator time against the full-vocabulary one's."""
    from parity.core import estimators

    def full() -> None:
        for zi, y in zip(z, ys, strict=True):
            estimators.full(zi, y, spec)

    def replay() -> None:
        for zi, y, r in zip(z, ys, recs, strict=True):
            if r.kept_ids is not None:
                estimators.replay(zi, y, r.kept_ids, spec)

    # The fastest of three timed calls (the first pays for warm-up).
    full_s, replay_s = (min(timeit.repeat(f, number=1, repeat=3)) for f in (full, replay))
    return f"replay {replay_s * 1e3:.1f} ms against full-vocabulary {full_s * 1e3:.1f} ms on these tokens"


def _block(sc: Scenario, wf: Waterfall, notes: list[str], token_match: dict[str, object], keep: list[int],
           records: Sequence[SequenceRecord], user_name: str | None) -> BudgetScenario:
    from parity.core.budget import FIXES, REMAINDER

    rows = [r.to_json() for r in wf.rows]
    best = wf.largest_fixable()
    block = {
        "scenario": sc.name,
        "spec": sc.spec.to_dict(),
        "trainer": user_name or "parity's full-vocabulary reference (log_softmax(z / T), as TRL and verl)",
        "sequences": len(keep),
        "sequences_sampled": len(records),
        "tokens": sum(records[i].length for i in keep),
        "order": list(wf.order),
        "start": wf.start,
        "rows": rows,
        "remainder": {"cause": REMAINDER, "label": LABELS[REMAINDER], "fix": FIXES[REMAINDER], "after": wf.remainder,
                      "share": wf.remainder_share, "bound": wf.bound},
        "largest_fixable": None if best is None else best.cause,
        "fix_first": wf.fix_first(),
        "token_match": token_match,
        "notes": notes,
    }
    return cast("BudgetScenario", block)
