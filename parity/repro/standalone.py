"""Emit a reproduction as one standalone Python script (torch, transformers and vLLM only).

The script text is cut from ``standalone_src.py``: its ``prelude`` section (environment, a tiny Llama
built from code, vLLM sampling, parity's filters and rounding bound, table printing) plus the repro's
section, then its settings as a ``CONFIG`` literal and a ``__main__`` guard. Each ``# @inline`` parity
import is replaced by that module's code, so the script runs anywhere vLLM does, without parity.
"""

from __future__ import annotations

import pprint
import re
from collections.abc import Mapping
from pathlib import Path

SOURCE = Path(__file__).with_name("standalone_src.py")
# The reproductions that run TRL's trainer: their own prelude (TRL, datasets and a tokenizer built from code).
TRL_SOURCE = Path(__file__).with_name("standalone_trl_src.py")
_MARK = re.compile(r"^# =+ section: (?P<name>[a-z0-9_]+) =+$", re.MULTILINE)
# ``from parity.X import ...  # @inline parity.X`` in the source (or ``import (  # @inline parity.X`` and the
# names on the lines up to ``)``) is replaced by module X's own code, so an emitted script carries the rule
# parity applies instead of a copy that could drift from it.
_INLINE = re.compile(r"^from (?P<module>parity\.[a-z_.]+) import (?:\(  # @inline (?P=module)\n[^)]*\)|.*# @inline (?P=module))$",
                     re.MULTILINE)
# An inlined module's own parity imports (parity.errors: the error classes it raises) are inlined in turn.
_NESTED = re.compile(r"^from (?P<module>parity\.[a-z_.]+) import [^\n(]*$", re.MULTILINE)


def _module_body(module: str, seen: set[str] | None = None) -> str:
    """A parity module's source without its docstring and ``from __future__`` line; the parity modules it
    imports from are inlined before it (once per script: ``seen``)."""
    import ast
    import importlib

    seen = set() if seen is None else seen
    seen.add(module)

    text = Path(importlib.import_module(module).__file__ or "").read_text(encoding="utf-8")
    tree = ast.parse(text)
    body = [n for n in tree.body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    body = [n for n in body if not (isinstance(n, ast.ImportFrom) and n.module == "__future__")]
    lines = text.splitlines()
    start = body[0].lineno - 1 if body else len(lines)
    code = "\n".join(lines[start:]).strip("\n")
    code = _NESTED.sub(lambda m: "" if m.group("module") in seen else _module_body(m.group("module"), seen), code)
    return f"# ---- inlined from {module} ----\n{code}\n# ---- end of {module} ----"


def inline(text: str, seen: set[str] | None = None) -> str:
    """Replace every ``# @inline`` import with the module it names (once per script: ``seen``)."""
    seen = set() if seen is None else seen
    return _INLINE.sub(lambda m: "" if m.group("module") in seen else _module_body(m.group("module"), seen), text)


def sections(source: Path = SOURCE) -> dict[str, str]:
    """Section name -> its source text, in file order."""
    text = source.read_text(encoding="utf-8")
    marks = list(_MARK.finditer(text))
    out: dict[str, str] = {}
    for i, m in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        out[m.group("name")] = text[m.end() : end].strip("\n") + "\n"
    return out


def source_of(name: str) -> Path:
    """The script source that holds the repro's section."""
    return TRL_SOURCE if name in sections(TRL_SOURCE) else SOURCE


def finding(name: str) -> str:
    """What a repro shows when its checks hold: its section's ``repro_NAME`` docstring (the section inlined: a
    repro may live in a module of its own that the section imports)."""
    import ast

    tree = ast.parse(inline(sections(source_of(name))[name]))
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == f"repro_{name}")
    return " ".join((ast.get_docstring(fn) or "").split())


def emit(name: str, title: str, *, config: Mapping[str, object], about: str | None = None) -> str:
    """The script text; ``about`` replaces the docstring's paragraph on what it needs and does (and its usage line)."""
    source = source_of(name)
    parts = sections(source)
    try:
        from importlib.metadata import version

        made_by = f"parity {version('parity')}"
    except Exception:  # noqa: BLE001 - a source checkout without installed metadata
        made_by = "parity (source checkout)"
    if about is None:
        about = (
            ("Needs only torch, transformers and vLLM; " if source == SOURCE else "Needs torch, transformers, vLLM, TRL and datasets; ")
            + "builds its tiny model from code and downloads nothing.\n"
            "It samples with vLLM (processed log-probs), scores the same tokens with transformers, prints a\n"
            "Markdown table and the checks, and exits 0 when the finding reproduces, 1 when it does not.\n\n"
            f"    python {name}.py {'[--prompts N] [--tokens L] ' if source == SOURCE else ''}[--seed S] [--json PATH]\n"
        )
    header = (
        "#!/usr/bin/env python3\n"
        f'"""{title}.\n\n'
        f"Standalone reproduction emitted by `parity repro {name} --emit-script` ({made_by}).\n"
        + about
        + '"""\n\n'
    )
    cfg = "CONFIG = " + pprint.pformat(config, sort_dicts=False, width=100) + "\n"
    main = (
        '\n\nif __name__ == "__main__":\n'
        f"    ARGS = parse_args(CONFIG, {title!r})\n"
        f"    sys.exit(report(repro_{name}(CONFIG, ARGS), ARGS.json))\n"
    )
    seen: set[str] = set()
    return header + inline(parts["prelude"], seen) + "\n\n" + cfg + "\n\n" + inline(parts[name], seen) + main
