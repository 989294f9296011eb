"""Mutation score of the engine-free core and the gates: mutmut, module by module, against the fast unit tests.

    python ci/mutation.py                                  # what `nox -s mutation` runs
    python ci/mutation.py --modules gates,spec             # a part
    python ci/mutation.py --modules judge.verdict,gates  # the gates and their thresholds
    python ci/mutation.py --reuse                          # keep mutants/ from the last run (faster locally)
    python ci/mutation.py --sample tenth                   # a tenth of every module's mutants (quick look)

mutmut (configured under ``[tool.mutmut]`` in pyproject.toml) copies parity/ and tests/ into mutants/,
with the checkout files the tests read (``also_copy``: README.md, fixtures/), writes every mutant of the
listed modules into that copy, records which unit test reaches which function, then runs each selected
mutant against only the tests that reach it. A mutant is *killed* when a test fails, *survived* when
every test still passes: a change to the core that no fast test notices.

Each module is its own ``mutmut run`` (sharded: one module at a time, ``--max-children`` workers), with
a wall-clock limit per module; a module cut by its limit keeps the verdicts it reached and is marked
partial. A module is one of parity/core (``gates``) or, named with its package, elsewhere in parity/
(``judge.verdict``); it runs a selection (``MODULES``): fnmatch patterns on its function names and a
sample on the mutant numbers. The gates are computed in judge/verdict.py, which holds the whole
records pipeline besides: only the gate functions' mutants run there (evaluate_summary, trend_violation,
_over, _scaled; ~530 mutants), on the fixed sample of mutants whose number ends in an even digit (about
half of every function's), as for the largest module (token_table.py, ~1100 mutants). Measured on two shared
cores: judge.verdict and gates together 16 minutes (judge.verdict 13.5, with mutmut's generation and
test statistics); ``--budget-s`` bounds the whole run, the gated modules first.

Score per module: killed / (killed + survived); timeouts, "no tests" and unchecked mutants are counted
and listed, never folded into the score. The table goes to stdout and to ``--out`` (score.md,
score.json, survivors.txt with one surviving mutant name a line: ``mutmut show NAME`` prints its diff).
The exit code is non-zero when a gated module scores below ``--fail-under``.

What survives is mostly equivalent: a change no test on this machine can observe. The classes seen,
left in the count rather than hidden:

* ``device=`` dropped or set to ``None``: the fast tests run on CPU, where every tensor is on the CPU;
* ``dtype=`` dropped where torch infers the same dtype (an int fill is long, a bool list is bool);
* ``dim=-1`` turned into ``dim=+1`` on a tensor that is 2-D by contract;
* padding ``-1`` turned into ``-2`` (any negative id is padding), or a pad value that is masked later;
* a fallback to the reference filter taken more often (the reference is exact, only slower);
* in the gates, a default that no report of ``_scenario_report`` reaches: the mean bias of a stream
  without tokens (its mean stays 0.0 until a token comes), the mean |diff| of the trend's first step
  outside the band (always one of ``per_step``'s steps).

Lines whose every mutant is equivalent carry ``# pragma: no mutate`` with the reason beside them.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# mutmut names a mutant ``<dotted module>.<mangled function>__mutmut_<n>``, n counting from 1 within
# each function; a module-level function ``f`` is mangled ``x_f`` (a method ``m`` of class ``C``:
# ``xǁCǁm``). A module key is its dotted name under parity/core (``gates``) or under parity/ when it
# holds a dot (``judge.verdict``). Each module runs a selection: fnmatch patterns on the mangled
# function names, and a sample on the mutant numbers.
SAMPLES = {"all": "*", "even": "*[02468]", "tenth": "*0"}


@dataclass(frozen=True)
class Selection:
    functions: tuple[str, ...] = ("*",)  # patterns on the mangled function name
    sample: str = "all"  # a key of SAMPLES

    def patterns(self, module: str) -> list[str]:
        """The mutant-name patterns ``mutmut run`` gets for ``module``."""
        if self.functions == ("*",) and self.sample == "all":
            # The pattern also matches the module's function names: mutmut's clean run takes only their tests.
            return [f"{dotted(module)}.*"]
        return [f"{dotted(module)}.{f}__mutmut_{SAMPLES[self.sample]}" for f in self.functions]

    def describe(self) -> str:
        if self.functions == ("*",):
            return self.sample
        names = ", ".join(f.removeprefix("x_") for f in self.functions)
        return names if self.sample == "all" else f"{names} ({self.sample})"


def dotted(module: str) -> str:
    return f"parity.{module}" if "." in module else f"parity.core.{module}"


def source(module: str) -> str:
    """The module's file, relative to the checkout (as in ``only_mutate``)."""
    return dotted(module).replace(".", "/") + ".py"


