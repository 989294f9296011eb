"""``import parity``, the math core and ``parity --help`` work without vLLM.

A fresh interpreter blocks vllm (``sys.modules['vllm'] = None`` makes every ``import vllm...`` raise
ImportError), so this runs the same on a machine with or without the ``cpu`` extra installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import contextlib, io, sys
    sys.modules["vllm"] = None  # any import of vllm now raises ImportError

    import parity
    from parity import full, predicted_log_s, recompute, reference_filter, replay, SamplingSpec
    import parity.core.metrics, parity.testing.properties
    import torch

    # The math core runs end to end.
    z = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    spec = SamplingSpec(0.7, top_k=2, top_p=0.9)
    res = reference_filter(z, spec)
    y = torch.tensor([0])
    replay(z, y, res.kept, spec); recompute(z, y, spec); full(z, y, spec); predicted_log_s(z, res.kept, spec)
    parity.core.metrics.max_abs_difference(res.logprobs, res.logprobs)

    from parity.cli.main import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code == 0, f"parity --help exited {exc.code}"
        else:
            raise AssertionError("parity --help did not exit")
    assert "sampler" in out.getvalue(), out.getvalue()

    # A command that needs vLLM says so in one line instead of a traceback.
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["sampler", "--cases", "1"])
    assert code == 2 and "needs vLLM" in err.getvalue(), (code, err.getvalue())

    leaked = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
    assert leaked == ["vllm"], leaked  # only the blocker itself
    print("ok")
    """
)


def test_parity_imports_and_helps_without_vllm() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    )
