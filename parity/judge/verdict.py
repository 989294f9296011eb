"""The verdicts of the records analysis: the report entries of a merged
:class:`~parity.judge.accumulators.Summary`, and every gate as a :class:`~parity.core.violation.Violation`.
The gates and their inputs: docs/records.md, section 6.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, cast

# No torch at import: records without --model are judged with numpy alone. torch is imported where a
# rule's one home computes on tensors (the top_p bracket, replay from kept logits).
from parity.core.error_model import (
    SUPPORT_MASS_TOL,
    log_s_signature,
    mean_bias_entry,
    ratio_bias_entry,
    unit_roundoff,
)
from parity.core.gates import Thresholds
from parity.core.power import Power, power_of, power_sentence
from parity.core.spec import SamplingSpec
from parity.core.violation import Violation
from parity.judge.accumulators import INPUTS, ScenarioAcc
from parity.judge.diagnosis import diagnosis_text, logprob_bias_class
from parity.judge.gate_table import CAPTURE_LIMIT_FIX, GATE_TABLE, GateCase, evaluate, split_verdict
from parity.judge.steps import COMPARISONS, REPORT_NAMES, SUPPORT_OF, TREND_GATE, drift_trend
from parity.judge.streams import HEAD_BINS, HEAD_LO, HEAD_STEP, na_ratios
from parity.report import blocks

if TYPE_CHECKING:
    from parity.judge.accumulators import Summary
    from parity.report.blocks import Routing

# What each records gate reads (inputs named as in REASONS), in the gate table's order (drift_trend aside:
# its inputs are the steps, judged by _step_view).
GATE_INPUTS: dict[str, tuple[str, ...]] = {
    g.name: g.needs for g in GATE_TABLE if g.scope == "records" and g.name != TREND_GATE
}
GATES = tuple(GATE_INPUTS)
# Gates of a trainer under test (the records' trainer_logprobs): where the records hold none they do not apply.
USER_GATES = tuple(g for g, inputs in GATE_INPUTS.items() if "user" in inputs)
# The mean-bias gates: a verdict is complete only with one of them (a log S bias moves only the mean).
MEAN_GATES = ("replay_mean_bias", "recompute_mean_bias", "trainer_under_test_mean_bias", "logprob_mean_bias")
# What supplies a mean-bias gate's inputs, for a scenario that has none (the no-verdict line).
MEAN_GATE_SUPPLY = (
    "trainer_logprobs (the trainer's log-prob of each sampled token, as a training run logs it: TRL's per-token "
    "logps, verl's old_log_probs) for logprob_mean_bias; or parity analyze --model CKPT, which re-scores the tokens "
    "for replay_mean_bias and recompute_mean_bias"
)
# Gates that judge the sequences that have their inputs (parity run gates the naive bias wherever a
# sampler-side log S exists); the others need every sequence to have them.
PARTIAL_OK = ("naive_vs_sampler_log_s",)
REASONS = {
    "kept": "no kept set (kept_ids, kept_offsets, kept_logprobs) under a filtering spec: the sampler's support S_q is unknown",
    "replay": "no trainer_replay_logprobs, and no trainer_kept_logits to renormalise over S_q",
    "recompute": "no trainer_recompute_logprobs: recomputing the filters needs the trainer's full-vocabulary logits "
    "(analyze with --model CKPT)",
    "recompute_support": "no trainer_recompute_support_equal: needs the trainer's full-vocabulary logits (--model CKPT)",
    "full": "no trainer_full_logprobs (the trainer's full-vocabulary log-probs)",
    "log_s": "no trainer_log_s, and log S cannot be derived (needs trainer_kept_logits with trainer_full_logprobs, "
    "or --model CKPT)",
    "user": "no trainer_logprobs (the trainer under test's own log-probs)",
    "forced": "no trainer_recompute_forced",
    "kl": "no trainer_kept_logits: KL and TV over S_q need the trainer's distribution there",
    "bound": "no trainer_bound: the per-token rounding bound needs the trainer's scaled logits over the whole row "
    "(parity run --records writes it; or analyze with --model CKPT)",
    "bound_full": "no trainer_bound_full (the full-vocabulary rounding bound; parity run --records writes it, or --model CKPT)",
    "sampler_log_s": "no sampler-side log S: no sampler_log_s_lo/_hi, and the top_p bracket needs top_p as the only "
    "filter, a complete kept set and the vocabulary size (records metadata vocab_size, or --model CKPT)",
}
assert set(REASONS) == set(INPUTS)


# -- the report entries and the verdicts -----------------------------------------------------------


def _diagnosis(a: ScenarioAcc, mean_limit: float, logprob: blocks.LogprobBias | None = None) -> str:
    u = a.streams["user"]
    if not a.views:
        if logprob is None:
            return "not diagnosed: " + REASONS["bound"]
        if abs(float(logprob["mean"])) > float(logprob["limit"]) or logprob["sign_test"]["failed"]:
            return logprob_bias_class(logprob, float(logprob["limit"]))
        return (f"no bias within the mean-bias resolution {logprob['limit']:.3g} per token (no per-token diagnosis: "
                + REASONS["bound"] + ")")
    close = {frozenset(k.split("+")) if k else frozenset(): v.close(mean_limit) for k, v in a.views.items()}
    return diagnosis_text(close, u.max_abs if u.n else math.nan, u.total / u.n if u.n else math.nan)


def spec_log_s_range(spec: SamplingSpec, vocab: int) -> tuple[float, float]:
    """The interval a position's log S (the log of the trainer's mass on the sampler's kept set) lies in
    under ``spec``, from the filters alone: top_p keeps at least ``top_p`` of the mass, top_k at least
    ``k / V``, min_p at least the top token's probability (at least ``1 / V``); 0 when nothing is filtered."""
    e = spec.effective()
    lo = 0.0
    if e.uses_top_p:
        lo += math.log(e.top_p)
    if e.uses_top_k and e.top_k < vocab:
        lo += math.log(e.top_k / vocab)
    if e.uses_min_p:
        lo += -math.log(vocab)
    return lo, 0.0


