"""``parity run``: the main job. vLLM rollout vs transformers trainer over a scenario matrix."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from parity.compare import TrainerFaults, build_table, summarize
from parity.gates import Thresholds, evaluate
from parity.matrix import Matrix, Scenario, default_matrix, load_matrix
from parity.spec import SamplingSpec

# Fixed prompt texts, tokenized by the trainer's tokenizer and sent to vLLM as token ids so that
# tokenization cannot drift between the sides.
PROMPT_TEXTS = (
    "The sampler and the trainer must agree on every token",
    "Once upon a time in a small village by the sea",
    "def log_softmax(logits):",
    "Importance sampling corrects for the gap between two distributions",
    "The quick brown fox jumps over the lazy dog",
    "In reinforcement learning the policy is updated from rollouts",
    "Numbers: 1, 2, 3, 5, 8, 13, 21",
    "A kept set is the support of the filtered distribution",
)
SAMPLE_TEXT = "Parity checks that both sides tokenize this sentence identically, 12345!"


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


def check_same_vocabulary(rollout: Any, trainer: Any) -> None:
    """The two sides must agree on ids before any comparison means anything."""
    problems = []
    if rollout.vocab_size != trainer.vocab_size:
        problems.append(f"vocab size: vllm={rollout.vocab_size} trainer={trainer.vocab_size}")
    tv, tt = rollout.tokenizer(), trainer.tokenizer()
    if len(tv) != len(tt):
        problems.append(f"tokenizer length: vllm={len(tv)} trainer={len(tt)}")
    ev, et = tv.encode(SAMPLE_TEXT, add_special_tokens=False), tt.encode(SAMPLE_TEXT, add_special_tokens=False)
    if list(ev) != list(et):
        problems.append(f"tokenization of {SAMPLE_TEXT!r}: vllm={list(ev)[:12]}... trainer={list(et)[:12]}...")
    if problems:
        raise ValueError(
            f"tokenizer/vocabulary mismatch between rollout model {rollout.model!r} and trainer model "
            f"{trainer.model_path!r}: " + "; ".join(problems)
        )


def make_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        text = PROMPT_TEXTS[i % len(PROMPT_TEXTS)]
        if i >= len(PROMPT_TEXTS):
            text = f"{text} ({i // len(PROMPT_TEXTS)})"
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise ValueError(f"prompt {i} ({text!r}) tokenizes to no ids")
        prompts.append(ids)
    return prompts


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


def _resolve(name: str) -> Path:
    if (Path(name) / "config.json").is_file():
        return Path(name)
    from parity.fixtures import resolve_model

    return resolve_model(name)


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

    from parity.parallel import check_parity, run_vocab_parallel

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

    from parity.trainers import call_trainer, diagnose, load_trainer, make_batch, reference_views

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


class EnginePool:
    """One rollout engine and one trainer per model, started on first use and shared across runs."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, str], tuple[Any, Any]] = {}

    def get(self, model_name: str, cfg: RunConfig, progress: Callable[[str], None]) -> tuple[Any, Any]:
        from parity.engines.rollout import VllmRollout
        from parity.engines.trainer import TransformersTrainer

        trainer_dtype = cfg.trainer_dtype or cfg.dtype
        trainer_name = cfg.trainer_model if cfg.trainer_model and model_name == cfg.model else model_name
        key = (model_name, f"{trainer_name}|{cfg.dtype}|{trainer_dtype}|{cfg.device}|{cfg.server or 'offline'}|{cfg.capture}")
        if key not in self._engines:
            model_path = _resolve(model_name)
            trainer_path = _resolve(trainer_name)
            progress(f"parity: starting vLLM ({cfg.device}, {cfg.dtype}) and transformers ({trainer_dtype}) on {model_name}")
            trainer = TransformersTrainer(trainer_path, dtype=trainer_dtype, device=cfg.device)
            common = dict(
                dtype=cfg.dtype,
                device=cfg.device,
                seed=cfg.seed,
                full_vocab_limit=cfg.full_vocab_limit,
                head=cfg.capture_head,
                timeout_s=cfg.timeout_s,
                prefix_caching=cfg.prefix_caching,
            )
            if cfg.capture != "topk":
                common["capture"] = cfg.capture
            if cfg.server:
                from parity.engines.server import ServerRollout

                rollout = ServerRollout(model_path, server=cfg.server, **common)
            else:
                rollout = VllmRollout(model_path, **common)
            try:
                check_same_vocabulary(rollout, trainer)
            except Exception:
                rollout.close()
                raise
            self._engines[key] = (rollout, trainer)
        return self._engines[key]

    def close(self) -> None:
        for rollout, _ in self._engines.values():
            rollout.close()
        self._engines.clear()


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cfg: RunConfig, progress: Callable[[str], None] = _progress, pool: EnginePool | None = None) -> dict[str, Any]:
    """Run the matrix; return the report dict (also written under ``cfg.out``).

    With ``pool`` the engines outlive the run (tests share them); without, they are closed at the end.
    """
    from parity.determinism import batch_invariant_mode

    matrix = resolve_matrix(cfg)
    # Entered before any engine starts: on CUDA, VLLM_BATCH_INVARIANT is read at engine start-up.
    # With the mode off the context changes nothing and records the knobs as they are.
    with batch_invariant_mode(cfg.batch_invariant, device=cfg.device) as state:
        return _run(cfg, matrix, progress, pool, state)


