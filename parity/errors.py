"""The errors parity raises on purpose, told apart from its bugs.

A :class:`ParityError` is something the user can fix: the input (a flag, a spec, a matrix, thresholds or
records file, a recipe), the machine (a missing package, no CUDA, no Java), or an engine parity drives
(a server that cannot be reached, an answer outside vLLM's contract, a step past ``--timeout``). Its
message says what is wrong and what is allowed; the CLI prints it as one line and exits 2. Any other
exception, an ``assert`` on parity's own invariants included, is a bug in parity: the CLI prints the
traceback and exits 3.

Each class also derives from the built-in exception that parity raised before it existed
(:class:`UsageError` is a ``ValueError``, :class:`PathNotFound` a ``FileNotFoundError``,
:class:`SetupError` and :class:`EngineError` are ``RuntimeError`` subclasses, :class:`TimedOut` a ``TimeoutError``),
so code that catches the built-in keeps working. The converse does not hold: a bare ``ValueError``
from parity or a library is not a user error.
"""

from __future__ import annotations


class ParityError(Exception):
    """Base of every error the user can fix; anything else parity raises is a bug."""


class UsageError(ParityError, ValueError):
    """A user's mistake: a bad flag, spec, file or value. The message names the field, the value given and
    what is allowed (``"Thresholds.max_diff=-1 is invalid: allowed a number >= 0"``)."""


class PathNotFound(UsageError, FileNotFoundError):
    """A file or folder the user named does not exist (or is not what it must be: a checkpoint without
    config.json, a directory without records)."""


class SetupError(ParityError, RuntimeError):
    """The machine lacks what the command needs: a package (with the pip line that installs it), CUDA,
    Java, a writable folder, a download from the package index."""


class EngineError(ParityError, RuntimeError):
    """An engine parity drives (vLLM in-process or over HTTP, TRL, Ray, Spark) failed or answered outside
    its contract: unreachable, died, too few log-probs, rows missing."""


class TimedOut(ParityError, TimeoutError):
    """A step did not finish within the time the user allowed (``--timeout``)."""