def _logprob_entry(a: ScenarioAcc) -> blocks.LogprobBias | None:
    """The two-column mean-bias gate's numbers (:func:`parity.core.error_model.ratio_bias_entry`) with the
    facts it assumed, the sign test and the count of tokens outside the trainer's support."""
    r = a.ratio
    spec = SamplingSpec.from_dict(a.spec)
    facts = a.facts()
    n_s = facts["sampler_support"]
    if a.captured and a.captured == a.tokens and not a.incomplete:
        n_s = min(n_s, max(a.support_max, 1))
    vocab, u, assumed = facts["vocab"], facts["u"], facts["assumed"]
    sampler_dtype, trainer_dtype = (a.dtypes + ["", ""])[:2]
    out = ratio_bias_entry(tokens=r.tokens, sequences=r.sequences, e_sum=r.e_sum, e_sq=r.e_sq, seq_e_sq=r.seq_e_sq,
                           seq_ne=r.seq_ne, seq_n_sq=r.seq_n_sq, d_sum=r.d_sum, lp_abs_sum=r.lp_abs_sum,
                           sampler_support=n_s, trainer_support=vocab, accumulate_u=u, d_sq=r.d_sq,
                           beyond_negative=r.beyond_negative, beyond_positive=r.beyond_positive)
    if out is None:
        return None
    lo, hi = spec_log_s_range(spec, vocab)
    source = "the spec's filters"
    if a.s_n:
        lo, hi, source = a.s_lo_sum / a.s_n, a.s_hi_sum / a.s_n, "the sampler-side log S"
    out.update(negative_frac=r.negative / r.tokens, outside_support=r.outside, nonfinite=r.nonfinite,
               log_s_range=[lo, hi], log_s_range_from=source, assumed=assumed,
               stated={"vocab_size": a.vocab_size or None, "sampler_dtype": sampler_dtype or None,
                       "trainer_dtype": trainer_dtype or None})
    return cast("blocks.LogprobBias", out)  # ratio_bias_entry's numbers and the facts above


