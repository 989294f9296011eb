"""The run at a glance: one row per scenario and one plain-language paragraph, computed from the report
dict alone (docs/internals.md, section 9). :func:`render_terminal` is the terminal block; :func:`paragraph`
and :func:`glance_rows` feed the head of report.md (:mod:`parity.report.markdown`).
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Mapping
from typing import SupportsFloat

from parity.core.display import NA, apart
from parity.core.spec import SamplingSpec
from parity.report import rl_section, routing_section
from parity.report.blocks import Diff, ReportJson, ScenarioJson, report_json

# Which gates belong to which side of the story (parity.core.gates names them).
REPLAY_GATES = ("replay_drift", "replay_mean_bias", "replay_support")
RECOMPUTE_GATES = ("recompute_drift", "recompute_mean_bias", "recompute_support")
NAIVE_GATES = ("naive_vs_sampler_log_s",)
TRAINER_GATES = ("trainer_under_test_drift", "trainer_under_test_mean_bias", "logprob_mean_bias", "trainer_support")
WIDTH = 100


def sampler_name(report: ReportJson) -> str:
    """Who sampled: vLLM for ``parity run``; for records, the ``sampler`` the files name, else "the sampler"."""
    env = report.get("environment")
    if not env or "sampler" not in env:
        return "vLLM"
    return str(env["sampler"] or "the sampler")


def not_evaluated(s: ScenarioJson) -> set[str]:
    """The gates a scenario could not evaluate (a records analysis lists them with the input they lack)."""
    return {g["gate"] for g in s.get("not_evaluated", [])}


def _f(x: object) -> float | None:
    """A report number as a float (report.json writes non-finite floats as strings); None where it is missing."""
    if x is None:
        return None
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return None
    if not isinstance(x, SupportsFloat):
        raise TypeError(f"a report number: expected a number or its string, got {type(x).__name__}")
    return float(x)


def _signed(x: object) -> str:
    v = _f(x)
    if v is None:
        return NA if x is None else "—"
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    return f"{v:+.4f}" if abs(v) >= 1e-3 else f"{v:+.1e}"


def _ratio(x: object) -> str:
    v = _f(x)
    if v is None:
        return NA if x is None else "—"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.2f}" if v < 100 else f"{v:.3g}"


def _pct(x: object) -> str:
    v = _f(x)
    if v is None:
        return NA if x is None else "—"
    return "100 %" if v == 1.0 else f"{100 * v:.1f} %"


def headroom_limit(report: ReportJson) -> float:
    thresholds = (report.get("config") or {}).get("thresholds")
    return _f(thresholds.get("max_headroom") if isinstance(thresholds, dict) else None) or 1.0


def _gates(s: ScenarioJson) -> list[str]:
    out: list[str] = []
    for v in s.get("violations", []):
        g = v.get("gate", "?") if isinstance(v, dict) else "?"
        if g not in out:
            out.append(g)
    return out


def truncates(s: ScenarioJson) -> bool:
    """The filters removed mass that rounding cannot explain: the mean ``-log S`` above what rounding can
    move a mean log-prob by (the replay mean-bias limit, :func:`parity.core.error_model.mean_bias_limit`;
    the mean per-token bound where a report has no limit). A per-token bound is the wrong yardstick for a
    mean: in bfloat16 it can exceed a real log S of 0.2 nats."""
    spec = SamplingSpec.from_dict(s["spec"]).effective()
    if log_s_unknown(s):
        return False
    log_s = _f(s["log_s"]["mean"]) or 0.0
    return spec.filtered and -log_s > _resolution(s)


def _resolution(s: ScenarioJson) -> float:
    """The replay mean-bias limit :func:`truncates` compares log S with (the mean bound where there is none)."""
    limits, bound = s.get("mean_bias_limit"), s.get("bound")
    limit = _f(limits.get("replay") if limits else None)
    return limit if limit is not None else (_f(bound.get("mean") if bound else None) or 0.0)


def log_s_unknown(s: ScenarioJson) -> bool:
    """A filtering scenario whose log S the records could not give: whether its filters truncated is unknown."""
    return SamplingSpec.from_dict(s["spec"]).effective().filtered and _f(s["log_s"]["mean"]) is None


def _token_s(s: ScenarioJson) -> float:
    """S per token: the naive IS ratio's mean, else the mean of exp(log S) (records without full log-probs)."""
    v = _f(s["is_ratio"]["naive"]["token"]["mean"])
    return v if v is not None else (_f(s["log_s"].get("mean_s")) or 1.0)


