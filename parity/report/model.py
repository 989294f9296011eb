"""report.json as types: :class:`Report`, its :class:`ScenarioVerdict` entries and its :class:`Environment`.

Every producer's report passes through :meth:`Report.from_json` before it is written, so a key that
these types do not name is an error, not a silent extra; CI code reads a report with
:func:`load_report`. The statistics blocks (``replay``, ``is_ratio``, ...) stay mappings: their keys
are the JSON Schema's (:func:`parity.report.schema.report_schema`). The capture plan is
:class:`parity.core.capture.CaptureStats`; violations are :class:`parity.core.violation.Violation`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from parity.core.spec import SamplingSpec
from parity.core.violation import Position, Violation
from parity.errors import UsageError
from parity.report.blocks import (
    Bound,
    Diff,
    DriftHeadroom,
    DriftSplit,
    Dtypes,
    EngineSettingEffect,
    IsRatio,
    JsonObject,
    LogS,
    MeanBiasEntries,
    MeanMax,
    Naive,
    NativeCapture,
    NotEvaluated,
    PerEstimator,
    Records,
    RoundingBound,
    Routing,
    SamplerLogS,
    StepJson,
    TrainerUnderTest,
    TrendJson,
    TrlFacts,
)

# report.json's layout version (3: the verdict "none" and no_verdict; README, reading a report).
SCHEMA_VERSION = 3

if TYPE_CHECKING:
    from parity.core.capture import CaptureStats  # imports torch: loaded where a capture plan is read

T = TypeVar("T")


def _float(x: Any) -> float:
    return float(x)  # JSON's "inf" / "-inf" / "nan" strings back to floats


def _fields(cls: type[T], data: Any, where: str) -> dict[str, Any]:
    """``data``'s keys checked against ``cls``'s fields: an unknown key or a missing required one is an error."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected an object, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}: allowed {', '.join(names)}")
    required = [f.name for f in dataclasses.fields(cls)  # type: ignore[arg-type]
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        raise UsageError(f"{where}: missing key(s) {', '.join(missing)}")
    return dict(data)


def _to_json(obj: Any) -> dict[str, Any]:
    """A report type's JSON: each field's own ``to_json``/``to_dict`` (lists element-wise); an optional block
    the producer did not give (None, with a None default) is left out."""

    def value(v: Any) -> Any:
        if isinstance(v, list):
            return [value(x) for x in v]
        return v.to_json() if hasattr(v, "to_json") else v.to_dict() if hasattr(v, "to_dict") else v

    return {f.name: value(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if not (getattr(obj, f.name) is None and f.default is None)}


def violation_from_json(d: dict[str, Any]) -> Violation:
    """The inverse of :meth:`Violation.to_dict` (``message`` is derived, so it is read back, not stored)."""
    worst = tuple(
        Position(p.get("prompt"), p.get("position"), p.get("token"),
                 {k: _float(v) for k, v in (p.get("values") or {}).items()},
                 None if p.get("gap") is None else _float(p["gap"]),
                 None if p.get("bound") is None else _float(p["bound"]), p.get("note", ""))
        for p in d.get("worst", ())
    )
    return Violation(d["gate"], d["scenario"], _float(d["statistic"]), _float(d["limit"]), d["label"],
                     d.get("comparison", ">"), worst, d.get("detail", ""))


@dataclass
class Environment:
    """Where a report was produced: versions, device, dtypes, determinism knobs (and, for an analysis of
    records, the versions that produced them beside the analysing machine's)."""

    vllm: str | None
    torch: str | None
    transformers: str | None
    parity: str | None
    python: str
    device: str
    dtype: str
    trainer_dtype: str
    determinism: JsonObject
    analysis_machine: JsonObject | None = None
    sampler: str | None = None
    sampler_version: str | None = None
    batch_invariant_mode: JsonObject | None = None  # parity run: what the batch-invariance knobs did
    trl: str | None = None  # the TRL capture: TRL's version

    @classmethod
    def from_json(cls, data: Any) -> Environment:
        return cls(**_fields(cls, data, "report.json environment"))

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ScenarioVerdict:
    """One scenario's entry: what was compared, every statistic, the verdict and its violations."""

    name: str
    spec: SamplingSpec
    tokens: int
    compared_tokens: int
    sequences: int
    log_s: LogS
    naive: Naive
    replay: Diff
    recompute: Diff
    is_ratio: IsRatio
    kl_over_support: MeanMax
    tv_over_support: MeanMax
    incomplete_positions: int
    sampled_outside_support: int
    token_mismatch: int
    headroom: PerEstimator
    mean_bias_limit: PerEstimator
    mean_bias: MeanBiasEntries
    bound: Bound | None
    sampler_log_s: SamplerLogS
    drift_split: DriftSplit
    captured_positions: int
    max_support_size: int | None
    mean_support_size: float | None
    kept_mass_off_positions: int
    per_step: list[StepJson]
    trend: TrendJson | None
    not_evaluated: list[NotEvaluated]
    input_notes: list[str]
    lacking_inputs: dict[str, int]
    drift_headroom: DriftHeadroom
    gates_evaluated: list[str]
    verdict: Literal["pass", "fail", "none"]
    violations: list[Violation]
    reference_violations: list[Violation]
    mean_bias_evaluated: bool  # a mean-bias gate was evaluated (without one the verdict is incomplete)
    no_verdict: str | None  # why not: what the records lack and what supplies it
    capture_limit: str | None  # positions the capture left unproven (not evaluated, not a FAIL), and the fix
    trainer_under_test: TrainerUnderTest | None = None
    # What the producer adds (parity.analyze.report.REPORT_FACTS): the model, the capture, dtypes, the RL view.
    model: str | None = None
    capture_plan: CaptureStats | None = None
    dtypes: Dtypes | None = None
    rl_view: JsonObject | None = None
    native_capture: NativeCapture | None = None
    routing: Routing | None = None  # MoE: routing agreement per layer and routing replay (parity.core.routing)
    masked_tokens: int | None = None  # the TRL capture: tokens its completion mask dropped
    rounding_bound: RoundingBound | None = None  # the TRL capture: the sampler dtype's own per-token bound
    trl: TrlFacts | None = None  # the TRL capture: its importance-sampling mode, fix and step

    @classmethod
    def from_json(cls, data: Any) -> ScenarioVerdict:
        d = _fields(cls, data, f"report.json scenario {data.get('name') if isinstance(data, dict) else '?'}")
        d["spec"] = SamplingSpec(**d["spec"])
        d["violations"] = [violation_from_json(v) for v in d["violations"]]
        d["reference_violations"] = [violation_from_json(v) for v in d["reference_violations"]]
        if d.get("capture_plan") is not None:
            from parity.core.capture import CaptureStats

            d["capture_plan"] = CaptureStats.from_dict(d["capture_plan"])
        return cls(**d)

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)


@dataclass
class Report:
    """report.json: the scenarios, their verdicts, where they ran and what was compared."""

    schema_version: int
    source: str
    environment: Environment
    config: JsonObject
    records: Records
    warnings: list[str]
    scenarios: list[ScenarioVerdict]
    passed: bool
    complete: bool
    not_evaluated: list[NotEvaluated]
    verdict: Literal["pass", "fail", "none"] = "pass"  # pass, fail, or none (nothing failed, but a scenario had no mean-bias gate)
    no_verdict: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    plots: list[str] | None = None
    determinism: JsonObject | None = None  # parity run --invariance: the invariance checks
    matrix_pair_coverage: JsonObject | None = None
    rl_view: JsonObject | None = None  # the RL catalogue the scenarios' rl_view entries refer to
    engine_settings: list[EngineSettingEffect] | None = None  # prefix caching / chunked prefill against the same scenario without

    @classmethod
    def from_json(cls, data: Any) -> Report:
        d = _fields(cls, data, "report.json")
        if d["schema_version"] != SCHEMA_VERSION:
            raise UsageError(f"report.json schema_version {d['schema_version']!r}: this parity reads {SCHEMA_VERSION}")
        d["environment"] = Environment.from_json(d["environment"])
        d["scenarios"] = [ScenarioVerdict.from_json(s) for s in d["scenarios"]]
        return cls(**d)

    def to_json(self) -> dict[str, Any]:
        return _to_json(self)

    def scenario(self, name: str) -> ScenarioVerdict:
        for s in self.scenarios:
            if s.name == name:
                return s
        raise UsageError(f"report.json has no scenario {name!r}: it has {', '.join(s.name for s in self.scenarios)}")


def load_report(path: str | Path) -> Report:
    """A report.json file (or the folder holding one) as a :class:`Report`."""
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"{p}: no report.json there") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}: not JSON ({e})") from None
    return Report.from_json(data)
