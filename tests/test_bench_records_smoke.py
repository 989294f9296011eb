"""CI smoke test of the records benchmark (tests/bench/test_bench_records.py) on tiny files, nothing timed."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

BENCH = Path(__file__).parent / "bench"


def _load(name: str, filename: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_records_bench_code_runs_on_tiny_files(tmp_path: Path) -> None:
    lib = _load("parity_bench_conftest", "conftest.py")
    bench = _load("parity_bench_records", "test_bench_records.py")
    report = lib.BenchReport()
    tokens = 4096
    path = bench.make_file(tmp_path, tokens, k=8, vocab=512, length=64)
    runs = bench.measure_speed(path, tmp_path / "out", n=1, tokens=tokens)
    assert json.loads((tmp_path / "out" / "report.json").read_text())["records"]["tokens"] == tokens
    assert all(len(v) == 1 and v[0].wall > 0 and v[0].cpu > 0 for v in runs.values())
    bench.record_speed(report, runs, tokens)
    bench.put_peak(report, bench.SPEED_ROW, runs["analyze"][0].hwm_kb)
    one = bench.make_file(tmp_path, tokens, k=8, vocab=512, length=64, one_row_group=True, seed=1)
    assert pq.ParquetFile(one).metadata.num_row_groups == 1
    bench.put_peak(report, bench.IMPORTS_ROW, bench.high_water_of(bench.IMPORTS))
    child = bench.command(["analyze", str(one), "--out", str(tmp_path / "out1"), "--no-plots", "--batch-rows", "16"])
    assert child.hwm_kb > 0
    bench.put_peak(report, bench.ONE_ROW.format(16), child.hwm_kb)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        bench.make_file(shards, 1024, k=4, vocab=256, length=32, seed=i)
    argv = ["analyze", str(shards), "--out", str(tmp_path / "out-jobs"), "--no-plots"]
    jobs = bench.rounds({f"--jobs {n}": (lambda n=n: bench.command([*argv, "--jobs", str(n)])) for n in (1, 2)}, 1)
    bench.record_jobs(report, jobs, 2048)
    md, _ = lib.write_outputs(report, tmp_path / "bench", env={"machine": "smoke"})
    text = md.read_text()
    for title in (bench.TITLE, bench.RSS_TITLE, bench.JOBS_TITLE):
        assert title in text
    assert "parity analyze: " in text and "peak RSS" in text and "--jobs 2" in text