def support_cell(s: ScenarioJson) -> str:
    """Support equality, replay then recompute; the full vocabulary where no filter was captured."""
    if not s.get("captured_positions"):
        cell = NA if SamplingSpec.from_dict(s["spec"]).effective().filtered and "replay_support" in not_evaluated(s) else "full V"
    else:
        rep, rec = s["replay"]["support_equal_frac"], s["recompute"]["support_equal_frac"]
        cell = "equal" if _f(rep) == 1.0 and _f(rec) == 1.0 else f"{_pct(rep)} / {_pct(rec)}"
    if s.get("incomplete_positions"):
        cell += f" ({s['incomplete_positions']} incomplete)"
    return cell


def glance_rows(report: ReportJson) -> list[dict[str, str]]:
    """One row per scenario, in matrix order: the cells of the terminal table and of report.md's first table."""
    rows = []
    for s in report["scenarios"]:
        rows.append({
            "scenario": s["name"],
            "verdict": s["verdict"].upper(),
            "log S": _signed(s["log_s"]["mean"]),
            "naive bias": _signed(s["naive"]["bias_mean"]),
            "replay": _cell_of(s, "replay"),
            "recompute": _cell_of(s, "recompute"),
            "support": support_cell(s),
            "drift": f"{_cell_of(s, 'replay')}/{_cell_of(s, 'recompute')}",
            **_mean_cells(s),
            "failed gates": ", ".join(_gates(s)),
        })
    return rows


def _headroom(s: ScenarioJson, name: str) -> object:
    head: Mapping[str, object] = s.get("headroom") or {}
    return head.get(name)


def _cell_of(s: ScenarioJson, name: str) -> str:
    return NA if f"{name}_drift" in not_evaluated(s) else _ratio(_headroom(s, name))


def _mean_cells(s: ScenarioJson) -> dict[str, str]:
    """The deciding mean gate's use of its limit (|mean| / limit) and the limit itself: the verdict's
    resolution, the smallest per-token bias it would have detected (docs/error_model.md)."""
    means = s.get("mean_bias")
    entry = means and (means.get("trainer_under_test") or means.get("logprob") or means.get("replay")
                       or means.get("recompute"))
    if not entry or not isinstance(entry["limit"], (int, float)):
        return {"mean/limit": NA, "resolution": NA}
    limit = float(entry["limit"])
    ratio = abs(float(entry["mean"])) / limit if limit > 0 else float("inf")
    return {"mean/limit": _ratio(ratio), "resolution": f"{limit:.1e}"}


def _example(truncating: list[ScenarioJson]) -> ScenarioJson:
    """The scenario the paragraph speaks of: top_p alone nearest 0.9 at T nearest 1 (the common RL setting)."""

    def key(s: ScenarioJson) -> tuple[bool, float, float]:
        spec = SamplingSpec.from_dict(s["spec"])
        pure_top_p = spec.uses_top_p and not spec.uses_top_k and not spec.uses_min_p
        return (not pure_top_p, abs(spec.top_p - 0.9), abs(spec.temperature - 1.0))

    return min(truncating, key=key)


def _article(n: int) -> str:
    """'a' or 'an' before a number read aloud (an 8-token, an 11-token, a 16-token completion)."""
    return "an" if str(n).startswith("8") or n in (11, 18) or 11_000 <= n < 12_000 or 18_000 <= n < 19_000 else "a"


def _names(items: list[ScenarioJson], most: int = 3) -> str:
    names = [s["name"] for s in items]
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _failing(scenarios: list[ScenarioJson], gates: tuple[str, ...]) -> list[ScenarioJson]:
    return [s for s in scenarios if any(g in gates for g in _gates(s))]


