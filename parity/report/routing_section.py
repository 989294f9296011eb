"""The MoE routing view of a report (agreement per layer, the margin gate, routing replay's drift and IS weights)
and the engine-settings view (prefix caching, chunked prefill against the same scenario without them)."""

from __future__ import annotations

from parity.core.display import NA
from parity.report.blocks import EngineSettingEffect, ReportJson, ScenarioJson


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def terminal_lines(report: ReportJson) -> list[str]:
    """One line per MoE scenario and per engine-setting scenario for the terminal summary."""
    out = settings_lines(report)
    for s in report["scenarios"]:
        g = s.get("routing")
        if not g:
            continue
        layers = "/".join(f"{100 * p['agreement']:.1f}" for p in g["per_layer"])
        d = g["replay"]["drift"]
        out.append(
            f"routing [{s['name']}]: experts agree {_pct(g['agreement'])} (per layer {layers} %), "
            f"{_pct(g['rows_any_layer_differs'])} of tokens differ in >= 1 layer; {g['flips']} flips, "
            f"{g['flips_above_bound']} above the margin bound; replay forced {_pct(g['replay']['forced_frac'])}, "
            f"max|d| {d['without_replay']['max_abs_diff']:.2g} -> {d['with_replay']['max_abs_diff']:.2g}"
        )
    return out


def markdown(report: ReportJson) -> list[str]:
    """report.md's routing section: per scenario the per-layer table, then replay against no replay."""
    scenarios = [s for s in report["scenarios"] if s.get("routing")]
    settings = settings_lines(report)
    lines = ["", "## Engine settings: the same prompts and seeds with and without", ""] + [f"- {x}" for x in settings] if settings else []
    if not scenarios:
        return lines
    lines += [
        "", "## MoE routing: the sampler's experts against the trainer's router, and routing replay (R3)", "",
        "A flip (the two sides' top-k expert sets differ) is allowed only where the trainer's margin between its "
        "k-th and (k+1)-th router logits is within the margin's rounding bound (docs/routing.md). Under replay the "
        "trainer runs the sampler's experts, gate weights from its own router logits.",
    ]
    for s in scenarios:
        g = s["routing"]
        cap = g.get("capture")
        route = cap.get("route", NA) if isinstance(cap, dict) else NA
        worst = g["worst_margin_over_bound"]
        lines += [
            "", f"### {s['name']}", "",
            f"{g['rows']} tokens x {g['layers']} layers (top-{g['top_k']} of {g['num_experts']}); agreement "
            f"{_pct(g['agreement'])}; tokens with >= 1 layer different {_pct(g['rows_any_layer_differs'])}; flips "
            f"{g['flips']} ({g['flips_within_bound']} within the bound, {g['flips_above_bound']} above"
            f"{'' if worst is None else f'; largest margin / bound {worst:.3g}'}); capture: {route}, "
            f"{g['uncovered_rows']} tokens no forward covered (not compared).",
            "", "| layer | agreement | flips | above bound | median margin | median bound |", "|---|---|---|---|---|---|",
        ]
        lines += [f"| {p['layer']} | {_pct(p['agreement'])} | {p['flips']} | {p['flips_above_bound']} | "
                  f"{p['median_margin']:.3g} | {p['median_bound']:.3g} |" for p in g["per_layer"]]
        r = g["replay"]
        lines += ["", f"Replay forced {_pct(r['forced_frac'])} of (token, layer) expert sets ({r['mismatched']} differ); "
                      f"its drift and IS weights are in the RL view."]
    return lines


def replay_lines(s: ScenarioJson) -> list[str]:
    """The RL view's lines for a MoE scenario: log-prob drift and IS weights with and without routing replay."""
    g = s.get("routing")
    if not g:
        return []
    lines = ["", "Routing replay (R3): the trainer's log-probs (replay estimator) against vLLM's with its own routing "
             "and with the sampler's experts forced.", "", "| trainer | max abs diff | mean abs diff | headroom | "
             "IS ratio token mean | token max | sequence min | sequence max |", "|---|---|---|---|---|---|---|---|"]
    for name, key in (("own routing", "without_replay"), ("routing replay", "with_replay")):
        d = g["replay"]["drift"][key]
        lines.append(f"| {name} | {d['max_abs_diff']:.3g} | {d['mean_abs_diff']:.3g} | {d['headroom']:.3g} | "
                     f"{d['is_ratio_token_mean']:.6g} | {d['is_ratio_token_max']:.6g} | {d['is_ratio_seq_min']:.6g} | "
                     f"{d['is_ratio_seq_max']:.6g} |")
    return lines


def _setting(e: EngineSettingEffect) -> str:
    st = e["settings"]
    parts = (["prefix caching"] if st["prefix_caching"] else []) + (
        [f"chunked prefill at {st['max_num_batched_tokens']} tokens"] if st["max_num_batched_tokens"] else [])
    return " + ".join(parts)


def settings_lines(report: ReportJson) -> list[str]:
    """One measured sentence per engine-setting scenario (terminal and report.md)."""
    out = []
    for e in report.get("engine_settings") or []:
        routed = ("" if e["routed_rows_compared"] is None else
                  f"; routed experts equal at {e['routed_rows_equal']}/{e['routed_rows_compared']} tokens")
        out.append(f"engine setting [{e['scenario']}] ({_setting(e)}) against [{e['baseline']}]: same tokens in "
                   f"{e['same_tokens']}/{e['sequences']} sequences, log-probs bitwise equal in "
                   f"{e['logprobs_bitwise_equal']}, largest gap {e['max_abs_logprob_diff']:.3g}{routed} (measured)")
    return out
