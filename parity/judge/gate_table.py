"""Every gate parity applies, in one table (:data:`GATE_TABLE`): name, inputs, rule and where its limit comes from.

A rule reads a :class:`GateCase` and returns its violations (none: it passed). Adding a gate: docs/records.md,
section 6; the limits' derivations: docs/error_model.md."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from parity.core.display import NA, apart
from parity.core.gates import Thresholds, recompute_support_limit
from parity.core.violation import Position, Violation
from parity.judge.accumulators import ScenarioAcc
from parity.judge.diagnosis import logprob_bias_class
from parity.judge.steps import TREND_GATE, over

if TYPE_CHECKING:
    from parity.report.blocks import Routing, ScenarioStats

# A check that could not be measured (the status word of parity.determinism.knobs): not a violation.
UNAVAILABLE = "unavailable"
CAPTURE_LIMIT_FIX = ("their kept set was not proven complete; run without --max-capture-head (the offline engine "
                     "then reads every kept set from its sampler) or raise it (or the scenario's max_capture_head)")


@dataclass(frozen=True)
class GateCase:
    """What a rule reads: the scenario's name, entry and streamed statistics, the thresholds, the gates the
    records cannot evaluate (``skip``) and the facts not in records (``native``, ``checks``, ``routing``;
    docs/records.md, section 6)."""

    name: str
    stats: ScenarioStats | None
    acc: ScenarioAcc | None
    th: Thresholds
    skip: frozenset[str] = frozenset()
    native: Sequence[tuple[int, int]] | None = None
    checks: Sequence[Mapping[str, object]] = ()
    routing: Routing | None = None

    @property
    def sc(self) -> ScenarioStats:
        assert self.stats is not None, "a records gate needs the scenario's report entry"
        return self.stats

    @property
    def a(self) -> ScenarioAcc:
        assert self.acc is not None, "a records gate needs the scenario's statistics"
        return self.acc


Rule = Callable[[GateCase], list[Violation]]


@dataclass(frozen=True)
class Gate:
    """One gate. ``needs``: the inputs it reads (keys of :data:`parity.judge.verdict.REASONS`; without them it is
    listed as not evaluated). ``scope``: ``records`` (every scenario), ``native`` (``--capture both``) or ``run``
    (the invariance checks). ``reference``: beside a trainer under test it is a fact about parity's own
    estimators, not that trainer's verdict. ``skippable``: False for a check that reads no input."""

    name: str
    needs: tuple[str, ...]
    rule: Rule
    limit: str
    scope: str = "records"
    reference: bool = False
    skippable: bool = True


def _scaled(ps: tuple[Position, ...], factor: float) -> tuple[Position, ...]:
    return tuple(replace(p, bound=None if p.bound is None else p.bound * factor) for p in ps)


def _num(x: object) -> float:
    assert isinstance(x, int | float), f"a gate read {x!r}"  # None: the gate is not evaluated
    return x


def _key(stream: str) -> Literal["replay", "recompute", "trainer_under_test"]:
    return "trainer_under_test" if stream == "user" else "replay" if stream == "replay" else "recompute"


def _who(c: GateCase, stream: str) -> str:
    if stream != "user":
        return stream
    return f"trainer {c.sc['trainer_under_test']['name']!r} ({c.sc['trainer_under_test']['diagnosis']})"


def ties_cause(c: GateCase) -> str:
    """Why recompute differs from the sampler where the sampler's kept set holds ties at the k-th value that
    recompute dropped (vLLM's top_k keeps every token equal to the k-th value, ``apply_top_k_only``; at a coarser
    sampler dtype many tokens are equal there, at the trainer's finer one few are): "" where none did."""
    a = c.acc
    if a is None or not a.ties_dropped:
        return ""
    sides = c.sc.get("support_sides")
    k = sides["top_k"] if sides else None
    proven = a.captured - a.incomplete
    return (f"cause: the sampler's kept set holds tokens tied at the k-th value (top_k={k}; every token equal to the "
            f"k-th is kept, |S_q| up to {a.support_max}) at {a.ties_at_k} of {proven} positions, ties the trainer's "
            f"precision does not reproduce: recompute normalised over fewer tokens than S_q at {a.ties_dropped} of "
            f"them, so its log-probs sit higher there. Remedies: replay the captured kept set (--trainer replay), "
            f"or recompute at the sampler's precision (--recompute-precision sampler)")


