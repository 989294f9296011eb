"""Trainer-side cost on synthetic logits ``[T, V]``: full log-softmax vs replay vs recompute.

Every estimator is timed against ``full`` (the full-vocabulary ``log_softmax(z / T)[y]`` most trainers
run), interleaved round by round (conftest.paired; wall-clock ratio, the CPU-time ratio beside it); the
``full`` row is full against itself, the noise floor of the ratios. Rows:

* replay: gather the K captured ids + logsumexp (``estimators.replay`` on padded ids ``[T, K]``);
* recompute, every filter combination (temperature 0.8 throughout): with top_k, rows are filtered over
  ``topk(k)`` candidates (top_k + top_p is vLLM's sort path, top_k alone or with min_p its top-k-only
  path); rows a candidate list cannot decide exactly are sorted by the reference, their count is in the
  cell ("fallback n/T"). Without top_k, rows take the reference filter: top_p sorts the whole row, as
  vLLM's sampler does, and min_p alone applies vLLM's min_p rule to the whole row;
* recompute through the reference sort with top_k + top_p: the same kept set from ``reference_filter``
  (a full-row sort, what the candidate path saves), for scale;
* parts: what a combination pays before its own work starts (z / T and ``topk``, z / T and vLLM's min_p
  rule).

Shapes on CPU: T=512 at V=32000 and V=152064 (a ratio barely moves with T; T=4096 and T=1024 cost three
of the session's minutes). At V=152064 the CPU runs full, replay and the recompute rows with top_k
(the two targets); the rows that work on whole rows without top_k (the sorts, min_p alone), the parts
and the preallocated full (the allocator check) run at V=32000 (up to 40 s a row at V=152064, linear
in V). On CUDA: T in {512, 4096} x V in {32000, 152064}, every row. Each run also checks what it timed: recompute's kept set equals
``reference_filter``'s on the same logits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from parity.core import estimators as E
from parity.core.filters import check_logits, min_p_mask, reference_filter
from parity.core.spec import SamplingSpec

S = SamplingSpec
TOP_K = 50
SPEC = S(0.8, top_k=TOP_K, top_p=0.9)  # the replay workload's kept set; full and replay run with it
SHAPES = [(512, 32000), (512, 152064)]
CPU_WIDE_V = 100_000  # at or above this vocabulary, the CPU runs only the rows of cpu_wide_row
GPU_SHAPES = [(512, 32000), (4096, 32000), (512, 152064), (4096, 152064)]

# id -> (row label, kind, spec)
ESTIMATORS: dict[str, tuple[str, str, SamplingSpec]] = {
    "full": ("full (noise floor)", "full", SPEC),
    "full-warm": ("full, outputs preallocated (no page faults)", "full-warm", SPEC),
    "replay": ("replay (K captured ids)", "replay", SPEC),
    "recompute-k-p": (f"recompute top_k={TOP_K} top_p=0.9", "recompute", SPEC),
    "recompute-k": (f"recompute top_k={TOP_K}", "recompute", S(0.8, top_k=TOP_K)),
    "recompute-k-p-minp": (f"recompute top_k={TOP_K} top_p=0.9 min_p=0.05", "recompute", S(0.8, top_k=TOP_K, top_p=0.9, min_p=0.05)),
    "recompute-k-minp": (f"recompute top_k={TOP_K} min_p=0.05", "recompute", S(0.8, top_k=TOP_K, min_p=0.05)),
    "recompute-p": ("recompute top_p=0.9 (reference sort)", "recompute", S(0.8, top_p=0.9)),
    "recompute-p-minp": ("recompute top_p=0.9 min_p=0.05 (reference sort)", "recompute", S(0.8, top_p=0.9, min_p=0.05)),
    "recompute-minp": ("recompute min_p=0.05", "recompute", S(0.8, min_p=0.05)),
    "part-topk": (f"part: z / T and topk({TOP_K + 1}), what every top_k row pays", "part-topk", SPEC),
    "part-minp": ("part: z / T and vLLM's min_p rule on whole rows (min_p_mask)", "part-minp", S(0.8, min_p=0.05)),
    "reference-sort-k-p": (f"recompute top_k={TOP_K} top_p=0.9 via reference sort", "reference", SPEC),
}
ROUNDS, WARMUP = 3, 1  # fast rows; the multi-second sort rows run one round, no warm-up
REPLAY_ROUNDS = 20
FLOOR_TOL = 0.05  # the noise floor (full against full) is expected within 1 +- this
SORT_MAX_T = 512  # on CPU the full-row sort rows run at this T only (their cost is linear in T)
REPLAY_TARGET = ("replay <= 0.05x full at V=152k", 0.05)
RECOMPUTE_TARGET = ("recompute <= 2x full, every filter combination with top_k", 2.0)
TITLE = "Trainer side: ratio to the full-vocabulary log-softmax + gather (float32, CPU)"
INTRO = (
    f"Synthetic LM-like logits; replay reads the captured kept ids of top_k={TOP_K}, top_p=0.9 "
    "(K = widest kept set of the batch). At V=152064 only full, replay and recompute with top_k run on CPU. "
    "Freed memory is kept for reuse while this table is measured (glibc mallopt: M_MMAP_MAX=0, "
    "M_TRIM_THRESHOLD off), as a GPU caching allocator or a loop that reuses its buffers would: otherwise "
    "every [T, V] buffer is mapped and faulted in anew, which cost about three quarters of full's time "
    "and came and went between calls. The preallocated-full row checks that it held."
)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc mallopt parameters
GLIBC_DEFAULTS = {M_TRIM_THRESHOLD: 128 * 1024, M_MMAP_MAX: 65536}
ALLOCATOR: dict[str, str] = {}  # "regime": how this table's allocations were served


@pytest.fixture(scope="module", autouse=True)
def reused_buffers() -> Iterator[None]:
    """Serve large allocations from the heap and keep what is freed (glibc), for this module's tables."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    ok = libc is not None and hasattr(libc, "mallopt")
    if ok:
        assert libc is not None
        ok = bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
    ALLOCATOR["regime"] = "freed memory kept (mallopt)" if ok else "the allocator's default (mallopt unavailable)"
    try:
        yield
    finally:
        if ok:
            assert libc is not None
            for param, value in GLIBC_DEFAULTS.items():
                libc.mallopt(param, value)
            libc.malloc_trim(0)


