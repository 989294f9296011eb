"""The statistics blocks of report.json as types, and the JSON Schema generated from them (:func:`schema_of`).
A ``Stat`` is a number, or None where the records lack its input (null in report.json; text writes it as
:data:`parity.core.display.NA`); ``Json`` is a value whose layout the producer chooses, checked as JSON
(docs/internals.md, section 9).
"""

# No `from __future__ import annotations`: TypedDict reads NotRequired[...] only from evaluated annotations.
import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal, NotRequired, TypedDict, Union, cast

import numpy as np

if TYPE_CHECKING:
    from parity.core.rl_catalogue import TrainerSummary  # imports torch: named in a string annotation

from parity.core.json_types import Json as Json
from parity.core.json_types import JsonObject as JsonObject
from parity.core.routing import Agreement
from parity.core.routing import RoutingLayer as RoutingLayer

Stat = float | None  # None: a statistic whose inputs the records do not hold (the report says which and why)


class LogS(TypedDict):
    mean: Stat
    min: Stat
    mean_s: Stat


class Naive(TypedDict):
    bias_mean: Stat
    max_abs_diff: Stat
    max_abs_gap_to_log_s: Stat
    mean_gap_to_log_s: Stat
    # The penalties' part of the bias of a trainer that ignores filters and penalties (mean of
    # full(penalised z) - full(z) at the sampled token): that trainer's bias is log S minus it.
    penalty_term_mean: NotRequired[Stat]


class Diff(TypedDict):
    max_abs_diff: Stat
    mean_diff: Stat
    mean_abs_diff: Stat
    p99_abs_diff: Stat
    support_equal_frac: Stat
    forced_includes: NotRequired[int | None]  # recompute: tokens force-included to keep the sampled one finite


class Spread(TypedDict):
    mean: Stat
    min: Stat
    max: Stat


class Ratios(TypedDict):
    token: Spread
    sequence: Spread
    sequence_identity_max_rel_err: NotRequired[Stat]


class IsRatio(TypedDict):
    naive: Ratios
    replay: Ratios
    recompute: Ratios
    trainer_under_test: NotRequired[Ratios]


class MeanMax(TypedDict):
    mean: Stat
    max: Stat


class PerEstimator(TypedDict):
    """One number per comparison (None: not evaluated)."""

    replay: float | None
    recompute: float | None
    naive_vs_sampler_log_s: NotRequired[float | None]
    trainer_under_test: NotRequired[float | None]
    logprob: NotRequired[float | None]


class Signature(TypedDict):
    slope: float
    slope_se: float


class MeanBias(TypedDict):
    """A mean gate's numbers: the mean and its limit (the verdict's resolution), systematic + statistical."""

    mean: float
    limit: float
    systematic: float
    statistical: float
    spread_sd: float
    tokens: int
    log_s_signature: NotRequired[Signature]


class SignTest(TypedDict):
    failed: bool
    beyond_allowance: int
    negative_share: float
    honest_share: float
    limit: float
    z: float


class LogprobBias(MeanBias):
    """The two-column gate (``logprob_mean_bias``): the log of the mean IS ratio, its resolution, the sign test."""

    sign_test: SignTest
    sequences: int
    mean_diff: float
    kl_estimate: float
    standard_error: float
    effective_n: float
    standard_error_from: str
    sampler_support: int
    trainer_support: int
    negative_frac: float
    outside_support: int
    nonfinite: int
    log_s_range: list[float]
    log_s_range_from: str
    assumed: list[str]
    stated: dict[str, str | int | None]


class MeanBiasEntries(TypedDict):
    replay: MeanBias | None
    recompute: MeanBias | None
    trainer_under_test: NotRequired[MeanBias | None]
    logprob: NotRequired[LogprobBias | None]


