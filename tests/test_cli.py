"""The ``parity`` entry point: --version, --debug, one-line user errors, and no silently skipped command."""

from __future__ import annotations

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
