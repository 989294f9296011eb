"""``parity repro torch_cpu_log_softmax``: what its code guarantees on any machine.

The offsets are taken against float64, the table has one row per (V, sigma, kernel path), the child's
lines round-trip, the verdict follows its rule on synthetic tables, and the standalone script runs with
torch alone. Whether this machine's kernels show the bias is what the repro measures, never asserted.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from parity.repro import log_softmax_offsets as lsm
from parity.repro.common import Context
from parity.repro.registry import get, script_config
from parity.repro.runner import emit_script, run_entries

KEYS = {"vocab", "sigma", "capability", "rows", "ls_mean", "ls_max", "ls_min", "positive", "spread", "rounding",
        "lse_mean", "lse_abs", "written_mean", "fingerprint"}


def _exact(row: list[float]) -> list[float]:
    """float64 log_softmax of one row, in Python's own arithmetic."""
    m = max(row)
    lse = m + math.log(math.fsum(math.exp(v - m) for v in row))
    return [v - lse for v in row]


@pytest.mark.kernel_path
def test_offsets_are_taken_against_float64() -> None:
    z = torch.randn(3, 200, generator=torch.Generator().manual_seed(3)) * 4
    got = lsm.lsm_row_offsets(z)
    out = torch.log_softmax(z, dim=-1).tolist()
    lse_out = (z - torch.logsumexp(z, dim=-1, keepdim=True)).tolist()
    for i, row in enumerate(z.tolist()):
        exact = _exact(row)
        assert got["log_softmax"][i].item() == pytest.approx(math.fsum(o - e for o, e in zip(out[i], exact, strict=True)) / 200, abs=1e-12)
        assert got["logsumexp"][i].item() == pytest.approx(math.fsum(o - e for o, e in zip(lse_out[i], exact, strict=True)) / 200, abs=1e-12)
        # A float32 reference would shift every offset by the mean rounding of the exact values (kernel-independent).
        rounded = torch.tensor(exact, dtype=torch.float32).tolist()
        against_f32 = math.fsum(o - r for o, r in zip(out[i], rounded, strict=True)) / 200
        assert abs(against_f32 - got["log_softmax"][i].item()) > 1e-10
    assert all(v.dtype == torch.float64 and v.shape == (3,) for v in got.values())


@pytest.mark.kernel_path
def test_the_measurement_has_one_row_per_vocabulary_and_scale() -> None:
    rows = lsm.lsm_measure([64, 300], [1.0, 4.0], 5, seed=2)
    assert [(r["vocab"], r["sigma"]) for r in rows] == [(64, 1.0), (64, 4.0), (300, 1.0), (300, 4.0)]
    for r in rows:
        assert set(r) == KEYS and r["rows"] == 5
        assert r["capability"] == torch.backends.cpu.get_cpu_capability()
        assert r["ls_min"] <= r["ls_mean"] <= r["ls_max"] and 0.0 <= r["positive"] <= 1.0
        assert r["spread"] >= 0 and r["rounding"] >= 0 and r["lse_abs"] >= abs(r["lse_mean"]) - 1e-18
    # The same standard normal rows for every scale of a V; the same numbers when measured again.
    assert rows[0]["fingerprint"] == rows[1]["fingerprint"] != rows[2]["fingerprint"]
    assert lsm.lsm_measure([64], [4.0], 5, seed=2) == [rows[1]]


