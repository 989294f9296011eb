"""report.md: the verdict and what it means first, a narrow table, then the detail tables, RL view,
determinism, matrix coverage and thresholds."""

from __future__ import annotations

from collections.abc import Mapping

from parity.core.display import NA
from parity.report import budget_section, overview, rl_section, routing_section
from parity.report.blocks import EnvironmentJson, JsonObject, ReportJson, ScenarioJson, StepJson


def _obj(x: object) -> Mapping[str, object]:
    """A JSON object of a block whose layout its producer chooses (determinism, coverage, thresholds); else empty."""
    return x if isinstance(x, dict) else {}


def _items(x: object) -> list[object]:
    return x if isinstance(x, list) else []


def _fmt(x: object) -> str:
    if x is None:
        return NA
    if isinstance(x, float):
        return f"{x:.3g}"
    return str(x)


GLANCE_COLUMNS = (("scenario", "scenario"), ("verdict", "verdict"), ("log S", "log S"),
                  ("naive bias", "naive bias"), ("replay", "replay headroom"),
                  ("recompute", "recompute headroom"), ("support", "support equal"),
                  ("mean/limit", "mean bias / limit"), ("resolution", "resolution (nats)"))


def glance_table(report: ReportJson) -> list[str]:
    """The narrow table under the verdict: one row per scenario (cells from parity.report.overview)."""
    who = overview.sampler_name(report)
    lines = [
        "| " + " | ".join(title for _, title in GLANCE_COLUMNS) + " |",
        "|---|---|" + "---:|" * 4 + "---|" + "---:|" * 2,
    ]
    for r in overview.glance_rows(report):
        verdict = r["verdict"] + (f" ({r['failed gates']})" if r["failed gates"] else "")
        cells = [verdict if k == "verdict" else r[k] for k, _ in GLANCE_COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "log S: the mean log of the mass the filters kept (0: nothing filtered); naive bias: mean (full-vocabulary "
        f"trainer − {who}), per token. Headroom: max |trainer − {who}| / its per-token rounding bound (a gate fails "
        f"above {overview.headroom_limit(report):g}; n/a: not evaluated). Support equal: the captured S_q is the sampler's whole support (replay) and the trainer-side "
        "filters keep the same set (recompute); full V where nothing was filtered. Mean bias / limit: the deciding mean "
        "gate's |mean diff| over its limit (the trainer under test's, else replay's); resolution: that limit, the "
        "smallest per-token bias the scenario would have detected (docs/error_model.md).",
    ]
    return lines


# A scenario's per-step table shows at most this many steps (the first and last halves); report.json has all.
MAX_STEP_ROWS = 60


