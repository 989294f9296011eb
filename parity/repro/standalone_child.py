"""Child processes: run one with a timeout, and read what its traceback says.

Imports nothing from parity: the repros that start an engine or a trainer in a fresh process import it,
and the standalone script sources inline it at emit time (``# @inline``), so a repro and its script read
a crash with the same rules.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass
class ChildRun:
    """A finished (or timed-out) child process: its exit code (None on timeout) and its output."""

    rc: int | None
    stdout: str
    stderr: str
    timeout_s: float

    @property
    def text(self) -> str:
        return self.stdout + "\n" + self.stderr

    @property
    def error(self) -> str:
        """Why it failed, in one line: the timeout, else its last exception line, else its exit code ("" for 0)."""
        if self.rc is None:
            return f"timeout after {self.timeout_s:.0f} s"
        errors = exceptions(output_lines(self.text))
        if errors:
            return errors[-1]
        return f"exit code {self.rc}" if self.rc else ""


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def run_child(cmd: Sequence[str], env: Mapping[str, str] | None, timeout_s: float) -> ChildRun:
    """``cmd`` with a timeout (``env`` None: this process's environment); on timeout, what it had written by then."""
    try:
        p = subprocess.run(list(cmd), env=None if env is None else dict(env), capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return ChildRun(None, _text(exc.stdout), _text(exc.stderr), timeout_s)
    return ChildRun(p.returncode, p.stdout or "", p.stderr or "", timeout_s)


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)')
_EXCEPTION = re.compile(r"^\s*[A-Za-z_.]*(Error|Exception)\b.*:")


def output_lines(text: str) -> list[str]:
    """A child's output lines, vLLM's worker prefix (``[rank0]: ``) removed."""
    return [ln.split("]: ", 1)[-1] if ln.startswith("[rank") else ln for ln in text.splitlines()]


def exceptions(lines: Sequence[str]) -> list[str]:
    """The exception lines (``TypeError: ...``) among ``lines``, stripped."""
    return [ln.strip() for ln in lines if _EXCEPTION.match(ln)]


def frames(lines: Sequence[str]) -> list[dict[str, str]]:
    """The traceback frames among ``lines``: file, line and function of each."""
    return [m.groupdict() for ln in lines if (m := _FRAME.search(ln))]
