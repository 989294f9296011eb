"""Vocabulary-parallel estimators on 1, 2 and 4 shards: wall time and bytes moved per token.

One 4-rank pool serves all shard counts (jobs on fewer shards run on a subgroup of its first ranks).
The unsharded estimators are timed in the same run so the printed ratios compare like with like; no
timing is asserted. The bytes-per-token table is printed after the last case (``nox -s bench``).

Bytes are per token and per rank: ``payload`` is what a rank contributes to collectives, ``wire`` what
it sends under ring all-reduce / all-gather. The last column is a whole float32 row (4 V bytes), what
gathering the logits would cost.
"""

from __future__ import annotations

import time

import pytest
import torch

from parity.core import estimators as E
from parity.core.estimators import mask_to_ids
from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec
from parity.distributed.pool import VocabParallelPool
from parity.distributed.sharded import ESTIMATORS, check_parity

N, V = 32, 32000
SHARDS = (1, 2, 4)
WORKLOADS = {
    "top_k=50 top_p=0.9": (SamplingSpec(0.8, top_k=50, top_p=0.9), {}),
    "top_p=0.9 alone": (SamplingSpec(0.8, top_p=0.9), {}),
    "top_p=0.9 alone, band_policy=flag": (SamplingSpec(0.8, top_p=0.9), {"band_policy": "flag"}),
}
_RESULTS: dict[tuple[str, int], dict] = {}


@pytest.fixture(scope="module")
def pool4(request):
    if request.config.getoption("benchmark_disable", False):
        pytest.skip("benchmark only (nox -s bench); tests/parallel covers correctness")
    pool = VocabParallelPool(4, timeout_s=300)
    yield pool
    pool.close()


def _workload(spec: SamplingSpec):
    g = torch.Generator().manual_seed(0)
    # LM-like rows: a heavy head over a wide tail.
    logits = torch.randn(N, V, generator=g) * 2.0
    logits[:, :20] += torch.rand(N, 20, generator=g) * 10
    logits = logits[:, torch.randperm(V, generator=g)].contiguous()
    ref = reference_filter(logits, spec)
    sampled = torch.multinomial(ref.logprobs.exp(), 1, generator=g).squeeze(1)
    return logits, sampled, mask_to_ids(ref.kept)


def _unsharded_seconds(logits, sampled, spec, ids) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        E.full(logits, sampled, spec)
        E.replay(logits, sampled, ids, spec)
        E.recompute(logits, sampled, spec)
        E.predicted_log_s(logits, ids, spec)
        best = min(best, time.perf_counter() - t0)
    return best


def _cell(b: dict) -> str:
    return f"{b['payload']:>14.1f} / {b['wire']:>9.1f}"


def _print_table(capsys) -> None:
    lines = [f"\nbytes moved per token per rank (N={N}, V={V}; float32 full row = {4 * V} B)"]
    for wl in WORKLOADS:
        lines.append(f"\n{wl}")
        head = f"{'estimator':<16}" + "".join(f"{f'{s} shard(s) payload/wire':>28}" for s in SHARDS)
        lines.append(head)
        for est in ESTIMATORS:
            cells = [_cell(_RESULTS[(wl, s)]["bytes"][est]) for s in SHARDS]
            lines.append(f"{est:<16}" + "".join(f"{c:>28}" for c in cells))
        zero = {"payload": 0.0, "wire": 0.0}
        fbb = [_RESULTS[(wl, s)]["detail"].get("recompute/fallback", zero) for s in SHARDS]
        lines.append(f"{'  of which O(V)':<16}" + "".join(f"{_cell(b):>28}" for b in fbb))
        fb = [f"{_RESULTS[(wl, s)]['fallback_rows']} / {_RESULTS[(wl, s)]['ambiguous_rows']}" for s in SHARDS]
        ratio = [_RESULTS[(wl, s)]["ratio"] for s in SHARDS]
        lines.append(f"{'fallback/ambig.':<16}" + "".join(f"{f:>28}" for f in fb))
        eq = [_RESULTS[(wl, s)]["support_equal"] for s in SHARDS]
        lines.append(f"{'kept == ref':<16}" + "".join(f"{e:>28.3f}" for e in eq))
        lines.append(f"{'time / unsharded':<16}" + "".join(f"{r:>28.2f}" for r in ratio))
    with capsys.disabled():
        print("\n".join(lines))


@pytest.mark.parametrize("shards", SHARDS)
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_bench_vocab_parallel(benchmark, pool4, capsys, workload, shards):
    if benchmark.disabled:
        pytest.skip("benchmark only (nox -s bench); tests/parallel covers correctness")
    spec, options = WORKLOADS[workload]
    logits, sampled, ids = _workload(spec)
    base = _unsharded_seconds(logits, sampled, spec, ids)
    res = benchmark.pedantic(
        pool4.run,
        args=(logits, sampled, spec, ids),
        kwargs={"shards": shards, **options},
        rounds=3,
        iterations=1,
        warmup_rounds=1,
    )
    rep = check_parity(res, logits, sampled, spec, ids)
    assert rep.passed, rep.violations
    ratio = benchmark.stats.stats.min / base
    _RESULTS[(workload, shards)] = {
        "bytes": res["bytes_per_token"],
        "detail": res["bytes_detail"],
        "fallback_rows": rep.fallback_rows,
        "ambiguous_rows": int(res["recompute_ambiguous"].sum()),
        "ratio": ratio,
        "support_equal": rep.support_equal_frac,
    }
    benchmark.extra_info.update(
        bytes_per_token=res["bytes_per_token"],
        unsharded_s=base,
        ratio_to_unsharded=ratio,
        fallback_rows=rep.fallback_rows,
        max_abs_diff=rep.max_abs_diff,
    )
    if len(_RESULTS) == len(WORKLOADS) * len(SHARDS):
        _print_table(capsys)