def _full(a: ScenarioAcc, *inputs: str) -> bool:
    """Every sequence of the scenario has each of ``inputs``."""
    return all(a.lacking[k] == 0 for k in inputs)


def _ratios(a: ScenarioAcc, avail: dict[str, bool]) -> dict[str, blocks.Ratios]:
    ratios = {
        "naive": a.ratios["naive"].to_report(identity=True) if avail["full"] else na_ratios(identity=True),
        "replay": a.ratios["replay"].to_report() if avail["replay"] else na_ratios(),
        "recompute": a.ratios["recompute"].to_report() if avail["recompute"] else na_ratios(),
    }
    if avail["full"] and not avail["log_s"]:
        ratios["naive"]["sequence_identity_max_rel_err"] = None
    if avail["user"]:
        ratios["trainer_under_test"] = a.ratios["user"].to_report()
    return ratios


_Bias = tuple[dict[str, float | None], dict[str, "blocks.MeanBias | None"], dict[str, float | None],
              "blocks.LogprobBias | None"]


def _bias(a: ScenarioAcc, avail: dict[str, bool]) -> _Bias:
    """Headroom against the per-token bound, the mean-bias entries and their limits, per estimator."""
    b = a.bounds
    with_bound = avail["bound"]
    headroom: dict[str, float | None] = {
        "replay": b["replay"].headroom if with_bound and avail["replay"] else None,
        "recompute": b["recompute"].headroom if with_bound and avail["recompute"] else None,
        "naive_vs_sampler_log_s": b["naive"].headroom if b["naive"].n else None,
    }

    def entry(stream: str, ref: str, inp: str) -> blocks.MeanBias | None:
        if not (with_bound and avail[inp]):
            return None
        bs, rs = b[stream], b[ref] if b[ref].n else b[stream]
        sig = log_s_signature(bs.n, bs.cross_log_s, bs.log_s_sq, rs.sd) if stream == "user" else None
        return cast("blocks.MeanBias", mean_bias_entry(bs.n, bs.mean if bs.n else 0.0, bs.systematic_mean, rs.sd,
                                                       signature=sig))

    means: dict[str, blocks.MeanBias | None] = {"replay": entry("replay", "replay", "replay"),
                                                "recompute": entry("recompute", "recompute", "recompute")}
    lp = None
    if avail["user"]:
        headroom["trainer_under_test"] = b["user"].headroom if with_bound else None
        # The allowance for averaging comes from replay's spread, not the trainer's own.
        means["trainer_under_test"] = entry("user", "replay", "user")
        means["logprob"] = lp = _logprob_entry(a)
    limits = {k: None if v is None else float(v["limit"]) for k, v in means.items()}
    return headroom, means, limits, lp


