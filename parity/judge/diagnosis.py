"""What a trainer's log-probs are diagnosed as: the bug classes (:data:`BUGS`), named from the views it matches
(:func:`diagnosis_text`), or, from two log-prob columns alone, from where the bias lies (:func:`logprob_bias_class`)."""

from __future__ import annotations

from collections.abc import Mapping

from parity.core.display import apart, ordered
from parity.core.error_model import NEARLY_ALL_NEGATIVE
from parity.report.blocks import LogprobBias

# The bug classes a trainer's log-probs are checked for, and how each is described. A view is the
# trainer-side log-prob with a set of these bugs applied
# (:func:`parity.engines.trainer_under_test.reference_views`); the diagnosis names the smallest set whose
# view the trainer matches, so two bugs at once are named together.
BUGS: dict[str, str] = {
    "full_vocabulary": "it scores the full-vocabulary distribution while the sampler truncates (bias log S per "
    "token; use replay over the captured kept set or recompute the filters)",
    "forgets_temperature": "it forgets to divide the logits by the sampling temperature",
    "off_by_one": "it reads each token's log-prob one position late (logits and labels not shifted against "
    "each other)",
    "ignores_penalty": "it ignores the repetition penalty (and the presence/frequency penalties) the sampler applied "
    "before temperature; apply them from the prompt and the earlier tokens (parity.core.penalties.penalise_sequence)",
}


def diagnosis_text(close: Mapping[frozenset[str], bool], max_abs_diff: float, mean_diff: float) -> str:
    """The diagnosis from which views the trainer matches (``close``: within the per-token bound everywhere
    the view is known and its mean within the mean-bias limit; the empty set is the sampler's values).
    Sets of fewer bugs are tried first."""
    if close.get(frozenset()):
        return "matches the sampler's processed log-probs"
    for bugs in sorted((b for b, ok in close.items() if b and ok), key=lambda b: (len(b), sorted(b))):
        ordered = [b for b in BUGS if b in bugs]
        lead = "two bugs at once: " if len(ordered) == 2 else "three bugs at once: " if len(ordered) == 3 else ""
        return lead + "; ".join(BUGS[b] for b in ordered)
    return f"unexplained drift: max |diff| {max_abs_diff:.3g}, mean {mean_diff:.3g}"


def logprob_bias_class(m: LogprobBias, limit: float) -> str:
    """The bug class of a failed two-column mean-bias gate, named without the model: a full-vocabulary
    (log S) trainer when the bias sits in the log S range (to within ``limit``) and nearly every token is
    negative. The numbers are written with the digits that keep the sentence true."""
    mean, neg = float(m["mean"]), m["negative_frac"]
    lo, hi = (float(x) for x in m["log_s_range"])
    within = mean < 0 and lo - limit <= mean <= hi + limit
    b, lo_s, hi_s = ordered(mean, lo, hi)
    inside = lo <= mean <= hi
    where = f"log S range [{lo_s}, {hi_s}] from {m['log_s_range_from']}"
    lies = (f"lies in the {where}" if inside else
            f"lies within the resolution {apart(limit, abs(mean - (lo if mean < lo else hi)))} of the {where}")
    if within and neg >= NEARLY_ALL_NEGATIVE:
        return (f"a full-vocabulary (log S) trainer: the bias {b} {lies} and {neg:.1%} of tokens are negative; "
                + BUGS["full_vocabulary"])
    if within:
        return (f"consistent with a full-vocabulary (log S) trainer: the bias {b} {lies}, but only "
                f"{neg:.1%} of tokens are negative (without the model another bias that lowers every token reads the "
                f"same)")
    side = "more" if mean > 0 else "less"
    return (f"a per-token bias of {b} that log S does not explain (outside the {where}): the trainer gives the "
            f"sampled tokens {side} probability than the sampler ({neg:.1%} of tokens negative)")