def _truncation_sentences(sc: list[ScenarioJson], who: str) -> list[str]:
    """Whether the filters removed mass, by how much, and whether the naive bias is log S."""
    parts: list[str] = []
    truncating = [s for s in sc if truncates(s)]
    unknown = [s for s in sc if log_s_unknown(s)]
    if unknown:
        parts.append(
            f"Whether the filters removed probability mass is unknown in {len(unknown)} scenario(s) ({_names(unknown)}): "
            "the records hold no log S and nothing to derive it from."
        )
    faint = [s for s in sc if s not in truncating and s not in unknown and (_f(s["log_s"]["mean"]) or 0.0) < 0.0
             and SamplingSpec.from_dict(s["spec"]).effective().filtered]
    if faint:
        e = faint[0]
        log_s, limit = -(_f(e["log_s"]["mean"]) or 0.0), _resolution(e)
        parts.append(
            f"The filters removed probability mass in {len(faint)} scenario(s) ({_names(faint)}; log S = "
            f"{apart(-log_s, -limit)} nats per token at {e['name']}), but less than the mean-bias resolution "
            f"{apart(limit, log_s)}: there a full-vocabulary trainer cannot be told from a correct one."
        )
    if not truncating and not unknown and not faint:
        parts.append(
            "No scenario's filters removed any probability mass (S = 1 throughout), so a trainer that takes the "
            f"full-vocabulary log-softmax scores what {who} sampled here."
        )
    elif truncating:
        e = _example(truncating)
        tok = _token_s(e)
        seq = _f(e["is_ratio"]["naive"]["sequence"]["mean"])
        length = round((e.get("compared_tokens") or e["tokens"]) / max(1, e.get("sequences") or 1))
        parts.append(
            f"A trainer that takes the full-vocabulary log-softmax would under-weight every token by S = {tok:.2f} "
            f"at {e['name']} (log S = {_signed(e['log_s']['mean'])} nats per token)"
            + (f", {_article(length)} {length}-token completion by {seq:.2g}." if seq is not None else ".")
        )
        if len(truncating) > 1:
            lo = min(truncating, key=_token_s)
            hi = max(truncating, key=_token_s)
            parts.append(
                f"Over the {len(truncating)} scenarios whose filters truncate, S per token runs from "
                f"{_token_s(lo):.2f} ({lo['name']}) to {_token_s(hi):.2f} ({hi['name']})."
            )
        checked = [s for s in truncating if _f(_headroom(s, "naive_vs_sampler_log_s")) is not None]
        naive_bad = _failing(sc, NAIVE_GATES)
        if naive_bad:
            parts.append(
                f"In {len(naive_bad)} scenario(s) ({_names(naive_bad)}) the naive bias is not the sampler's log S: "
                "something besides the truncation differs."
            )
        elif checked:
            where = (
                "" if len(checked) == len(truncating) == 1
                else f" in all {len(checked)} of them" if len(checked) == len(truncating)
                else f" in {len(checked)} of them (the others have no sampler-side log S to compare)"
            )
            parts.append(
                "That bias is log S itself: it matches the log S taken from the sampler's side within the rounding "
                f"bound{where}."
            )
    return parts


