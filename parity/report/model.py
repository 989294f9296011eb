"""report.json held to its types: :class:`~parity.report.blocks.ReportJson`, its scenario entries
(:class:`~parity.report.blocks.ScenarioJson`) and its environment (:class:`~parity.report.blocks.EnvironmentJson`).
Every producer's report passes :func:`checked_report` before it is written, so a key these types do not name is an
error; CI code reads a report with :func:`load_report` (docs/internals.md, section 9).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import cast

from parity.core.spec import SamplingSpec
from parity.core.violation import Position, Violation
from parity.errors import UsageError
from parity.report.blocks import EnvironmentJson, ReportJson, ScenarioJson

# report.json's layout version (3: the verdict "none" and no_verdict; 4: a missing statistic is null, not "n/a"; docs/running.md).
SCHEMA_VERSION = 4


def _float(x: object) -> float:
    if isinstance(x, (int, float, str)):
        return float(x)  # JSON's "inf" / "-inf" / "nan" strings back to floats
    raise TypeError(f"float() argument must be a string or a real number, not '{type(x).__name__}'")


def _list(x: object, where: str) -> list[object]:
    if not isinstance(x, list):
        raise UsageError(f"{where}: expected a list, got {type(x).__name__}")
    return x


def _mapping(x: object, where: str) -> Mapping[str, object]:
    if not isinstance(x, dict):
        raise UsageError(f"{where}: expected an object, got {type(x).__name__}")
    return x


def _keys(tp: type, data: object, where: str) -> dict[str, object]:
    """``data`` held to the TypedDict ``tp``: an unknown key or a missing required one is an error. The keys come
    back in ``tp``'s order, the required ones first; an optional block given as None is left out."""
    d = _mapping(data, where)
    names = list(tp.__annotations__)
    required: frozenset[str] = getattr(tp, "__required_keys__")  # noqa: B009 (a TypedDict class: mypy sees a plain type)
    unknown = sorted(set(d) - set(names))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}: allowed {', '.join(names)}")
    missing = [k for k in names if k in required and k not in d]
    if missing:
        raise UsageError(f"{where}: missing key(s) {', '.join(missing)}")
    order = [k for k in names if k in required] + [k for k in names if k not in required]
    return {k: d[k] for k in order if k in d and (k in required or d[k] is not None)}


def violation_from_json(d: Mapping[str, object]) -> Violation:
    """The inverse of :meth:`Violation.to_dict` (``message`` is derived, so it is read back, not stored).
    Strings and integers are passed on as written (the dataclasses do not check them)."""
    position: Callable[..., Position] = Position
    violation: Callable[..., Violation] = Violation
    worst = []
    for item in _list(d.get("worst", []), "report.json violation worst"):
        p = _mapping(item, "report.json violation position")
        worst.append(position(p.get("prompt"), p.get("position"), p.get("token"),
                              {k: _float(v) for k, v in _mapping(p.get("values") or {}, "position values").items()},
                              None if p.get("gap") is None else _float(p["gap"]),
                              None if p.get("bound") is None else _float(p["bound"]), p.get("note", "")))
    return violation(d["gate"], d["scenario"], _float(d["statistic"]), _float(d["limit"]), d["label"],
                     d.get("comparison", ">"), tuple(worst), d.get("detail", ""))


def _scenario(data: object) -> ScenarioJson:
    where = f"report.json scenario {data.get('name') if isinstance(data, dict) else '?'}"
    d = _keys(ScenarioJson, data, where)
    d["spec"] = SamplingSpec.from_dict(_mapping(d["spec"], f"{where} spec")).to_dict()  # its values checked
    for key in ("violations", "reference_violations"):
        d[key] = [violation_from_json(_mapping(v, f"{where} {key}")).to_dict() for v in _list(d[key], f"{where} {key}")]
    if d.get("capture_plan") is not None:
        from parity.core.capture import CaptureStats  # imports torch: loaded where a capture plan is read

        d["capture_plan"] = CaptureStats.from_dict(dict(_mapping(d["capture_plan"], f"{where} capture_plan"))).to_dict()
    return cast("ScenarioJson", d)


def checked_report(data: object) -> ReportJson:
    """``data`` as report.json writes it: every key known, every required key present, in the types' order; the
    spec, the violations and the capture plan read back through their own types (a bad value is an error)."""
    d = _keys(ReportJson, data, "report.json")
    if d["schema_version"] != SCHEMA_VERSION:
        raise UsageError(f"report.json schema_version {d['schema_version']!r}: this parity reads {SCHEMA_VERSION}")
    d["environment"] = cast("EnvironmentJson", _keys(EnvironmentJson, d["environment"], "report.json environment"))
    d["scenarios"] = [_scenario(s) for s in _list(d["scenarios"], "report.json scenarios")]
    return cast("ReportJson", d)


def load_report(path: str | Path) -> ReportJson:
    """A report.json file (or the folder holding one), checked (:func:`checked_report`)."""
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"{p}: no report.json there") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}: not JSON ({e})") from None
    return checked_report(data)