class SupportSides(TypedDict):
    """Where recompute's kept set S_p and the sampler's S_q differ one way: positions where S_q holds ties at the
    k-th value (|S_q| > top_k), those where recompute normalised over fewer tokens there, and every position where
    S_p differs from S_q and is smaller or larger (None: the records hold no trainer_recompute_support_size)."""

    top_k: int | None
    ties_at_k_positions: int
    ties_dropped_positions: int | None
    smaller_positions: int | None
    larger_positions: int | None


class PowerJson(TypedDict):
    """A verdict's power (:class:`parity.core.power.Power`): its finest deciding mean-bias gate's resolution against
    the class bias it exists to catch (|log S|), and the tokens that would resolve it (None: no count would).
    ``class_bias`` and ``resolved`` None: the records hold no log S, so power was not assessed."""

    gate: str
    class_bias: float | None
    resolution: float
    systematic: float
    tokens: int
    tokens_needed: int | None
    resolved: bool | None


class Bound(TypedDict):
    max: float
    mean: float
    roundoff: float


class SamplerLogS(TypedDict):
    source: str
    positions: int
    lo_mean: float | None
    hi_mean: float | None
    naive_max_gap: float | None
    raw_logits_pass: NotRequired[JsonObject]


class DriftSplit(TypedDict):
    logit_drift_max: float | None
    logit_drift_mean: float | None
    replay_max_abs_diff: float | None


class StepComparisonJson(TypedDict):
    tokens: int
    mean_bias: Stat
    mean_abs_diff: Stat
    max_headroom: float | None
    support_equal_frac: Stat


class StepJson(TypedDict):
    """One step of ``per_step``. The flat statistics are those of ``comparison`` (the one the trend gates: the
    trainer under test where the records hold one, else replay, else recompute); ``by_comparison`` has every
    comparison the records hold (None: the records do not hold it; ``max_headroom`` None: no per-token bound)."""

    step: int
    sequences: int
    tokens: int
    comparison: str | None
    compared_tokens: int
    mean_bias: Stat
    mean_abs_diff: Stat
    max_headroom: float | None
    support_equal_frac: Stat
    by_comparison: dict[str, StepComparisonJson]


class TrendJson(TypedDict):
    """The least-squares trend of a comparison's mean |diff| over steps, and the ``drift_trend`` verdict (``passed``
    None when not evaluated: ``reason``; :func:`parity.judge.steps.drift_trend`). ``slope`` is in nats per token per
    training step, ``slope_se`` the larger of ``slope_se_residual`` and ``slope_se_tokens``, ``limit``
    ``z * slope_se`` (docs/error_model.md, section 5; the fields: docs/records.md, section 7)."""

    comparison: str
    steps: int
    first_step: int | None
    last_step: int | None
    slope: float | None
    intercept: float | None
    slope_se: float | None
    slope_se_residual: float | None
    slope_se_tokens: float | None
    z: float
    limit: float | None
    baseline_steps: list[int]
    baseline_mean: float | None
    noise: float | None
    band_k: float
    band_lo: float | None
    band_hi: float | None
    first_step_outside: int | None
    evaluated: bool
    passed: bool | None
    reason: str


class NotEvaluated(TypedDict):
    gate: str
    reason: str
    scenarios: NotRequired[list[str]]  # the report's list: where


class DriftHeadroom(TypedDict):
    """Counts of log10(|diff| / bound) for the drift plot: [bin index, count] pairs per estimator."""

    log10_lo: float
    bin_width: float
    bins: int
    replay: NotRequired[list[list[int]]]
    recompute: NotRequired[list[list[int]]]


def sparse_hist(hist: np.ndarray) -> list[list[int]]:
    """A histogram's filled bins as [index, count] pairs (``drift_headroom``, and the map step's JSON)."""
    return [[int(i), int(hist[i])] for i in np.flatnonzero(hist)]


def dense_hist(pairs: list[list[int]], bins: int) -> np.ndarray:
    """The inverse of :func:`sparse_hist`: ``bins`` counts."""
    hist = np.zeros(bins, dtype=np.int64)
    for i, c in pairs:
        hist[i] = c
    return hist