def _drift_sentences(sc: list[ScenarioJson], who: str, limit: float, truncating: bool) -> list[str]:
    """Replay and recompute: which fail, the worst kernel drift against its bound, forced includes."""
    parts: list[str] = []
    rep_bad, rec_bad = _failing(sc, REPLAY_GATES), _failing(sc, RECOMPUTE_GATES)
    if not rep_bad and not rec_bad:
        parts += _estimators_sentences(sc, who, truncating)
    else:
        for name, bad in (("Replay", rep_bad), ("Recompute", rec_bad)):
            if bad:
                parts.append(f"{name} fails in {len(bad)} scenario(s): {_names(bad)}.")
    heads = [
        (h, s) for s in sc for k in ("replay", "recompute")
        if (h := _f(_headroom(s, k))) is not None
    ]
    if heads:
        h, s = max(heads, key=lambda t: t[0] if math.isfinite(t[0]) else math.inf)
        if h <= limit:
            parts.append(
                f"Remaining kernel drift is within {h:.2g} of its rounding bound (worst: {s['name']}; a gate fails "
                f"above {limit:g})."
            )
        else:
            parts.append(
                f"The trainer's gap to {who} reaches {_ratio(h)} times its rounding bound in {s['name']} (the gate "
                f"allows {limit:g})."
            )
    ties = [(s, sd) for s in sc if (sd := s.get("support_sides")) is not None and sd["ties_dropped_positions"]]
    if ties:
        e, sd = ties[0]
        parts.append(
            f"At {e['name']} the sampler's kept set holds tokens tied at the k-th value (top_k={sd['top_k']}) at "
            f"{sd['ties_at_k_positions']} position(s); recompute, at the trainer's precision, kept fewer tokens at "
            f"{sd['ties_dropped_positions']} of them (S_q ⊋ S_p): replay, or recompute at the sampler's precision "
            f"(--recompute-precision sampler), keeps them."
        )
    forced = sum(int(_f(s["recompute"].get("forced_includes")) or 0) for s in sc)
    if forced:
        parts.append(
            f"Recompute had to force-include the sampled token at {forced} position(s): the trainer's numerics moved "
            "the filter boundary there."
        )
    return parts


def _trainer_sentences(sc: list[ScenarioJson], who: str) -> list[str]:
    """The trainer under test's verdict and diagnosis, and the other failed gates."""
    parts: list[str] = []
    tested = [s for s in sc if s.get("trainer_under_test")]
    if tested:
        tester = tested[0]["trainer_under_test"].get("name")
        bad = _failing(tested, TRAINER_GATES)
        # Not gated: none of the trainer's gates was evaluated (a failed gate was evaluated, so never both).
        ungated = [s for s in tested if s not in bad and set(TRAINER_GATES) <= not_evaluated(s)]
        powerless = [s for s in tested if s not in bad and s not in ungated and s["verdict"] == "none"]
        worst = bad[0] if bad else tested[0]
        if bad:
            verdict = f"fails in {len(bad)} of {len(tested)} scenario(s) ({_names(bad)})"
        elif len(ungated) == len(tested):
            mean = _signed(tested[0]["trainer_under_test"].get("mean_diff"))
            verdict = (f"was not gated: its drift and mean-bias gates were not evaluated (see the gates not evaluated); "
                       f"its mean gap to {who} is {mean} nats per token at {tested[0]['name']}")
        elif powerless:
            verdict = (f"has no verdict in {len(powerless)} of {len(tested)} scenario(s) ({_names(powerless)}): its "
                       f"mean-bias gate could not have failed a full-vocabulary trainer there (see NO VERDICT)")
            worst = powerless[0]
        elif ungated:
            verdict = f"passes the {len(tested) - len(ungated)} scenario(s) where it was gated (not gated in {_names(ungated)})"
        else:
            verdict = "passes every scenario"
        diagnosis = worst["trainer_under_test"].get("diagnosis") or "none"
        if worst in powerless:
            diagnosis += ", within a resolution too coarse to tell"
        parts.append(f"The trainer under test ({tester}) {verdict}; diagnosis at {worst['name']}: {diagnosis}.")
    other = sorted({g for s in sc for g in _gates(s)} - set(REPLAY_GATES + RECOMPUTE_GATES + NAIVE_GATES + TRAINER_GATES))
    if other:
        parts.append("Other failed gates: " + ", ".join(other) + ".")
    return parts


def _determinism_sentences(report: ReportJson) -> list[str]:
    det = report.get("determinism") or {}
    sides = [f"{side} {'bitwise' if d['invariant'] else 'not bitwise'}" for side in ("rollout", "trainer")
             if isinstance(d := det.get(side), dict) and "invariant" in d]
    if not sides:
        return []
    why = " (required under batch-invariant mode)." if det.get("required") else " (reported, not required)."
    return ["Across batch sizes and layouts: " + ", ".join(sides) + why]


