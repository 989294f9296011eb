"""Records analysis (``parity analyze``): tokens per second and peak memory on a synthetic file.

A 1M-token file with K=64 kept ids per position (256-token sequences, spec T=0.8 top_k=64, trainer
full/replay/log S columns), and a file four times its size drawn the same way (4M tokens). The analysis streams
record batches, so its peak RSS should stay flat from the 1x to the 4x file; the time grows with the
tokens. Timed in-process (``timer``, paired with a plain pyarrow read of the same file as baseline:
the ratio is what the analysis adds to decoding Parquet); peak RSS is read in a fresh process per file
(a high-water mark, so one process cannot measure two files: VmHWM of the child's own image, since
``ru_maxrss`` survives exec and starts at the parent's RSS), next to the same mark right after its
imports. Reported, never gated.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SIZES = {"1M tokens": 1_000_000, "4M tokens": 4_000_000}
K = 64
TITLE = "Records analysis (parity analyze)"
INTRO = (
    f"Synthetic records, K={K} kept ids per position, 256-token sequences, one worker; baseline: pyarrow "
    "reading the same row groups. Peak RSS from a fresh process per file."
)
RSS_TARGET = "records analysis peak RSS: 4x file / 1x file (flat = 1)"

CHILD = """
import json, resource, sys, time
from pathlib import Path


def high_water_kb():
    # VmHWM belongs to this process image; ru_maxrss is not reset by exec and starts at the parent's RSS.
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


from parity.analyze import summarize_paths
from parity.records.analyze import Options

base = high_water_kb()
t0 = time.perf_counter()
s = summarize_paths([Path(sys.argv[1])], Options())
dt = time.perf_counter() - t0
print(json.dumps({"base_kb": base, "peak_kb": high_water_kb(), "seconds": dt, "tokens": s.tokens}))
"""


def make_file(folder: Path, tokens: int, *, k: int = K, vocab: int = 32_768, length: int = 256) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import records_synth

    path = folder / f"records-{tokens}-k{k}.parquet"
    if not path.exists():
        records_synth.write_file(path, tokens, k=k, vocab=vocab, length=length)
    return path


def analyse(path: Path) -> Any:
    from parity.analyze import summarize_paths
    from parity.records.analyze import Options

    return summarize_paths([path], Options())


def read_only(path: Path) -> int:
    import pyarrow.parquet as pq

    rows = 0
    for b in pq.ParquetFile(path).iter_batches(batch_size=1024):
        rows += b.num_rows
    return rows


def peak_rss(path: Path, timeout_s: float = 1200.0) -> dict[str, Any]:
    """Peak RSS of a fresh process that analyses ``path`` (and its RSS after imports)."""
    root = Path(__file__).resolve().parents[2]
    env_path = str(root)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "PYTHONPATH": env_path},
    )
    if proc.returncode != 0:
        raise RuntimeError(f"analysis child failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def record(report: Any, row: str, pair: Any, tokens: int, mem: dict[str, Any]) -> None:
    table = report.table("records", TITLE, "file", INTRO, cols=["analysis / read", "tokens/s", "peak RSS", "RSS over imports"])
    table.put_pair(row, "analysis / read", pair)
    table.put(row, "tokens/s", tokens / pair.seconds, unit="tokens/s", seconds=pair.seconds)
    table.put(row, "peak RSS", mem["peak_kb"] / 1024, unit="MiB")
    table.put(row, "RSS over imports", (mem["peak_kb"] - mem["base_kb"]) / 1024, unit="MiB")
    rss = [table.cells[(r, "peak RSS")].value for r in SIZES if (r, "peak RSS") in table.cells]
    if len(rss) == 2:
        report.check(RSS_TARGET, None, "peak RSS", rss[1] / rss[0])
    report.derive(records_findings)


def records_findings(report: Any) -> list[str]:
    t = report.tables.get("records")
    if t is None:
        return []
    rows = [r for r in SIZES if (r, "peak RSS") in t.cells]
    if len(rows) < 2:
        return []
    a, b = (t.cells[(r, "peak RSS")].value for r in rows)
    return [f"records analysis: peak RSS {a:,.0f} MiB at 1M tokens, {b:,.0f} MiB at 4M tokens ({b / a:.2f}x for 4x the data)"]


@pytest.mark.parametrize("size", list(SIZES))
def test_records_analysis(size: str, timer, bench_report, tmp_path_factory) -> None:
    folder = tmp_path_factory.getbasetemp() / "records-bench"
    folder.mkdir(exist_ok=True)
    tokens = SIZES[size]
    path = make_file(folder, tokens)
    pair = timer(lambda: analyse(path), lambda: read_only(path), rounds=2, warmup_rounds=0)
    summary = pair.result
    assert summary.tokens == tokens - tokens % 256  # whole sequences
    mem = peak_rss(path)
    record(bench_report, size, pair, summary.tokens, mem)