def test_the_childs_lines_round_trip(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [{"vocab": 152064, "sigma": 4.0, "capability": "NO AVX", "rows": 8, "ls_mean": 1.2345678901234567e-05,
             "positive": 1.0, "fingerprint": 123456789012345}]
    print("noise from torch")
    lsm.lsm_print(rows)
    assert lsm.lsm_parse(capsys.readouterr().out) == rows


def _row(path: str, vocab: int = 1000, sigma: float = 4.0, *, mean: float = 1e-5, positive: float = 1.0,
         lse_abs: float = 1e-7, capability: str | None = None) -> dict:
    cap = capability or ("DEFAULT" if path == lsm.LSM_DEFAULT else "AVX2")
    return {"path": path, "vocab": vocab, "sigma": sigma, "capability": cap, "rows": 64, "ls_mean": mean,
            "positive": positive, "lse_abs": lse_abs}


def _verdict(rows: list[dict], vocab: int = 1000, scale: float = 4.0, error: str = "") -> list[bool]:
    return [ok for _, ok, _ in lsm.lsm_checks(rows, vocab, scale, error)]


def test_the_verdict_follows_its_rule_on_synthetic_tables() -> None:
    both = [_row(lsm.LSM_IN_PROCESS), _row(lsm.LSM_DEFAULT)]
    assert _verdict(both) == [True, True, True]
    # Exactly at the thresholds still holds; just below does not.
    edge = [_row(lsm.LSM_IN_PROCESS, positive=lsm.LSM_MIN_POSITIVE, mean=lsm.LSM_MIN_RATIO * 1e-7), _row(lsm.LSM_DEFAULT)]
    assert _verdict(edge) == [True, True, True]
    assert _verdict([_row(lsm.LSM_IN_PROCESS, positive=0.9), _row(lsm.LSM_DEFAULT)]) == [True, False, True]
    assert _verdict([_row(lsm.LSM_IN_PROCESS), _row(lsm.LSM_DEFAULT, mean=9e-7)]) == [True, True, False]
    assert _verdict([_row(lsm.LSM_IN_PROCESS, mean=-1e-5, lse_abs=0.0), _row(lsm.LSM_DEFAULT)]) == [True, False, True]
    assert _verdict([_row(lsm.LSM_IN_PROCESS, mean=0.0, lse_abs=0.0), _row(lsm.LSM_DEFAULT)]) == [True, False, True]
    # Only the largest V at the verdict's scale counts: a biased smaller V or another scale does not rescue it.
    rows = [_row(p, vocab=v, sigma=s, mean=m) for p in (lsm.LSM_IN_PROCESS, lsm.LSM_DEFAULT)
            for v, s, m in ((500, 4.0, 1e-5), (1000, 8.0, 1e-5), (1000, 4.0, 1e-8))]
    assert _verdict(rows) == [True, False, False]
    # The second kernel path must have run, on torch's DEFAULT kernels.
    checks = lsm.lsm_checks([_row(lsm.LSM_IN_PROCESS)], 1000, 4.0, "ImportError: boom")
    assert [ok for _, ok, _ in checks] == [False, True, False]
    assert "ImportError: boom" in checks[0][2] and checks[2][2] == "not measured"
    assert _verdict([_row(lsm.LSM_IN_PROCESS), _row(lsm.LSM_DEFAULT, capability="AVX512")]) == [False, True, True]


@pytest.mark.kernel_path
def test_the_repro_runs_on_small_settings(tmp_path) -> None:
    [res] = run_entries([get("torch_cpu_log_softmax")], Context(small=True, progress=lambda _m: None), lambda _e: tmp_path)
    cfg = script_config("torch_cpu_log_softmax", True)
    per_path = len(cfg["vocabs"]) * len(cfg["scales"])
    assert [r["path"] for r in res.rows] == [lsm.LSM_IN_PROCESS] * per_path + [lsm.LSM_DEFAULT] * per_path
    assert res.checks[0].passed, res.checks[0].detail  # the subprocess ran torch's DEFAULT kernels
    assert {key for key, _, _ in res.columns} <= set(res.rows[0])
    assert [c.passed for c in res.checks] == [ok for _, ok, _ in
                                               lsm.lsm_checks(res.rows, max(cfg["vocabs"]), cfg["verdict_scale"])]
    assert res.data["settings"] == cfg
    assert (tmp_path / "result.json").is_file() and f"**{res.verdict}**" in (tmp_path / "table.md").read_text()


@pytest.mark.kernel_path
def test_the_standalone_script_runs_with_torch_alone(tmp_path) -> None:
    script = tmp_path / "torch_cpu_log_softmax.py"
    script.write_text(emit_script(get("torch_cpu_log_softmax"), small=True))
    (tmp_path / "parity").mkdir()  # parity must not be needed: an importable shadow that refuses
    (tmp_path / "parity" / "__init__.py").write_text("raise ImportError('parity must not be needed')\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", lsm.LSM_CHILD)}
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = p.stdout.rstrip().splitlines()
    assert lines and lines[-1] in ("REPRODUCED", "NOT REPRODUCED"), p.stdout[-2000:] + p.stderr[-2000:]
    assert p.returncode == (0 if lines[-1] == "REPRODUCED" else 1)
    table = [ln for ln in lines if ln.startswith("| ")]
    cfg = script_config("torch_cpu_log_softmax", True)
    assert len(table) == 1 + 2 * len(cfg["vocabs"]) * len(cfg["scales"])  # header, then both kernel paths
    assert sum(lsm.LSM_DEFAULT in ln for ln in table) == len(cfg["vocabs"]) * len(cfg["scales"])
    assert "- [x] the subprocess with ATEN_CPU_CAPABILITY=default ran torch's DEFAULT" in p.stdout
