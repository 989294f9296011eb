"""report.json: its versioned schema, the environment block, and the writer of the report folder.

:func:`write_report` writes report.json, report.md (:mod:`parity.report.markdown`) and the PNG plots
(:mod:`parity.report.plots`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from parity.report.markdown import render_markdown
from parity.report.model import SCHEMA_VERSION, Report
from parity.report.plots import write_plots

DETERMINISM_ENV = (
    "VLLM_BATCH_INVARIANT",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_KVCACHE_SPACE",
    "CUBLAS_WORKSPACE_CONFIG",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
)


def installed_version(dist: str) -> str | None:
    """``dist``'s installed version (or its CPU build's, ``dist-cpu``), None when neither is installed."""
    for name in (dist, f"{dist}-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment(device: str, dtype: str, trainer_dtype: str) -> dict[str, Any]:
    """Versions, device, dtypes and the determinism knobs in force. torch's own state is read where this
    process has loaded torch (a run, a re-scoring); an analysis of records without a model never imports
    it (3 s of its start), and reports the installed version with ``None`` for torch's knobs."""
    torch = sys.modules.get("torch")
    return {
        "vllm": installed_version("vllm"),
        "torch": torch.__version__ if torch is not None else installed_version("torch"),
        "transformers": installed_version("transformers"),
        "parity": installed_version("parity"),
        "python": platform.python_version(),
        "device": device,
        "dtype": dtype,
        "trainer_dtype": trainer_dtype,
        "determinism": {
            "env": {k: os.environ.get(k) for k in DETERMINISM_ENV},
            "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled() if torch is not None else None,
            "torch_num_threads": torch.get_num_threads() if torch is not None else None,
        },
    }