class TrainerUnderTest(TypedDict):
    name: str | None
    max_abs_diff: Stat
    mean_diff: Stat
    mean_abs_diff: Stat
    p99_abs_diff: Stat
    max_abs_gap_to_log_s: Stat
    diagnosis: str


class Dtypes(TypedDict):
    sampler: str
    trainer: str


class NativeCapture(TypedDict):
    mode: str
    mismatched_positions: int
    positions: list[list[int]]


class RoundingBound(TypedDict):
    dtype: str
    mean: float
    max: float


class TrlFacts(TypedDict):
    is_mode: str
    fix: str | None
    sampler_dtype: str
    step: int


class Records(TypedDict):
    files: int
    rows: int
    tokens: int
    page_checksums: Literal["all", "some", "none", "unknown"]
    files_without_page_checksums: list[str]


class ReplayDrift(TypedDict):
    """|trainer - sampler| against the per-token bound, and the IS ratio exp(trainer - sampler)."""

    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    mean_diff: float
    headroom: float
    is_ratio_token_mean: float
    is_ratio_token_max: float
    is_ratio_seq_min: float
    is_ratio_seq_max: float


class RoutingReplay(TypedDict):
    rows: int
    forced_frac: float
    mismatched: int
    drift: dict[str, ReplayDrift]  # without_replay, with_replay


class RoutingSection(Agreement):
    """MoE: the sampler's experts against the trainer's router per layer (:class:`parity.core.routing.Agreement`),
    and routing replay (R3), as :func:`parity.engines.routing_replay.routing_report` measures them."""

    uncovered_rows: int
    replay: RoutingReplay


class Routing(RoutingSection):
    """A scenario's ``routing``: the measured section, and ``listed``: per routing gate, the positions its
    violation names where it fails (written where there are any); ``capture``: how the sampler's experts were
    captured."""

    listed: dict[str, JsonObject]
    capture: NotRequired[Json]


class EngineSettingEffect(TypedDict):
    """A scenario with prefix caching or chunked prefill against the same scenario without (core/settings_effect)."""

    scenario: str
    baseline: str
    settings: JsonObject
    sequences: int
    same_tokens: int
    logprobs_bitwise_equal: int
    max_abs_logprob_diff: float
    routed_rows_compared: int | None
    routed_rows_equal: int | None


class PositionJson(TypedDict):
    """One of a violation's worst positions (:meth:`parity.core.violation.Position.to_dict`)."""

    prompt: int | None
    position: int | None
    token: int | None
    values: dict[str, float]
    gap: NotRequired[float | None]
    bound: NotRequired[float | None]
    note: NotRequired[str]


class ViolationJson(TypedDict):
    """A failed gate (:meth:`parity.core.violation.Violation.to_dict`; its schema: parity.report.schema)."""

    gate: str
    scenario: str
    statistic: float
    limit: float
    label: str
    comparison: str
    worst: list[PositionJson]
    detail: NotRequired[str]
    message: str


class _ProducerBlocks(TypedDict):
    model: NotRequired[str]
    capture_plan: NotRequired[JsonObject]
    dtypes: NotRequired[Dtypes]
    rl_view: NotRequired["dict[str, TrainerSummary]"]
    native_capture: NotRequired[NativeCapture]
    routing: NotRequired[Routing]
    masked_tokens: NotRequired[int]
    rounding_bound: NotRequired[RoundingBound]
    trl: NotRequired[TrlFacts]


class ScenarioFacts(_ProducerBlocks):
    """What a producer adds to a scenario's entry that its records do not hold (stored in the records metadata
    under :data:`parity.analyze.report.REPORT_FACTS`): parity run's capture plan, dtypes, RL view, native
    capture and routing; the TRL capture's model, masked tokens, rounding bound and TRL facts."""

    raw_logits_pass: NotRequired[JsonObject]  # moved into the scenario's sampler_log_s


