"""Records analysis (``parity analyze``): the whole command against a plain pyarrow scan, peak memory on one
large row group, and ``--jobs`` over shards.

What a user waits for is the command, so every side runs as a fresh process, interleaved round by round
(the same machine load on both sides of a ratio), timed on the wall clock with the child's own CPU time
(user + sys of its threads, from ``wait4``) beside it:

* the plain scan (baseline): ``python -c`` that imports pyarrow and iterates the file's batches of
  1,024 rows, reading every value of every list column once (``pyarrow.compute.min_max``);
* ``parity analyze FILE --out DIR`` (report.json, report.md and the plots);
* the imports alone: ``import pyarrow.parquet`` against what ``parity analyze`` imports before it
  reads a row (startup).

Speed: 2M tokens in 256-token sequences, kept sets of K=20 ids, written by ``RecordsWriter`` (row groups
of 65,536 tokens; tests/records_synth.py). The noise floor is each side's spread over its rounds
(max / min - 1); past ``SPREAD_TOL`` the table is marked invalid.

Memory: peak RSS (VmHWM of the child's own image: ``ru_maxrss`` survives exec and starts at the parent's
RSS) of ``parity analyze`` on a file written as ONE row group of 4M tokens, at ``--batch-rows`` 1,024 and
256, next to the speed file (its 256-row row groups cap its batches at 256 rows) and the imports alone:
memory follows the batch, not the writer's row group.

``--jobs``: four shards of 500k tokens (copies of one file), ``--jobs 1`` against ``--jobs 2``. Reported,
never gated.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SPEED_TOKENS, RSS_TOKENS, SHARD_TOKENS, SHARDS = 2_000_000, 4_000_000, 500_000, 4
K, LENGTH, VOCAB = 20, 256, 32_768
ROUNDS = 3
JOBS_ROUNDS = 2
SPREAD_TOL = 0.25  # a side whose rounds spread more than this (max / min - 1) makes the table invalid
TITLE = "Records analysis (parity analyze): the whole command against a plain pyarrow scan"
INTRO = (
    f"{SPEED_TOKENS / 1e6:g}M tokens, K={K} kept ids per position, {LENGTH}-token sequences; fresh processes, "
    f"{ROUNDS} interleaved rounds, min wall time (the child's own CPU time in parentheses). Baseline: a python "
    "process that imports pyarrow and reads every value of every list column, batches of 1,024 rows."
)
SPEED_LIMIT = 1.3
SPEED_TARGET = f"parity analyze FILE --out DIR <= {SPEED_LIMIT:g}x a plain pyarrow scan of the file (fresh processes, wall)"
RSS_TITLE = "Records analysis: peak RSS (fresh process, VmHWM)"
RSS_INTRO = (
    f"parity analyze on {RSS_TOKENS / 1e6:g}M tokens written as ONE row group (K={K}), and on the {SPEED_TOKENS / 1e6:g}M "
    "speed file (row groups of 256 rows); 'imports' is a process that imports what the command imports."
)
RSS_TARGET = "records analysis peak RSS: one 4M-token row group / the speed file's, same batch (flat = 1)"
JOBS_TITLE = "Records analysis: --jobs over shards"
JOBS_INTRO = (
    f"{SHARDS} shards of {SHARD_TOKENS / 1e6:g}M tokens (K={K}); parity analyze DIR --jobs N, fresh processes, "
    f"{JOBS_ROUNDS} interleaved rounds, min wall time (CPU time of the command and its workers in parentheses)."
)

# A plain scan of the columns the analysis reads: every value of every list column, once.
SCAN = """
import sys
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

rows = 0
for batch in pq.ParquetFile(sys.argv[1]).iter_batches(batch_size=1024):
    rows += batch.num_rows
    for col in batch.columns:
        if pa.types.is_list(col.type):
            pc.min_max(col.flatten())
