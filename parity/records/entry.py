"""A scenario's report entry as the records analysis builds it (:func:`parity.records.verdict._scenario_report`),
typed by the keys the gates (:mod:`parity.records.gate_table`) and :func:`parity.records.verdict.judge` read; its
other keys are those of :class:`parity.report.model.ScenarioVerdict`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypedDict

from parity.report import blocks


class ScenarioEntry(TypedDict, total=False):
    name: str
    spec: Mapping[str, object]
    tokens: int
    sequences: int
    replay: blocks.Diff
    recompute: blocks.Diff
    incomplete_positions: int
    sampled_outside_support: int
    token_mismatch: int
    headroom: blocks.PerEstimator
    mean_bias_limit: blocks.PerEstimator
    mean_bias: blocks.MeanBiasEntries
    sampler_log_s: blocks.SamplerLogS
    trainer_under_test: blocks.TrainerUnderTest
    captured_positions: int
    per_step: list[blocks.StepJson]
    trend: blocks.TrendJson | None
    not_evaluated: list[blocks.NotEvaluated]
    lacking_inputs: dict[str, int]
    routing: blocks.Routing
