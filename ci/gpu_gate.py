"""The GPU CI gate: every parity check that needs CUDA, as one script the `gpu` nox session runs.

    python ci/gpu_gate.py                      # on the GPU runner (device cuda)
    python ci/gpu_gate.py --device cpu --small # the same steps through the same code on CPU (CI dry run)

Steps: float32 and bfloat16 runs of the default matrix against ci/thresholds.toml, the same with
batch-invariant mode on, native sampling-mask capture compared with top-K capture (CUDA only), the
tie characterization at batch sizes 1..16, and the rollout capture-overhead table on CUDA (CUDA only:
the same table as the CPU benchmark, tests/bench/test_bench_rollout.py, wall-clock basis, its noise
floor checked; written to reports/gpu/bench/bench.md). Each step's verdict goes to
reports/gpu/summary.md; the exit code is non-zero if any step fails.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass
class Step:
    name: str
    argv: list[str]  # arguments to the `parity` CLI, or to pytest (runner "pytest")
    cuda_only: bool = False
    runner: str = "parity"  # "parity" or "pytest"
    env: dict[str, str] = field(default_factory=dict)  # extra environment of the step


def steps(device: str, out: Path, *, small: bool = False) -> list[Step]:
    th = str(HERE / "thresholds.toml")
    size = ["--matrix", str(HERE / "small_matrix.toml")] if small else []
    run = ["run", "--model", "qwen2-tiny", "--device", device, "--thresholds", th, *size]
    return [
        Step("float32", [*run, "--dtype", "float32", "--out", str(out / "fp32")]),
        Step("bfloat16", [*run, "--dtype", "bfloat16", "--out", str(out / "bf16")]),
        Step("float32 batch-invariant", [*run, "--dtype", "float32", "--batch-invariant", "--out", str(out / "fp32-bi")]),
        Step("bfloat16 batch-invariant", [*run, "--dtype", "bfloat16", "--batch-invariant", "--out", str(out / "bf16-bi")]),
        Step(
            "native mask vs top-K",
            [*run, "--dtype", "float32", "--capture", "both", "--matrix", str(HERE / "native_matrix.toml"), "--out", str(out / "native")],
            cuda_only=True,
        ),
        Step(
            "ties per batch size",
            ["ties", "--device", device, "--top-k", "2", "--batch-sizes", "1,2" if small else "1-16", "--out", str(out / "ties")],
        ),
        Step(
            "capture overhead table",
            [
                str(HERE.parent / "tests" / "bench" / "test_bench_rollout.py"),
                "-m",
                "gpu",
                "-k",
                "capture_cuda or capture_floor_cuda",
                "--benchmark-only",
                "--benchmark-autosave",
                f"--benchmark-storage=file://{out / 'bench'}",
                "-p",
                "no:cacheprovider",
            ],
            cuda_only=True,
            runner="pytest",
            env={"PARITY_BENCH_DIR": str(out / "bench")},
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", type=Path, default=Path("reports/gpu"))
    ap.add_argument("--small", action="store_true", help="tiny sizes (the CPU dry run)")
    ap.add_argument("--only", action="append", default=[], help="run only the step with this exact name (repeatable)")
    ap.add_argument("--in-process", action="store_true", help="call the CLI in this process (tests; one engine import)")
    ap.add_argument("--list", action="store_true", help="print the steps' command lines and exit")
    args = ap.parse_args(argv)

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_gate: --device cuda but torch.cuda.is_available() is False: run on a CUDA runner, or --device cpu for the dry run", file=sys.stderr)
            return 2
    chosen = [s for s in steps(args.device, args.out, small=args.small) if not args.only or s.name in args.only]
    if args.list:
        for s in chosen:
            print(f"{s.name}: {s.runner} {' '.join(s.argv)}")
        return 0
    rows = []
    for s in chosen:
        if s.cuda_only and args.device != "cuda":
            rows.append((s.name, "skipped (needs CUDA)", 0.0))
            continue
        t0 = time.perf_counter()
        print(f"gpu_gate: {s.name}: {s.runner} {' '.join(s.argv)}", flush=True)
        if s.runner == "pytest":
            rc = subprocess.call([sys.executable, "-m", "pytest", *s.argv], env={**os.environ, **s.env}, cwd=HERE.parent)
        elif args.in_process:
            from parity.cli.main import main as parity_main

            rc = parity_main(s.argv)
        else:
            rc = subprocess.call([sys.executable, "-m", "parity", *s.argv], env={**os.environ, **s.env})
        rows.append((s.name, "pass" if rc == 0 else f"FAIL (exit {rc})", time.perf_counter() - t0))
    args.out.mkdir(parents=True, exist_ok=True)
    lines = [f"# parity GPU gate ({args.device})", "", "| step | verdict | seconds |", "|---|---|---|"]
    lines += [f"| {n} | {v} | {t:.0f} |" for n, v, t in rows]
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(not v.startswith("FAIL") for _, v, _ in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