def _with_cause(stream: str, c: GateCase, detail: str) -> str:
    cause = ties_cause(c) if stream == "recompute" else ""
    return "; ".join(x for x in (detail, cause) if x)


def _drift(stream: str) -> Rule:
    def rule(c: GateCase) -> list[Violation]:
        stat = _num(c.sc["headroom"][_key(stream)])
        if not over(stat, c.th.max_headroom):
            return []
        worst = _scaled(c.a.bounds[stream].worst.positions(c.th.max_violations_listed), c.th.max_headroom)
        return [Violation(f"{_key(stream)}_drift", c.name, stat, c.th.max_headroom,
                          f"{_who(c, stream)} max |diff| / bound", worst=worst, detail=_with_cause(stream, c, ""))]
    return rule


def _mean(stream: str) -> Rule:
    def rule(c: GateCase) -> list[Violation]:
        bs = c.a.bounds[stream]
        bias = bs.mean if bs.n else 0.0
        allowed = c.th.mean_bias_headroom * _num(c.sc["mean_bias_limit"][_key(stream)])
        if not over(abs(bias), allowed):
            return []
        return [Violation(f"{_key(stream)}_mean_bias", c.name, abs(bias), allowed, f"{_who(c, stream)} |mean bias|",
                          detail=_with_cause(stream, c, f"mean(trainer - vllm) = {bias:.3g} over {bs.n} tokens"))]
    return rule


def _logprob_mean_bias(c: GateCase) -> list[Violation]:
    m = c.sc["mean_bias"].get("logprob")
    if m is None:
        return []
    who = f"trainer {c.sc['trainer_under_test']['name']!r}"
    allowed, mean = c.th.mean_bias_headroom * _num(m["limit"]), _num(m["mean"])
    sign = m["sign_test"]
    if sign["failed"] and not over(abs(mean), allowed):
        return [Violation(
            "logprob_mean_bias", c.name, sign["negative_share"], sign["limit"],
            f"{who} share of tokens below their systematic allowance",
            detail=(f"{logprob_bias_class(m, allowed)}. {sign['beyond_allowance']} of {m['tokens']} tokens lie "
                    f"beyond their systematic allowance, {sign['negative_share']:.1%} of them negative where an "
                    f"honest drift of spread {m['spread_sd']:.3g} gives {sign['honest_share']:.1%} "
                    f"({sign['z']:.1f} standard errors); the mean alone (log mean IS ratio "
                    f"{apart(abs(_num(m['mean'])), allowed)} in magnitude, resolution {apart(allowed, abs(mean))}) "
                    f"could not tell"),
        )]
    if not over(abs(mean), allowed):
        return []
    return [Violation(
        "logprob_mean_bias", c.name, abs(mean), allowed, f"{who} |log mean IS ratio|",
        detail=(f"{logprob_bias_class(m, allowed)}. mean(trainer - sampler) = {m['mean_diff']:.3g}, log mean "
                f"exp(trainer - sampler) = {m['mean']:.3g} over {m['tokens']} tokens in {m['sequences']} "
                f"sequences; resolution {allowed:.3g} = systematic {m['systematic']:.3g} + "
                f"{m['statistical']:.3g} ({m['standard_error_from']})"),
    )]


def _trainer_support(c: GateCase) -> list[Violation]:
    r = c.a.ratio
    bad = r.outside + r.nonfinite
    if not over(bad, c.th.max_trainer_support_failures):
        return []
    extra = f"; {r.nonfinite} other non-finite pair(s) (NaN, +inf or a sampler -inf)" if r.nonfinite else ""
    return [Violation(
        "trainer_support", c.name, bad, c.th.max_trainer_support_failures,
        f"trainer {c.sc['trainer_under_test']['name']!r}: sampled tokens without a finite log-prob",
        worst=c.a.first["trainer_support"].positions(c.th.max_violations_listed),
        detail=f"sampled token outside the trainer's support: {r.outside} tokens (trainer -inf, sampler finite){extra}")]


def _naive(c: GateCase) -> list[Violation]:
    h = c.sc["headroom"].get("naive_vs_sampler_log_s")
    if h is None or not over(h, c.th.max_headroom):
        return []
    return [Violation(
        "naive_vs_sampler_log_s", c.name, h, c.th.max_headroom, "naive bias outside the sampler-side log S, max gap / bound",
        detail=f"log S from the sampler's {c.sc['sampler_log_s']['source'].replace('_', ' ')}",
        worst=_scaled(c.a.bounds["naive"].worst.positions(c.th.max_violations_listed), c.th.max_headroom))]


