"""The engines' output goes to ``engine.log``; parity's own lines and its wait indicators go to the terminal.

:class:`EngineOutput` redirects descriptors 1 and 2 while the engines live and restores them first on an
exception, showing the log's last lines (docs/internals.md, section 5)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import IO

from parity.errors import SetupError

LOG_NAME = "engine.log"
TAIL_LINES = 20
MARK = "=== "  # parity's own lines in the log start with this
_ACTIVE: list[EngineOutput] = []  # innermost last


def _fileno(stream: IO[str]) -> int | None:
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def _columns(stream: IO[str]) -> int:
    """The terminal's width; 80 where it reports none (a new pseudo-terminal says 0, and tqdm then draws nothing)."""
    fd = _fileno(stream)
    try:
        cols = os.get_terminal_size(fd).columns if fd is not None else 0
    except OSError:
        cols = 0
    return cols or 80


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()


def log_tail(path: str | os.PathLike[str], lines: int = TAIL_LINES, max_bytes: int = 64_000) -> list[str]:
    """The last ``lines`` lines of a log, with progress-bar redraws (``\\r``) reduced to their last state."""
    p = Path(path)
    if not p.is_file():
        return []
    with open(p, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - max_bytes))
        text = f.read().decode(errors="replace")
    last_states = (line.rstrip("\r").split("\r")[-1].rstrip() for line in text.splitlines())
    return [line for line in last_states if line][-lines:]


class EngineOutput:
    """Context manager: engine output to ``log_path`` (unless ``verbose``), parity's lines to the terminal."""

    def __init__(self, log_path: str | os.PathLike[str], *, verbose: bool = False, tail_lines: int = TAIL_LINES) -> None:
        self.log_path = Path(log_path)
        self.verbose = verbose
        self.tail_lines = tail_lines
        self.redirected = False
        self.term: IO[str] = sys.stderr
        self._log_fd: int | None = None
        self._saved: dict[int, int] = {}
        self._own_term = False

    # -- the context -----------------------------------------------------------------------------
    def __enter__(self) -> EngineOutput:
        try:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
        except OSError as exc:
            raise SetupError(f"cannot write the engine log {str(self.log_path)!r} ({exc.strerror or exc}): "
                             "allowed a writable report folder (--out)") from exc
        _flush_std()
        if not self.verbose:
            try:
                self._saved = {fd: os.dup(fd) for fd in (1, 2)}
            except OSError:  # a closed standard descriptor: nothing to keep quiet
                for fd in self._saved.values():
                    os.close(fd)
                self._saved = {}
            if self._saved:
                # parity's lines go where stderr went; when sys.stderr is not descriptor 2 (a test's
                # capture object), it stays the terminal.
                if _fileno(sys.stderr) == 2:
                    encoding = getattr(sys.stderr, "encoding", None) or "utf-8"
                    self.term = os.fdopen(os.dup(self._saved[2]), "w", buffering=1, encoding=encoding, errors="replace")
                    self._own_term = True
                os.dup2(self._log_fd, 1)
                os.dup2(self._log_fd, 2)
                self.redirected = True
        _ACTIVE.append(self)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _flush_std()
        if _ACTIVE and _ACTIVE[-1] is self:
            _ACTIVE.pop()
        if self.redirected:
            for fd, saved in self._saved.items():
                os.dup2(saved, fd)
                os.close(saved)
            self._saved = {}
            self.redirected = False
        if self._own_term:
            with contextlib.suppress(OSError, ValueError):
                self.term.close()
            self._own_term = False
        self.term = sys.stderr
        if exc is not None:
            for i, line in enumerate(f"{type(exc).__name__}: {exc}".splitlines() or [type(exc).__name__]):
                self._mark(f"{MARK}{'error: ' if i == 0 else '    '}{line}")
        if self._log_fd is not None:
            os.close(self._log_fd)
            self._log_fd = None
        if isinstance(exc, Exception) and not self.verbose:
            self.show_tail()

    # -- parity's own output ---------------------------------------------------------------------
    def _mark(self, text: str) -> None:
        """A line of parity's into the log, so the engines' lines read in context."""
        if self._log_fd is not None:
            with contextlib.suppress(OSError):
                os.write(self._log_fd, (text.rstrip("\n") + "\n").encode(errors="replace"))

    def say(self, msg: str) -> None:
        """One of parity's lines: to the terminal, and into the log as a marker."""
        self._mark(msg if msg.startswith(MARK) else MARK + msg)
        print(msg, file=self.term, flush=True)

    def show_tail(self) -> None:
        """The log's last lines, on stderr, with where the whole log is."""
        lines = [ln for ln in log_tail(self.log_path, self.tail_lines * 2) if not ln.startswith(MARK)]
        lines = lines[-self.tail_lines :]
        if not lines:
            return  # nothing of the engines' to show: the error that follows says it all
        print(f"parity: last {len(lines)} lines of the engines' output ({self.log_path}):", file=sys.stderr)
        for ln in lines:
            print(f"    {ln}", file=sys.stderr)
        sys.stderr.flush()

    @contextlib.contextmanager
    def wait(self, label: str, *, refresh_s: float = 0.25) -> Iterator[None]:
        """Elapsed time while ``label`` runs: a live line on a terminal, one closing line otherwise."""
        self._mark(f"{MARK}{label} …")
        start = time.monotonic()
        bar = stop = ticker = None
        live = not self.verbose and bool(getattr(self.term, "isatty", lambda: False)())
        if live:
            from tqdm import tqdm

            bar = tqdm(total=None, desc=f"parity: {label}", bar_format="{desc} … {elapsed}", file=self.term,
                       leave=False, ncols=_columns(self.term))
            stop = threading.Event()

            def tick() -> None:
                while not stop.wait(refresh_s):
                    bar.refresh()

            ticker = threading.Thread(target=tick, name="parity-wait", daemon=True)
            ticker.start()
        elif self.verbose:
            self.say(f"parity: {label} …")
        ok = False
        try:
            yield
            ok = True
        finally:
            if stop is not None and ticker is not None and bar is not None:
                stop.set()
                ticker.join(timeout=2.0)
                bar.close()
            elapsed = time.monotonic() - start
            self.say(f"parity: {label}: {elapsed:.1f} s" if ok else f"parity: {label}: failed after {elapsed:.1f} s")


def active() -> EngineOutput | None:
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def waiting(label: str) -> Iterator[None]:
    """The wait indicator of the active :class:`EngineOutput`; nothing without one (library use, tests)."""
    out = active()
    with out.wait(label) if out is not None else contextlib.nullcontext():
        yield


def say(msg: str) -> None:
    """One of parity's lines: through the active :class:`EngineOutput`, else to stderr."""
    out = active()
    if out is None:
        print(msg, file=sys.stderr, flush=True)
    else:
        out.say(msg)