print(rows)
"""
# The command as the console script runs it, then the process's high-water mark into argv[1].
COMMAND = """
import sys
from parity.cli.main import main

code = main(sys.argv[2:])
with open("/proc/self/status") as f:
    hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
with open(sys.argv[1], "w") as f:
    f.write(str(hwm))
sys.exit(code)
"""
IMPORTS = "import parity.cli.main, parity.cli.analyze, parity.analyze, parity.report.schema"
IMPORTS_WITH_PLOTS = IMPORTS + ", matplotlib.pyplot"


@dataclasses.dataclass
class Child:
    wall: float  # seconds
    cpu: float  # the child's user + sys, its threads and reaped children included
    hwm_kb: int | None = None  # VmHWM of the command (COMMAND children only)


def run_child(code: str, args: Sequence[str], *, timeout_s: float = 600.0) -> Child:
    """Run ``python -c code args...`` in a fresh process; its wall time and its own CPU time (wait4)."""
    with tempfile.NamedTemporaryFile("w+", suffix=".err") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
        deadline = t0 + timeout_s
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                proc.kill()
                raise TimeoutError(f"python -c ... {' '.join(args)} ran past {timeout_s:.0f} s")
            time.sleep(0.005)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"python -c ... {' '.join(args)} exited {proc.returncode}: {err.read()[-2000:]}")
    return Child(wall, usage.ru_utime + usage.ru_stime)


def command(argv: Sequence[str]) -> Child:
    """``parity ARGV`` in a fresh process, with its peak RSS."""
    with tempfile.NamedTemporaryFile("w+", suffix=".hwm") as hwm:
        child = run_child(COMMAND, [hwm.name, *argv])
        hwm.seek(0)
        child.hwm_kb = int(hwm.read())
    return child


def high_water_of(code: str) -> int:
    """VmHWM (KB) of a fresh process that runs ``code``."""
    with tempfile.NamedTemporaryFile("w+", suffix=".hwm") as hwm:
        run_child(code + "\nimport sys\nwith open('/proc/self/status') as f:\n"
                  "    h = next(int(l.split()[1]) for l in f if l.startswith('VmHWM'))\n"
                  "open(sys.argv[1], 'w').write(str(h))\n", [hwm.name])
        hwm.seek(0)
        return int(hwm.read())


def make_file(folder: Path, tokens: int, *, k: int = K, vocab: int = VOCAB, length: int = LENGTH, seed: int = 0,
              one_row_group: bool = False) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    import records_synth

    path = folder / f"records-{tokens}-k{k}-s{seed}{'-rg1' if one_row_group else ''}.parquet"
    if not path.exists():
        records_synth.write_file(path, tokens, k=k, vocab=vocab, length=length, seed=seed, one_row_group=one_row_group)
    return path


def rounds(sides: dict[str, Callable[[], Child]], n: int) -> dict[str, list[Child]]:
    """Every side once per round, in order, ``n`` rounds."""
    out: dict[str, list[Child]] = {k: [] for k in sides}
    for _ in range(n):
        for name, run in sides.items():
            out[name].append(run())
    return out


def put_ratio(table: Any, row: str, col: str, target: list[Child], baseline: list[Child]) -> Any:
    """A ratio cell from fresh-process rounds: min wall over min wall, the children's CPU-time ratio beside it."""
    wall, base = min(c.wall for c in target), min(c.wall for c in baseline)
    cpu = min(c.cpu for c in target) / min(c.cpu for c in baseline)
    return table.put(row, col, wall / base, seconds=wall, baseline_seconds=base, basis="wall", other=cpu)


def spread(runs: list[Child]) -> float:
    walls = [c.wall for c in runs]
    return max(walls) / min(walls) - 1.0


