"""One run: a scenario matrix through the vLLM rollout and the transformers trainer, compared, gated, reported.

The command line is :mod:`parity.cli.run`; the engines and prompts come from :mod:`parity.engines.session`.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.core.gates import Thresholds, evaluate
from parity.core.matrix import Matrix, Scenario, default_matrix, load_matrix
from parity.core.spec import SamplingSpec
from parity.core.table import TrainerFaults, build_table, summarize
from parity.engines.session import EnginePool, make_prompts


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
    full_vocab_limit: int = 4096
    timeout_s: float = 900.0
    prefix_caching: bool = False
    trainer_shards: int = 1  # > 1: also score vocab-parallel across this many local processes
    trainer: Any = None  # trainer under test: "full" | "recompute" | "replay" | "module:function"
    invariance: bool = False  # run the batch-invariance checks on both sides and report them
    batch_invariant: bool = False  # turn on every batch-invariance knob available on the device
    capture: str = "topk"  # "topk" | "native" (vLLM return_sampling_mask, CUDA) | "both" (and compare them)
    server: str | None = None  # None: offline engine; "spawn": a local vLLM server; or a URL to attach to
    plots: bool = True


def resolve_matrix(cfg: RunConfig) -> Matrix:
    if isinstance(cfg.matrix, Matrix):
        m = cfg.matrix
    elif cfg.matrix == "default":
        m = default_matrix()
    else:
        m = load_matrix(cfg.matrix)
    if cfg.prompts or cfg.max_tokens:
        from dataclasses import replace

        m = Matrix(
            m.name,
            tuple(
                replace(s, prompts=cfg.prompts or s.prompts, max_tokens=cfg.max_tokens or s.max_tokens) for s in m.scenarios
            ),
        )
    return m


@dataclass
class ScenarioResult:
    scenario: Scenario
    records: list[Any]
    table: Any
    summary: dict[str, Any]
    violations: list[str]
    seconds: float


def score_scenario(rollout: Any, trainer: Any, sc: Scenario, cfg: RunConfig) -> ScenarioResult:
    """Sample with vLLM, score with the trainer, compare, gate: one scenario."""
    t0 = time.perf_counter()
    prompts = make_prompts(trainer.tokenizer(), sc.prompts)
    rollout.head = sc.capture_head if sc.capture_head is not None else cfg.capture_head
    records = rollout.generate(prompts, sc.spec, max_tokens=sc.max_tokens, seed=cfg.seed + sc.seed)
    logits = trainer.logits(records)
    table = build_table(records, logits, sc.spec, faults=cfg.faults)
    if cfg.trainer:
        score_trainer_under_test(table, records, logits, sc, cfg.trainer, trainer, cfg.thresholds.replay_max_abs_diff)
    summary = summarize(table)
    violations = evaluate(sc.name, table, summary, cfg.thresholds)
    if cfg.trainer_shards > 1:
        summary["vocab_parallel"], shard_violations = score_vocab_parallel(records, logits, sc, cfg.trainer_shards)
        violations += [f"[{sc.name}] vocab-parallel ({cfg.trainer_shards} shards): {v}" for v in shard_violations]
    if any("native_kept_ids" in r.extras for r in records):
        mism = [(r.prompt_index, int(t)) for r in records for t in r.extras.get("native_vs_topk_mismatch", [])]
        summary["native_capture"] = {"mode": cfg.capture, "mismatched_positions": len(mism)}
        if mism:
            where = "; ".join(f"prompt {p}, position {t}" for p, t in mism[: cfg.thresholds.max_violations_listed])
            violations.append(f"[{sc.name}] native sampling mask and top-K capture disagree on S_q at {len(mism)} positions: {where}")
    return ScenarioResult(sc, records, table, summary, violations, time.perf_counter() - t0)


def score_vocab_parallel(records: list[Any], logits: list[Any], sc: Scenario, shards: int) -> tuple[dict[str, Any], list[str]]:
    """Score the scenario's tokens with the vocab-parallel estimators and compare with the unsharded ones."""
    import torch

    from parity.distributed.pool import run_vocab_parallel
    from parity.distributed.sharded import check_parity

    z = torch.cat(list(logits))
    y = torch.cat([torch.tensor(r.completion_ids, dtype=torch.long) for r in records])
    kept = None
    if all(r.kept_ids is not None for r in records):
        width = max(int(r.kept_ids.shape[1]) for r in records)
        kept = torch.cat([torch.nn.functional.pad(r.kept_ids, (0, width - r.kept_ids.shape[1]), value=-1) for r in records])
    result = run_vocab_parallel(z, y, sc.spec, kept, shards)
    rep = check_parity(result, z, y, sc.spec, kept)
    summary = {
        "shards": shards,
        "max_abs_diff_vs_unsharded": rep.max_abs_diff,
        "support_equal_frac": rep.support_equal_frac,
        "fallback_rows": rep.fallback_rows,
        "bytes_per_token": result.get("bytes_per_token"),
        "passed": rep.passed,
    }
    return summary, list(rep.violations)