def json_safe(obj: Any) -> Any:
    """JSON-safe: non-finite floats become strings ('inf', '-inf', 'nan'), tensors and arrays lists, paths strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    if hasattr(obj, "tolist"):
        return json_safe(obj.tolist())
    return str(obj) if isinstance(obj, Path) else obj


# A violation object (parity.core.violation.Violation.to_dict), schema_version 2.
VIOLATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["gate", "scenario", "statistic", "limit", "label", "comparison", "worst", "message"],
    "properties": {
        "gate": {"type": "string"},
        "scenario": {"type": "string"},
        "statistic": {"type": ["number", "string"]},
        "limit": {"type": ["number", "string"]},
        "label": {"type": "string"},
        "comparison": {"enum": [">", "<"]},
        "worst": {"type": "array", "items": {"type": "object", "required": ["prompt", "position", "token", "values"]}},
        "detail": {"type": "string"},
        "message": {"type": "string"},
    },
}


def report_schema() -> dict[str, Any]:
    """JSON Schema of report.json, schema_version 2 (violations became objects; see VIOLATION_SCHEMA)."""
    num = {"type": ["number", "string"]}
    diff: dict[str, Any] = {
        "type": "object",
        "required": ["max_abs_diff", "mean_diff", "p99_abs_diff", "support_equal_frac"],
        "properties": {k: num for k in ("max_abs_diff", "mean_diff", "p99_abs_diff", "support_equal_frac")},
    }
    scenario = {
        "type": "object",
        "required": [
            "name", "spec", "tokens", "log_s", "naive", "replay", "recompute", "is_ratio",
            "incomplete_positions", "verdict", "violations",
        ],
        "properties": {
            "name": {"type": "string"},
            "spec": {
                "type": "object",
                "required": ["temperature", "top_k", "top_p", "min_p"],
                "properties": {"temperature": num, "top_k": {"type": "integer"}, "top_p": num, "min_p": num},
            },
            "tokens": {"type": "integer", "minimum": 0},
            "log_s": {"type": "object", "required": ["mean", "min"], "properties": {"mean": num, "min": num}},
            "naive": {"type": "object", "required": ["bias_mean", "max_abs_gap_to_log_s"]},
            "replay": diff,
            "recompute": {**diff, "required": diff["required"] + ["forced_includes"]},
            "is_ratio": {"type": "object"},
            "incomplete_positions": {"type": "integer", "minimum": 0},
            "verdict": {"enum": ["pass", "fail", "none"]},
            "mean_bias_evaluated": {"type": "boolean"},
            "no_verdict": {"type": ["string", "null"]},
            "capture_limit": {"type": ["string", "null"]},
            "violations": {"type": "array", "items": VIOLATION_SCHEMA},
            # With a trainer under test: parity's own estimators' violations, reported beside its verdict.
            "reference_violations": {"type": "array", "items": VIOLATION_SCHEMA},
            # Per mean gate: the mean, its limit (the verdict's resolution) split into systematic and
            # statistical parts (parity.core.error_model.mean_bias_entry); null where not evaluated.
            "mean_bias": {
                "type": "object",
                "additionalProperties": {
                    "anyOf": [
                        {"type": "null"},
                        {"type": "object",
                         "required": ["mean", "limit", "systematic", "statistical", "spread_sd", "tokens"],
                         "properties": {k: num for k in ("mean", "limit", "systematic", "statistical", "spread_sd")}},
                    ],
                },
            },
            # Per trainer, each framework's metric and each IS-correction method (parity.core.rl).
            "rl_view": {"type": "object", "additionalProperties": {"type": "object", "required": ["metrics", "methods"]}},
            # parity analyze on a training log (a step column): per step, and the trend drift_trend gates
            # (parity.records.steps.StepEntry and DriftTrend).
            "per_step": {"type": "array", "items": {
                "type": "object",
                "required": ["step", "tokens", "mean_bias", "mean_abs_diff", "max_headroom", "support_equal_frac"],
                "properties": {"step": {"type": "integer"}, "tokens": {"type": "integer", "minimum": 0},
                               "mean_bias": num, "mean_abs_diff": num, "max_headroom": {"type": ["number", "string", "null"]},
                               "support_equal_frac": num, "by_comparison": {"type": "object"}},
            }},
            # The drift plot's histogram of log10(|diff| / bound) (parity.records.verdict.drift_headroom_hist).
            "drift_headroom": {"type": "object", "required": ["log10_lo", "bin_width", "bins"], "properties": {
                "log10_lo": {"type": "number"}, "bin_width": {"type": "number"}, "bins": {"type": "integer"},
                **{k: {"type": "array", "items": {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                                                     "maxItems": 2}} for k in ("replay", "recompute")}}},
            # MoE: the sampler's experts against the trainer's router, and routing replay (parity.core.routing).
            "routing": {"type": ["object", "null"], "required": [
                "rows", "layers", "top_k", "num_experts", "per_layer", "agreement", "rows_any_layer_differs", "flips",
                "flips_above_bound", "uncovered_rows", "replay"], "properties": {"per_layer": {"type": "array", "items": {
                    "type": "object", "required": ["layer", "agreement", "flips", "flips_above_bound"]}}}},
            "trend": {"type": ["object", "null"], "required": [
                "comparison", "steps", "slope", "slope_se", "limit", "baseline_steps", "band_lo", "band_hi",
                "first_step_outside", "evaluated", "passed"]},
        },
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "required": ["schema_version", "environment", "scenarios", "passed"],
        "properties": {
            "schema_version": {"const": SCHEMA_VERSION},
            "environment": {"type": "object", "required": ["vllm", "torch", "transformers", "device", "dtype", "determinism"]},
            "scenarios": {"type": "array", "items": scenario},
            "passed": {"type": "boolean"},
            # pass, fail, or none: nothing failed but a scenario had no mean-bias gate (exit 4)
            "verdict": {"enum": ["pass", "fail", "none"]},
            "no_verdict": {"type": "array", "items": {"type": "string"}},
            # parity analyze: passed covers the gates evaluated; complete says whether that was every gate.
            "complete": {"type": "boolean"},
            "not_evaluated": {
                "type": "array",
                "items": {"type": "object", "required": ["gate", "reason", "scenarios"]},
            },
            "warnings": {"type": "array", "items": {"type": "string"}},
            # Prefix caching / chunked prefill against the same scenario without them (parity.core.settings_effect).
            "engine_settings": {"type": ["array", "null"], "items": {"type": "object", "required": [
                "scenario", "baseline", "settings", "sequences", "same_tokens", "logprobs_bitwise_equal",
                "max_abs_logprob_diff"]}},
        },
    }


def write_report(report: dict[str, Any], out: Path, *, plots: bool = True) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        report["plots"] = write_plots(report, out)
    # The typed report decides what is written: a key that Report does not name is an error, not an extra.
    # Both texts are rendered before either is written: a report is never left half written.
    text = json.dumps(json_safe(Report.from_json(report).to_json()), indent=2, sort_keys=False) + "\n"
    md = render_markdown(report)
    (out / "report.json").write_text(text)
    (out / "report.md").write_text(md)