def paragraph(report: ReportJson) -> str:
    """What the numbers mean for a training run, in plain words, computed from the report."""
    sc = report["scenarios"]
    who = sampler_name(report)
    truncating = [s for s in sc if truncates(s)]
    parts = _truncation_sentences(sc, who)
    parts += _drift_sentences(sc, who, headroom_limit(report), bool(truncating))
    parts += _trainer_sentences(sc, who)
    parts += _determinism_sentences(report)
    if truncating:
        headline = rl_section.headline(_example(truncating))
        if headline:
            parts.append(f"In RL terms, {headline}")
    skipped = sorted({g for s in sc for g in not_evaluated(s)})
    if skipped:
        parts.append(
            f"{len(skipped)} gate(s) could not be evaluated on these records ({', '.join(skipped)}): they neither "
            "pass nor fail, and the verdict covers only the gates that were evaluated."
        )
    return " ".join(parts)


def _diff(s: ScenarioJson, name: str) -> Diff:
    return s["replay"] if name == "replay" else s["recompute"]


def _estimators_sentences(sc: list[ScenarioJson], who: str, truncating: bool) -> list[str]:
    """Replay's and recompute's gap to the sampler where no gate of theirs failed: measured where the records
    hold them, named as not gated where their drift gate was not evaluated, as missing where neither."""
    measured = {k: [s for s in sc if _f(_diff(s, k)["max_abs_diff"]) is not None] for k in ("replay", "recompute")}
    names = [k for k, v in measured.items() if v]
    if not names:
        return ["Neither replay nor recompute could be measured on these records (see the gates not evaluated)."]
    worst = max(_f(_diff(s, k)["max_abs_diff"]) or 0.0 for k in names for s in measured[k])
    subject = " and ".join(names).capitalize()
    ungated = sorted({s["name"] for k in names for s in measured[k] if f"{k}_drift" in not_evaluated(s)})
    if ungated:
        out = [f"{subject}'s largest per-token gap to {who} is {worst:.1e} nats, measured but not gated in "
               f"{len(ungated)} scenario(s) (no rounding bound to compare it with)."]
    elif truncating:
        verb, pron = ("remove", "their") if len(names) == 2 else ("removes", "its")
        out = [f"{subject} {verb} it: {pron} largest per-token gap to {who} is {worst:.1e} nats."]
    else:
        out = [f"{subject} {'agree' if len(names) == 2 else 'agrees'} with {who} to {worst:.1e} nats per token."]
    missing = [k for k in ("replay", "recompute") if k not in names]
    if missing:
        out.append(f"{missing[0].capitalize()} was not evaluated: the records do not hold what it needs.")
    return out


TERMINAL_COLUMNS = (("verdict", "verdict"), ("scenario", "scenario"), ("log S", "log S"),
                    ("drift", "drift rep/rec"), ("support", "support"), ("mean/limit", "mean"),
                    ("resolution", "resolution"))


def render_terminal(report: Mapping[str, object], *, width: int = WIDTH) -> str:
    """The block ``parity run`` prints last: a one-line-per-scenario table, then the paragraph (the columns:
    docs/internals.md, section 9). ``report``: as ``parity run`` returns it, or report.json loaded back
    (:func:`parity.report.blocks.report_json`)."""
    report = report_json(report)
    rows = glance_rows(report)
    widths = {k: max(len(title), *(len(r[k]) for r in rows)) for k, title in TERMINAL_COLUMNS}
    right = {"log S", "drift", "mean/limit", "resolution"}

    def cell(key: str, text: str) -> str:
        return text.rjust(widths[key]) if key in right else text.ljust(widths[key])

    lines = ["  ".join(cell(k, title) for k, title in TERMINAL_COLUMNS).rstrip()]
    for r in rows:
        line = "  ".join(cell(k, r[k]) for k, _ in TERMINAL_COLUMNS).rstrip()
        if r["failed gates"]:
            line += f"  ← {r['failed gates']}"
        lines.append(line)
    lines.append("")
    # "0 %" and "S = 0.91" stay on one line.
    text = paragraph(report).replace(" %", "\0%").replace(" = ", "\0=\0")
    lines += [ln.replace("\0", " ") for ln in textwrap.wrap(text, width=width)]
    routing = [w for r in routing_section.terminal_lines(report) for w in textwrap.wrap(r, width=width)]
    lines += ["", *routing] if routing else []
    return "\n".join(lines)