def steps_section(report: ReportJson) -> list[str]:
    """The training-log view (records with a ``step`` column): each scenario's trend of mean |diff| over steps
    with the ``drift_trend`` verdict, then its per-step table. Empty when no scenario has steps."""
    sc = [s for s in report["scenarios"] if s.get("per_step")]
    if not sc:
        return []
    lines = [
        "", "## Drift per step (training log)", "",
        "Per scenario, the comparison its verdict follows (the trainer under test, else replay, else recompute): mean "
        "|diff| per training step and its least-squares slope against step, with the slope's standard error (the larger "
        "of the one from the per-step values' scatter about the line and the one from each step's per-token spread). "
        "drift_trend fails when the slope exceeds its limit (z standard errors) and a step after the baseline steps lies "
        "above the band, baseline mean + k × noise (docs/error_model.md, section 5).", "",
        "| scenario | comparison | steps | slope per step | slope se | limit | band (baseline steps) | first step above "
        "| drift_trend |",
        "|---|---|---:|---:|---:|---:|---|---:|---|",
    ]
    for s in sc:
        trend = s.get("trend")
        tr: Mapping[str, object] = trend or {}
        band = "—"
        mean, noise = tr.get("baseline_mean"), tr.get("noise")
        if trend and isinstance(mean, (int, float)) and isinstance(noise, (int, float)):
            base = ", ".join(str(x) for x in trend.get("baseline_steps", []))
            band = f"{_fmt(mean)} ± {_fmt(trend['band_k'] * noise)} ({base})"
        lines.append("| " + " | ".join(_fmt(x) for x in (
            s["name"], tr.get("comparison"), tr.get("steps", 0), tr.get("slope"), tr.get("slope_se"), tr.get("limit"),
            band, tr.get("first_step_outside"),
            ("PASS" if tr.get("passed") else "FAIL") if tr.get("evaluated") else "not evaluated",
        )) + " |")
    if "drift_steps.png" in set(report.get("plots") or []):
        lines += ["", "![mean |diff| per training step, its fitted line and band](drift_steps.png)"]
    for s in sc:
        steps = s["per_step"]
        who = steps[0].get("comparison") or "no comparison"
        lines += ["", f"### {s['name']}: per step ({who})", "",
                  "| step | sequences | tokens | mean bias | mean abs diff | max headroom | support equal |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        shown: list[StepJson | None] = list(steps)
        if len(steps) > MAX_STEP_ROWS:
            shown = [*steps[: MAX_STEP_ROWS // 2], None, *steps[-MAX_STEP_ROWS // 2:]]
        for e in shown:
            if e is None:
                lines.append(f"| … | | | | | | ({len(steps) - MAX_STEP_ROWS} more steps in report.json) |")
                continue
            lines.append("| " + " | ".join(_fmt(x) for x in (
                e["step"], e["sequences"], e["tokens"], e["mean_bias"], e["mean_abs_diff"], e["max_headroom"],
                e["support_equal_frac"],
            )) + " |")
    return lines


def _headline(report: ReportJson) -> str:
    """The verdict line; a records analysis that could not evaluate every gate says its PASS covers the others."""
    sc = report["scenarios"]
    n_pass = sum(s["verdict"] == "pass" for s in sc)
    skipped = sorted({g for s in sc for g in overview.not_evaluated(s)})
    where = sum(bool(overview.not_evaluated(s)) for s in sc)
    if report.get("verdict") == "none":
        return (f"**NO VERDICT** — nothing failed, but {len(report['no_verdict'])} scenario(s) had no mean-bias gate "
                f"(exit 4): " + " ".join(report["no_verdict"][:2]))
    if not skipped:
        return f"**{'PASS' if report['passed'] else 'FAIL'}** — {n_pass}/{len(sc)} scenarios pass."
    verdict = "PASS on the gates evaluated" if report["passed"] else "FAIL"
    return (f"**{verdict}** — {n_pass}/{len(sc)} scenarios pass; {len(skipped)} gate(s) were not evaluated "
            f"in {where} scenario(s) and neither pass nor fail (see \"Gates not evaluated\").")


def _environment(env: EnvironmentJson) -> str:
    """Who produced the numbers: for records, the sampler the files name (not assumed to be vLLM)."""
    if "sampler" not in env:
        return (f"vLLM {env['vllm']}, torch {env['torch']}, transformers {env['transformers']}, device {env['device']}, "
                f"dtype {env['dtype']} (trainer {env['trainer_dtype']}).")

    def said(x: object) -> str:
        return "not recorded" if x in (None, "unknown") else str(x)

    sampler = env["sampler"] or "sampler"
    version = f" {env['sampler_version']}" if env.get("sampler_version") else (" (not recorded)" if not env["sampler"] else "")
    machine = env.get("analysis_machine") or {}
    return (f"Records from: {sampler}{version}, torch {said(env['torch'])}, transformers {said(env['transformers'])}, "
            f"dtype {said(env['dtype'])} (trainer {said(env['trainer_dtype'])}). Analysed with parity "
            f"{said(machine.get('parity'))}, torch {said(machine.get('torch'))}, device {env['device']}.")


def _bullets(title: str, items: list[str]) -> list[str]:
    """A section of one bullet per item; none without items."""
    return [f"## {title}", ""] + [f"- {x}" for x in items] + [""] if items else []


def _verdict_lists(sc: list[ScenarioJson]) -> list[str]:
    """Violations, the reference estimators' findings, the gates not evaluated and the input problems."""
    lines = _bullets("Violations", [v["message"] for s in sc for v in s["violations"]])
    references = [v for s in sc for v in s.get("reference_violations", [])]
    if references:
        lines += ["## Reference estimators", "",
                  "With a trainer under test the verdict is that trainer's; parity's own replay and recompute are "
                  "references, and what their gates found here is a fact about them at this precision:", ""]
        lines += [f"- {v['message']}" for v in references] + [""]
    # Records analysis (parity analyze): what the inputs could not support, and what they got wrong.
    skipped: dict[str, list[str]] = {}
    for s in sc:
        for g in s.get("not_evaluated", []):
            skipped.setdefault(f"{g['gate']}: {g['reason']}", []).append(s["name"])
    lines += _bullets("Gates not evaluated", [f"{k} ({len(v)} scenario(s): {', '.join(v[:6])}"
                                              f"{' ...' if len(v) > 6 else ''})" for k, v in skipped.items()])
    notes = [f"[{s['name']}] {n}" for s in sc for n in s.get("input_notes", [])]
    return lines + _bullets("Input problems", notes)


def _detail_table(sc: list[ScenarioJson]) -> list[str]:
    """One row per scenario, failures first."""
    lines = [
        "## Detail per scenario",
        "",
        "Headroom is max |diff| / bound: the per-token rounding bound of parity.core.error_model (both sides' "
        "dtype, |z|/T, support size); a gate fails above 1. The naive bias is gated against a log S from the "
        "sampler's side (its raw logits, or the nucleus bracket for top_p alone); where neither exists it is "
        "reported, not gated.",
        "",
        "A statistic shown n/a could not be computed from the records (its inputs are listed under \"Gates not "
        "evaluated\").",
        "",
        "| verdict | scenario | spec | tokens | log S mean (trainer) | naive bias | sampler-side log S | naive headroom | "
        "replay headroom | recompute headroom | replay max abs diff | forced | replay support eq | recompute support eq "
        "| seq IS ratio (naive, mean) | incomplete |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sorted(sc, key=lambda s: s["verdict"] != "fail"):
        spec = s["spec"]
        label = f"T={spec['temperature']:g} k={spec['top_k']} p={spec['top_p']:g} min_p={spec['min_p']:g}"
        lines.append("| " + " | ".join(_fmt(x) for x in (
            s["verdict"].upper(), s["name"], label, s["tokens"], s["log_s"]["mean"], s["naive"]["bias_mean"],
            s["sampler_log_s"]["source"].replace("_", " "), s["headroom"]["naive_vs_sampler_log_s"],
            s["headroom"]["replay"], s["headroom"]["recompute"], s["replay"]["max_abs_diff"],
            s["recompute"]["forced_includes"], s["replay"]["support_equal_frac"],
            s["recompute"]["support_equal_frac"], s["is_ratio"]["naive"]["sequence"]["mean"],
            s["incomplete_positions"],
        )) + " |")
    return lines


def _determinism(det: JsonObject) -> list[str]:
    lines = ["", "## Determinism", ""]
    lines.append(
        f"Invariance {'required (batch-invariant mode on)' if det['required'] else 'reported, not required'}; "
        f"overall {'bitwise invariant' if det['invariant'] else 'NOT invariant'}. Largest batching difference "
        f"{_fmt(_obj(det['cross_side'])['kernel_noise_max_abs_diff'])} vs end-to-end replay max |diff| "
        f"{_fmt(_obj(det['cross_side'])['replay_max_abs_diff'])}."
    )
    lines += ["", "| side | check | bitwise | max abs diff |", "|---|---|---|---|"]
    for side in ("rollout", "trainer"):
        for check in _items(_obj(det.get(side)).get("checks", [])):
            c = _obj(check)
            lines.append(f"| {side} | {c.get('name')} | {c.get('bitwise')} | {_fmt(c.get('max_abs_diff'))} |")
    knobs = _obj(_obj(det.get("mode")).get("knobs"))
    if knobs:
        lines += ["", "Knobs: " + "; ".join(f"{k}: {_obj(v).get('status')}" for k, v in knobs.items())]
        kernels = _obj(knobs.get("cpu_kernels", {}))
        value = kernels.get("value")
        if kernels.get("status") == "on" and isinstance(value, dict):
            calls = _obj(value.get("calls", {}))
            lines += ["", "CPU kernels replaced on the trainer: "
                      + ", ".join(f"{k} ({calls.get(k, 0)} calls)" for k in _obj(value.get("replaced", {})))]
            other = _obj(value.get("other_ops"))
            if other:
                lines.append("Operations no kernel covers (measured by the checks): "
                             + ", ".join(f"{k} x{n}" for k, n in other.items()))
    lines += [f"- {_obj(v)['message']}" for v in _items(det["violations"])]
    return lines


DETAILS = "details.md"


def render_markdown(report: ReportJson) -> str:
    """report.md: one screen first (the verdict, the paragraph, the table, its plot), then what failed and why;
    the per-scenario detail is :func:`render_details`' (details.md, linked)."""
    sc = report["scenarios"]
    plots = set(report.get("plots") or [])
    lines = ["# parity report", "", _headline(report), "", overview.paragraph(report), "",
             _environment(report["environment"]), ""]
    limits = [x for s in sc if (x := s.get("capture_limit"))]
    lines += _bullets("Capture limits (not evaluated, not a FAIL)", limits)
    lines += _bullets("Warnings", report.get("warnings") or [])
    lines += glance_table(report)
    if "log_s_bias.png" in plots:
        lines += ["", "![log S against the naive trainer's bias, per scenario](log_s_bias.png)"]
    lines.append("")
    lines += _verdict_lists(sc)
    if "drift_hist.png" in plots:
        lines += ["", "![per-token drift of replay and recompute against its rounding bound](drift_hist.png)"]
    lines += steps_section(report)
    lines += budget_section.markdown(report, plots)
    det = report.get("determinism")
    if det:
        lines += _determinism(det)
    lines += ["", f"Per-scenario detail (estimators, the RL view, routing, matrix coverage, thresholds): [{DETAILS}]({DETAILS})."]
    return "\n".join(lines) + "\n"


def render_details(report: ReportJson) -> str:
    """details.md: each scenario's numbers, the RL view per scenario, routing, matrix coverage and thresholds."""
    lines = ["# parity report: detail per scenario", "", "The verdict and its reasons: [report.md](report.md).", ""]
    lines += _detail_table(report["scenarios"])
    lines += budget_section.split_markdown(report)
    lines += rl_section.markdown(report)
    lines += routing_section.markdown(report)
    cov = report.get("matrix_pair_coverage")
    if cov:
        lines += ["", "## Matrix pair coverage", ""]
        lines += [f"- {k}: {', '.join(str(x) for x in _items(v))}" for k, v in cov.items()]
    th = _obj(report.get("config", {}).get("thresholds"))
    if th:
        lines += ["", "## Thresholds", ""] + [f"- {k}: {v}" for k, v in th.items()]
    return "\n".join(lines) + "\n"
