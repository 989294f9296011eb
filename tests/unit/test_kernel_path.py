"""The second kernel path is real: under ATEN_CPU_CAPABILITY=default torch runs its non-vectorised kernels."""

from __future__ import annotations

import os

import pytest
import torch


def test_torch_runs_the_requested_kernel_path() -> None:
    requested = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if requested != "default":
        pytest.skip(f"ATEN_CPU_CAPABILITY={requested or '(unset)'}: the native pass; the second pass asks for default")
    # "default" exists on every CPU, which is why CI asks for it: the pass must not silently run native.
    assert torch.backends.cpu.get_cpu_capability() == "DEFAULT"
