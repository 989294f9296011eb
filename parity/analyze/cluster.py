"""``parity analyze --engine ray``: the records map step on a Ray cluster's workers, the merge and the report here.

Driver, workers, errors and imports: docs/records.md, section 8; row numbering per engine: README, "Scale".
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import numpy as np
import pyarrow as pa

from parity.analyze.shards import batch_summarizer, file_header
from parity.errors import EngineError, SetupError, TimedOut, UsageError
from parity.judge.accumulators import Summary
from parity.judge.token_columns import Options
from parity.records.arrays import RecordsBatch
from parity.records.read import open_records
from parity.records.schema import RecordsError
from parity.records.validate import validate_batch

if TYPE_CHECKING:
    from ray import ObjectRef

ENGINE_FORMS = "local; ray (a local Ray cluster, or the one RAY_ADDRESS names); ray://HOST:PORT"
# The note a worker adds to a RecordsError: this prefix, then the message as a JSON string.
ERROR_NOTE = "parity.records error (json): "


@dataclass(frozen=True)
class Engine:
    """Where the map step runs: ``kind`` local or ray; ``address`` a Ray address (None: a local cluster, or none)."""

    kind: str
    address: str | None = None

    @property
    def label(self) -> str:
        return self.kind if self.address is None else f"{self.kind} ({self.address})"


def parse_engine(text: str) -> Engine:
    """``--engine`` as given; refuses anything else, listing the allowed forms."""
    t = text.strip()
    if t == "local":
        return Engine("local")
    if t == "ray":
        return Engine("ray", os.environ.get("RAY_ADDRESS") or None)
    if t.startswith("ray://") and len(t) > len("ray://"):
        return Engine("ray", t)
    raise UsageError(f"--engine {text!r} is invalid: allowed {ENGINE_FORMS}")


def _require(module: str, extra: str) -> ModuleType:
    """Import an engine's package, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] == module.split(".")[0]:
            raise SetupError(f"parity analyze --engine {extra} needs {module.split('.')[0]}, which is not installed: "
                             f"pip install 'parity[{extra}]'") from None
        raise