def _replay_support(c: GateCase) -> list[Violation]:
    frac, limit = _num(c.sc["replay"]["support_equal_frac"]), c.th.replay_support_equal_frac
    if not over(limit, frac):
        return []
    return [Violation("replay_support", c.name, frac, limit, "replay support equality", "<",
                      worst=c.a.first["replay_support"].positions(c.th.max_violations_listed),
                      detail="captured S_q is not the sampler's whole support (mass != 1 or the sampled token missing)")]


def _recompute_support(c: GateCase) -> list[Violation]:
    frac = _num(c.sc["recompute"]["support_equal_frac"])
    limit = recompute_support_limit(c.th.recompute_support_equal_frac, c.a.recompute_n)
    if not over(limit, frac):
        return []
    sides = c.sc.get("support_sides")
    where = ""
    if sides and sides["smaller_positions"] is not None:
        where = (f": smaller than S_q (S_q ⊋ S_p) at {sides['smaller_positions']} positions, larger at "
                 f"{sides['larger_positions']}")
    return [Violation("recompute_support", c.name, frac, limit, "recompute support equality", "<",
                      worst=c.a.first["recompute_support"].positions(c.th.max_violations_listed),
                      detail=_with_cause("recompute", c, "trainer-side filters keep a different set" + where))]


def _incomplete(c: GateCase) -> list[Violation]:
    # Opt-in (max_incomplete_frac < 1): by default an unproven position is a limit of the capture, reported in
    # capture_limit and left out of the kept-set gates, not a fault of either side.
    inc, tokens = c.sc["incomplete_positions"], c.sc["tokens"]
    if not tokens or not over(inc / tokens, c.th.max_incomplete_frac):
        return []
    return [Violation("incomplete_capture", c.name, inc / tokens, c.th.max_incomplete_frac,
                      "incomplete capture fraction", worst=c.a.first["incomplete"].positions(c.th.max_violations_listed),
                      detail=f"{inc} of {tokens} positions: {CAPTURE_LIMIT_FIX}")]


def _count(gate: str, key: Literal["sampled_outside_support", "token_mismatch"], first: str,
           limit: Callable[[Thresholds], int], label: str, detail: str) -> Rule:
    def rule(c: GateCase) -> list[Violation]:
        n = c.sc[key]
        if not over(n, limit(c.th)):
            return []
        return [Violation(gate, c.name, n, limit(c.th), label, worst=c.a.first[first].positions(c.th.max_violations_listed),
                          detail=detail)]
    return rule


def trend_violation(sc: ScenarioStats, out: list[Violation], skip: set[str] | frozenset[str]) -> None:
    """``drift_trend``: the verdict :func:`parity.judge.steps.drift_trend` gave, as a violation naming the
    first step above the band of the first steps."""
    tr = sc.get("trend")
    if TREND_GATE in skip or not tr or not tr["evaluated"] or tr["passed"]:
        return
    who = tr["comparison"]
    if who == "trainer_under_test":
        who = f"trainer {sc['trainer_under_test']['name']!r}"
    by_step = {e["step"]: e for e in sc["per_step"]}
    s = tr["first_step_outside"]
    at = by_step[s]["mean_abs_diff"] if s is not None and s in by_step else None
    if tr["slope"] is None:  # a step's mean |diff| is not finite
        out.append(Violation(TREND_GATE, sc["name"], math.inf, 0.0, f"{who} mean |diff| per step",
                             detail=f"{tr['reason']}: drift left every band at step {s}"))
        return
    first, last = (by_step[int(_num(tr[k]))]["mean_abs_diff"] for k in ("first_step", "last_step"))
    base = ", ".join(str(x) for x in tr["baseline_steps"])
    out.append(Violation(
        TREND_GATE, sc["name"], tr["slope"], _num(tr["limit"]), f"{who} slope of mean |diff| per step",
        detail=(f"mean |diff| {first:.3g} at step {tr['first_step']} -> {last:.3g} at step {tr['last_step']} over "
                f"{tr['steps']} steps, slope {tr['slope']:.3g} ± {tr['slope_se']:.3g} per step (limit {tr['z']:g} "
                f"standard errors); first left the band {tr['baseline_mean']:.3g} ± {tr['band_k']:g} × "
                f"{tr['noise']:.3g} of steps {base} at step {s} (mean |diff| {NA if at is None else format(at, '.3g')})"),
    ))


