"""parity.errors: every error parity raises on purpose is a ParityError; the built-ins it used before still
catch them; no committed module raises a bare ValueError, FileNotFoundError or TimeoutError (the CLI would
call it a bug)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from parity import errors
from parity.core.gates import Thresholds
from parity.core.matrix import load_matrix
from parity.determinism.kernels import UnsupportedModel
from parity.engines.vllm_server.protocol import (
    LogprobsModeMismatch,
    MalformedResponse,
    ServerDied,
    ServerError,
    ServerUnreachable,
)
from parity.records.schema import RecordsError

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [(errors.UsageError, ValueError), (errors.PathNotFound, FileNotFoundError), (errors.PathNotFound, ValueError),
     (errors.SetupError, RuntimeError), (errors.EngineError, RuntimeError), (errors.TimedOut, TimeoutError)],
)
def test_each_kind_is_a_parity_error_and_its_old_builtin(cls: type[Exception], builtin: type[Exception]) -> None:
    assert issubclass(cls, errors.ParityError) and issubclass(cls, builtin)
    with pytest.raises(builtin, match="x=1 is invalid"):
        raise cls("x=1 is invalid: allowed 0")


@pytest.mark.parametrize(
    ("cls", "kind"),
    [(RecordsError, errors.UsageError), (UnsupportedModel, errors.UsageError), (ServerError, errors.EngineError),
     (ServerUnreachable, ServerError), (ServerDied, ServerError), (MalformedResponse, ServerError),
     (LogprobsModeMismatch, ServerError)],
)
def test_the_existing_error_classes_are_parity_errors(cls: type[Exception], kind: type[Exception]) -> None:
    assert issubclass(cls, kind) and issubclass(cls, errors.ParityError)


def test_bad_files_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.PathNotFound, match="does not exist"):
        Thresholds.from_toml(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[thresholds\nmax = 1\n")
    with pytest.raises(errors.UsageError, match=r"thresholds file .*bad.toml' is not valid TOML"):
        Thresholds.from_toml(bad)
    with pytest.raises(errors.UsageError, match=r"matrix file .*bad.toml' is not valid TOML"):
        load_matrix(bad)
    bad.write_text("thresholds = 3\n")
    with pytest.raises(errors.UsageError, match=r"bad.toml': thresholds = 3; allowed a table of name = value"):
        Thresholds.from_toml(bad)
    bad.write_text("[thresholds]\nmax_headroom = -1\n")
    with pytest.raises(errors.UsageError, match=r"Thresholds.max_headroom=-1 is invalid: allowed a number >= 0"):
        Thresholds.from_toml(bad)


# The built-ins a user error once was; raised bare, the CLI reports them as bugs (exit 3).
USER_ERROR_BUILTINS = {"ValueError", "FileNotFoundError", "TimeoutError"}


def test_no_module_raises_a_bare_user_error_builtin() -> None:
    tracked = subprocess.run(["git", "ls-files", "parity/*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    problems = []
    for path in [ROOT / p for p in tracked.stdout.split() if (ROOT / p).is_file()]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and node.exc is not None:
                exc = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
                if isinstance(exc, ast.Name) and exc.id in USER_ERROR_BUILTINS:
                    problems.append(f"{path.relative_to(ROOT)}:{node.lineno}: raise {exc.id}")
    assert not problems, ("a user's mistake is a parity.errors.UsageError (or another ParityError), an invariant "
                          "an assert:\n" + "\n".join(problems))
