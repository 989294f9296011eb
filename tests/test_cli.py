"""The ``parity`` entry point: --version, --debug, one-line user errors (exit 2), bugs with their traceback
(exit 3), and no silently skipped command."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import parity
from parity.cli import main as cli
from parity.cli import matrix as matrix_cli
from parity.errors import ParityError, PathNotFound, SetupError, TimedOut, UsageError


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"parity {parity.__version__}"


def _raising(exc: BaseException):  # a command's main that raises exc
    def main(args: object) -> int:
        raise exc

    return main


@pytest.mark.parametrize(
    "exc",
    [UsageError("matrix 'x' is invalid: allowed a TOML file"), PathNotFound("matrix file 'x.toml' does not exist"),
     SetupError("needs vLLM: install parity[cpu]"), TimedOut("did not finish within 5 s (raise --timeout)")],
    ids=lambda e: type(e).__name__,
)
def test_a_user_error_is_one_line_and_exit_2(
    exc: ParityError, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(matrix_cli, "main", _raising(exc))
    assert cli.main(["matrix"]) == cli.USER_ERROR == 2
    err = capsys.readouterr().err
    assert err == f"parity matrix: error: {exc} (--debug: full traceback)\n"


def test_debug_shows_the_traceback_of_a_user_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(matrix_cli, "main", _raising(UsageError("matrix 'x' is invalid: allowed a TOML file")))
    assert cli.main(["--debug", "matrix"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "parity.errors.UsageError: matrix 'x' is invalid" in err
    assert err.rstrip().splitlines()[-1] == "parity matrix: error: matrix 'x' is invalid: allowed a TOML file"
    assert "bug" not in err


def test_a_real_user_error_from_a_command_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    assert cli.main(["matrix", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"matrix file {str(missing)!r} does not exist" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[[scenario]]\nname = 'a'\ntemperature = 7.0\n")
    assert cli.main(["matrix", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "temperature=7.0 is invalid" in err and "Traceback" not in err


# Exceptions a bug raises, among them the built-ins that once passed for user errors.
BUGS = [IndexError("index 7 is out of bounds for dimension 0 with size 4"), KeyError("a bug, not a user mistake"),
        RuntimeError("The size of tensor a (3) must match the size of tensor b (4) at non-singleton dimension 1"),
        ValueError("too many values to unpack (expected 2)"), FileNotFoundError(2, "No such file", "/tmp/x"),
        TimeoutError("timed out"), AssertionError("capture asked for 2 sequences and got 1")]


@pytest.mark.parametrize("exc", BUGS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_an_internal_bug_prints_its_traceback_and_exits_3(
    exc: Exception, debug: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(matrix_cli, "main", _raising(exc))
    argv = [*(["--debug"] if debug else []), "matrix", "my file.toml"]
    assert cli.main(argv) == cli.INTERNAL_ERROR == 3
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):")
    assert f"{type(exc).__name__}: " in err and "in main" in err  # the frame that raised
    tail = err.rstrip().splitlines()[-2:]
    assert tail[0].startswith("parity matrix: internal error: this is a bug in parity") and "report it" in tail[0]
    assert tail[1].strip() == ("parity --debug" if debug else "parity") + " matrix 'my file.toml'"  # the command to report


def test_the_console_script_exits_with_the_codes(tmp_path: Path) -> None:
    """What a shell sees: 2 for a user error, 3 for a bug (1 stays the gates' own)."""
    code = "import sys; from parity.cli import main as cli, matrix as m\n" \
           "def boom(args): return [][1]\n" \
           "m.main = boom if sys.argv[1] == 'bug' else m.main\n" \
           "sys.exit(cli.main(['matrix', sys.argv[2]]))\n"
    run = [sys.executable, "-c", code]
    cwd = Path(__file__).resolve().parents[1]
    user = subprocess.run([*run, "user", str(tmp_path / "nope.toml")], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert user.returncode == 2 and "does not exist" in user.stderr and "Traceback" not in user.stderr
    bug = subprocess.run([*run, "bug", "default"], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert bug.returncode == 3 and "IndexError: list index out of range" in bug.stderr and "bug in parity" in bug.stderr


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


ANALYZE = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from parity.cli.main import main
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = main(json.loads(sys.argv[1]))
    heavy = sorted(m for m in ("torch", "pandas", "transformers", "vllm", "matplotlib") if m in sys.modules)
    print(json.dumps({"code": code, "heavy": heavy}))
    """
)


@pytest.mark.parametrize("plots", [False, True], ids=["no-plots", "plots"])
def test_analyze_without_a_model_imports_neither_torch_nor_pandas(plots: bool, tmp_path: Path) -> None:
    """``parity analyze FILE`` (no ``--model``) reads records with numpy and pyarrow alone: torch took 3 s of
    its start, pandas (through pyarrow's own numpy conversion) 0.4 s. The plots need matplotlib."""
    import json

    import records_synth

    path = records_synth.write_file(tmp_path / "r.parquet", 2048, k=8, vocab=512, length=64)
    argv = ["analyze", str(path), "--out", str(tmp_path / "out"), *([] if plots else ["--no-plots"])]
    proc = subprocess.run(
        [sys.executable, "-c", ANALYZE, json.dumps(argv)], cwd=Path(__file__).resolve().parents[1],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"code": 0, "heavy": ["matplotlib"] if plots else []}, f"{got}\n{proc.stderr}"
    jsonschema = pytest.importorskip("jsonschema")
    from parity.report.schema import report_schema

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    jsonschema.validate(report, report_schema())  # torch's knobs are None where torch was never loaded
    assert report["environment"]["determinism"]["torch_num_threads"] is None


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