def _stat_blocks(a: ScenarioAcc, avail: dict[str, bool]) -> dict[str, object]:
    """The scenario's statistics that no gate limit enters: log S, the naive view, diffs, IS ratios, KL/TV."""
    s = a.streams

    def diff(stream: str, inp: str) -> Mapping[str, blocks.Stat]:
        return s[stream].stats() if avail[inp] else dict.fromkeys(("max_abs_diff", "mean_diff", "mean_abs_diff", "p99_abs_diff"), None)

    def frac(ok: int, n: int, inp: str) -> blocks.Stat:
        if not avail[inp]:
            return None
        return ok / n if n else 1.0

    naive = s["naive"].stats() if avail["full"] else None
    gap = s["gap"].stats() if avail["full"] and avail["log_s"] else None
    mean_max = {"mean": None, "max": None}
    return {
        "log_s": {"mean": a.log_s_sum / a.log_s_n if a.log_s_n else 0.0, "min": a.log_s_min if a.log_s_n else 0.0,
                  "mean_s": a.log_s_sum_exp / a.log_s_n if a.log_s_n else 1.0}
        if avail["log_s"] else {"mean": None, "min": None, "mean_s": None},
        "naive": {
            "bias_mean": naive["mean_diff"] if naive else None,
            "max_abs_diff": naive["max_abs_diff"] if naive else None,
            "max_abs_gap_to_log_s": gap["max_abs_diff"] if gap else None,
            "mean_gap_to_log_s": gap["mean_diff"] if gap else None,
            **({"penalty_term_mean": s["penalty"].stats()["mean_diff"]} if s["penalty"].n else {}),
        },
        "replay": {**diff("replay", "replay"), "support_equal_frac": frac(a.replay_ok, a.replay_n, "kept")},
        "recompute": {
            **diff("recompute", "recompute"),
            "support_equal_frac": frac(a.recompute_eq, a.recompute_n, "recompute_support"),
            "forced_includes": a.forced if avail["forced"] else None,
        },
        "is_ratio": _ratios(a, avail),
        "kl_over_support": {"mean": a.kl_sum / a.kl_n if a.kl_n else 0.0, "max": a.kl_max} if avail["kl"] else mean_max,
        "tv_over_support": {"mean": a.tv_sum / a.kl_n if a.kl_n else 0.0, "max": a.tv_max} if avail["kl"] else mean_max,
    }


def _input_notes(a: ScenarioAcc) -> list[str]:
    notes = []
    if a.mass_off:
        notes.append(
            f"{a.mass_off} position(s) with a kept set that claims to be complete carry sampler probability "
            f"{a.mass_off_worst:.6g} at worst, not 1 (|mass - 1| > {SUPPORT_MASS_TOL:g}): tokens are missing from "
            f"kept_ids, or the log-probs are not processed log-probs (vLLM's default logprobs_mode is raw_logprobs; "
            f"the sampler must run with logprobs_mode='processed_logprobs')"
        )
    if a.sampled_outside:
        notes.append(
            f"{a.sampled_outside} sampled token(s) are missing from a kept set that claims to be complete "
            f"(kept_incomplete False): an engine or capture fault, or a head too small with kept_incomplete unset"
        )
    return notes


def _not_evaluated(a: ScenarioAcc, avail: dict[str, bool], notes: list[str]) -> list[blocks.NotEvaluated]:
    """The gates whose inputs the records lack, with the reason; a gate judged on part of them adds a note."""
    not_eval: list[blocks.NotEvaluated] = []
    for gate in GATES:
        if gate in USER_GATES and not avail["user"]:
            continue  # no trainer under test in these records: its gates do not apply (nor pass)
        inputs = GATE_INPUTS[gate]
        have = (all(avail[k] for k in inputs) and a.s_n > 0) if gate in PARTIAL_OK else _full(a, *inputs)
        if have:
            if gate in PARTIAL_OK and not _full(a, *inputs):
                missing = [k for k in inputs if a.lacking[k]]
                notes.append(f"{gate} judged {a.s_n} of {a.compared} compared positions; the others lack: "
                             + "; ".join(REASONS[k] for k in missing))
            continue
        missing = [k for k in inputs if not _full(a, k)] or ["sampler_log_s"]
        why = "; ".join(
            REASONS[k] + ("" if a.lacking[k] >= a.sequences else f" ({a.lacking[k]} of {a.sequences} sequences lack it; "
                          f"the statistics cover the others)")
            for k in missing
        )
        not_eval.append({"gate": gate, "reason": why})
    return not_eval


