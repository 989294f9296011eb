"""The errors parity raises on purpose, told apart from its bugs: a :class:`ParityError` is something the
user can fix (exit 2, one line); any other exception is a bug in parity (exit 3). Each class also derives
from the built-in exception parity raised before it (docs/internals.md, section 7).
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
