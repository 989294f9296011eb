"""Which torch CPU kernel paths (``ATEN_CPU_CAPABILITY`` values) this machine can run, from its CPU flags
alone: nothing here imports torch, so nox can ask while it builds its sessions. Each path sums a row in
its own order (docs/error_model.md, section 9); the kernel-dependent tests run under every one."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
# In the order torch ranks them. ATen's get_cpu_capability (aten/src/ATen/native/DispatchStub.cpp) takes
# AVX512 when the CPU has avx512vl, avx512bw, avx512dq and fma, AVX2 when it has avx2 and fma; "default"
# (the non-vectorised kernels) runs everywhere.
REQUIRED_FLAGS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "avx2": frozenset({"avx2", "fma"}),
    "avx512": frozenset({"avx512vl", "avx512bw", "avx512dq", "fma"}),
}


def capabilities_from_flags(flags: Iterable[str]) -> tuple[str, ...]:
    """The ``ATEN_CPU_CAPABILITY`` values a CPU with these flags runs, in torch's order (the last is native)."""
    have = {f.lower() for f in flags}
    return tuple(cap for cap, need in REQUIRED_FLAGS.items() if need <= have)


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The x86 feature flags of the first processor in ``cpuinfo`` (empty where there is none: another OS or
    architecture, where torch's vector paths named here do not exist)."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def supported_capabilities(cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """Every ``ATEN_CPU_CAPABILITY`` this machine runs: ``("default",)`` at least, then ``avx2`` and ``avx512``
    where the CPU has them (the last is the path torch picks by itself)."""
    return capabilities_from_flags(cpu_flags(cpuinfo))


def other_capabilities(cpuinfo: Path = CPUINFO) -> tuple[str, ...]:
    """The paths to run again after a native pass: every supported one but the native, ``default`` at least (on a
    CPU whose flags name no x86 vector path, such as ARM, torch's native path is not ``default`` either)."""
    caps = supported_capabilities(cpuinfo)
    return caps[:-1] or ("default",)