def score_trainer_under_test(table: Any, records: list[Any], logits: list[Any], sc: Scenario, name: Any, trainer: Any, tol: float) -> None:
    """Run the trainer under test on the sampled batch and attach its values and diagnosis to the table."""
    import torch

    from parity.engines.trainer_under_test import (
        call_trainer,
        diagnose,
        load_trainer,
        make_batch,
        reference_views,
    )

    label, fn = load_trainer(name)
    batch = make_batch(records, logits, sc.spec, getattr(trainer, "model", None), getattr(trainer, "model_path", ""))
    table.user = call_trainer(fn, label, batch)
    table.user_name = label
    ys = [torch.tensor(r.completion_ids, dtype=torch.long) for r in records]
    untempered, shifted = reference_views(logits, ys, sc.spec)
    ok = ~table.incomplete
    table.user_diagnosis = diagnose(
        table.user[ok], table.vllm[ok], table.log_s[ok], untempered=untempered[ok], shifted=shifted[ok], tol=tol
    )


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cfg: RunConfig, progress: Callable[[str], None] = _progress, pool: EnginePool | None = None) -> dict[str, Any]:
    """Run the matrix; return the report dict (also written under ``cfg.out``).

    With ``pool`` the engines outlive the run (tests share them); without, they are closed at the end.
    """
    from parity.determinism.knobs import batch_invariant_mode

    matrix = resolve_matrix(cfg)
    # Entered before any engine starts: on CUDA, VLLM_BATCH_INVARIANT is read at engine start-up.
    # With the mode off the context changes nothing and records the knobs as they are.
    with batch_invariant_mode(cfg.batch_invariant, device=cfg.device) as state:
        return _run(cfg, matrix, progress, pool, state)


def _run(cfg: RunConfig, matrix: Matrix, progress: Callable[[str], None], pool: EnginePool | None, state: Any) -> dict[str, Any]:
    from parity.core.matrix import pair_coverage
    from parity.determinism.checks import check_rollout_invariance, check_trainer_invariance
    from parity.determinism.gate import determinism_section
    from parity.determinism.knobs import batch_invariant_mode
    from parity.report.schema import environment, write_report

    own_pool = pool is None
    pool = pool or EnginePool()
    results: list[dict[str, Any]] = []
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    # Scenarios run grouped by model so that each engine starts once, then are reported in matrix order.
    order = sorted(range(len(matrix.scenarios)), key=lambda i: (matrix.scenarios[i].model or cfg.model) != cfg.model)
    by_index: dict[int, dict[str, Any]] = {}
    try:
        for done, idx in enumerate(order, start=1):
            sc = matrix.scenarios[idx]
            model_name = sc.model or cfg.model
            rollout, trainer = pool.get(model_name, cfg, progress)
            # The trainer-side knobs (eager attention) need the model, so they nest around scoring.
            with batch_invariant_mode(cfg.batch_invariant, device=cfg.device, models=[trainer.model]):
                res = score_scenario(rollout, trainer, sc, cfg)
            by_index[idx] = {
                "name": sc.name,
                "model": model_name,
                "spec": sc.spec.to_dict(),
                **res.summary,
                "verdict": "fail" if res.violations else "pass",
                "violations": res.violations,
                "_table": res.table,
            }
            timings[f"scenario_s[{sc.name}]"] = res.seconds
            s = res.summary
            progress(
                f"[{done}/{len(matrix.scenarios)}] {sc.name:<28} {'FAIL' if res.violations else 'PASS'}  "
                f"log S mean {s['log_s']['mean']:+.4f}  replay max|d| {s['replay']['max_abs_diff']:.1e}  "
                f"({s['tokens']} tokens, {res.seconds:.1f} s)"
            )
        determinism = None
        if cfg.invariance:
            rollout, trainer = pool.get(cfg.model, cfg, progress)
            progress("parity: invariance checks (rollout batch sizes 2..32, trainer padding and packing)")
            t0 = time.perf_counter()
            prompts = make_prompts(trainer.tokenizer(), 8)
            spec = SamplingSpec(temperature=1.0, top_p=0.9)
            with batch_invariant_mode(cfg.batch_invariant, device=cfg.device, models=[trainer.model]):
                ro = check_rollout_invariance(rollout, prompts, spec, max_tokens=8, seed=cfg.seed)
                tr = check_trainer_invariance(trainer, rollout.generate(prompts, spec, max_tokens=8, seed=cfg.seed))
            replay_max = max((r["replay"]["max_abs_diff"] for r in by_index.values()), default=None)
            determinism = determinism_section(
                state, rollout=ro, trainer=tr, required=cfg.batch_invariant, replay_max_abs_diff=replay_max
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
    timings["total_s"] = time.perf_counter() - t_start
    trainer_dtype = cfg.trainer_dtype or cfg.dtype
    report = {
        "schema_version": 1,
        "environment": {**environment(cfg.device, cfg.dtype, trainer_dtype), "batch_invariant_mode": state.to_dict()},
        "config": {
            "model": cfg.model,
            "trainer_model": cfg.trainer_model or cfg.model,
            "matrix": matrix.name,
            "seed": cfg.seed,
            "prefix_caching": cfg.prefix_caching,
            "rollout": "vllm-server" if cfg.server else "vllm-offline",
            "trainer_shards": cfg.trainer_shards,
            "trainer_under_test": cfg.trainer if cfg.trainer is None or isinstance(cfg.trainer, str) else getattr(cfg.trainer, "__qualname__", "callable"),
            "thresholds": cfg.thresholds.to_dict(),
            "planted_faults": {k: v for k, v in cfg.faults.__dict__.items() if v},
        },
        "matrix_pair_coverage": pair_coverage(matrix),
        "scenarios": results,
        "determinism": determinism,
        "passed": all(r["verdict"] == "pass" for r in results) and not (determinism and determinism["violations"]),
        "timings": timings,
    }
    write_report(report, cfg.out, plots=cfg.plots)
    for r in results:
        r.pop("_table", None)
    return report


