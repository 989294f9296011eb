"""The RL catalogue (parity/data/rl_catalogue.toml) read into :mod:`parity.core.rl`'s metrics and methods, and
the RL view of a trainer's tokens: every metric and method on them (:func:`summarize`)."""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TypedDict, TypeVar

import torch

from parity.core.rl import ASSUMPTION, Method, Metric, Mismatch, Threshold
from parity.errors import PathNotFound, UsageError

CATALOGUE = "rl_catalogue.toml"  # the packaged metrics and methods, in parity/data/


class _Wrong(Exception):
    """A catalogue value of the wrong type; the message is what is allowed."""


def _text(v: object) -> str:
    if not isinstance(v, str):
        raise _Wrong("a string")
    return v


def _number(v: object) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _Wrong("a number (inf and -inf included)")
    return float(v)


def _texts(v: object) -> tuple[str, ...]:
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise _Wrong("a non-empty list of strings")
    return tuple(v)


def _interval(v: object) -> tuple[float, float]:
    if not isinstance(v, list) or len(v) != 2:
        raise _Wrong("[low, high], two numbers")
    try:
        return _number(v[0]), _number(v[1])
    except _Wrong:
        raise _Wrong("[low, high], two numbers") from None


def _threshold(v: object) -> Threshold:
    allowed = "{ limit = <number>, op = '<=' or '<', source = <string> }"
    if not isinstance(v, dict) or set(v) != {"limit", "op", "source"}:
        raise _Wrong(allowed)
    try:
        return Threshold(_number(v["limit"]), _text(v["op"]), _text(v["source"]))
    except _Wrong:
        raise _Wrong(allowed) from None


# Per table of the file: how each key's value is read.
_TABLES: dict[str, dict[str, Callable[[object], object]]] = {
    "metric": {**dict.fromkeys(("framework", "name", "level", "statistic", "source", "values", "reduce", "compute"), _text),
               "threshold": _threshold},
    "method": {"name": _text, "frameworks": _texts, "level": _text, "statistic": _text, "interval": _interval,
               "action": _text, "source": _text, "sign": _text, "weight": _text, "dual_clip": _number, "note": _text},
}
E = TypeVar("E", Metric, Method)


class TrainerSummary(TypedDict):
    """:func:`summarize`'s numbers (None = undefined); ``methods``: per method and sign, its result's numbers."""

    tokens: int
    sequences: int
    empty_sequences: int
    excluded_nan: int
    metrics: dict[str, float | None]
    over_threshold: list[str]
    methods: dict[str, dict[str, dict[str, float | None]]]


def _entries(doc: Mapping[str, object], table: str, kind: type[E], where: str) -> list[E]:
    readers = _TABLES[table]
    make: Callable[..., E] = kind  # called with each key's value as its reader gives it
    raw = doc.get(table, [])
    if not isinstance(raw, list):
        raise UsageError(f"{where}: {table}={raw!r} is invalid: allowed [[{table}]] tables")
    required = [f.name for f in dataclasses.fields(kind) if f.default is dataclasses.MISSING]
    out = []
    for i, entry in enumerate(raw, 1):
        what = f"{where}, [[{table}]] {i}"
        if not isinstance(entry, dict):
            raise UsageError(f"{what}: {entry!r} is invalid: allowed a table")
        what += f" ({entry['name']!r})" if isinstance(entry.get("name"), str) else ""
        missing = [k for k in required if k not in entry]
        if missing:
            raise UsageError(f"{what}: {', '.join(missing)} missing: required {', '.join(required)}")
        kwargs = {}
        for key, value in entry.items():
            if key not in readers:
                raise UsageError(f"{what}: {key}={value!r} is not a field: allowed {', '.join(readers)}")
            try:
                kwargs[key] = readers[key](value)
            except _Wrong as e:
                raise UsageError(f"{what}: {key}={value!r} is invalid: allowed {e}") from None
            except UsageError as e:  # a threshold's own check
                raise UsageError(f"{what}: {key}: {e}") from None
        try:
            out.append(make(**kwargs))
        except UsageError as e:
            raise UsageError(f"{what}: {e}") from None
    return out


def load_catalogue(path: str | Path | None = None) -> tuple[tuple[Metric, ...], tuple[Method, ...]]:
    """The ``[[metric]]`` and ``[[method]]`` entries of a catalogue file (TOML), each checked; by default the
    packaged parity/data/rl_catalogue.toml, whose header documents the fields. Entries of one's own in the same
    form go to :func:`summarize`."""
    if path is None:
        where = f"parity/data/{CATALOGUE}"
        text = (resources.files("parity") / "data" / CATALOGUE).read_text(encoding="utf-8")
    else:
        where = str(path)
        try:
            text = Path(path).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise PathNotFound(f"catalogue file {where!r} does not exist: allowed a TOML file") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"{where}: not valid TOML: {e}") from None
    for key in doc:
        if key not in _TABLES:
            raise UsageError(f"{where}: {key}={doc[key]!r} is not a table of the catalogue: allowed [[metric]], [[method]]")
    metrics, methods = tuple(_entries(doc, "metric", Metric, where)), tuple(_entries(doc, "method", Method, where))
    _check_unique(metrics, f"{where}: metric")
    _check_unique(methods, f"{where}: method")
    return metrics, methods


def _check_unique(entries: Sequence[Metric] | Sequence[Method], kind: str) -> None:
    names = [e.name for e in entries]
    for name in names:
        if names.count(name) > 1:
            raise UsageError(f"{kind} name {name!r} is used twice: allowed unique names")


METRICS, METHODS = load_catalogue()


def summarize(
    m: Mismatch, *, metrics: Sequence[Metric] = METRICS, methods: Sequence[Method] = METHODS
) -> TrainerSummary:
    """Every metric and every method on one trainer's tokens, as plain numbers (None = undefined)."""
    values = {e.name: e.value(m) for e in metrics}
    over = [e.name for e in metrics if e.threshold is not None and e.threshold.holds(values[e.name]) is False]
    return {
        "tokens": m.tokens,
        "sequences": m.sequences,
        "empty_sequences": m.empty_sequences,
        "excluded_nan": m.excluded_nan,
        "metrics": values,
        "over_threshold": over,
        "methods": {e.name: {s: e.apply(m, s).to_dict() for s in e.signs} for e in methods},
    }


def summarize_trainers(
    sampler: torch.Tensor, trainers: Mapping[str, torch.Tensor], seq_lengths: Sequence[int]
) -> dict[str, TrainerSummary]:
    """The RL view of several trainers scored against one sampler, on the flat token layout."""
    return {name: summarize(Mismatch.from_flat(lp, sampler, seq_lengths)) for name, lp in trainers.items()}


def catalogue() -> dict[str, object]:
    """What each entry is (for report.json): the assumption, the metrics and the methods."""
    return {
        "assumption": ASSUMPTION,
        "metrics": [e.describe() for e in METRICS],
        "methods": [e.describe() for e in METHODS],
    }