class EnvironmentJson(TypedDict):
    """report.json's ``environment`` (:func:`parity.report.schema.environment`; a records analysis fills
    ``analysis_machine`` and the sampler's name and version, a producer its own keys)."""

    vllm: str | None
    torch: str | None
    transformers: str | None
    parity: str | None
    python: str
    device: str
    dtype: str
    trainer_dtype: str
    determinism: JsonObject
    analysis_machine: JsonObject | None
    sampler: str | None
    sampler_version: str | None
    batch_invariant_mode: JsonObject | None
    trl: str | None


class SplitStep(TypedDict):
    step: int
    mean_abs_delta: float
    share_of_growth: float | None  # this step's rise over the step before, of the first-to-last growth


class MismatchSplit(TypedDict):
    """What two log-prob columns alone say about a gap (:func:`parity.core.mismatch_split.records_split`): mean |δ| as the
    systematic shift |mean δ| plus the symmetric spread, each step's share of a growing gap, and what needs the model."""

    comparison: str
    tokens: int
    mean_delta: float
    mean_abs_delta: float
    systematic: float
    spread: float
    systematic_share: float | None
    limit: float | None
    resolved: bool | None
    growth: float | None
    per_step: list[SplitStep]
    needs_the_model: list[str]


class ScenarioStats(TypedDict):
    """A scenario's statistics, as the records analysis builds them (:func:`parity.judge.verdict._scenario_report`)
    and the gates read them (:mod:`parity.judge.gate_table`): the first keys of :class:`ScenarioJson`."""

    name: str
    spec: dict[str, float]
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
    trainer_under_test: NotRequired[TrainerUnderTest]
    power: NotRequired[PowerJson]  # the verdict's power (parity.core.power), which the judge adds
    support_sides: NotRequired[SupportSides]
    mismatch_split: NotRequired[MismatchSplit]


class ScenarioJson(ScenarioStats, _ProducerBlocks):
    """One scenario of report.json (:func:`parity.judge.verdict.judge` builds it; :func:`parity.report.model.checked_report`
    holds it to these keys): a block the producer did not give is left out."""

    drift_headroom: DriftHeadroom
    gates_evaluated: list[str]
    verdict: Literal["pass", "fail", "none"]
    violations: list[ViolationJson]
    reference_violations: list[ViolationJson]
    mean_bias_evaluated: bool
    no_verdict: str | None
    capture_limit: str | None


class BudgetRow(TypedDict):
    """One cause of ``parity budget``'s waterfall (:class:`parity.core.budget.Row`): each measure before and after
    its fix, the drop, its share of the starting value and its noise."""

    cause: str
    label: str
    fix: str
    status: Literal["measured", "not_applicable", "not_measured"]
    reason: str | None
    cost: str | None
    before: dict[str, float]
    after: dict[str, float]
    drop: dict[str, float | None]
    share: dict[str, float | None]
    noise: dict[str, float | None]
    within_noise: dict[str, bool]


class BudgetBound(TypedDict):
    headroom: float  # max |δ| / per-token rounding bound after every fix
    mean_abs_delta: float
    mean_bound: float


class BudgetRemainder(TypedDict):
    cause: str
    label: str
    fix: str
    after: dict[str, float]
    share: dict[str, float | None]
    bound: BudgetBound | None


class TokenMatch(TypedDict):
    sequences_differ: int
    tokens_differ: int


class BudgetScenario(TypedDict):
    scenario: str
    spec: dict[str, float]
    trainer: str
    sequences: int
    sequences_sampled: int
    tokens: int
    order: list[str]
    start: dict[str, float]
    rows: list[BudgetRow]
    remainder: BudgetRemainder
    largest_fixable: str | None
    fix_first: str
    token_match: dict[str, TokenMatch]
    notes: list[str]


class BudgetBlock(TypedDict):
    """``parity budget``: per scenario, the mismatch split into its causes (docs/budget.md)."""

    order: list[str]
    headline: str
    measures: dict[str, str]
    noise_method: str
    scenarios: list[BudgetScenario]


