"""report.json as types: :class:`Report`, its :class:`ScenarioVerdict` entries and its :class:`Environment`.
Every producer's report passes :meth:`Report.from_json` before it is written, so a key these types do not
name is an error; CI code reads a report with :func:`load_report` (docs/internals.md, section 9).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from parity.core.spec import SamplingSpec
from parity.core.violation import Position, Violation
from parity.errors import UsageError
from parity.report.blocks import (
    Bound,
    BudgetBlock,
    Diff,
    DriftHeadroom,
    DriftSplit,
    Dtypes,
    EngineSettingEffect,
    EnvironmentJson,
    IsRatio,
    JsonObject,
    LogS,
    MeanBiasEntries,
    MeanMax,
    MismatchSplit,
    Naive,
    NativeCapture,
    NotEvaluated,
    PerEstimator,
    PowerJson,
    Records,
    ReportJson,
    RoundingBound,
    Routing,
    SamplerLogS,
    ScenarioJson,
    StepJson,
    SupportSides,
    TrainerUnderTest,
    TrendJson,
    TrlFacts,
)

# report.json's layout version (3: the verdict "none" and no_verdict; README, reading a report).
SCHEMA_VERSION = 3

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from parity.core.capture import CaptureStats  # imports torch: loaded where a capture plan is read

def _float(x: object) -> float:
    if isinstance(x, (int, float, str)):
        return float(x)  # JSON's "inf" / "-inf" / "nan" strings back to floats
    raise TypeError(f"float() argument must be a string or a real number, not '{type(x).__name__}'")


def _list(x: object, where: str) -> list[object]:
    if not isinstance(x, list):
        raise UsageError(f"{where}: expected a list, got {type(x).__name__}")
    return x


def _fields(cls: type[DataclassInstance], data: object, where: str) -> dict[str, object]:
    """``data``'s keys checked against ``cls``'s fields: an unknown key or a missing required one is an error."""
    if not isinstance(data, dict):
        raise UsageError(f"{where}: expected an object, got {type(data).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise UsageError(f"{where}: unknown key(s) {', '.join(unknown)}: allowed {', '.join(names)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in data]
    if missing:
        raise UsageError(f"{where}: missing key(s) {', '.join(missing)}")
    return dict(data)


def _to_json(obj: DataclassInstance) -> dict[str, object]:
    """A report type's JSON: each field's own ``to_json``/``to_dict`` (lists element-wise); an optional block
    the producer did not give (None, with a None default) is left out."""

    def value(v: object) -> object:
        if isinstance(v, list):
            return [value(x) for x in v]
        as_json = getattr(v, "to_json", None) or getattr(v, "to_dict", None)
        return as_json() if callable(as_json) else v

    return {f.name: value(getattr(obj, f.name)) for f in dataclasses.fields(obj)
            if not (getattr(obj, f.name) is None and f.default is None)}


def _mapping(x: object, where: str) -> Mapping[str, object]:
    if not isinstance(x, dict):
        raise UsageError(f"{where}: expected an object, got {type(x).__name__}")
    return x


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
    def from_json(cls, data: object) -> Environment:
        build: Callable[..., Environment] = cls  # the values as written (JSON: strings and objects)
        return build(**_fields(cls, data, "report.json environment"))

    def to_json(self) -> EnvironmentJson:
        return {"vllm": self.vllm, "torch": self.torch, "transformers": self.transformers, "parity": self.parity,
                "python": self.python, "device": self.device, "dtype": self.dtype, "trainer_dtype": self.trainer_dtype,
                "determinism": copy.deepcopy(self.determinism),
                "analysis_machine": copy.deepcopy(self.analysis_machine), "sampler": self.sampler,
                "sampler_version": self.sampler_version, "batch_invariant_mode": copy.deepcopy(self.batch_invariant_mode),
                "trl": self.trl}


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
    power: PowerJson | None = None  # the verdict's power: resolution against |log S| (parity.core.power)
    support_sides: SupportSides | None = None  # ties at the k-th value and one-sided kept-set differences
    mismatch_split: MismatchSplit | None = None  # records alone: systematic shift against spread, per-step growth
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
    def from_json(cls, data: object) -> ScenarioVerdict:
        where = f"report.json scenario {data.get('name') if isinstance(data, dict) else '?'}"
        d = _fields(cls, data, where)
        spec: Callable[..., SamplingSpec] = SamplingSpec  # __post_init__ checks each value's type
        d["spec"] = spec(**_mapping(d["spec"], f"{where} spec"))
        for key in ("violations", "reference_violations"):
            d[key] = [violation_from_json(_mapping(v, f"{where} {key}")) for v in _list(d[key], f"{where} {key}")]
        if d.get("capture_plan") is not None:
            from parity.core.capture import CaptureStats

            d["capture_plan"] = CaptureStats.from_dict(dict(_mapping(d["capture_plan"], f"{where} capture_plan")))
        build: Callable[..., ScenarioVerdict] = cls  # the blocks as written (their keys: the JSON Schema's)
        return build(**d)

    def to_json(self) -> ScenarioJson:
        # The fields are ScenarioJson's keys (tests/unit/test_report_model.py checks), each field's JSON its value.
        return cast("ScenarioJson", _to_json(self))


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
    budget: BudgetBlock | None = None  # parity budget: the mismatch split into its causes

    @classmethod
    def from_json(cls, data: object) -> Report:
        d = _fields(cls, data, "report.json")
        if d["schema_version"] != SCHEMA_VERSION:
            raise UsageError(f"report.json schema_version {d['schema_version']!r}: this parity reads {SCHEMA_VERSION}")
        d["environment"] = Environment.from_json(d["environment"])
        d["scenarios"] = [ScenarioVerdict.from_json(s) for s in _list(d["scenarios"], "report.json scenarios")]
        build: Callable[..., Report] = cls  # the blocks as written (their keys: the JSON Schema's)
        return build(**d)

    def to_json(self) -> ReportJson:
        # The fields are ReportJson's keys (tests/unit/test_report_model.py checks), each field's JSON its value.
        return cast("ReportJson", _to_json(self))

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
