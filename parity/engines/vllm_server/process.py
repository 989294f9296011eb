"""Process control of a spawned vLLM server: free ports, its process group, and a launcher that dies
with its parent."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def process_group_alive(pgid: int) -> bool:
    """True while any process of the group exists (zombies of our own children are reaped first)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_group(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after ``grace_s``; reap the leader."""
    pgid = proc.pid  # start_new_session: the leader's pid is the group id
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and (proc.poll() is None or process_group_alive(pgid)):
            time.sleep(0.05)
        if proc.poll() is not None and not process_group_alive(pgid):
            break
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent
        pass


def shutdown(proc: subprocess.Popen[bytes], log_dir: Path, log_state: dict[str, bool]) -> None:
    """Finalizer of a spawned server: kill its group; remove its log unless an error message cites it."""
    _kill_group(proc)
    if not log_state.get("keep"):
        shutil.rmtree(log_dir, ignore_errors=True)


# Child side of the launcher: die with the parent (PR_SET_PDEATHSIG survives exec), then exec the
# server. Covers a parent killed by SIGKILL, where neither atexit nor finally blocks run.
LAUNCHER = (
    "import ctypes,os,signal,sys\n"
    "try:\n"
    "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
    "except Exception:\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.execv(sys.executable, [sys.executable] + sys.argv[2:])\n"
)