# -- the map step on a worker ----------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """One records file as the workers need it: its index and name in the local analysis, its own columns
    (an engine's reader may add columns another shard has) and its metadata."""

    index: int
    source: str
    columns: tuple[str, ...]
    metadata: Mapping[str, object]
    rows: int


class MapStep:
    """The worker's side: rows of any files, each with its file and row number, → one :class:`Summary`.

    Picklable (it holds the shards and the options); the per-file summarizers are built on first use in
    each worker process."""

    def __init__(self, shards: Sequence[Shard], options: Options) -> None:
        self.shards = list(shards)
        self.options = options
        self.by_key = {k: i for i, s in enumerate(self.shards)
                       for k in (os.path.abspath(s.source), os.path.realpath(s.source))}
        self._summarizers: dict[int, Callable[[RecordsBatch], Summary]] = {}

    def __getstate__(self) -> dict[str, object]:
        return {"shards": self.shards, "options": self.options, "by_key": self.by_key}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._summarizers = {}

    def shard_of(self, reported: str) -> int:
        """The shard an engine's file name (a path, or a URI such as ``file:/a%20b/x.parquet``) refers to."""
        p = unquote(urlparse(reported).path) if reported.startswith("file:") else reported
        for k in (p, os.path.abspath(p), os.path.realpath(p)):
            if k in self.by_key:
                return self.by_key[k]
        raise EngineError(f"parity analyze: the engine read {reported!r}, which is none of the {len(self.shards)} "
                          f"records file(s) listed for it")

    def _summarize(self, j: int) -> Callable[[RecordsBatch], Summary]:
        if j not in self._summarizers:
            s = self.shards[j]
            self._summarizers[j] = batch_summarizer(dict(s.metadata), s.index, self.options)
        return self._summarizers[j]

    def summarize(self, table: pa.Table, files: np.ndarray, rows: np.ndarray) -> Summary:
        """``table``: rows of records files; ``files[i]``, ``rows[i]``: row i's file (as the engine names it)
        and row number in that file. Each run of consecutive rows of one file is validated under the
        file's name and row numbers, in batches of at most ``options.batch_rows`` rows."""
        out = Summary()
        n = table.num_rows
        if n == 0:
            return out
        names, inv = np.unique(np.asarray(files, dtype=object).astype(str), return_inverse=True)
        shard = np.array([self.shard_of(str(x)) for x in names], dtype=np.int64)[inv]
        rows = np.asarray(rows, dtype=np.int64)
        order = np.lexsort((rows, shard))
        if bool(np.any(order != np.arange(n))):
            table, shard, rows = table.take(pa.array(order)), shard[order], rows[order]
        cut = np.flatnonzero((np.diff(shard) != 0) | (np.diff(rows) != 1)) + 1
        step = max(1, int(self.options.batch_rows))
        try:
            for a, b in zip(np.r_[0, cut], np.r_[cut, n], strict=True):
                s = self.shards[int(shard[a])]
                run = table.slice(int(a), int(b - a)).select(list(s.columns))
                summarize = self._summarize(int(shard[a]))
                for c in range(0, int(b - a), step):
                    rb = validate_batch(run.slice(c, step), source=s.source, first_row=int(rows[a]) + c)
                    out.merge(summarize(rb))
        except RecordsError as exc:
            exc.add_note(ERROR_NOTE + json.dumps(str(exc)))
            raise
        return out


def records_error_in(exc: BaseException) -> str | None:
    """The message of a worker's RecordsError, from the note it carries through an engine's exception text."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        for text in (str(e), *(str(n) for n in getattr(e, "__notes__", ()))):
            i = text.find(ERROR_NOTE)
            if i >= 0:
                try:
                    msg = json.JSONDecoder().raw_decode(text, i + len(ERROR_NOTE))[0]
                except ValueError:
                    continue
                if isinstance(msg, str):
                    return msg
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]
    return None


# -- the driver ------------------------------------------------------------------------------------


def summarize_on_engine(
    engine: str | Engine, paths: Sequence[Path], options: Options, *, timeout_s: float = 3600.0,
    progress: Callable[[str], None] | None = None,
) -> Summary:
    """Every shard's summary computed on ``engine``'s workers, merged here (what the local path gives)."""
    eng = parse_engine(engine) if isinstance(engine, str) else engine
    if eng.kind != "ray":
        raise UsageError(f"summarize_on_engine runs ray, not {eng.kind!r}")
    say = progress or (lambda m: None)
    total = Summary()
    shards = []
    for i, p in enumerate(paths):
        f = open_records(p)  # the footer: the same refusals, in the same order, as the local analysis
        total.merge(file_header(str(p), f))
        shards.append(Shard(i, str(p), tuple(f.columns), dict(f.metadata), f.num_rows))
    step = MapStep(shards, options)
    targets = [os.path.abspath(s.source) for s in shards]
    say(f"parity analyze: {len(shards)} file(s) on {eng.label}")
    t0 = time.perf_counter()
    try:
        parts = _on_ray(eng, targets, step, timeout_s, say)
    except Exception as exc:
        msg = records_error_in(exc)
        if msg is not None:
            raise RecordsError(msg) from None
        raise
    for text in parts:
        total.merge(Summary.from_json(text))
    want = sum(s.rows for s in shards)
    if total.rows != want:
        raise EngineError(f"parity analyze --engine {eng.kind}: the engine delivered {total.rows} row(s) of the {want} the "
                          f"{len(shards)} file footer(s) hold: refusing a partial analysis")
    say(f"parity analyze: {len(parts)} summaries merged from {eng.label} in {time.perf_counter() - t0:.1f} s")
    return total


# -- Ray Data ---------------------------------------------------------------------------------------

_RAY_LOOKUPS: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}


def _ray_map(table: pa.Table, *, step: MapStep, lookup: ObjectRef) -> pa.Table:
    """map_batches' function: row numbers from the row hashes, then the map step."""
    import ray

    key = lookup.hex()
    if key not in _RAY_LOOKUPS:
        _RAY_LOOKUPS.clear()
        _RAY_LOOKUPS[key] = ray.get(lookup)
    tables = _RAY_LOOKUPS[key]
    files = table.column("path").to_numpy(zero_copy_only=False)
    hashes = table.column("row_hash").to_numpy(zero_copy_only=False).astype(np.uint64)
    rows = np.empty(table.num_rows, dtype=np.int64)
    for name in np.unique(files.astype(str)):
        at = np.flatnonzero(files == name)
        sorted_hashes, row_of = tables[step.shard_of(str(name))]
        i = np.clip(np.searchsorted(sorted_hashes, hashes[at]), 0, max(sorted_hashes.size - 1, 0))
        if sorted_hashes.size == 0 or bool(np.any(sorted_hashes[i] != hashes[at])):
            raise EngineError(f"parity analyze --engine ray: rows of {name} carry a row_hash the first pass did not "
                              f"see: the two reads of the file differ")
        rows[at] = row_of[i]
    s = step.summarize(table.drop_columns(["path", "row_hash"]), files, rows)
    return pa.table({"summary": [s.to_json()]})


def _ray_row_numbers(ray: ModuleType, targets: Sequence[str], step: MapStep) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per shard: its rows' hashes sorted, and the row number of each, from a pass in file order."""
    ctx = ray.data.DataContext.get_current()
    saved = ctx.execution_options.preserve_order
    ctx.execution_options.preserve_order = True
    try:
        ds = ray.data.read_parquet(list(targets), include_paths=True, include_row_hash=True, file_extensions=None)
        ds = ds.select_columns(["path", "row_hash"])
        seen: list[list[np.ndarray]] = [[] for _ in step.shards]
        for b in ds.iter_batches(batch_format="pyarrow", batch_size=None):
            files = b.column("path").to_numpy(zero_copy_only=False).astype(str)
            hashes = b.column("row_hash").to_numpy(zero_copy_only=False).astype(np.uint64)
            cut = np.flatnonzero(files[1:] != files[:-1]) + 1
            for a, e in zip(np.r_[0, cut], np.r_[cut, files.size], strict=True):
                if e > a:
                    seen[step.shard_of(str(files[a]))].append(hashes[a:e])
    finally:
        ctx.execution_options.preserve_order = saved
    out = []
    for s, parts in zip(step.shards, seen, strict=True):
        h = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint64)
        order = np.argsort(h, kind="stable")
        if h.size != s.rows or bool(np.any(np.diff(h[order]) == 0)):
            raise EngineError(f"parity analyze --engine ray: {s.source}: Ray Data listed {h.size} row hash(es) for "
                              f"the {s.rows} row(s) of the footer, or repeated one: cannot number the rows")
        out.append((h[order], order.astype(np.int64)))
    return out