def _trend(c: GateCase) -> list[Violation]:
    out: list[Violation] = []
    trend_violation(c.sc, out, c.skip)
    return out


def _native(c: GateCase) -> list[Violation]:
    mism = list(c.native or ())
    if not mism:
        return []
    where = tuple(Position(prompt=p, position=t) for p, t in mism[: c.th.max_violations_listed])
    return [Violation("native_vs_topk", c.name, len(mism), 0, "positions where the native sampling mask and the "
                      "top-K capture disagree on S_q", worst=where)]


def describe_check(c: Mapping[str, object]) -> str:
    """One invariance check in words: what differs from its reference layout, where, and by how much."""
    d = c.get("max_abs_diff")
    diff = NA if d is None else f"{d:.3e}"
    if c.get("kind") == "run_to_run":
        return (f"determinism: {c['name']}: {c['unique_outputs']} unique outputs from {c['repeats']} identical "
                f"requests (max |diff| {diff})")
    where = f"batch size {c['batch_size']} (position {c['position']})" if "batch_size" in c else c.get("layout", "")
    if c.get("tokens_equal") is False and c.get("first_token_mismatch") is not None:
        return (f"determinism: {c['name']}: tokens differ from the batch-size-1 reference at completion position "
                f"{c['first_token_mismatch']} in {where} (max |diff| before it {diff})")
    ref = "batch size 1" if c.get("side") == "rollout" else "the sequence alone"
    extra = f", {c['records_not_bitwise']} record(s), worst record {c['worst_record']}" if "records_not_bitwise" in c else ""
    return f"determinism: {c['name']}: not bitwise equal to {ref} in {where}: max |diff| {diff}{extra}"


def _invariance(c: GateCase) -> list[Violation]:
    out = []
    for check in c.checks:
        if check.get("status") == UNAVAILABLE or check["bitwise"]:
            continue
        d, w = check.get("max_abs_diff"), check.get("worst_record")
        worst = (Position(prompt=int(w), note="worst record"),) if isinstance(w, int | float | str) else ()
        out.append(Violation("invariance", str(check["name"]), float(d) if isinstance(d, int | float | str) else math.inf,
                             0.0, "max |diff| against the reference layout", worst=worst, detail=describe_check(check)))
    return out


def _routing(gate: str, stat: Callable[[Routing], float], limit: Callable[[Thresholds], float], label: str,
             comparison: str = ">") -> Rule:
    """A gate on the scenario's routing section (``comparison`` "<": the statistic must reach the limit)."""
    def rule(c: GateCase) -> list[Violation]:
        r = c.routing
        if r is None:
            return []
        value, lim = stat(r), limit(c.th)
        if not (over(value, lim) if comparison == ">" else over(lim, value)):
            return []
        listed = r["listed"].get(gate) or {}
        worst = listed.get("worst")
        where = () if not isinstance(worst, list) else tuple(
            Position.from_dict(p) for p in worst if isinstance(p, dict))
        return [Violation(gate, c.name, value, lim, label, comparison, worst=where,
                          detail=str(listed.get("detail", "")))]
    return rule


_routing_agreement = _routing("routing_agreement", lambda r: r["flips_above_bound"], lambda th: 0,
                              "routing flips at a router margin above its rounding bound")
_routing_forced = _routing("routing_replay_forced", lambda r: r["replay"]["forced_frac"], lambda th: 1.0,
                           "fraction of (row, layer) expert sets replay forced", "<")
_routing_drift = _routing("routing_replay_drift", lambda r: r["replay"]["drift"]["with_replay"]["headroom"],
                          lambda th: th.max_headroom, "log-prob max |diff| / bound under routing replay")


_BOUND = "max_headroom × the per-token bound from both dtypes, |z|/T and the support (docs/error_model.md §1)"
_MEAN = ("mean_bias_headroom × (mean systematic bound + 4 standard errors of a reference spread / √N) "
         "(docs/error_model.md §2)")

