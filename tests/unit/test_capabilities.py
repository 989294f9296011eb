"""The kernel paths this machine runs, read from its CPU flags without torch, are the ones torch runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parity.determinism.capabilities import (
    capabilities_from_flags,
    cpu_flags,
    other_capabilities,
    supported_capabilities,
)

AVX512_XEON = "fpu sse sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl avx512cd"
AVX2_EPYC = "fpu sse sse2 avx avx2 fma bmi2"


@pytest.mark.parametrize(("flags", "want"), [
    (AVX512_XEON, ("default", "avx2", "avx512")),
    (AVX2_EPYC, ("default", "avx2")),
    ("fpu sse sse2 avx", ("default",)),  # AVX without AVX2: torch's vector paths need AVX2
    ("avx2", ("default",)),  # AVX2 without FMA: torch does not take it
    ("avx512f avx512bw avx512dq fma", ("default",)),  # AVX-512 without VL, and no avx2: neither
    ("", ("default",)),
])
def test_capabilities_from_flags(flags: str, want: tuple[str, ...]) -> None:
    assert capabilities_from_flags(flags.split()) == want


def test_cpuinfo_is_read_from_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {AVX2_EPYC}\n\nprocessor\t: 1\nflags\t: avx512vl\n")
    assert cpu_flags(info) == frozenset(AVX2_EPYC.split())
    assert supported_capabilities(info) == ("default", "avx2")
    assert supported_capabilities(tmp_path / "missing") == ("default",)


@pytest.mark.parametrize(("flags", "want"), [(AVX512_XEON, ("default", "avx2")), (AVX2_EPYC, ("default",)), ("", ("default",))])
def test_the_paths_run_again_after_the_native_pass(tmp_path: Path, flags: str, want: tuple[str, ...]) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text(f"flags\t: {flags}\n")
    assert other_capabilities(info) == want


def test_the_module_imports_no_torch() -> None:
    code = "import sys, parity.determinism.capabilities as c; c.supported_capabilities(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


def test_torch_runs_every_capability_the_flags_name() -> None:
    """Each path named is the one torch runs when asked for it (a path torch would silently downgrade would
    make the kernel-dependent pass under it a copy of another)."""
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    for cap in supported_capabilities():
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                             env=env)
        assert out.stdout.strip().lower() == cap, (cap, out.stdout)
