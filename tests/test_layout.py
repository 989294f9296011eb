"""The layout is the architecture: layer rules, the README's tree, and no pointer to a file that is not here."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARITY = ROOT / "parity"
ENGINE_MODULES = {"vllm", "transformers", "tokenizers", "trl"}  # never imported by core or records
USER_EXAMPLE_PATHS = {"tests/test_my_trainer.py"}  # the reader's own test file in README's example
# Modules of parity's top level that every layer may import: they import nothing of parity themselves.
SHARED = {"errors"}
# layer -> the parity layers it may import (itself always allowed)
ALLOWED = {
    "core": {"core"},
    "records": {"core", "records", "report"},
    "judge": {"core", "records", "report"},  # judge() builds the report's typed scenario entries
    "report": {"core"},  # renders what the core declares (the RL catalogue), never an engine
    "determinism": {"core", "records", "judge", "report"},
}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_layers_import_only_what_they_may() -> None:
    problems = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((PARITY / layer).rglob("*.py")):
            for mod in _imports(path):
                top = mod.split(".")[0]
                if top in ENGINE_MODULES and layer in ("core", "records", "judge"):
                    problems.append(f"{path.relative_to(ROOT)} imports the engine module {mod}")
                if top == "parity":
                    used = mod.split(".")[1] if "." in mod else ""
                    if used != layer and used not in allowed | SHARED:
                        problems.append(f"{path.relative_to(ROOT)} imports {mod} (allowed: {sorted(allowed | {layer})})")
    for name in sorted(SHARED):
        path = PARITY / f"{name}.py"
        problems += [f"{path.relative_to(ROOT)} imports {mod}: a shared module imports nothing of parity"
                     for mod in sorted(_imports(path)) if mod.split(".")[0] == "parity"]
    assert not problems, "\n".join(problems)


def test_the_layers_contract_holds_and_no_module_imports_itself_in_a_circle() -> None:
    """pyproject's import-linter contract (every layer imports only from below), and no cycle of modules."""
    import json
    import os
    import shutil
    import sys

    exe = Path(sys.executable).parent / "lint-imports"  # the test environment's own (import-linter, the test extra)
    proc = subprocess.run([str(exe) if exe.exists() else shutil.which("lint-imports") or "lint-imports"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "1 kept, 0 broken" in proc.stdout, proc.stdout + proc.stderr
    # The graph of this checkout's source (a subprocess, source first on the path), not of whatever copy
    # of parity this process imported (an installed one can hold files the tree no longer has).
    code = ("import grimp, json; g = grimp.build_graph('parity'); print(json.dumps(sorted("
            "(a, b) for a in g.modules for b in g.find_modules_directly_imported_by(a) "
            "if b != a and g.chain_exists(importer=b, imported=a))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    found = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert found.returncode == 0, found.stderr
    cycles = json.loads(found.stdout)
    assert not cycles, cycles[:5]


def test_readme_tree_matches_the_packages() -> None:
    text = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    section = text.split("## How the code is laid out", 1)[1]
    tree = section.split("```", 2)[1]
    listed = set(re.findall(r"^parity/([a-z_]+)/", tree, re.M))
    packages = {p.parent.name for p in PARITY.glob("*/__init__.py")}
    assert listed == packages, f"README lists {sorted(listed)}, the tree has {sorted(packages)}"
    for name in re.findall(r"^parity/([a-z_]+\.py)", tree, re.M):
        assert (PARITY / name).is_file(), f"README names parity/{name}, which does not exist"


def _tracked_text_files() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    keep = (".py", ".md", ".toml", ".yml", ".txt")
    return [ROOT / f for f in out if f.endswith(keep) and (ROOT / f).is_file()]


def test_no_pointer_to_what_is_not_in_the_repository() -> None:
    """No design notes, reference folders or tracker numbers that a reader of the repository cannot open,
    and every repository path a file names exists."""
    banned = re.compile(r"DESIGN\.md|shared/references|\bissue \d+|\bissue's\b", re.I)
    path_ref = re.compile(r"(?<![\w./-])((?:parity|tests|ci|fixtures|\.github)/[\w./-]*\w)")
    problems = []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            where = f"{path.relative_to(ROOT)}:{i}"
            if banned.search(line):
                problems.append(f"{where}: {line.strip()}")
            for ref in path_ref.findall(line):
                if "*" in ref or "{" in ref or ref.endswith(("/NAME", "/")) or ref in USER_EXAMPLE_PATHS:
                    continue
                if not (ROOT / ref).exists() and not (ROOT / ref.rstrip(".")).exists():
                    problems.append(f"{where}: names {ref}, which is not in the repository")
    assert not problems, "\n".join(problems)


# Dotted names that are placeholders or deliberately absent (a test of the error for an unknown command),
# and the installed-only package the fixtures folder becomes (pyproject's package-dir).
DOTTED_NOT_MODULES = {"parity.X", "parity.repro.NAME", "parity.cli.no_such_command"}
INSTALLED_ONLY = {"parity.fixture_data": ROOT / "fixtures"}


def _resolves(name: str) -> bool:
    """``parity.a.b.C``: an importable module, then attributes of it, all the way."""
    import importlib

    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as exc:
            if exc.name and not exc.name.startswith("parity"):
                return True  # the module is there; an optional dependency of it is not installed
            continue
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_parity_name_resolves() -> None:
    """Docstrings, comments and docs that name ``parity.x.y`` name a module or attribute that exists."""
    dotted = re.compile(r"(?<![\w/.-])parity(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
    problems = []
    for path in _tracked_text_files():
        if path == Path(__file__).resolve():
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for name in dotted.findall(line):
                if name in DOTTED_NOT_MODULES or (name in INSTALLED_ONLY and INSTALLED_ONLY[name].is_dir()):
                    continue
                if not _resolves(name):
                    problems.append(f"{path.relative_to(ROOT)}:{i}: names {name}, which does not resolve")
    assert not problems, "\n".join(problems)


def test_dotted_name_check_tells_a_stale_name_from_a_live_one() -> None:
    assert _resolves("parity.core.error_model.logprob_rounding_bound")
    assert _resolves("parity.core.sequence.SequenceRecord")
    assert not _resolves("parity.rounding")  # a module that moved
    assert not _resolves("parity.records.SequenceRecord")  # an attribute the package does not export


README = ROOT / "README.md"


def test_readme_is_a_front_door() -> None:
    """Short, a runnable example early, and every module it names is the public API."""
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 300, f"README is {len(lines)} lines: deep topics belong in docs/"
    first = next(i for i, ln in enumerate(lines, 1) if ln.startswith("```python"))
    assert first <= 60, f"README's first runnable example starts at line {first}"
    import parity.api

    unquoted = re.sub(r'"[^"\n]*"', '""', text)  # a metadata key such as "parity.records" is not a module
    named = set(re.findall(r"\bparity(?:\.[A-Za-z_]\w*)+", unquoted))
    for dotted in sorted(named):
        parts = dotted.split(".")
        assert parts[1] == "api", f"README names {dotted}: only parity.api is public"
        assert len(parts) == 2 or parts[2] in parity.api.__all__, f"README names {dotted}, not in parity.api"
    for module in re.findall(r"^\s*(?:from|import) (parity[\w.]*)", text, re.M):
        assert module == "parity.api", f"README imports {module}"


def test_the_public_api_resolves_every_name() -> None:
    import parity.api

    for name in parity.api.__all__:
        if name == "patch_grpo" and importlib.util.find_spec("trl") is None:
            continue
        assert getattr(parity.api, name) is not None, name
    with pytest.raises(AttributeError, match="its names"):
        parity.api.no_such_name  # noqa: B018