GATE_TABLE: tuple[Gate, ...] = (
    Gate("replay_drift", ("replay", "bound"), _drift("replay"), _BOUND, reference=True),
    Gate("recompute_drift", ("recompute", "bound"), _drift("recompute"), _BOUND, reference=True),
    Gate("replay_mean_bias", ("replay", "bound"), _mean("replay"), _MEAN, reference=True),
    Gate("recompute_mean_bias", ("recompute", "bound"), _mean("recompute"), _MEAN, reference=True),
    Gate("trainer_under_test_drift", ("user", "bound"), _drift("user"), _BOUND),
    Gate("trainer_under_test_mean_bias", ("user", "bound"), _mean("user"), _MEAN + "; the allowance from replay's spread"),
    Gate("logprob_mean_bias", ("user",), _logprob_mean_bias,
         "|log mean exp(trainer - sampler)| within a systematic allowance from the dtypes and vocabulary plus the "
         "per-sequence standard error, and a sign test on tokens beyond their own allowance (docs/error_model.md §8)"),
    Gate("trainer_support", ("user",), _trainer_support, "max_trainer_support_failures sampled tokens at -inf/NaN (0)"),
    Gate("naive_vs_sampler_log_s", ("full", "bound", "bound_full", "sampler_log_s"), _naive,
         "the naive bias within the sampler-side log S interval, ± the full-vocabulary bound (docs/error_model.md §7)", reference=True),
    Gate("replay_support", ("kept",), _replay_support, "replay_support_equal_frac of positions (1: every one)"),
    Gate("recompute_support", ("recompute_support",), _recompute_support,
         "recompute_support_equal_frac less 3 binomial standard errors; sets that differ only at the cutoff count "
         "as equal (docs/capture_plan.md §9)", reference=True),
    Gate("incomplete_capture", ("kept",), _incomplete, "max_incomplete_frac (1 by default: a stated capture limit)"),
    Gate("sampled_outside", ("kept",), _count("sampled_outside", "sampled_outside_support", "sampled_outside",
                                              lambda th: th.max_sampled_outside, "sampled tokens outside the captured S_q",
                                              "the engine reports a sampled token that its own kept set does not hold"),
         "max_sampled_outside (0)"),
    Gate(TREND_GATE, (), _trend, "slope of mean |diff| per step within z standard errors, after a band of the first steps (docs/error_model.md §5)"),
    Gate("token_mismatch", (), _count("token_mismatch", "token_mismatch", "token_mismatch", lambda th: th.max_token_mismatch,
                                      "trainer scored other tokens than sampled", "the trainer's token ids are not the sampler's "
                                      "(an off-by-one or a re-tokenisation)"), "max_token_mismatch (0)", skippable=False),
    Gate("native_vs_topk", (), _native, "0 positions where the two captures of S_q differ", scope="native"),
    Gate("invariance", (), _invariance, "bitwise (0) on every side a knob in force guarantees", scope="run"),
    Gate("routing_agreement", (), _routing_agreement, "0 expert-set flips where the trainer's k-th to (k+1)-th router "
         "margin exceeds the rounding bound of both dtypes, 2·8·u·‖h‖·(rms w_a + rms w_b) (docs/routing.md §2)",
         scope="routing"),
    Gate("routing_replay_forced", (), _routing_forced, "every (row, layer) expert set under replay is the recorded "
         "one (1.0, checked on the experts that ran)", scope="routing"),
    Gate("routing_replay_drift", (), _routing_drift, _BOUND + ", under routing replay", scope="routing"),
)
REFERENCE_GATES = tuple(g.name for g in GATE_TABLE if g.reference)


def evaluate(case: GateCase, scope: str = "records") -> list[Violation]:
    """Every gate of ``scope`` in the table's order; a gate the records cannot evaluate (``case.skip``) yields
    nothing, and a trainer under test's gates apply only where the records hold one."""
    out: list[Violation] = []
    for g in GATE_TABLE:
        if g.scope != scope or (g.skippable and g.name in case.skip):
            continue
        if "user" in g.needs and (case.stats is None or "trainer_under_test" not in case.stats):
            continue
        out += g.rule(case)
    return out


def split_verdict(violations: list[Violation], *, trainer_under_test: bool) -> tuple[list[Violation], list[Violation]]:
    """``(deciding, reference)``: with a trainer under test the verdict is that trainer's, and parity's own
    estimators' gates are reported beside it (facts about replay and recompute at this precision)."""
    if not trainer_under_test:
        return list(violations), []
    return ([v for v in violations if v.gate not in REFERENCE_GATES],
            [v for v in violations if v.gate in REFERENCE_GATES])
