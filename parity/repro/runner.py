"""The one runner every reproduction goes through: a repro module measures, the runner does the rest.

A repro module holds only what is specific to its upstream bug (registry docstring lists the names):
``settings(small)``, ``run(ctx, cfg) -> Measured`` (its table rows, checks and notes), ``FINDING`` and
``COLUMNS`` (unless ``run`` measures them), and ``script_config(small)`` for its standalone script;
``TAKES_MODEL = True`` where ``--model`` may replace its fixture (then ``settings(small, model=...)``).
The runner names the result after the registry entry (number, name, title), stores the settings
in its data, times it, turns an exception into a failed result, writes ``result.json``/``table.md``
and prints the Markdown; it also emits the standalone scripts. The helpers below are the steps
several repros share: walking a sweep, pairing records with trainer logits, rendering a rounding-bound
detail, and the environment of a child process (engine start-ups that must not share this process's
state; :mod:`parity.repro.standalone_child` runs it and reads its traceback).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from parity.errors import UsageError
from parity.repro import standalone
from parity.repro.common import Check, Column, Context, ReproResult

if TYPE_CHECKING:  # pragma: no cover
    from parity.core.spec import SamplingSpec
    from parity.records.sequence import SequenceRecord
    from parity.repro.registry import Entry

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Measured:
    """What one repro's ``run`` returns: its table and verdicts, before the runner names and writes them."""

    rows: list[dict[str, Any]]
    checks: list[Check]
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # beside the settings, which the runner stores first
    finding: str | None = None  # measured (what a subprocess showed); None: the module's FINDING
    columns: list[Column] | None = None  # None: the module's COLUMNS


def columns(*spec: tuple[str, ...]) -> list[Column]:
    """A table's columns from ``(key, title[, format])`` tuples."""
    return [Column(*s) for s in spec]


def title(entry: Entry, module: Any) -> str:
    """The title a repro's report and script carry: the registry's, unless the module has a longer one."""
    return str(getattr(module, "TITLE", entry.title))


def takes_model(entry: Entry) -> bool:
    """Whether the repro can run on another model than its fixture (``parity repro NAME --model``)."""
    return bool(getattr(entry.load(), "TAKES_MODEL", False))


def settings_for(entry: Entry, module: Any, ctx: Context) -> dict[str, Any]:
    """The repro's settings for this invocation: ``settings(small)``, or ``settings(small, model)`` under ``--model``."""
    if ctx.model is None:
        return dict(module.settings(ctx.small))
    if not getattr(module, "TAKES_MODEL", False):
        raise UsageError(f"--model is not an option of repro {entry.name!r}: it runs on its own fixture")
    return dict(module.settings(ctx.small, model=ctx.model))


def run_entry(entry: Entry, ctx: Context) -> ReproResult:
    """Run one repro (no timing, no output): its module's measurement, named after the registry entry."""
    module = entry.load()
    cfg = settings_for(entry, module, ctx)
    m: Measured = module.run(ctx, cfg)
    return ReproResult(
        name=entry.name, number=entry.number, title=title(entry, module),
        finding=m.finding if m.finding is not None else module.FINDING,
        columns=m.columns if m.columns is not None else module.COLUMNS,
        rows=m.rows, checks=m.checks, notes=m.notes, data={"settings": cfg, **m.data},
    )


def run_entries(entries: Sequence[Entry], ctx: Context, out_for: Callable[[Entry], Path]) -> list[ReproResult]:
    """Run ``entries`` in order with a shared context; a repro that raises is reported as failed."""
    results = []
    for entry in entries:
        ctx.progress(f"parity repro: [{entry.number}] {entry.name} ...")
        start = time.perf_counter()
        try:
            res = run_entry(entry, ctx)
        except Exception as exc:  # noqa: BLE001 - one broken repro must not hide the others
            res = ReproResult(
                name=entry.name, number=entry.number, title=entry.title,
                finding="The reproduction did not run to completion.", columns=[], rows=[],
                checks=[Check("the reproduction runs to completion", False, f"{type(exc).__name__}: {exc}")],
            )
        res.seconds = time.perf_counter() - start
        res.write(out_for(entry))
        print(res.markdown(), flush=True)
        results.append(res)
    return results


def emit_script(entry: Entry, small: bool) -> str:
    """The repro's standalone script: its section of the script source, with its settings as ``CONFIG``."""
    module = entry.load()
    source = getattr(module, "SCRIPT_SOURCE", standalone.SOURCE)
    return standalone.emit(entry.name, title(entry, module), config=module.script_config(small), source=source,
                           about=getattr(module, "SCRIPT_ABOUT", None))


# --------------------------------------------------------------------------------------------------
# steps several repros share


def sweep(ctx: Context, items: Iterable[T], measure: Callable[[T], R], label: Callable[[T], str] | None = None) -> list[R]:
    """``measure(item)`` for each item in order, announcing ``label(item)`` first when given."""
    out = []
    for item in items:
        if label is not None:
            ctx.progress(f"parity repro: {label(item)}")
        out.append(measure(item))
    return out


def scored(records: Sequence[SequenceRecord], logits: Sequence[torch.Tensor]) -> Iterator[tuple[Any, torch.Tensor, torch.Tensor]]:
    """(record, its trainer logits ``[L, V]``, its sampled ids ``[L]`` as long) for each record."""
    for r, z in zip(records, logits, strict=True):
        yield r, z, torch.tensor(r.completion_ids, dtype=torch.long)


def bound_detail(rows: Sequence[dict[str, Any]], value: str, headroom: str, *, prefix: str = "max ",
                 suffix: str = " of the bound") -> str:
    """``max 1.2e-07 (0.31 of the bound), ...``: each row's value and its share of the rounding bound."""
    return prefix + ", ".join(f"{r[value]:.1e} ({r[headroom]:.2f}{suffix})" for r in rows)


def filter_kwargs(spec: SamplingSpec, keys: Sequence[str] = ("top_k", "top_p")) -> dict[str, Any]:
    """The filters ``spec`` sets among ``keys``, in that order: keyword arguments of a standalone script's sampler."""
    on = {"top_k": spec.uses_top_k, "top_p": spec.uses_top_p, "min_p": spec.uses_min_p}
    return {k: getattr(spec, k) for k in keys if on[k]}


def cpu_features() -> dict[str, Any]:
    """The CPU facts an engine-start failure can depend on (torch's kernel path, AVX-512 BF16, AMX)."""
    return {"capability": torch.backends.cpu.get_cpu_capability(),
            "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
            "amx_tile": bool(torch.cpu._is_amx_tile_supported())}


# --------------------------------------------------------------------------------------------------
# child processes

ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
              "TOKENIZERS_PARALLELISM": "false"}


def child_env(overrides: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """A child's environment: this process's, with the in-process CPU engine settings, this process's parity
    importable (``python -m parity...``) and ``overrides`` applied (None: unset)."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(ENGINE_ENV)
    for key, value in (overrides or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env
