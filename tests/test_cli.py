"""The ``parity`` entry point: --version, --debug, one-line user errors, and no silently skipped command."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import parity
from parity.cli import main as cli
from parity.cli import matrix as matrix_cli


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"parity {parity.__version__}"


def test_user_error_is_one_line_and_debug_shows_the_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def bad(args: object) -> int:
        raise ValueError("matrix 'x' is invalid: allowed a TOML file")

    monkeypatch.setattr(matrix_cli, "main", bad)
    assert cli.main(["matrix"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "parity matrix: error: matrix 'x' is invalid" in err and "--debug" in err
    with pytest.raises(ValueError, match="matrix 'x' is invalid"):
        cli.main(["--debug", "matrix"])


def test_an_unexpected_exception_is_not_swallowed(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(args: object) -> int:
        raise KeyError("a bug, not a user mistake")

    monkeypatch.setattr(matrix_cli, "main", broken)
    with pytest.raises(KeyError, match="a bug"):
        cli.main(["matrix"])


def test_a_command_module_without_add_arguments_is_an_error() -> None:
    with pytest.raises(TypeError, match=r"'spec': module parity.core.spec has no add_arguments\(\) or main\(\)"):
        cli.build_parser({"spec": ("parity.core.spec", "not a command")})
    with pytest.raises(ModuleNotFoundError):
        cli.build_parser({"nope": ("parity.cli.no_such_command", "missing")})


def test_every_listed_command_has_a_module_of_its_own() -> None:
    assert {m for m, _ in cli.COMMANDS.values()} == {f"parity.cli.{name}" for name in cli.COMMANDS}
    parser = cli.build_parser()
    for name in cli.COMMANDS:
        assert parser.parse_args([name, *(["list"] if name == "repro" else [])]).command == name


def test_help_shows_three_examples_that_parse(capsys: pytest.CaptureFixture[str]) -> None:
    import shlex

    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    examples = [line.strip() for line in out.split("examples:", 1)[1].splitlines() if line.startswith("  parity ")]
    assert len(examples) == 3
    parser = cli.build_parser()
    for line in examples:
        args = parser.parse_args(shlex.split(line)[1:])  # a typo in an example exits 2 here
        assert args.command in cli.COMMANDS
    assert parser.parse_args(["run", "--verbose"]).verbose is True


# A fresh interpreter per command line: what it imported is read from sys.modules once main returns.
NO_TORCH = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from parity.cli.main import main
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(json.loads(sys.argv[1]))
        except SystemExit as exc:
            code = exc.code
    heavy = sorted(m for m in ("torch", "numpy", "transformers", "vllm") if m in sys.modules)
    print(json.dumps({"code": code, "heavy": heavy}))
    """
)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["matrix"], ["fixtures", "list"]], ids=" ".join)
def test_quick_commands_do_not_import_torch(argv: list[str]) -> None:
    """``parity --help``, ``--version``, ``matrix`` and ``fixtures list`` import only their own command's
    module and no torch (it took seconds before any output)."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", NO_TORCH, json.dumps(argv)], cwd=Path(__file__).resolve().parents[1],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"code": 0, "heavy": []}, f"parity {' '.join(argv)}: {got}\n{proc.stderr}"


def test_the_lazy_top_level_names_resolve() -> None:
    assert set(parity.__all__) == {"__version__", *parity._LAZY}
    for name in parity._LAZY:
        assert getattr(parity, name).__name__ == name
    unknown = "nope"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(parity, unknown)


def test_the_named_command_alone_is_loaded() -> None:
    """main builds the parser with only the named command's arguments; every command still parses."""
    assert cli._command(["--debug", "matrix", "x.toml"]) == "matrix"
    assert cli._command(["--help"]) is None and cli._command([]) is None
    bare = cli.build_parser(load=[])
    with pytest.raises(SystemExit):  # a command that was not loaded has no arguments of its own
        bare.parse_args(["matrix", "x.toml"])
    assert cli.build_parser(load=["matrix"]).parse_args(["matrix", "x.toml"]).matrix == "x.toml"
