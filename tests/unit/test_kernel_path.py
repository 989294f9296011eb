"""The kernel path asked for is real: under ATEN_CPU_CAPABILITY=default torch runs its non-vectorised kernels, under
avx2 or avx512 those vector kernels."""

from __future__ import annotations

import os

import pytest
import torch


def test_torch_runs_the_requested_kernel_path() -> None:
    requested = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if not requested:
        pytest.skip("ATEN_CPU_CAPABILITY unset: the native pass; the later passes ask for each path by name")
    # A pass under a path must not silently run another (native): its numbers would be another pass's.
    assert torch.backends.cpu.get_cpu_capability() == requested.upper()
