"""report.json (versioned schema), report.md (verdicts first) and PNG plots."""

from __future__ import annotations

import json
import math
import os
import platform
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1
DETERMINISM_ENV = (
    "VLLM_BATCH_INVARIANT",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_KVCACHE_SPACE",
    "CUBLAS_WORKSPACE_CONFIG",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
)


def _version(dist: str) -> str | None:
    for name in (dist, f"{dist}-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def environment(device: str, dtype: str, trainer_dtype: str) -> dict[str, Any]:
    return {
        "vllm": _version("vllm"),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "parity": _version("parity"),
        "python": platform.python_version(),
        "device": device,
        "dtype": dtype,
        "trainer_dtype": trainer_dtype,
        "determinism": {
            "env": {k: os.environ.get(k) for k in DETERMINISM_ENV},
            "torch_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "torch_num_threads": torch.get_num_threads(),
        },
    }


def _clean(obj: Any) -> Any:
    """JSON-safe: non-finite floats become strings ('inf', '-inf', 'nan')."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items() if not k.startswith("_")}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def report_schema() -> dict[str, Any]:
    """JSON Schema of report.json, schema_version 1 (the contract in DESIGN.md)."""
    num = {"type": ["number", "string"]}
    diff = {
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
            "verdict": {"enum": ["pass", "fail"]},
            "violations": {"type": "array", "items": {"type": "string"}},
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
        },
    }


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


def render_markdown(report: dict[str, Any]) -> str:
    sc = report["scenarios"]
    n_fail = sum(s["verdict"] == "fail" for s in sc)
    env = report["environment"]
    lines = [
        "# parity report",
        "",
        f"**{'PASS' if report['passed'] else 'FAIL'}** — {len(sc) - n_fail}/{len(sc)} scenarios pass. "
        f"vLLM {env['vllm']}, torch {env['torch']}, transformers {env['transformers']}, device {env['device']}, "
        f"dtype {env['dtype']} (trainer {env['trainer_dtype']}).",
        "",
    ]
    failures = [v for s in sc for v in s["violations"]]
    if failures:
        lines += ["## Violations", ""] + [f"- {v}" for v in failures] + [""]
    lines += [
        "## Summary",
        "",
        "| verdict | scenario | spec | tokens | log S mean | log S min | naive bias | naive gap to log S | replay max abs diff | "
        "recompute max abs diff | forced | replay support eq | recompute support eq | seq IS ratio (naive, mean) | incomplete |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sorted(sc, key=lambda s: s["verdict"] != "fail"):
        spec = s["spec"]
        label = f"T={spec['temperature']:g} k={spec['top_k']} p={spec['top_p']:g} min_p={spec['min_p']:g}"
        lines.append(
            "| "
            + " | ".join(
                _fmt(x)
                for x in (
                    s["verdict"].upper(),
                    s["name"],
                    label,
                    s["tokens"],
                    s["log_s"]["mean"],
                    s["log_s"]["min"],
                    s["naive"]["bias_mean"],
                    s["naive"]["max_abs_gap_to_log_s"],
                    s["replay"]["max_abs_diff"],
                    s["recompute"]["max_abs_diff"],
                    s["recompute"]["forced_includes"],
                    s["replay"]["support_equal_frac"],
                    s["recompute"]["support_equal_frac"],
                    s["is_ratio"]["naive"]["sequence"]["mean"],
                    s["incomplete_positions"],
                )
            )
            + " |"
        )
    det = report.get("determinism")
    if det:
        lines += ["", "## Determinism", ""]
        lines.append(
            f"Invariance {'required (batch-invariant mode on)' if det['required'] else 'reported, not required'}; "
            f"overall {'bitwise invariant' if det['invariant'] else 'NOT invariant'}. Largest batching difference "
            f"{_fmt(det['cross_side']['kernel_noise_max_abs_diff'])} vs end-to-end replay max |diff| "
            f"{_fmt(det['cross_side']['replay_max_abs_diff'])}."
        )
        lines += ["", "| side | check | bitwise | max abs diff |", "|---|---|---|---|"]
        for side in ("rollout", "trainer"):
            for c in (det.get(side) or {}).get("checks", []):
                lines.append(f"| {side} | {c.get('name')} | {c.get('bitwise')} | {_fmt(c.get('max_abs_diff'))} |")
        mode = det.get("mode") or {}
        if mode.get("knobs"):
            lines += ["", "Knobs: " + "; ".join(f"{k}: {v.get('status')}" for k, v in mode["knobs"].items())]
            kernels = mode["knobs"].get("cpu_kernels", {})
            if kernels.get("status") == "on" and isinstance(kernels.get("value"), dict):
                calls = kernels["value"].get("calls", {})
                lines += [
                    "",
                    "CPU kernels replaced on the trainer: "
                    + ", ".join(f"{k} ({calls.get(k, 0)} calls)" for k in kernels["value"].get("replaced", {})),
                ]
                other = kernels["value"].get("other_ops") or {}
                if other:
                    lines.append(
                        "Operations no kernel covers (measured by the checks): "
                        + ", ".join(f"{k} x{n}" for k, n in other.items())
                    )
        lines += [f"- {v}" for v in det["violations"]]
    cov = report.get("matrix_pair_coverage")
    if cov:
        lines += ["", "## Matrix pair coverage", ""]
        lines += [f"- {k}: {', '.join(v)}" for k, v in cov.items()]
    th = report.get("config", {}).get("thresholds")
    if th:
        lines += ["", "## Thresholds", ""] + [f"- {k}: {v}" for k, v in th.items()]
    return "\n".join(lines) + "\n"


def write_plots(report: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    sc = report["scenarios"]
    tables = [(s["name"], s.get("_table")) for s in sc if s.get("_table") is not None]
    if tables:
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for est in ("replay", "recompute"):
            d = torch.cat([(getattr(t, est) - t.vllm)[~t.incomplete] for _, t in tables]).abs()
            d = d[torch.isfinite(d)]
            ax.hist(torch.log10(d.clamp(min=1e-12)).numpy(), bins=60, alpha=0.6, label=f"{est} − vLLM")
        ax.set_xlabel("log10 |trainer − vLLM| per token (exact matches drawn at −12)")
        ax.set_ylabel("tokens")
        ax.set_title("Per-token drift after the fix (all scenarios)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "drift_hist.png", dpi=110)
        plt.close(fig)
        written.append("drift_hist.png")
    fig, ax = plt.subplots(figsize=(max(8, len(sc) * 0.45), 4.5))
    x = range(len(sc))
    ax.bar([i - 0.2 for i in x], [s["log_s"]["mean"] for s in sc], width=0.4, label="predicted log S (mean)")
    ax.bar([i + 0.2 for i in x], [s["naive"]["bias_mean"] for s in sc], width=0.4, label="naive bias full − vLLM (mean)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([s["name"] for s in sc], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("nats per token")
    ax.set_title("The naive trainer's bias equals log S")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "log_s_bias.png", dpi=110)
    plt.close(fig)
    written.append("log_s_bias.png")
    return written


def write_report(report: dict[str, Any], out: Path, *, plots: bool = True) -> None:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        report["plots"] = write_plots(report, out)
    (out / "report.json").write_text(json.dumps(_clean(report), indent=2, sort_keys=False) + "\n")
    (out / "report.md").write_text(render_markdown(report))