class ReportJson(TypedDict):
    """report.json: the one type of a report (what :func:`parity.report.model.load_report` returns). A report builder's dict
    (:func:`parity.analyze.report.build_report`) has no ``timings`` or ``plots`` yet, and may hold the optional
    blocks as None (:func:`parity.report.model.checked_report` leaves those out when it is written)."""

    schema_version: int
    source: str
    environment: EnvironmentJson
    config: JsonObject
    records: Records
    warnings: list[str]
    scenarios: list[ScenarioJson]
    passed: bool
    complete: bool
    not_evaluated: list[NotEvaluated]
    verdict: Literal["pass", "fail", "none"]
    no_verdict: list[str]
    timings: NotRequired[dict[str, float]]
    plots: NotRequired[list[str]]
    determinism: NotRequired[JsonObject | None]
    matrix_pair_coverage: NotRequired[JsonObject | None]
    rl_view: NotRequired[JsonObject | None]
    engine_settings: NotRequired[list[EngineSettingEffect] | None]
    budget: NotRequired[BudgetBlock | None]


def report_json(report: Mapping[str, object]) -> ReportJson:
    """A report dict handed over untyped (``parity run``'s return value, report.json loaded back) read as
    :class:`ReportJson`: checked to be an object whose ``scenarios`` are objects; the blocks are taken as their
    producer wrote them (:func:`parity.report.model.checked_report` checks the keys before one is written)."""
    scenarios = report.get("scenarios")
    if not isinstance(scenarios, list) or not all(isinstance(s, dict) for s in scenarios):
        raise TypeError(f"a report's scenarios: expected a list of objects, got {type(scenarios).__name__}")
    return cast("ReportJson", report)


# -- the JSON Schema of a type ---------------------------------------------------------------------

_NUMBER: JsonObject = {"type": ["number", "string"]}  # a float, or its JSON string ("inf", "-inf", "nan")


def schema_of(tp: object, fixed: typing.Mapping[object, JsonObject] | None = None,
              localns: dict[str, object] | None = None) -> JsonObject:
    """The JSON Schema of a field type: TypedDicts and dataclasses become objects with their required keys,
    ``X | None`` adds null, ``Json`` accepts any JSON value; ``fixed``: types whose JSON is written by hand
    (their schema), ``localns``: names their annotations use that their modules import only for type checking."""
    fixed, localns = fixed or {}, {"Json": Json, **(localns or {})}
    if tp in fixed:
        return fixed[tp]
    if tp is Json or (isinstance(tp, typing.ForwardRef) and tp.__forward_arg__ == "Json"):
        return {}

    def sub(t: object) -> JsonObject:
        return schema_of(t, fixed, localns)

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return {"anyOf": [sub(a) for a in args]}
    if origin is Literal:
        return {"enum": list(args)}
    if origin is list:
        return {"type": "array", "items": sub(args[0])}
    if origin is dict:
        return {"type": "object", "additionalProperties": sub(args[1])}
    if tp is type(None):
        return {"type": "null"}
    simple: dict[type, JsonObject] = {bool: {"type": "boolean"}, int: {"type": "integer"}, float: _NUMBER, str: {"type": "string"}}
    if isinstance(tp, type) and tp in simple:
        return dict(simple[tp])
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp, localns=localns)
        keys: list[Json] = sorted(getattr(tp, "__required_keys__", hints))
        return {"type": "object", "required": keys, "properties": {k: sub(v) for k, v in hints.items()}}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = typing.get_type_hints(tp, localns=localns)
        fs = dataclasses.fields(tp)
        req: list[Json] = [f.name for f in fs if f.default is dataclasses.MISSING
                           and f.default_factory is dataclasses.MISSING]
        return {"type": "object", "required": req, "properties": {f.name: sub(hints[f.name]) for f in fs}}
    raise TypeError(f"no JSON Schema for the type {tp!r}")