def _scenario_report(a: ScenarioAcc, name: str, trainer: str | None = None) -> blocks.ScenarioStats:
    avail = {k: a.lacking[k] < a.sequences or a.sequences == 0 for k in INPUTS}  # some sequence has it
    headroom, means, limits, lp = _bias(a, avail)
    sources = [x for x in a.s_sources if x != "none"]
    out: dict[str, object] = {
        "name": name, "spec": a.spec, "tokens": a.tokens, "compared_tokens": a.compared, "sequences": a.sequences,
        **_stat_blocks(a, avail),
        "incomplete_positions": a.incomplete,
        "sampled_outside_support": a.sampled_outside,
        "token_mismatch": a.token_mismatch,
        "headroom": headroom,
        "mean_bias_limit": limits,
        "mean_bias": means,
        "bound": (
            {"max": a.bound_max if a.bound_n else 0.0, "mean": a.bound_sum / a.bound_n if a.bound_n else 0.0,
             "roundoff": a.roundoff} if avail["bound"] else None
        ),
        "sampler_log_s": {
            "source": sources[0] if len(sources) == 1 else ("mixed" if sources else "none"),
            "positions": a.s_n,
            "lo_mean": a.s_lo_sum / a.s_n if a.s_n else None,
            "hi_mean": a.s_hi_sum / a.s_n if a.s_n else None,
            "naive_max_gap": a.naive_gap_max if a.s_n else None,
        },
        "drift_split": {
            "logit_drift_max": a.drift_max if a.drift_n else None,
            "logit_drift_mean": a.drift_sum / a.drift_n if a.drift_n else None,
            "replay_max_abs_diff": a.drift_replay_max if a.drift_n else None,
        },
    }
    if avail["user"]:
        s = a.streams
        out["trainer_under_test"] = {
            "name": trainer,  # the caller's, from the file metadata
            **s["user"].stats(),
            "max_abs_gap_to_log_s": s["user_gap"].max_abs if s["user_gap"].n else None,
            "diagnosis": _diagnosis(a, limits["trainer_under_test"] if limits["trainer_under_test"] is not None
                                    else math.inf, lp),
        }
    e = SamplingSpec.from_dict(a.spec).effective()
    sized = a.recompute_sized > 0
    out["support_sides"] = {
        "top_k": e.top_k if e.uses_top_k else None, "ties_at_k_positions": a.ties_at_k,
        "ties_dropped_positions": a.ties_dropped if sized else None,
        "smaller_positions": a.recompute_smaller if sized else None,
        "larger_positions": a.recompute_larger if sized else None,
    }
    out.update(captured_positions=a.captured, max_support_size=a.support_max if a.captured else None,
               mean_support_size=a.support_sum / a.captured if a.captured else None, kept_mass_off_positions=a.mass_off)
    notes = _input_notes(a)
    not_eval = _not_evaluated(a, avail, notes)
    per_step, trend, trend_why = _step_view(a, avail)
    out["per_step"] = per_step
    split = _mismatch_split(a, avail, limits, lp, per_step)
    if split is not None:
        out["mismatch_split"] = split
    out["trend"] = trend
    if a.steps and not (trend is not None and trend["evaluated"]):
        not_eval.append({"gate": TREND_GATE, "reason": trend_why})
    if a.steps and a.unstepped:
        notes.append(f"{a.unstepped} of {a.sequences} sequences carry no step (null or negative): they are left out "
                     f"of the per-step view and of {TREND_GATE}")
    out["not_evaluated"] = not_eval
    out["input_notes"] = notes
    out["lacking_inputs"] = {k: v for k, v in a.lacking.items() if v}
    return cast("blocks.ScenarioStats", out)  # the entry's blocks, as built above


