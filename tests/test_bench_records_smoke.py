"""CI smoke test of the records benchmark (tests/bench/test_bench_records.py) on a tiny file, nothing timed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).parent / "bench"


def _load(name: str, filename: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH / filename)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_records_bench_code_runs_on_a_tiny_file(tmp_path: Path) -> None:
    lib = _load("parity_bench_conftest", "conftest.py")
    bench = _load("parity_bench_records", "test_bench_records.py")
    report = lib.BenchReport()
    for row, tokens in zip(bench.SIZES, (2048, 8192), strict=True):
        path = bench.make_file(tmp_path, tokens, k=8, vocab=512, length=64)
        pair = lib.paired_plain(lambda p=path: bench.analyse(p), lambda p=path: bench.read_only(p), collect=False)
        summary = pair.result
        assert summary.tokens == tokens
        (acc,) = summary.groups.values()
        assert acc.captured == tokens and acc.sampled_outside == 0 and acc.mass_off == 0  # the synthetic data is sound
        mem = bench.peak_rss(path, timeout_s=300)
        assert mem["tokens"] == tokens and mem["peak_kb"] >= mem["base_kb"] > 0
        bench.record(report, row, pair, summary.tokens, mem)
    md, _ = lib.write_outputs(report, tmp_path / "out", env={"machine": "smoke"})
    text = md.read_text()
    assert bench.TITLE in text and "peak RSS" in text and bench.RSS_TARGET in text