def _on_ray(eng: Engine, targets: Sequence[str], step: MapStep, timeout_s: float, say: Callable[[str], None]) -> list[str]:
    ray = _require("ray", "ray")
    _require("ray.data", "ray")
    import logging

    started = not ray.is_initialized()
    if started:
        # Ray's own INFO and WARNING lines (cluster start, each dataset's plan) are engine chatter: errors only.
        if eng.address:
            ray.init(address=eng.address, logging_level=logging.ERROR)
        else:
            ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
    data_log = logging.getLogger("ray.data")
    level = data_log.level
    data_log.setLevel(logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    bars = ctx.enable_progress_bars
    ctx.enable_progress_bars = False
    deadline = time.monotonic() + timeout_s
    try:
        say("parity analyze: ray: numbering rows (path and row_hash, no data column)")
        lookup = ray.put(_ray_row_numbers(ray, targets, step))
        ds = ray.data.read_parquet(list(targets), include_paths=True, include_row_hash=True, file_extensions=None)
        mapped = ds.map_batches(_ray_map, batch_format="pyarrow", batch_size=None, fn_kwargs={"step": step, "lookup": lookup})
        parts = []
        for b in mapped.iter_batches(batch_format="pyarrow", batch_size=None):
            parts += b.column("summary").to_pylist()
            if time.monotonic() > deadline:
                raise TimedOut(f"parity analyze --engine {eng.kind}: the analysis did not finish within "
                               f"{timeout_s:.0f} s (raise --timeout)")
        return parts
    finally:
        ctx.enable_progress_bars = bars
        data_log.setLevel(level)
        if started:
            ray.shutdown()
