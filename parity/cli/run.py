"""``parity run``: the main job. vLLM rollout vs transformers trainer over a scenario matrix."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from parity.cli import thresholds_from_args
from parity.core.token_table import TrainerFaults
from parity.engines.engine_log import LOG_NAME, EngineOutput
from parity.errors import UsageError
from parity.report.overview import render_terminal
from parity.run import RunConfig, run

FAULTS = {
    "perturb-logits": TrainerFaults(perturb_logits=0.05),
    "forget-temperature": TrainerFaults(forget_temperature=True),
    "swap-token": TrainerFaults(swap_token=True),
    "drop-kept": TrainerFaults(drop_kept=True),
    "ignore-penalty": TrainerFaults(ignore_penalty=True),
}


def add_arguments(p: argparse.ArgumentParser, *, out: str = "reports/parity", matrix: str = "'default' or a TOML matrix file",
                  run_only: bool = True) -> None:
    """parity run's options; ``run_only`` False leaves out those only a run takes (invariance checks, planted faults,
    the sampler-side log S, a server, the capture mode, records), for ``parity budget``, which shares the rest."""
    p.add_argument("--model", default="qwen2-tiny", help="fixture name or Hugging Face checkpoint directory (default: qwen2-tiny)")
    p.add_argument("--trainer-model", default=None, help="a different checkpoint for the trainer side (must share the vocabulary)")
    p.add_argument("--matrix", default="default", help=matrix)
    p.add_argument("--out", type=Path, default=Path(out), help=f"report folder (default: {out})")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32", help="both sides' dtype")
    p.add_argument("--trainer-dtype", choices=["float32", "bfloat16", "float16"], default=None, help="override the trainer's dtype")
    p.add_argument("--prompts", type=int, default=None, help="prompts per scenario (overrides the matrix)")
    p.add_argument("--max-tokens", type=int, default=None, help="completion length (overrides the matrix)")
    p.add_argument("--max-prompts", type=int, default=None, metavar="N",
                   help="sample a scenario again with up to N prompts when its mean-bias verdict cannot resolve the "
                        "scenario's log S (default 64; a scenario's own prompts when larger); a verdict still without "
                        "that power is no verdict (exit 4), naming the tokens it needs")
    p.add_argument("--recompute-precision", choices=["trainer", "sampler"], default="trainer",
                   help="where recompute chooses its kept set: on the trainer's logits (default), or on them rounded to "
                        "the sampler's dtype, whose ties at the k-th value vLLM's top_k keeps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--thresholds", type=Path, default=None, help="TOML file with a [thresholds] table")
    p.add_argument("--gate", action="append", default=[], metavar="NAME=VALUE", help="override one threshold")
    p.add_argument("--capture-head", type=int, default=None, help="force the top-K capture head (-1: full vocabulary)")
    p.add_argument("--max-capture-head", type=int, default=None,
                   help="cap of S_q capture: a kept set of this many tokens or more is left unproven and "
                        "not evaluated (default: no cap on the offline engine, which reads wide kept sets "
                        "from its sampler; 4096, the widest top-K head, on a server)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds any one engine call may take")
    p.add_argument("--prefix-caching", action="store_true", help="let vLLM reuse cached KV blocks (each scenario's prompts are sent once first, so its requests hit "
                   "the cache; off: order-independent results)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="vLLM's step token budget with chunked prefill on (prompts longer than it are chunked)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="turn on every batch-invariance knob the device offers (the report lists which were "
                        "on or unavailable)")
    p.add_argument("--trainer", default=None, metavar="NAME|module:function",
                   help="score a trainer under test: full, recompute, replay, or your own module:function "
                        "(see README)")
    p.add_argument("--no-plots", action="store_true")
    if run_only:
        p.add_argument("--plant", choices=sorted(FAULTS), default=None, help="plant a trainer-side fault (self-test of the gates)")
        p.add_argument("--invariance", action="store_true",
                       help="also check batch invariance on both sides (required, i.e. gated, under "
                            "--batch-invariant)")
        p.add_argument("--capture", choices=["topk", "native", "both"], default="topk",
                       help="how S_q is captured: top-K processed log-probs, vLLM's native sampling mask "
                            "(CUDA, Model Runner V2), or both compared")
        p.add_argument("--server", default=None, metavar="spawn|URL",
                       help="sample through vLLM's OpenAI-compatible server: 'spawn' starts one on "
                            "127.0.0.1, a URL attaches")
        p.add_argument("--no-sampler-log-s", action="store_true",
                       help="skip the raw-logits engine that gives a sampler-side log S (the naive bias is "
                            "then reported, not gated)")
        p.add_argument("--records", type=Path, default=None, metavar="PATH",
                       help="also write every sampled and scored token to a records file (Parquet; read it "
                            "back with parity analyze)")
    p.add_argument("--verbose", action="store_true",
                   help="let vLLM, torch and transformers print to the terminal (default: into engine.log in "
                        "the report folder)")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    if args.max_prompts is not None and args.max_prompts < 1:
        raise UsageError(f"--max-prompts={args.max_prompts} is invalid: allowed an integer >= 1")
    if args.max_capture_head is not None and args.max_capture_head < 2:
        raise UsageError(f"--max-capture-head={args.max_capture_head} is invalid: allowed an integer >= 2")
    from parity.core.error_model import UNIT_ROUNDOFF

    trainer_dtype = args.trainer_dtype or args.dtype
    # The looser side sets the thresholds, as it sets the bound: a bfloat16 sampler against a float32
    # trainer is judged as bfloat16.
    looser = max((args.dtype, trainer_dtype), key=UNIT_ROUNDOFF.__getitem__)
    th = thresholds_from_args(args.thresholds, args.gate, looser)
    derived = dict(
        thresholds=th,
        faults=FAULTS[args.plant] if args.plant else TrainerFaults(),
        timeout_s=args.timeout,
        invariance=args.invariance or args.batch_invariant,
        plots=not args.no_plots,
        sampler_log_s=not args.no_sampler_log_s,
    )
    # Every other RunConfig field takes its flag's value unchanged.
    same = {f.name: getattr(args, f.name) for f in fields(RunConfig) if f.name not in derived}
    return RunConfig(**same, **derived)


def main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    # The engines' log lines and warnings go to engine.log (shown in part if the run fails); parity's
    # own progress lines and the wait indicators go to the terminal.
    with EngineOutput(Path(cfg.out) / LOG_NAME, verbose=args.verbose) as out:
        report = run(cfg, progress=out.say)
    print()
    print(render_terminal(report))
    print()
    for s in report["scenarios"]:
        if s.get("capture_limit"):
            print(f"CAPTURE LIMIT {s['capture_limit']}")
    for s in report["scenarios"]:
        for v in s["violations"]:
            print(f"FAIL {v['message']}")
    det_violations = (report.get("determinism") or {}).get("violations")
    for dv in det_violations if isinstance(det_violations, list) else []:
        if isinstance(dv, dict):
            print(f"FAIL [determinism] {dv['message']}")
    for line in report["no_verdict"]:
        print(f"NO VERDICT {line}")
    n_pass = sum(s["verdict"] == "pass" for s in report["scenarios"])
    print(
        f"parity: {n_pass}/{len(report['scenarios'])} scenarios pass; report in "
        f"{cfg.out}/report.md" + ("" if args.verbose else f", engine output in {cfg.out}/{LOG_NAME}")
    )
    from parity.cli import verdict_exit_code, verdict_line

    code = verdict_exit_code(report)
    print(verdict_line(report, code))
    return code
