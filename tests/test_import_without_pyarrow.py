"""``parity --help`` works without pyarrow; the records commands say what to install instead of a traceback."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, sys
    sys.modules["pyarrow"] = None  # any import of pyarrow now raises ImportError

    from parity.cli.main import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code == 0, f"parity --help exited {exc.code}"
    assert "analyze" in out.getvalue(), out.getvalue()

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["analyze", "missing.parquet", "--dtype", "float32"])
    assert code == 2 and "pip install 'parity[records]'" in err.getvalue(), (code, err.getvalue())
    print("ok")
    """
)


def test_help_and_a_clear_error_without_pyarrow() -> None:
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