def _step_view(
    a: ScenarioAcc, avail: Mapping[str, bool]
) -> tuple[list[blocks.StepJson], blocks.TrendJson | None, str]:
    """``(per_step, trend, why)``: the scenario's training-log view (empty without steps), the trend of the
    comparison whose verdict the scenario gives (None when there is none; docs/error_model.md, section 5) and,
    when the trend gate is not evaluated, why."""
    if not a.steps:
        return [], None, ""
    held = [k for k in COMPARISONS if avail[k]]
    follow = next((k for k in ("user", "replay", "recompute") if k in held), None)
    support_known = {"replay": avail["kept"], "recompute": avail["recompute_support"]}
    entries: list[blocks.StepJson] = []
    for step in sorted(a.steps):
        sa = a.steps[step]
        by: dict[str, blocks.StepComparisonJson] = {}
        for k in held:
            st = sa.streams[k]
            ok, n = sa.support(SUPPORT_OF[k])
            by[REPORT_NAMES[k]] = blocks.StepComparisonJson(
                tokens=st.n,
                mean_bias=st.mean_bias if st.n else None,
                mean_abs_diff=st.mean_abs if st.n else None,
                max_headroom=st.headroom if avail["bound"] and st.head_n else None,
                support_equal_frac=(ok / n if n else 1.0) if support_known[SUPPORT_OF[k]] else None,
            )
        f = by[REPORT_NAMES[follow]] if follow else None
        entries.append(blocks.StepJson(
            step=step, sequences=sa.sequences, tokens=sa.tokens, comparison=REPORT_NAMES[follow] if follow else None,
            compared_tokens=f["tokens"] if f else 0, mean_bias=f["mean_bias"] if f else None,
            mean_abs_diff=f["mean_abs_diff"] if f else None, max_headroom=f["max_headroom"] if f else None,
            support_equal_frac=f["support_equal_frac"] if f else None, by_comparison=by,
        ))
    if follow is None:
        return entries, None, ("no comparison to follow across steps: " + REASONS["user"] + "; "
                               + REASONS["replay"] + "; " + REASONS["recompute"])
    at = [(s, a.steps[s].streams[follow]) for s in sorted(a.steps) if a.steps[s].streams[follow].n]
    trend = drift_trend([s for s, _ in at], [st.mean_abs for _, st in at], [st.abs_se for _, st in at],
                        REPORT_NAMES[follow], tokens=[st.n for _, st in at])
    if trend["evaluated"] and not _full(a, follow):
        why = (REASONS[follow] + f" ({a.lacking[follow]} of {a.sequences} sequences lack it; the per-step values "
               f"cover the others)")
        trend = {**trend, "evaluated": False, "passed": None, "reason": why}
    return entries, trend, trend["reason"]


def _mismatch_split(a: ScenarioAcc, avail: Mapping[str, bool], limits: Mapping[str, float | None],
                    lp: blocks.LogprobBias | None, per_step: Sequence[blocks.StepJson]) -> blocks.MismatchSplit | None:
    """The part of ``parity budget`` that records alone support (:func:`parity.core.mismatch_split.records_split`), on the
    comparison the verdict follows: the trainer under test, else replay, else recompute."""
    from parity.core.mismatch_split import records_split

    follow = next((k for k in ("user", "replay", "recompute") if avail[k] and a.streams[k].n), None)
    if follow is None:
        return None
    st = a.streams[follow].stats()
    name = REPORT_NAMES[follow]
    limit = limits.get(name)
    if limit is None and follow == "user" and lp is not None:
        limit = float(lp["limit"])
    steps = [(e["step"], float(v)) for e in per_step
             if (c := e["by_comparison"].get(name)) is not None and isinstance(v := c["mean_abs_diff"], float)]
    return cast("blocks.MismatchSplit", records_split(name, a.streams[follow].n, st["mean_diff"], st["mean_abs_diff"],
                                                      limit, steps))


def evaluate_summary(sc: blocks.ScenarioStats, a: ScenarioAcc, th: Thresholds) -> list[Violation]:
    """Every records gate of the table on a scenario's streamed statistics; ``sc``: the entry of
    :func:`_scenario_report` (its ``not_evaluated`` gates are left out)."""
    return evaluate(GateCase(sc["name"], sc, a, th, skip=frozenset(g["gate"] for g in sc["not_evaluated"])))


def drift_headroom_hist(a: ScenarioAcc) -> blocks.DriftHeadroom:
    """Counts of ``|diff| / bound`` per replay and recompute on log10 bins, for the report's drift plot:
    ``bins`` of width ``bin_width`` from ``log10_lo``; each estimator's filled bins as [index, count] pairs."""
    out: blocks.DriftHeadroom = {"log10_lo": HEAD_LO, "bin_width": HEAD_STEP, "bins": HEAD_BINS}
    for k in ("replay", "recompute"):
        if a.bounds[k].n:
            out[k] = blocks.sparse_hist(a.bounds[k].hist)
    return out


