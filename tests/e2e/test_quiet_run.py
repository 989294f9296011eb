"""A real `parity run` in a subprocess, as a user starts it: the terminal holds parity's lines and the
summary only; the engines' chatter (vLLM at INFO level here, so there surely is some) is in engine.log."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from parity.report.overview import render_terminal

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MATRIX = """
[defaults]
prompts = 2
max_tokens = 4

[[scenario]]
name = "top_p=0.9 T=0.7"
temperature = 0.7
top_p = 0.9

[[scenario]]
name = "baseline T=1"
"""
# parity's own lines on stderr: progress, wait indicators, per-scenario lines.
OWN = re.compile(r"^(parity: |\[\d+/\d+\] |    capture: |    power: )")  # the scenario line, its capture-plan and power lines
VLLM_LINE = re.compile(r"\b(INFO|WARNING)\b.*\[[\w./]+\.py:\d+\]")  # vLLM's log format: LEVEL date [file.py:line]


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    tmp = tmp_path_factory.mktemp("quiet")
    (tmp / "matrix.toml").write_text(MATRIX)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": "INFO",
        "TOKENIZERS_PARALLELISM": "false",
    }
    out = tmp / "report"
    proc = subprocess.run(
        [sys.executable, "-m", "parity", "run", "--model", "qwen2-tiny", "--matrix", str(tmp / "matrix.toml"),
         "--out", str(out), "--no-plots"],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=900,
    )
    return proc, out


def test_the_terminal_holds_only_paritys_lines_and_the_summary(quiet_run) -> None:
    proc, out = quiet_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    block = render_terminal(report)
    assert block in proc.stdout
    rest = proc.stdout.replace(block, "").splitlines()
    assert [line for line in rest if line.strip()] == [
        f"parity: 2/2 scenarios pass; report in {out}/report.md, engine output in {out}/engine.log",
        "verdict: PASS (exit 0): 2 pass, 0 fail, 0 without a verdict, of 2 scenario(s)",
    ]
    stray = [line for line in proc.stderr.splitlines() if not OWN.match(line)]
    assert stray == [], "\n".join(stray)
    assert any(line.startswith("parity: vLLM engine start-up: ") for line in proc.stderr.splitlines())
    assert [line.split()[0] for line in proc.stderr.splitlines() if line.startswith("[")] == ["[1/2]", "[2/2]"]


def test_engine_log_holds_the_engines_chatter(quiet_run) -> None:
    proc, out = quiet_run
    log = (out / "engine.log").read_text(errors="replace").splitlines()
    chatter = [line for line in log if VLLM_LINE.search(line)]
    assert chatter, "no vLLM log line in engine.log"
    terminal = proc.stdout + proc.stderr
    assert not [line for line in chatter if line in terminal]
    assert "=== vLLM engine start-up …" in log
