"""report.md: the verdicts first, then the summary table, determinism, matrix coverage and thresholds."""

from __future__ import annotations

from typing import Any

from parity.report import rl as rl_report


def _fmt(x: Any) -> str:
    if x is None:
        return "—"
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
        lines += ["## Violations", ""] + [f"- {v['message']}" for v in failures] + [""]
    lines += [
        "## Summary",
        "",
        "Headroom is max |diff| / bound: the per-token rounding bound of parity.core.error_model (both sides' "
        "dtype, |z|/T, support size); a gate fails above 1. The naive bias is gated against a log S from the "
        "sampler's side (its raw logits, or the nucleus bracket for top_p alone); where neither exists it is "
        "reported, not gated.",
        "",
        "| verdict | scenario | spec | tokens | log S mean (trainer) | naive bias | sampler-side log S | naive headroom | "
        "replay headroom | recompute headroom | replay max abs diff | forced | replay support eq | recompute support eq "
        "| seq IS ratio (naive, mean) | incomplete |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
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
                    s["naive"]["bias_mean"],
                    s["sampler_log_s"]["source"].replace("_", " "),
                    s["headroom"]["naive_vs_sampler_log_s"],
                    s["headroom"]["replay"],
                    s["headroom"]["recompute"],
                    s["replay"]["max_abs_diff"],
                    s["recompute"]["forced_includes"],
                    s["replay"]["support_equal_frac"],
                    s["recompute"]["support_equal_frac"],
                    s["is_ratio"]["naive"]["sequence"]["mean"],
                    s["incomplete_positions"],
                )
            )
            + " |"
        )
    lines += rl_report.markdown(report)
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
        lines += [f"- {v}" for v in det["violations"]]
    cov = report.get("matrix_pair_coverage")
    if cov:
        lines += ["", "## Matrix pair coverage", ""]
        lines += [f"- {k}: {', '.join(v)}" for k, v in cov.items()]
    th = report.get("config", {}).get("thresholds")
    if th:
        lines += ["", "## Thresholds", ""] + [f"- {k}: {v}" for k, v in th.items()]
    return "\n".join(lines) + "\n"