def label(module: str) -> str:
    """The module's file as the table names it: under parity/core by its name, else from parity/."""
    return source(module).removeprefix("parity/core/").removeprefix("parity/")


# judge/verdict.py holds the report entries and the gates; the gates are what is run: evaluate_summary,
# trend_violation and their helpers (finalize, which only collects their verdict, is reached by the
# whole-pipeline tests alone: seconds per mutant, and no pin of its own).
GATE_FUNCTIONS = ("x_evaluate_summary", "x_trend_violation", "x__over", "x__scaled")
MODULES: dict[str, Selection] = {
    "capture": Selection(),
    "capture_plan": Selection(),
    "support": Selection(),
    "gates": Selection(),
    "judge.verdict": Selection(GATE_FUNCTIONS, sample="even"),
    "estimators": Selection(),
    "spec": Selection(),
    "metrics": Selection(),
    "error_model": Selection(),
    "log_s": Selection(),
    "violation": Selection(),
    "token_table": Selection(sample="even"),
}
# Modules whose score gates the run (the others are reported); MODULES lists them first, so that the
# budget cuts only reported modules.
GATED = ("capture", "capture_plan", "support", "gates", "judge.verdict", "estimators", "spec", "metrics")

# mutmut's exit-code classes (mutmut/stats.py status_by_exit_code), read here so that a mutmut that is
# not importable (the table of an earlier run) still renders.
KILLED = {1, 3, 37}
SURVIVED = {0}
TIMEOUT = {36, -24, 24, 152, 255}
NO_TESTS = {5, 33}


@dataclass
class Score:
    module: str
    selection: Selection
    mutants: int = 0  # generated for the module
    selected: int = 0  # matched by the selection's patterns
    killed: int = 0
    survived: int = 0
    timeout: int = 0
    no_tests: int = 0
    other: int = 0  # suspicious, segfault, interrupted
    unchecked: int = 0
    seconds: float = 0.0
    partial: bool = False
    survivors: list[str] = field(default_factory=list)

    @property
    def score(self) -> float | None:
        n = self.killed + self.survived
        return self.killed / n if n else None


def classify(module: str, selection: Selection, meta: dict[str, Any]) -> Score:
    s = Score(module, selection)
    codes: dict[str, int | None] = meta.get("exit_code_by_key", {})
    s.mutants = len(codes)
    patterns = selection.patterns(module)
    for name, code in sorted(codes.items()):
        if not any(fnmatch.fnmatch(name, p) for p in patterns):
            continue
        s.selected += 1
        if code is None:
            s.unchecked += 1
        elif code in KILLED:
            s.killed += 1
        elif code in SURVIVED:
            s.survived += 1
            s.survivors.append(name)
        elif code in TIMEOUT:
            s.timeout += 1
        elif code in NO_TESTS:
            s.no_tests += 1
        else:
            s.other += 1
    return s


def run_module(module: str, selection: Selection, *, children: int, limit_s: float,
               env: dict[str, str]) -> tuple[float, bool]:
    """One ``mutmut run`` for one module; returns (seconds, cut by the limit)."""
    # The console script, not ``python -m mutmut``: mutmut forks its workers from a module it expects
    # to find as ``mutmut.__main__``.
    exe = shutil.which("mutmut", path=str(Path(sys.executable).parent)) or "mutmut"
    cmd = [exe, "run", "--max-children", str(children), *selection.patterns(module)]
    print(f"\n== {module}: mutmut {' '.join(cmd[1:])} (limit {limit_s:.0f} s)", flush=True)
    t0 = time.monotonic()
    log = open(ROOT / "mutants" / f"{module}.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cut = False
    try:
        proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        cut = True
        proc.send_signal(signal.SIGINT)  # mutmut stops its workers and keeps the verdicts it has
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    finally:
        log.close()
    seconds = time.monotonic() - t0
    if proc.returncode not in (0, None) and not cut:
        tail = (ROOT / "mutants" / f"{module}.log").read_text(errors="replace")[-3000:]
        raise SystemExit(f"mutmut failed on {module} (exit {proc.returncode}):\n{tail}")
    return seconds, cut


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f} %"


