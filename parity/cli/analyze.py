"""``parity analyze``: judge records recorded anywhere (Parquet) with the gates and report of ``parity run``."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from parity.cli import thresholds_from_args, verdict_exit_code, verdict_line
from parity.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, nargs="?", default=None, help="a records file (Parquet) or a directory of *.parquet shards")
    p.add_argument("--model", default=None, help="re-score with this trainer checkpoint (fixture name or Hugging Face directory)")
    p.add_argument("--jobs", type=int, default=1, help="analyse shards in N local processes and merge (default 1)")
    p.add_argument("--engine", default="local", metavar="ENGINE",
                   help="where the per-batch map step runs (default local): ray (a local cluster, or RAY_ADDRESS's), "
                        "or ray://HOST:PORT; the summaries merge here (needs parity[ray])")
    p.add_argument("--out", type=Path, default=Path("reports/analyze"), help="report folder (default: reports/analyze)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="trainer dtype: picks the default thresholds (and the --model dtype); default: the records' "
                        "trainer_dtype metadata, else float32")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="device for --model")
    p.add_argument("--thresholds", type=Path, default=None, help="TOML file with a [thresholds] table")
    p.add_argument("--gate", action="append", default=[], metavar="NAME=VALUE", help="override one threshold")
    p.add_argument("--batch-rows", type=int, default=1024,
                   help="rows per streamed batch, 1 to 16,384 (default 1024): the analysis holds one batch at a time, "
                        "so memory grows with it, whatever the files' row groups")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the whole analysis may take")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--accept-partial", action="store_true",
                   help="exit 0 when the gates that could be evaluated pass, though a scenario has no mean-bias "
                        "gate (default: exit 4, no verdict)")


def _records_dtype(path: Path) -> str | None:
    import parity.analyze.shards  # noqa: F401  (refuses a missing pyarrow with what to install)
    from parity.records.read import open_records, records_paths
    from parity.records.schema import RecordsError

    try:
        return open_records(records_paths(path)[0]).metadata.get("trainer_dtype")
    except (OSError, RecordsError):
        return None


def main(args: argparse.Namespace) -> int:
    if args.path is None:
        raise UsageError("parity analyze needs PATH: allowed a records file (Parquet) or a directory of *.parquet shards")
    # isort: off
    from parity.analyze.report import analyze  # first: it refuses a missing pyarrow with what to install
    from parity.analyze.cluster import parse_engine
    from parity.core.display import ordered
    from parity.core.power import Power, unassessed_sentence
    from parity.core.spec import SamplingSpec
    from parity.judge.token_columns import Options
    # isort: on

    parse_engine(args.engine)  # a bad --engine is refused before any file is read
    dtype = args.dtype or _records_dtype(args.path) or "float32"
    th = thresholds_from_args(args.thresholds, args.gate, dtype)
    # parity.analyze, imported above, refused a missing pyarrow
    from parity.records.read import check_batch_rows

    check_batch_rows(args.batch_rows, "--batch-rows")
    opts = Options(model=args.model, dtype=dtype, device=args.device, batch_rows=args.batch_rows)
    report = analyze(
        args.path, thresholds=th, options=opts, jobs=args.jobs, out=args.out, plots=not args.no_plots,
        timeout_s=args.timeout, progress=lambda m: print(m, file=sys.stderr, flush=True), engine=args.engine,
    )
    sc = report["scenarios"]
    n_pass = sum(s["verdict"] == "pass" for s in sc)
    scope = "" if report["complete"] else f" on the gates evaluated ({len({g['gate'] for g in report['not_evaluated']})} not evaluated)"
    print(
        f"parity analyze: {n_pass}/{len(sc)} scenarios pass{scope} over {report['records']['tokens']} tokens "
        f"in {report['records']['files']} file(s); report in {args.out}/report.md"
    )
    for w in report["warnings"]:
        print(f"WARNING {w}")
    skipped: dict[str, list[str]] = {}
    for s in sc:
        for g in s["not_evaluated"]:
            skipped.setdefault(f"{g['gate']}: {g['reason']}", []).append(s["name"])
    if sc and all(s["mean_bias_evaluated"] for s in sc):
        # The mean-bias gate decided: the gates the records could not feed are one line (report.md names each).
        gates = sorted({g["gate"] for s in sc for g in s["not_evaluated"]})
        if gates:
            print(f"NOT EVALUATED {len(gates)} gate(s) whose inputs the records lack (each with what supplies it in "
                  f"{args.out}/report.md): {', '.join(gates)}")
    else:
        for what, names in skipped.items():
            print(f"NOT EVALUATED ({len(names)} of {len(sc)} scenarios) {what}")
    for s in sc:
        m = (s.get("mean_bias") or {}).get("logprob")
        if m:
            mean, limit = ordered(float(m["mean"]), float(m["limit"]))
            print(f"MEAN BIAS [{s['name']}] log mean IS ratio {mean} against a resolution of {limit} "
                  f"per token (systematic {m['systematic']:.2g} + statistical {m['statistical']:.2g}, "
                  f"{m['standard_error_from']}) over {m['tokens']} tokens; mean(trainer - sampler) {m['mean_diff']:.3g}"
                  + (f"; assumed: {'; '.join(m['assumed'])}" if m["assumed"] else ""))
    from parity.report.budget_section import split_line

    for s in sc:
        sp = s.get("mismatch_split")
        if sp is not None:
            print("SPLIT " + split_line(s["name"], sp))
    for s in sc:
        p = s.get("power")
        if p is not None and p["resolved"] is None:
            power = Power(p["gate"], math.nan, float(p["resolution"]), float(p["systematic"]), int(p["tokens"]), None,
                          penalised=SamplingSpec.from_dict(s["spec"]).penalised)
            print(f"POWER NOT ASSESSED {unassessed_sentence(power, s['name'])}")
    for s in sc:
        if s.get("capture_limit"):
            print(f"CAPTURE LIMIT {s['capture_limit']}")
    for s in sc:
        for v in s["violations"]:
            print(f"FAIL {v['message']}")
    code = verdict_exit_code(report, accept_partial=args.accept_partial)
    for line in report["no_verdict"]:
        print(f"{'PARTIAL' if code == 0 else 'NO VERDICT'} {line}")
    print(verdict_line(report, code))
    return code