def capture_limit_line(sc: blocks.ScenarioStats) -> str | None:
    """The capture's own limit, when it left positions unproven: counted, not evaluated, and not a FAIL."""
    inc = int(sc.get("incomplete_positions") or 0)
    if not inc:
        return None
    return (f"{inc} of {sc['tokens']} positions of {sc['name']!r} not evaluated by the kept-set gates: "
            f"{CAPTURE_LIMIT_FIX}")


def no_verdict_line(sc: blocks.ScenarioStats, judged: bool, near: str = "") -> str:
    """Why a scenario has no mean-bias gate (and, when ``judged`` is false, no gate at all): the columns it
    lacks and what supplies them; ``near``: the note naming a present column close to trainer_logprobs."""
    n_lack, n = sc["lacking_inputs"].get("user", 0), sc["sequences"]
    which = "" if n_lack >= n else f" in {n_lack} of {n} sequences"
    head = "no gate could be evaluated" if not judged else "no mean-bias gate could be evaluated"
    return f"{head} on {sc['name']!r}: the records lack trainer_logprobs{which}{near}; add " + MEAN_GATE_SUPPLY


def class_bias(sc: blocks.ScenarioStats) -> float | None:
    """The bias a mean-bias gate exists to catch: that of a full-vocabulary trainer which leaves the penalties out,
    |mean log S - mean penalty term| (log S: the scenario's, else the sampler-side one nearest 0); 0 where nothing is
    filtered or penalised; None when unknown, as on penalised records without trainer_penalty_term (docs/power.md)."""
    spec = SamplingSpec.from_dict(sc["spec"]).effective()
    raw = sc["naive"].get("penalty_term_mean") if spec.penalised else 0.0
    if not (isinstance(raw, int | float) and math.isfinite(raw)):
        return None
    pen = float(raw)
    if not spec.filtered:
        return abs(pen)
    mean = sc["log_s"]["mean"]
    if isinstance(mean, int | float) and math.isfinite(mean):
        return abs(float(mean) - pen)
    hi = sc["sampler_log_s"]["hi_mean"]
    if sc["sampler_log_s"]["positions"] and hi is not None and math.isfinite(hi):
        return abs(float(hi) - pen)
    return None


def verdict_power(sc: blocks.ScenarioStats, evaluated: Sequence[str], th: Thresholds) -> Power | None:
    """The power of the scenario's verdict: its finest deciding mean-bias gate against the class bias
    (:mod:`parity.core.power`; a class bias of NaN where log S is unknown); None where no such gate was evaluated
    or nothing is filtered."""
    bias = class_bias(sc)
    if bias is not None and bias <= unit_roundoff("float32"):
        # The filters removed less mass than float32 resolves (top_k >= V, or a 1e-12 tail on a peaked row): a
        # full-vocabulary trainer computes the same float32 numbers as the exact one, so there is no bias to catch.
        return None
    if bias is None:
        bias = math.nan
    user = "trainer_under_test" in sc
    entries: tuple[tuple[str, Literal["trainer_under_test", "logprob", "replay", "recompute"]], ...] = (
        (("trainer_under_test_mean_bias", "trainer_under_test"), ("logprob_mean_bias", "logprob")) if user
        else (("replay_mean_bias", "replay"), ("recompute_mean_bias", "recompute")))
    out = []
    for gate, key in entries:
        m: blocks.MeanBias | None = sc["mean_bias"].get(key)
        if gate not in evaluated or m is None or not isinstance(m["limit"], int | float):
            continue
        out.append(power_of(gate, bias, float(m["limit"]), float(m["systematic"]), th.mean_bias_headroom,
                            int(m["tokens"]), penalised=SamplingSpec.from_dict(sc["spec"]).penalised))
    return min(out, key=lambda p: p.resolution, default=None)


def _json(violations: list[Violation]) -> list[blocks.ViolationJson]:
    return [cast("blocks.ViolationJson", v.to_dict()) for v in violations]