def measure_speed(path: Path, out: Path, *, n: int = ROUNDS, tokens: int) -> dict[str, list[Child]]:
    argv = ["analyze", str(path), "--out", str(out)]
    return rounds({
        "scan": lambda: run_child(SCAN, [str(path)]),
        "analyze": lambda: command(argv),
        "imports: pyarrow": lambda: run_child("import pyarrow.parquet", []),
        "imports: parity analyze": lambda: run_child(IMPORTS, []),
    }, n)


def record_speed(report: Any, runs: dict[str, list[Child]], tokens: int) -> None:
    table = report.table("records", TITLE, "command", INTRO, cols=["/ plain scan", "tokens/s", "spread over rounds"])
    scan = runs["scan"]
    table.put("plain pyarrow scan", "/ plain scan", 1.0, seconds=min(c.wall for c in scan),
              note=f"(cpu {min(c.cpu for c in scan):.2f} s)")
    table.put("plain pyarrow scan", "tokens/s", tokens / min(c.wall for c in scan), unit="tokens/s")
    table.put("plain pyarrow scan", "spread over rounds", 100 * spread(scan), unit="%")
    cell = put_ratio(table, "parity analyze", "/ plain scan", runs["analyze"], scan)
    table.put("parity analyze", "tokens/s", tokens / cell.seconds, unit="tokens/s")
    table.put("parity analyze", "spread over rounds", 100 * spread(runs["analyze"]), unit="%")
    table.notes.append(
        "startup: the imports of parity analyze take {:.2f} s against {:.2f} s for import pyarrow.parquet".format(
            min(c.wall for c in runs["imports: parity analyze"]), min(c.wall for c in runs["imports: pyarrow"])))
    worst = max(spread(runs["scan"]), spread(runs["analyze"]))
    if worst > SPREAD_TOL:
        table.invalid = f"the rounds spread {100 * worst:.0f} % (> {100 * SPREAD_TOL:.0f} %): the machine's load moved"
    else:
        report.check(SPEED_TARGET, SPEED_LIMIT, f"{SPEED_TOKENS / 1e6:g}M tokens, K={K}", table.cells[("parity analyze", "/ plain scan")].value)
    report.derive(records_findings)


IMPORTS_ROW = "imports (with matplotlib)"
SPEED_ROW = f"speed file ({SPEED_TOKENS / 1e6:g}M tokens, 256-row row groups)"
ONE_ROW = f"one row group of {RSS_TOKENS / 1e6:g}M tokens, --batch-rows {{}}"


def put_peak(report: Any, row: str, kb: int) -> None:
    """A peak RSS (VmHWM, KB) into the memory table, and what it adds over the imports once they are known."""
    table = report.table("records-rss", RSS_TITLE, "process", RSS_INTRO, cols=["peak RSS", "over imports"])
    table.put(row, "peak RSS", kb / 1024, unit="MiB")
    base = table.cells.get((IMPORTS_ROW, "peak RSS"))
    if base is not None:
        for r in table.rows:
            if r != IMPORTS_ROW and (r, "peak RSS") in table.cells:
                table.put(r, "over imports", table.cells[(r, "peak RSS")].value - base.value, unit="MiB")
    report.derive(records_findings)


def record_jobs(report: Any, runs: dict[str, list[Child]], tokens: int) -> None:
    table = report.table("records-jobs", JOBS_TITLE, "command", JOBS_INTRO, cols=["/ --jobs 1", "tokens/s"])
    for name, got in runs.items():
        cell = put_ratio(table, f"parity analyze DIR {name}", "/ --jobs 1", got, runs["--jobs 1"])
        table.put(f"parity analyze DIR {name}", "tokens/s", tokens / cell.seconds, unit="tokens/s")
    report.derive(records_findings)