def _run(cfg: RunConfig, matrix: Matrix, progress: Callable[[str], None], pool: EnginePool | None, state: Any) -> dict[str, Any]:
    from parity.determinism import (
        batch_invariant_mode,
        check_rollout_invariance,
        check_trainer_invariance,
        determinism_section,
    )
    from parity.matrix import pair_coverage
    from parity.report import environment, write_report

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
            # The trainer-side knobs (the CPU kernels; eager attention elsewhere) need the model, so they nest
            # around scoring.
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
            with batch_invariant_mode(cfg.batch_invariant, device=cfg.device, models=[trainer.model]) as inner:
                ro = check_rollout_invariance(rollout, prompts, spec, max_tokens=8, seed=cfg.seed)
                tr = check_trainer_invariance(trainer, rollout.generate(prompts, spec, max_tokens=8, seed=cfg.seed))
            replay_max = max((r["replay"]["max_abs_diff"] for r in by_index.values()), default=None)
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


FAULTS = {
    "perturb-logits": TrainerFaults(perturb_logits=0.05),
    "forget-temperature": TrainerFaults(forget_temperature=True),
    "swap-token": TrainerFaults(swap_token=True),
    "drop-kept": TrainerFaults(drop_kept=True),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen2-tiny", help="fixture name or Hugging Face checkpoint directory (default: qwen2-tiny)")
    p.add_argument("--trainer-model", default=None, help="a different checkpoint for the trainer side (must share the vocabulary)")
    p.add_argument("--matrix", default="default", help="'default' or a TOML matrix file")
    p.add_argument("--out", type=Path, default=Path("reports/parity"), help="report folder (default: reports/parity)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="both sides' dtype")
    p.add_argument("--trainer-dtype", choices=["float32", "bfloat16", "float16"], default=None, help="override the trainer's dtype")
    p.add_argument("--prompts", type=int, default=None, help="prompts per scenario (overrides the matrix)")
    p.add_argument("--max-tokens", type=int, default=None, help="completion length (overrides the matrix)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--thresholds", type=Path, default=None, help="TOML file with a [thresholds] table")
    p.add_argument("--gate", action="append", default=[], metavar="NAME=VALUE", help="override one threshold")
    p.add_argument("--capture-head", type=int, default=None, help="force the top-K capture head (-1: full vocabulary)")
    p.add_argument("--full-vocab-limit", type=int, default=4096, help="largest vocabulary captured in full for top_p/min_p-only specs")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one engine call may take")
    p.add_argument("--plant", choices=sorted(FAULTS), default=None, help="plant a trainer-side fault (self-test of the gates)")
    p.add_argument("--prefix-caching", action="store_true", help="let vLLM reuse cached KV blocks across scenarios (off: order-independent results)")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="turn on every batch-invariance knob the device offers (the report lists which were on or unavailable)",
    )
    p.add_argument(
        "--invariance",
        action="store_true",
        help="also check batch invariance on both sides (required, i.e. gated, under --batch-invariant)",
    )
    p.add_argument(
        "--capture",
        choices=["topk", "native", "both"],
        default="topk",
        help="how S_q is captured: top-K processed log-probs, vLLM's native sampling mask (CUDA, Model Runner V2), or both compared",
    )
    p.add_argument(
        "--trainer-shards",
        type=int,
        default=1,
        help="also score the trainer side vocab-parallel over N local processes (gloo on CPU) and compare",
    )
    p.add_argument(
        "--trainer",
        default=None,
        metavar="NAME|module:function",
        help="score a trainer under test: full, recompute, replay, or your own module:function (see README)",
    )
    p.add_argument(
        "--server",
        default=None,
        metavar="spawn|URL",
        help="sample through vLLM's OpenAI-compatible server: 'spawn' starts one on 127.0.0.1, a URL attaches",
    )
    p.add_argument("--no-plots", action="store_true")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    trainer_dtype = args.trainer_dtype or args.dtype
    th = Thresholds.from_toml(args.thresholds, trainer_dtype) if args.thresholds else Thresholds.for_dtype(trainer_dtype)
    changes: dict[str, float] = {}
    for item in args.gate:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--gate {item!r} is invalid: allowed NAME=VALUE")
        try:
            changes[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--gate {item!r}: value {value!r} is not a number") from None
    if changes:
        th = th.override(**changes)
    return RunConfig(
        model=args.model,
        trainer_model=args.trainer_model,
        matrix=args.matrix,
        out=args.out,
        device=args.device,
        dtype=args.dtype,
        trainer_dtype=args.trainer_dtype,
        prompts=args.prompts,
        max_tokens=args.max_tokens,
        seed=args.seed,
        thresholds=th,
        faults=FAULTS[args.plant] if args.plant else TrainerFaults(),
        capture_head=args.capture_head,
        full_vocab_limit=args.full_vocab_limit,
        timeout_s=args.timeout,
        prefix_caching=args.prefix_caching,
        server=args.server,
        trainer=args.trainer,
        trainer_shards=args.trainer_shards,
        capture=args.capture,
        batch_invariant=args.batch_invariant,
        invariance=args.invariance or args.batch_invariant,
        plots=not args.no_plots,
    )


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    report = run(cfg)
    n_fail = sum(s["verdict"] == "fail" for s in report["scenarios"])
    print(f"parity: {len(report['scenarios']) - n_fail}/{len(report['scenarios'])} scenarios pass; report in {cfg.out}/report.md")
    for s in report["scenarios"]:
        for v in s["violations"]:
            print(f"FAIL {v}")
    for v in (report.get("determinism") or {}).get("violations", []):
        print(f"FAIL [determinism] {v}")
    return 0 if report["passed"] else 1
