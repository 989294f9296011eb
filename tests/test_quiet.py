"""Engine output into engine.log: every way a library writes (file descriptors, Python streams, warnings,
logging handlers, child processes) lands in the log, parity's own lines on the terminal.

Each case runs in a fresh interpreter whose stdout and stderr are real descriptors (as under the
``parity`` command), not pytest's capture objects. No engine is started: what is checked is where
bytes go, with the same calls an engine makes.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from parity.engines.engine_log import MARK, log_tail

ROOT = Path(__file__).resolve().parents[1]

CHATTER = """
import logging, os, subprocess, sys, warnings
os.write(1, b"c-level stdout line\\n")
os.write(2, b"c-level stderr line\\n")
print("python stdout line")
print("python stderr line", file=sys.stderr)
warnings.warn("a python warning line", FutureWarning)
handler = logging.StreamHandler(sys.stdout)  # as vLLM's handler, bound to sys.stdout at import
log = logging.getLogger("fake_engine")
log.addHandler(handler)
log.warning("a logging handler line")
subprocess.run([sys.executable, "-c", "import os; os.write(2, b'child process line\\\\n')"], check=True)
"""
CHATTER_LINES = (
    "c-level stdout line",
    "c-level stderr line",
    "python stdout line",
    "python stderr line",
    "a python warning line",
    "a logging handler line",
    "child process line",
)


def _run(body: str, tmp_path: Path, *, stderr: int | None = None) -> subprocess.CompletedProcess[str]:
    script = "import sys\nfrom parity.engines.engine_log import EngineOutput, waiting\n" + textwrap.dedent(body)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=stderr is None, text=True, timeout=120,
        **({"stdout": subprocess.PIPE, "stderr": stderr} if stderr is not None else {}),
    )


def test_every_kind_of_engine_output_goes_to_the_log(tmp_path: Path) -> None:
    body = f"""
with EngineOutput("out/engine.log") as out:
    out.say("parity: starting the engine")
    with waiting("engine start-up"):
{textwrap.indent(CHATTER, " " * 8)}
    out.say("parity: done")
print("after the run")
"""
    proc = _run(body, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "after the run\n"
    lines = proc.stderr.splitlines()
    assert lines[0] == "parity: starting the engine" and lines[2] == "parity: done" and len(lines) == 3
    assert lines[1].startswith("parity: engine start-up: ") and lines[1].endswith(" s")
    log = (tmp_path / "out" / "engine.log").read_text()
    for text in CHATTER_LINES:
        assert text in log, text
    # parity's own lines are in the log too, marked, so the engines' lines read in context.
    assert f"{MARK}parity: starting the engine" in log and f"{MARK}engine start-up …" in log


def test_verbose_leaves_the_engines_on_the_terminal(tmp_path: Path) -> None:
    body = f"""
with EngineOutput("engine.log", verbose=True) as out:
    with waiting("engine start-up"):
{textwrap.indent(CHATTER, " " * 8)}
"""
    proc = _run(body, tmp_path)
    assert proc.returncode == 0, proc.stderr
    both = proc.stdout + proc.stderr
    for text in CHATTER_LINES:
        assert text in both, text
    assert "parity: engine start-up …" in proc.stderr
    log = (tmp_path / "engine.log").read_text()
    assert all(line.startswith(MARK) for line in log.splitlines()), log


def test_an_engine_failure_shows_the_last_lines_of_the_log(tmp_path: Path) -> None:
    body = """
import os
with EngineOutput("engine.log", tail_lines=3) as out:
    with waiting("engine start-up"):
        for i in range(10):
            os.write(2, f"engine line {i}\\n".encode())
        raise RuntimeError("the engine died")
"""
    proc = _run(body, tmp_path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    err = proc.stderr.splitlines()
    assert err[0].startswith("parity: engine start-up: failed after ")
    i = next(n for n, line in enumerate(err) if line.startswith("parity: last 3 lines"))
    assert [line.strip() for line in err[i + 1 : i + 4]] == ["engine line 7", "engine line 8", "engine line 9"]
    assert "engine line 6" not in proc.stderr
    assert "RuntimeError: the engine died" in err[-1]  # the traceback comes after the tail
    assert "error: RuntimeError: the engine died" in (tmp_path / "engine.log").read_text()


def test_on_a_terminal_a_long_wait_shows_its_elapsed_time(tmp_path: Path) -> None:
    """The live indicator (tqdm) redraws the elapsed time while the wait lasts, then one closing line."""
    master, slave = pty.openpty()
    try:
        body = """
import time
with EngineOutput("engine.log") as out:
    with waiting("model load"):
        time.sleep(1.2)
"""
        proc = _run(body, tmp_path, stderr=slave)
        os.close(slave)
        slave = -1
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        text = b"".join(chunks).decode(errors="replace")
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    assert proc.returncode == 0
    redraws = [seg for seg in text.split("\r") if seg.startswith("parity: model load … 00:0")]
    assert len(redraws) >= 2, text  # it ticked while waiting
    assert "parity: model load: 1." in text or "parity: model load: 2." in text


@pytest.mark.parametrize(
    ("raw", "want"),
    [
        (b"a\nb\nc\n", ["b", "c"]),
        (b"bar  0%\rbar 50%\rbar 100%\nlast\n", ["bar 100%", "last"]),
        (b"x\n\n\n  \n", ["x"]),
    ],
)
def test_log_tail_keeps_the_last_lines_and_the_last_state_of_a_redrawn_bar(tmp_path: Path, raw: bytes, want: list[str]) -> None:
    p = tmp_path / "engine.log"
    p.write_bytes(raw)
    assert log_tail(p, lines=2) == want
    assert log_tail(tmp_path / "missing.log") == []
