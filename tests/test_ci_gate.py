"""The GPU gate's files and command lines, checked on CPU (the gate itself needs CUDA)."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest

from parity.core.gates import THRESHOLD_DTYPES, Thresholds, thresholds_toml

ROOT = Path(__file__).resolve().parents[1]


def load_gate():
    spec = importlib.util.spec_from_file_location("gpu_gate", ROOT / "ci" / "gpu_gate.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["gpu_gate"] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def test_thresholds_file_validates_for_every_dtype() -> None:
    data = tomllib.loads((ROOT / "ci" / "thresholds.toml").read_text())
    assert data["schema_version"] == 2
    for dtype in ("float32", "bfloat16", "float16"):
        th = Thresholds.from_toml(ROOT / "ci" / "thresholds.toml", dtype)
        assert th.replay_support_equal_frac == 1.0
        assert th.to_dict() != Thresholds.for_dtype("float32").to_dict() or dtype == "float32"
    assert Thresholds.from_toml(ROOT / "ci" / "thresholds.toml", "bfloat16").recompute_support_equal_frac == 0.0


def test_thresholds_file_is_generated_from_the_code() -> None:
    """The limits live in Thresholds.for_dtype only: ci/thresholds.toml is its rendering, and reading
    it back gives every dtype's defaults exactly."""
    text = (ROOT / "ci" / "thresholds.toml").read_text()
    assert text == thresholds_toml(), (
        "ci/thresholds.toml is out of date with parity.core.gates.Thresholds.for_dtype; regenerate it: "
        "python -c \"from parity.core.gates import thresholds_toml; print(thresholds_toml(), end='')\" > ci/thresholds.toml"
    )
    for dtype in THRESHOLD_DTYPES:
        assert Thresholds.from_toml(ROOT / "ci" / "thresholds.toml", dtype) == Thresholds.for_dtype(dtype)


def test_thresholds_rendering_follows_a_changed_default(monkeypatch) -> None:
    """Negative control: a limit changed in the code changes the rendered file (so a stale file fails above)."""
    original = Thresholds.for_dtype

    def looser(dtype: str) -> Thresholds:
        th = original(dtype)
        return th.override(recompute_support_equal_frac=0.25) if dtype == "bfloat16" else th

    monkeypatch.setattr(Thresholds, "for_dtype", staticmethod(looser))
    assert "recompute_support_equal_frac = 0.25" in thresholds_toml()
    assert thresholds_toml() != (ROOT / "ci" / "thresholds.toml").read_text()


def test_gpu_steps_cover_dtypes_invariance_native_mask_ties_and_capture_table(tmp_path) -> None:
    gate = load_gate()
    steps = gate.steps("cuda", tmp_path)
    names = [s.name for s in steps]
    assert {"float32", "bfloat16", "float32 batch-invariant", "native mask vs top-K", "ties per batch size"} <= set(names)
    native = next(s for s in steps if s.name == "native mask vs top-K")
    assert native.cuda_only and "--capture" in native.argv and "both" in native.argv
    cli = [s for s in steps if s.runner == "parity"]
    assert all("cuda" in s.argv for s in cli)
    # Every CLI step's argv parses with the real CLI parser.
    from parity.cli.main import build_parser

    parser = build_parser()
    for s in cli:
        parser.parse_args(s.argv)
    # The capture-overhead table on CUDA: the rollout benchmark's gpu cases and their noise-floor check,
    # benchmarks enabled, written next to the summary.
    table = next(s for s in steps if s.name == "capture overhead table")
    assert table.cuda_only and table.runner == "pytest"
    bench = Path(table.argv[0])
    assert bench.name == "test_bench_rollout.py" and bench.exists()
    assert table.argv[table.argv.index("-m") + 1] == "gpu" and "--benchmark-only" in table.argv
    selected = table.argv[table.argv.index("-k") + 1]
    src = bench.read_text()
    assert all(f"def test_bench_{name}(" in src for name in selected.split(" or "))
    assert table.env["PARITY_BENCH_DIR"] == str(tmp_path / "bench")


def test_gpu_gate_refuses_cuda_without_a_gpu(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert load_gate().main(["--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


@pytest.mark.e2e
def test_gpu_gate_dry_run_on_cpu(tmp_path) -> None:
    """The gate's own code path, with --device cpu and tiny sizes: float32 and the tie step."""
    gate = load_gate()
    rc = gate.main(["--device", "cpu", "--small", "--in-process", "--out", str(tmp_path), "--only", "float32", "--only", "ties per batch size"])
    summary = (tmp_path / "summary.md").read_text()
    assert rc == 0, summary
    assert "| float32 | pass" in summary and "| ties per batch size | pass" in summary


def test_workflows_validate_and_a_broken_one_does_not(tmp_path) -> None:
    import shutil
    import subprocess

    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    if not Path(exe).exists():
        pytest.skip("check-jsonschema is not installed (it is in the test extra)")
    workflows = sorted(str(p) for p in (ROOT / ".github" / "workflows").glob("*.yml"))
    assert len(workflows) == 2
    ok = subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", *workflows], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = tmp_path / "broken.yml"
    broken.write_text((ROOT / ".github" / "workflows" / "cpu.yml").read_text().replace("runs-on:", "runs_on:"))
    bad = subprocess.run([exe, "--builtin-schema", "vendor.github-workflows", str(broken)], capture_output=True, text=True)
    assert bad.returncode != 0