def shape_label(t: int, v: int) -> str:
    return f"T={t} V={v}"


def shape_id(t: int, v: int) -> str:
    return f"T{t}xV{v}"


def cpu_wide_row(name: str) -> bool:
    """The rows the CPU runs at V >= CPU_WIDE_V: full, replay and recompute with top_k (the targets' rows)."""
    _, kind, spec = ESTIMATORS[name]
    return kind in ("full", "replay") or (kind == "recompute" and bool(spec.top_k))


def sort_based(name: str) -> bool:
    """The rows that sort whole rows: the reference sort, and recompute with top_p but no top_k."""
    _, kind, spec = ESTIMATORS[name]
    return kind == "reference" or (kind == "recompute" and spec.uses_top_p and not spec.top_k)


def make_workload(t: int, v: int, *, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """LM-like logits (a heavy head over a wide tail), ids sampled inside SPEC's kept set, kept ids."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(t, v, generator=g, device=device) * 2.0
    head = min(20, v)
    logits[:, :head] += torch.rand(t, head, generator=g, device=device) * 10
    logits = logits[:, torch.randperm(v, generator=g, device=device)].contiguous()
    kept = E.recompute(logits, torch.zeros(t, dtype=torch.long, device=device), SPEC).kept
    sampled = torch.multinomial(kept.float(), 1, generator=g).squeeze(1)
    # Padded kept ids [T, K] (-1 = padding), what capture hands the trainer; topk on the mask is O(V)
    # per row where mask_to_ids sorts the whole row (seconds at V = 152k).
    counts = kept.sum(dim=1)
    ids = kept.to(torch.int8).topk(int(counts.max()), dim=1).indices
    ids = torch.where(torch.arange(ids.shape[1], device=device) < counts.unsqueeze(1), ids, -1)
    return {"logits": logits, "sampled": sampled, "ids": ids}


_CACHE: dict[tuple[int, int, str], dict[str, torch.Tensor]] = {}


def workload(t: int, v: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One shape in memory at a time (cases are ordered shape by shape)."""
    key = (t, v, device)
    if key not in _CACHE:
        _CACHE.clear()
        gc.collect()
        _CACHE[key] = make_workload(t, v, device=device)
    return _CACHE[key]


def estimator_fn(kind: str, spec: SamplingSpec, w: dict[str, torch.Tensor]) -> Callable[[], Any]:
    z, y, ids = w["logits"], w["sampled"], w["ids"]
    if kind == "full":
        return lambda: E.full(z, y, spec)
    if kind == "full-warm":  # the same ops as E.full, into buffers allocated once
        scaled, logp = torch.empty_like(z), torch.empty_like(z)

        def warm() -> torch.Tensor:
            check_logits(z)
            torch.div(z, spec.temperature, out=scaled)
            torch.ops.aten._log_softmax.out(scaled, 1, False, out=logp)
            return logp.gather(1, y.unsqueeze(1)).squeeze(1)

        return warm
    if kind == "replay":
        return lambda: E.replay(z, y, ids, spec)
    if kind == "recompute":
        return lambda: E.recompute(z, y, spec)
    if kind == "part-topk":
        return lambda: E.scale(z, spec).topk(TOP_K + 1, dim=1)
    if kind == "part-minp":
        mp = torch.full((z.shape[0],), spec.min_p, device=z.device)
        return lambda: min_p_mask(E.scale(z, spec), mp)
    if kind == "reference":
        return lambda: E._recompute_reference(z, y, spec)
    raise ValueError(f"unknown estimator kind {kind!r}")


def check_result(name: str, result: Any, w: dict[str, torch.Tensor]) -> None:
    """What was timed must be right (correctness, not timing)."""
    label, kind, spec = ESTIMATORS[name]
    if kind in ("recompute", "reference"):
        want = reference_filter(w["logits"], spec).kept
        assert torch.equal(result.kept, want), f"{label}: kept set differs from reference_filter"
        assert bool(torch.isfinite(result.logprobs).all()), f"{label}: non-finite log-probs"
    elif kind == "replay":
        assert int(result.outside.sum()) == 0, f"{label}: sampled ids outside the kept ids"
    elif kind == "part-topk":  # the candidates start at the row max
        assert torch.equal(result.values[:, 0], E.scale(w["logits"], spec).amax(dim=1)), f"{label}: not the row max first"
    elif kind == "part-minp":  # min_p never drops a row's max
        top = E.scale(w["logits"], spec).argmax(dim=1, keepdim=True)
        assert not bool(result.gather(1, top).any()), f"{label}: dropped a row's max"
    elif kind == "full-warm":
        assert torch.equal(result, E.full(w["logits"], w["sampled"], spec)), f"{label}: not full's log-probs"


def run_case(
    report: Any,
    timer: Callable[..., Any],
    name: str,
    t: int,
    v: int,
    *,
    device: str = "cpu",
    sync: Callable[[], None] | None = None,
    table_key: str = "trainer",
    title: str = TITLE,
    targets: bool = True,
) -> Any:
    """Time estimator ``name`` (an ESTIMATORS id) at one shape against full; check it; report the ratio."""
    label, kind, spec = ESTIMATORS[name]
    slow = sort_based(name)
    col = shape_label(t, v)
    table = report.table(
        table_key,
        title,
        "estimator",
        INTRO,
        rows=[label for label, _, _ in ESTIMATORS.values()],
        cols=[shape_label(*s) for s in (SHAPES if device == "cpu" else GPU_SHAPES)],
    )
    if slow and device == "cpu" and t > SORT_MAX_T:
        why = (
            f"full-row sort rows run at T={SORT_MAX_T} only on CPU: seconds to tens of seconds per round, "
            "linear in T (keeps nox -s bench under 5 minutes)"
        )
        table.skip(label, col, why)
        pytest.skip(why)
    if device == "cpu" and v >= CPU_WIDE_V and not cpu_wide_row(name):
        why = (
            f"rows without top_k (whole-row sorts, min_p alone), the parts and preallocated full run at V=32000 on CPU: "
            f"up to 40 s a row at V={v}, linear in V (keeps nox -s bench under 5 minutes)"
        )
        table.skip(label, col, why)
        pytest.skip(why)
    w = workload(t, v, device)
    fast = kind == "replay"  # milliseconds: many rounds of it, the usual few of the baseline
    pair = timer(
        estimator_fn(kind, spec, w),
        estimator_fn("full", SPEC, w),
        rounds=1 if slow else REPLAY_ROUNDS if fast else ROUNDS,
        warmup_rounds=0 if slow else WARMUP,
        sync=sync,
        baseline_rounds=ROUNDS if fast else None,
    )
    check_result(name, pair.result, w)
    notes = ["(1 round)"] if slow else []
    if kind == "recompute" and spec.top_k:
        notes.append(f"fallback {0 if pair.result.fallback is None else int(pair.result.fallback.sum())}/{t}")
    pair.result = None  # recompute's kept mask is [T, V]: do not keep it alive
    table.put_pair(label, col, pair, note=" ".join(notes))
    if targets and kind == "replay" and v >= 100_000:
        report.check(*REPLAY_TARGET, col, pair.ratio)
    if targets and kind == "recompute" and spec.top_k:
        report.check(*RECOMPUTE_TARGET, f"{label.removeprefix('recompute ')} @ {col}", pair.ratio)
    return pair


def trainer_findings(report: Any) -> list[str]:
    """Findings read off the trainer table: what the candidate bound saved, and what each row pays."""
    table = report.tables.get("trainer")
    if table is None:
        return []

    def cell(key: str, col: str) -> Any:
        c = table.cells.get((ESTIMATORS[key][0], col))
        return None if c is None or isinstance(c, str) else c

    def ratio(key: str, col: str) -> float | None:
        c = cell(key, col)
        return None if c is None else c.value

    lines = []
    for col in table.cols:
        warm = ratio("full-warm", col)
        if warm is not None and warm >= 0.8:
            c = cell("full-warm", col)
            lines.append(
                f"{col}: full with its outputs preallocated costs {warm:.2f}x full ({_secs(c.seconds)} against "
                f"{_secs(c.baseline_seconds)}): allocation adds next to nothing here "
                f"({ALLOCATOR.get('regime', '?')}), so the ratios compare computation"
            )
        elif warm is not None:
            c = cell("full-warm", col)
            lines.append(
                f"{col}: full with its two [T, V] outputs preallocated costs {warm:.2f}x full "
                f"({_secs(c.seconds)} against {_secs(c.baseline_seconds)}): {100 * (1 - warm):.0f} % of full's time is "
                "the allocator's fresh pages (glibc maps each buffer this large anew). A trainer that reuses its "
                "buffers, or a GPU caching allocator, sees the smaller figure: divide a ratio by "
                f"{warm:.2f} to read it against that"
            )
        fast, ref, alone, rep = (ratio(k, col) for k in ("recompute-k-p", "reference-sort-k-p", "recompute-p", "replay"))
        if fast is not None and ref is not None:
            lines.append(
                f"{col}: recompute with top_k={TOP_K} top_p=0.9 costs {fast:.2f}x full over topk candidates "
                f"against {ref:.1f}x through the reference full-row sort ({ref / fast:.0f}x less)"
            )
        if alone is not None:
            lines.append(
                f"{col}: recompute with top_p alone costs {alone:.2f}x full: without top_k the whole row is sorted, "
                "as vLLM's sampler sorts it for top_p"
            )
        floor = ratio("full", col)
        if floor is not None and abs(floor - 1) > FLOOR_TOL:
            lines.append(
                f"{col}: the noise floor (full against full) read {floor:.2f}x, outside 1 +- {FLOOR_TOL}: this "
                "column's ratios are uncertain by about that much"
            )
        over = [
            (k, r) for k in ESTIMATORS if ESTIMATORS[k][1] == "recompute" and not sort_based(k)
            and (r := ratio(k, col)) is not None and r > RECOMPUTE_TARGET[1]
        ]
        parts = {k: ratio(k, col) for k in ("part-topk", "part-minp")}
        for k, r in over:
            spec = ESTIMATORS[k][2]
            part = "part-topk" if spec.top_k else "part-minp" if spec.uses_min_p else None
            if part is not None and parts[part] is not None:
                what = f"topk({TOP_K + 1}) over each row" if part == "part-topk" else "vLLM's min_p rule over each whole row"
                lines.append(
                    f"{col}: why {ESTIMATORS[k][0].removeprefix('recompute ')} is over {RECOMPUTE_TARGET[1]:g}x "
                    f"({r:.2f}x): {what} alone, with z / T, costs {parts[part]:.2f}x full (measured above), "
                    f"{100 * parts[part] / r:.0f} % of it; it is torch's own kernel, and the exact kept set "
                    "needs that pass before anything else"
                )
        if rep is not None:
            k = table.cells[(ESTIMATORS["replay"][0], col)]
            lines.append(f"{col}: replay costs {rep:.3f}x full ({_secs(k.seconds)} against {_secs(k.baseline_seconds)})")
    return lines


def _secs(s: float | None) -> str:
    return "?" if s is None else (f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s")


CASES = [(shape, name) for shape in SHAPES for name in ESTIMATORS]


@pytest.mark.parametrize(("shape", "name"), CASES, ids=[f"{shape_id(*s)}-{n}" for s, n in CASES])
def test_bench_trainer(timer, bench_report, shape, name) -> None:
    bench_report.derive(trainer_findings)
    run_case(bench_report, timer, name, *shape)


GPU_CASES = [(shape, name) for shape in GPU_SHAPES for name in ESTIMATORS]


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "name"), GPU_CASES, ids=[f"{shape_id(*s)}-{n}" for s, n in GPU_CASES])
def test_bench_trainer_cuda(timer, bench_report, shape, name) -> None:
    """CUDA-synchronized: ``torch.cuda.synchronize`` closes every timed interval (kernels are async)."""
    run_case(
        bench_report,
        timer,
        name,
        *shape,
        device="cuda",
        sync=torch.cuda.synchronize,
        table_key="trainer-cuda",
        title="Trainer side on CUDA: ratio to the full-vocabulary log-softmax + gather (float32, synchronized)",
        targets=False,
    )