def records_findings(report: Any) -> list[str]:
    out = []
    t = report.tables.get("records")
    if t is not None and not t.invalid and ("parity analyze", "/ plain scan") in t.cells:
        a, s = t.cells[("parity analyze", "/ plain scan")], t.cells[("plain pyarrow scan", "/ plain scan")]
        out.append(f"parity analyze: {a.value:.2f}x a plain pyarrow scan end to end ({a.seconds:.2f} s against "
                   f"{s.seconds:.2f} s for {SPEED_TOKENS / 1e6:g}M tokens)")
    r = report.tables.get("records-rss")
    if r is not None:
        cells = {row: r.cells[(row, "peak RSS")].value for row in r.rows if (row, "peak RSS") in r.cells}
        if cells:
            out.append("records analysis peak RSS: " + ", ".join(f"{row} {v:,.0f} MiB" for row, v in cells.items()))
    j = report.tables.get("records-jobs")
    if j is not None and ("parity analyze DIR --jobs 2", "/ --jobs 1") in j.cells:
        c = j.cells[("parity analyze DIR --jobs 2", "/ --jobs 1")]
        out.append(f"parity analyze --jobs 2 over {SHARDS} shards: {c.value:.2f}x the time of --jobs 1 ({c.seconds:.2f} s)")
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.getbasetemp() / "records-bench"
    path.mkdir(exist_ok=True)
    return path


@pytest.mark.filterwarnings("ignore:Benchmark fixture was not used")
def test_records_analyze_against_a_plain_scan(bench_budget, bench_report, folder: Path) -> None:
    path = make_file(folder, SPEED_TOKENS)
    tokens = SPEED_TOKENS - SPEED_TOKENS % LENGTH  # whole sequences
    runs = measure_speed(path, folder / "out", tokens=tokens)
    report = json.loads((folder / "out" / "report.json").read_text())
    assert report["records"]["tokens"] == tokens and report["passed"], report["records"]
    record_speed(bench_report, runs, tokens)
    put_peak(bench_report, SPEED_ROW, min(c.hwm_kb or 0 for c in runs["analyze"]))


@pytest.mark.filterwarnings("ignore:Benchmark fixture was not used")
def test_records_analyze_peak_rss_one_row_group(bench_budget, bench_report, folder: Path) -> None:
    path = make_file(folder, RSS_TOKENS, one_row_group=True)
    put_peak(bench_report, IMPORTS_ROW, high_water_of(IMPORTS_WITH_PLOTS))
    for rows in (1024, 256):
        out = folder / f"out-rss-{rows}"
        child = command(["analyze", str(path), "--out", str(out), "--batch-rows", str(rows)])
        assert json.loads((out / "report.json").read_text())["records"]["tokens"] == RSS_TOKENS - RSS_TOKENS % LENGTH
        put_peak(bench_report, ONE_ROW.format(rows), child.hwm_kb or 0)
    t = bench_report.tables["records-rss"]
    if (SPEED_ROW, "peak RSS") in t.cells:  # the same batches (256 rows), one row group against 256-row ones
        bench_report.check(RSS_TARGET, None, "--batch-rows 256 (effective)",
                           t.cells[(ONE_ROW.format(256), "peak RSS")].value / t.cells[(SPEED_ROW, "peak RSS")].value)


@pytest.mark.filterwarnings("ignore:Benchmark fixture was not used")
def test_records_analyze_jobs(bench_budget, bench_report, folder: Path) -> None:
    shards = folder / "shards"
    shards.mkdir(exist_ok=True)
    one = make_file(folder, SHARD_TOKENS)  # written once: the shards are copies of it (same work per shard)
    for i in range(SHARDS):
        if not (shards / f"shard-{i}.parquet").exists():
            shutil.copyfile(one, shards / f"shard-{i}.parquet")
    argv = ["analyze", str(shards), "--out", str(folder / "out-jobs"), "--no-plots"]
    runs = rounds({f"--jobs {n}": (lambda n=n: command([*argv, "--jobs", str(n)])) for n in (1, 2)}, JOBS_ROUNDS)
    record_jobs(bench_report, runs, SHARDS * (SHARD_TOKENS - SHARD_TOKENS % LENGTH))
