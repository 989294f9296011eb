"""Install sets: every package parity imports comes from its base install or a named extra, a missing one is a
user error that names the extra, and a closed pipe ends a command quietly (ci/install_check.py runs the same
tables inside every nox session, on the real install set)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from parity.errors import OPTIONAL_PACKAGES

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("install_check", REPO / "ci" / "install_check.py")
assert _spec and _spec.loader
install_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(install_check)
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _names(reqs: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in reqs}


def test_every_third_party_import_is_the_base_installs_or_an_extras_that_declares_it() -> None:
    base = _names(PROJECT["dependencies"])
    extras = {k: _names(v) for k, v in PROJECT["optional-dependencies"].items()}
    imported = set().union(*install_check.parity_modules().values())
    assert imported, "the scan found no import at all"
    for module in sorted(imported):
        if module in install_check.GUARDED_MODULES:
            continue
        if module in install_check.BASE_MODULES:
            assert canonicalize_name(install_check.BASE_MODULES[module]) in base, module
            continue
        assert module in OPTIONAL_PACKAGES, f"parity imports {module!r}, which neither the base install nor an extra provides"
        dist, extra = OPTIONAL_PACKAGES[module]
        assert canonicalize_name(dist) in extras[extra], f"{module!r}: extra {extra!r} does not declare {dist!r}"


def test_the_real_checkpoints_build_packages_come_with_the_real_extra_alone() -> None:
    from parity.fixtures import build_requires, load_recipe

    needs = build_requires(load_recipe("smollm2-135m"))
    assert set(needs) == {"gguf", "accelerate"}
    real = _names(PROJECT["optional-dependencies"]["real"])
    assert {canonicalize_name(OPTIONAL_PACKAGES[m][0]) for m in needs} <= real


def test_the_scan_sees_function_level_imports_and_require_calls(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import os\nfrom parity.errors import require\n\ndef f():\n    import ray.data\n"
                   "    require('gguf', 'accelerate')\n")
    assert install_check.third_party_imports(src) == {"ray", "gguf", "accelerate"}


def _hiding(tmp_path: Path, *modules: str) -> dict[str, str]:
    """An environment whose interpreters cannot import ``modules``, exactly as if they were not installed
    (``import`` raises ModuleNotFoundError and importlib.util.find_spec returns None)."""
    site = tmp_path / "hide"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "PARITY_FIXTURE_CACHE": str(tmp_path / "empty-cache")}


def _parity(*args: str, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "parity.cli.main", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_without_accelerate_doctor_fails_and_run_is_a_user_error_naming_the_extra(tmp_path: Path) -> None:
    env = _hiding(tmp_path, "accelerate")
    probe = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('accelerate'))"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert probe.stdout.strip() == "None", probe.stderr
    doctor = _parity("doctor", "--quiet", env=env)
    assert doctor.returncode == 1, doctor.stdout + doctor.stderr
    (line,) = [ln for ln in doctor.stdout.splitlines() if "fixture build" in ln]
    assert "FAIL" in line and "smollm2-135m" in line and "'accelerate'" in line
    assert "pip install 'parity[real]'" in doctor.stdout
    run = _parity("run", "--model", "smollm2-135m", "--out", str(tmp_path / "out"), env=env)
    assert run.returncode == 2, run.stdout + run.stderr
    errors = [ln for ln in run.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "'accelerate' is not installed" in errors[0] and "parity[real]" in errors[0], run.stderr
    assert "internal error" not in run.stderr and "Traceback" not in run.stderr
    assert "wrote nothing" not in run.stderr


def test_a_module_a_command_imports_and_lacks_is_a_user_error(tmp_path: Path) -> None:
    env = _hiding(tmp_path, "matplotlib")
    code = ("import sys; from parity.cli import main as m\n"
            "def boom(args):\n    import matplotlib.pyplot\n"
            "m.COMMANDS['x'] = ('parity.cli.matrix', 'x')\n"
            "import parity.cli.matrix as mx; mx.main = boom\n"
            "sys.exit(m.main(['x']))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "'matplotlib' is not installed" in proc.stderr and "pip install 'parity[report]'" in proc.stderr
    assert "internal error" not in proc.stderr


def test_a_closed_pipe_ends_the_command_quietly() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "parity.cli.main", "matrix"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line, as `| head -0` would be
    err = proc.stderr.read()
    rc = proc.wait(timeout=120)
    assert rc == 141 and err == "", (rc, err)


@pytest.mark.parametrize("pipeline", ["parity matrix | head -1"])
def test_parity_matrix_into_head(pipeline: str) -> None:
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.run(["bash", "-c", pipeline], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1
    assert "internal error" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