@dataclass
class ScenarioVerdict:
    """A scenario as judged: its report.json entry, and its violations as objects (their messages and positions;
    the entry holds them as JSON)."""

    entry: blocks.ScenarioJson
    violations: list[Violation]
    reference_violations: list[Violation]

    @property
    def verdict(self) -> Literal["pass", "fail", "none"]:
        return self.entry["verdict"]


def judge(
    summary: Summary, th: Thresholds, *, trainer_name: str | None = None,
    native: Mapping[str, Sequence[tuple[int, int]]] | None = None, routing: Mapping[str, Routing] | None = None,
) -> list[ScenarioVerdict]:
    """The one way from per-token statistics to verdicts: each scenario of ``summary`` through every gate of
    the table (``native``: per scenario, the positions where vLLM's native mask and the top-K capture differ;
    ``routing``: a MoE scenario's routing section, :func:`parity.run.routing_section`)."""
    from parity.records.schema import nearest_note

    near = nearest_note("trainer_logprobs", summary.ignored_columns)
    accs = sorted(summary.groups.values(), key=lambda a: a.first_order)
    names = [a.name for a in accs]
    out = []
    for a in accs:
        name = a.name if names.count(a.name) == 1 else f"{a.name} [{SamplingSpec.from_dict(a.spec).label()}]"
        sc = _scenario_report(a, name, trainer_name or "trainer")
        violations = evaluate_summary(sc, a, th)
        if native is not None and name in native:
            violations += evaluate(GateCase(name, sc, a, th, native=native[name]), scope="native")
        if routing is not None and name in routing:
            violations += evaluate(GateCase(name, sc, a, th, routing=routing[name]), scope="routing")
        skipped = {g["gate"] for g in sc["not_evaluated"]}
        evaluated = [g for g in GATES if g not in skipped and ("trainer_under_test" in sc or g not in USER_GATES)]
        if sc["trend"] is not None and sc["trend"]["evaluated"]:
            evaluated.append(TREND_GATE)
        # Support gates over no captured position hold by definition (S_q is the vocabulary), and the
        # token check holds by the format's definition unless trainer_token_ids says otherwise: they judge nothing.
        judged = [g for g in evaluated if g == TREND_GATE or GATE_INPUTS[g] not in (("kept",), ())
                  or (sc["captured_positions"] and g != "token_mismatch")]
        mean_evaluated = any(g in evaluated for g in MEAN_GATES)
        no_verdict = None if mean_evaluated else no_verdict_line(sc, bool(judged), near)
        capture_limit = capture_limit_line(sc)
        violations, reference = split_verdict(violations, trainer_under_test="trainer_under_test" in sc)
        # Nothing judged: the scenario neither passes nor fails (its no_verdict line says what would judge it).
        verdict: Literal["pass", "fail", "none"] = "fail" if violations else ("pass" if judged else "none")
        if verdict == "pass" and sc["tokens"] and sc["incomplete_positions"] == sc["tokens"]:
            # Every kept set unproven: the capture's limit leaves nothing to pass.
            verdict, no_verdict = "none", capture_limit
        power = verdict_power(sc, evaluated, th)
        if verdict == "pass" and power is not None and power.resolved is False:
            # A PASS only where the gate could have failed the bias it exists to catch.
            verdict, no_verdict = "none", power_sentence(power, name)
        entry = cast("blocks.ScenarioJson", {
            **sc, "drift_headroom": drift_headroom_hist(a),
            "gates_evaluated": evaluated, "verdict": verdict, "violations": _json(violations),
            "reference_violations": _json(reference), "mean_bias_evaluated": mean_evaluated,
            "no_verdict": no_verdict, "capture_limit": capture_limit,
        })
        if power is not None:
            entry["power"] = cast("blocks.PowerJson", power.to_json())
        if routing is not None and name in routing:
            entry["routing"] = routing[name]
        out.append(ScenarioVerdict(entry, violations, reference))
    return out