def render(scores: list[Score], total_s: float) -> str:
    lines = [
        "# Mutation score of the core",
        "",
        "mutmut against tests/unit; score = killed / (killed + survived). "
        "Sample: which mutants ran (all; even: numbered with an even last digit; tenth: ending in 0; "
        "function names: those functions' mutants only).",
        "",
        "| module | sample | run / generated | killed | survived | score | timeout | no tests | unchecked | seconds |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in scores:
        mark = " (partial)" if s.partial else ""
        lines.append(
            f"| {label(s.module)}{' *' if s.module in GATED else ''} | {s.selection.describe()} | {s.selected} / {s.mutants} | {s.killed} "
            f"| {s.survived} | {_pct(s.score)}{mark} | {s.timeout} | {s.no_tests} | {s.unchecked} | {s.seconds:.0f} |"
        )
    lines += ["", f"`*` gated modules. Total {total_s / 60:.1f} min.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modules", default=",".join(MODULES), help=f"comma-separated, of {', '.join(MODULES)}")
    ap.add_argument("--sample", choices=sorted(SAMPLES), help="one sample for every module (of its selected "
                    "functions): all, even (about 1/2) or tenth (numbers ending in 0); default: all, token_table.py even")
    ap.add_argument("--max-children", type=int, default=2)
    ap.add_argument("--module-limit-s", type=float, default=1200.0, help="wall-clock limit per module")
    ap.add_argument("--budget-s", type=float, default=2700.0, help="wall-clock limit of the whole run")
    ap.add_argument("--fail-under", type=float, default=90.0, help="minimum score (percent) of the gated modules")
    ap.add_argument("--out", default="reports/mutation")
    ap.add_argument("--reuse", action="store_true", help="keep mutants/ (generated mutants and test stats)")
    args = ap.parse_args(argv)

    chosen = [m.strip() for m in args.modules.split(",") if m.strip()]
    unknown = [m for m in chosen if m not in MODULES]
    if unknown:
        ap.error(f"--modules {unknown}: allowed {list(MODULES)}")
    if not args.reuse and (ROOT / "mutants").exists():
        shutil.rmtree(ROOT / "mutants")
    (ROOT / "mutants").mkdir(exist_ok=True)
    # The venv may hold another parity: mutmut puts mutants/ first on sys.path; PYTHONPATH must not
    # put the unmutated tree ahead of it. One torch thread per worker: the workers are the parallelism.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", "dev")}
    env.pop("PYTHONPATH", None)

    t0 = time.monotonic()
    scores = []
    for module in chosen:
        selection = replace(MODULES[module], sample=args.sample) if args.sample else MODULES[module]
        left = args.budget_s - (time.monotonic() - t0)
        if left < 30:
            print(f"   {module}: skipped, the budget of {args.budget_s:.0f} s is spent", flush=True)
            scores.append(Score(module, selection, partial=True))
            continue
        limit = min(args.module_limit_s, left)
        seconds, cut = run_module(module, selection, children=args.max_children, limit_s=limit, env=env)
        meta_path = ROOT / "mutants" / f"{source(module)}.meta"
        s = classify(module, selection, json.loads(meta_path.read_text()))
        s.seconds, s.partial = seconds, cut or s.unchecked > 0
        scores.append(s)
        print(f"   {module}: killed {s.killed}, survived {s.survived}, score {_pct(s.score)}, {seconds:.0f} s", flush=True)
    total = time.monotonic() - t0

    table = render(scores, total)
    print("\n" + table)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "score.md").write_text(table)
    (out / "score.json").write_text(json.dumps(
        {"seconds": total, "fail_under": args.fail_under, "gated": list(GATED),
         "modules": [{**asdict(s), "patterns": s.selection.patterns(s.module), "score": s.score} for s in scores]}, indent=2))
    (out / "survivors.txt").write_text("".join(f"{n}\n" for s in scores for n in s.survivors))
    print(f"written: {out / 'score.md'}, {out / 'score.json'}, {out / 'survivors.txt'}")

    low = [s for s in scores if s.module in GATED and (s.score is None or 100 * s.score < args.fail_under)]
    for s in low:
        print(f"FAIL {label(s.module)}: mutation score {_pct(s.score)} < {args.fail_under:g} %", file=sys.stderr)
    return 1 if low else 0


if __name__ == "__main__":
    raise SystemExit(main())
