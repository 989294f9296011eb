"""report.json: its versioned schema, the environment block, and the writer of the report folder
(:func:`write_report`: report.json, report.md by :mod:`parity.report.markdown`, the PNG plots by :mod:`parity.report.plots`).
"""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any, overload

from parity.core.spec import SamplingSpec
from parity.report.blocks import EnvironmentJson, JsonObject, ReportJson, ViolationJson, schema_of
from parity.report.markdown import DETAILS, render_details, render_markdown
from parity.report.model import SCHEMA_VERSION, checked_report
from parity.report.plots import write_plots

DETERMINISM_ENV = ("VLLM_BATCH_INVARIANT", "VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_CPU_KVCACHE_SPACE",
                   "CUBLAS_WORKSPACE_CONFIG", "OMP_NUM_THREADS", "PYTHONHASHSEED")


def installed_version(dist: str) -> str | None:
    """``dist``'s installed version (or its CPU build's, ``dist-cpu``), None when neither is installed."""
    for name in (dist, f"{dist}-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment(device: str, dtype: str, trainer_dtype: str) -> EnvironmentJson:
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
        "analysis_machine": None, "sampler": None, "sampler_version": None, "batch_invariant_mode": None, "trl": None,
    }


@overload
def json_safe(obj: Mapping[str, object]) -> dict[str, object]: ...


@overload
def json_safe(obj: object) -> object: ...


def json_safe(obj: object) -> object:
    """JSON-safe: non-finite floats become strings ('inf', '-inf', 'nan'), tensors and arrays lists, paths strings
    (anything else is returned as it is, for json.dumps to write or refuse)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, Mapping):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    tolist = getattr(obj, "tolist", None)
    if tolist is not None:
        return json_safe(tolist())
    return str(obj) if isinstance(obj, Path) else obj


# A violation object (parity.core.violation.Violation.to_dict), schema_version 2.
VIOLATION_SCHEMA: JsonObject = {
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


class _TrainerSummary:
    """A scenario's ``rl_view`` entry: :class:`parity.core.rl_catalogue.TrainerSummary` (its module imports torch)."""


def report_schema() -> JsonObject:
    """JSON Schema of report.json, generated from its types (:mod:`parity.report.blocks`); violations:
    :data:`VIOLATION_SCHEMA`."""
    fixed: dict[object, JsonObject] = {ViolationJson: VIOLATION_SCHEMA, _TrainerSummary: {"type": "object"}}
    out = schema_of(ReportJson, fixed, localns={"TrainerSummary": _TrainerSummary})
    properties = out["properties"]
    assert isinstance(properties, dict)
    scenarios: Any = properties["scenarios"]  # the spec: every field of SamplingSpec, as its to_dict writes them
    scenarios["items"]["properties"]["spec"] = schema_of(SamplingSpec)
    properties["schema_version"] = {"const": SCHEMA_VERSION}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **out}


def write_report(report: ReportJson, out: Path, *, plots: bool = True) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        report["plots"] = write_plots(report, out)
    # The report's types decide what is written: a key they do not name is an error, not an extra.
    # Both texts are rendered before either is written: a report is never left half written.
    text = json.dumps(json_safe(checked_report(report)), indent=2, sort_keys=False) + "\n"
    md = render_markdown(report)
    details = render_details(report)
    (out / "report.json").write_text(text)
    (out / "report.md").write_text(md)
    (out / DETAILS).write_text(details)
