"""The mismatch budget (engine-free): a sampler–trainer gap split into its causes, one fix at a time. Per
*stage* (a set of fixed causes) the caller gives both sides' log-probs of the same tokens; computed here:
each stage's measures, each fix's drop in a stated order, its share of the starting gap and its bootstrap
noise (docs/budget.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from parity.core.error_model import MEAN_BIAS_Z, headroom
from parity.core.rl import STATISTICS, Mismatch, k3
from parity.core.rl_catalogue import METHODS
from parity.errors import UsageError

# The causes in their default order: what is cheapest to see and fix first (the trainer's math), then the
# sampler, the trainer's layout, routing and the engine's settings. What no fix removes is the remainder.
CAUSES: tuple[str, ...] = (
    "truncation",
    "filter_boundary",
    "logits_processors",
    "sampler_precision",
    "batch_composition",
    "moe_routing",
    "engine_settings",
)
REMAINDER = "kernel_drift"
LABELS: dict[str, str] = {
    "truncation": "truncation normalisation",
    "filter_boundary": "filter boundary",
    "logits_processors": "logits processors skipped",
    "sampler_precision": "sampler precision",
    "batch_composition": "trainer batch composition",
    "moe_routing": "MoE routing",
    "engine_settings": "engine settings",
    REMAINDER: "remaining kernel drift",
}
FIXES: dict[str, str] = {
    "truncation": "replay",
    "filter_boundary": "replay instead of recompute",
    "logits_processors": "apply them (divide by T, penalise)",
    "sampler_precision": "a sampler head at the trainer's dtype",
    "batch_composition": "batch-invariant kernels or a fixed layout",
    "moe_routing": "routing replay (R3)",
    "engine_settings": "prefix caching and chunked prefill off",
    REMAINDER: "none (compared with its rounding bound)",
}

MEASURES: tuple[str, ...] = ("mean_delta", "mean_abs_delta", "k3_kl", "outside_ppo", "seq_ratio_sd")
MEASURE_LABELS = {
    "mean_delta": "mean δ",
    "mean_abs_delta": "mean |δ|",
    "k3_kl": "k3 KL",
    "outside_ppo": "ratio outside PPO's interval",
    "seq_ratio_sd": "sequence IS ratio sd",
}
HEADLINE = "mean_abs_delta"
# PPO's token ratio interval, from the RL catalogue (one home for it).
PPO_INTERVAL: tuple[float, float] = next(m.interval for m in METHODS if m.name.startswith("PPO clip"))
BOOTSTRAP = 400  # resamples of the sequences for each drop's noise
BOOTSTRAP_SEED = 0  # fixed: two runs of the same tokens give the same noise
STATUSES = ("measured", "not_applicable", "not_measured")


@dataclass(frozen=True)
class Stage:
    """One stage's two columns over the same tokens, flat ``[T]``, split into sequences by ``seq_lengths``."""

    trainer: torch.Tensor
    sampler: torch.Tensor
    seq_lengths: tuple[int, ...]


@dataclass(frozen=True)
class Cause:
    """Whether a cause applies to the setup: ``status`` one of :data:`STATUSES`, ``reason`` when it is not
    measured or not applicable, ``cost`` what the fix costs, as measured by the caller."""

    status: str = "measured"
    reason: str | None = None
    cost: str | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise UsageError(f"Cause.status={self.status!r} is invalid: allowed {', '.join(STATUSES)}")
        if self.status != "measured" and not self.reason:
            raise UsageError(f"Cause.status={self.status!r} needs a reason")


@dataclass(frozen=True)
class PerSequence:
    """What every measure reduces, per sequence: token count, Σδ, Σ|δ|, Σk3, tokens outside PPO's interval."""

    n: torch.Tensor
    d: torch.Tensor
    a: torch.Tensor
    k: torch.Tensor
    o: torch.Tensor

    @classmethod
    def of(cls, stage: Stage) -> PerSequence:
        m = Mismatch.from_flat(stage.trainer, stage.sampler, stage.seq_lengths)
        if m.excluded_nan or m.empty_sequences:
            raise UsageError(f"a budget stage has {m.excluded_nan} NaN tokens and {m.empty_sequences} empty sequences: "
                             f"allowed finite values on non-empty sequences")
        d = m.delta()
        lo, hi = PPO_INTERVAL
        r = STATISTICS["ratio"].compute(m)
        outside = ((r < lo) | (r > hi)).double()
        return cls(m.seq_reduce(torch.ones_like(d), "sum"), m.seq_reduce(d, "sum"), m.seq_reduce(d.abs(), "sum"),
                   m.seq_reduce(k3(d), "sum"), m.seq_reduce(outside, "sum"))

    def measures(self, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each measure under sequence weights ``w`` ``[B, S]`` (ones: the measured value; multinomial counts: a
        bootstrap replicate). The sequence IS ratio exp(Σδ) spreads by its Bessel-corrected sd."""
        n = w @ self.n
        seq_ratio = self.d.exp()
        wsum = w.sum(dim=-1)
        mean_r = (w @ seq_ratio) / wsum
        var = (w * (seq_ratio.unsqueeze(0) - mean_r.unsqueeze(1)) ** 2).sum(dim=-1) / (wsum - 1).clamp(min=1)
        return {"mean_delta": (w @ self.d) / n, "mean_abs_delta": (w @ self.a) / n, "k3_kl": (w @ self.k) / n,
                "outside_ppo": (w @ self.o) / n, "seq_ratio_sd": var.sqrt()}

    def point(self) -> dict[str, float]:
        """The measured values (every sequence weighted once)."""
        ones = torch.ones(1, self.n.numel(), dtype=torch.float64)
        return {k: float(v[0]) for k, v in self.measures(ones).items()}


def measures(stage: Stage) -> dict[str, float]:
    """The five mismatch measures of one stage (docs/budget.md, section 1)."""
    return PerSequence.of(stage).point()


@dataclass
class Row:
    cause: str
    status: str
    reason: str | None
    cost: str | None
    before: dict[str, float]
    after: dict[str, float]
    drop: dict[str, float | None]  # before − after (None: not measured)
    share: dict[str, float | None]  # drop / the starting value (None where that is 0)
    noise: dict[str, float | None]  # MEAN_BIAS_Z bootstrap standard errors of the drop
    within_noise: dict[str, bool]

    def to_json(self) -> dict[str, object]:
        return {"cause": self.cause, "label": LABELS[self.cause], "fix": FIXES[self.cause], **asdict(self)}


@dataclass
class Waterfall:
    order: tuple[str, ...]
    start: dict[str, float]
    rows: list[Row]
    remainder: dict[str, float]
    remainder_share: dict[str, float | None]
    bound: dict[str, float] | None

    def largest_fixable(self, measure: str = HEADLINE) -> Row | None:
        """The measured cause with the largest share of ``measure`` beyond its noise (None: none)."""
        rows = [r for r in self.rows if r.status == "measured" and not r.within_noise.get(measure, True)
                and (r.share.get(measure) or 0.0) > 0.0]
        return max(rows, key=lambda r: r.share[measure] or 0.0, default=None)

    def fix_first(self) -> str:
        best = self.largest_fixable()
        if best is None:
            return f"fix first: nothing beyond noise ({MEASURE_LABELS[HEADLINE]} is what the rounding leaves)"
        share = best.share[HEADLINE] or 0.0
        label = MEASURE_LABELS[HEADLINE]
        return f"fix first: {LABELS[best.cause]} ({share:.0%} of {label}; {FIXES[best.cause]})"


def check_order(order: Sequence[str]) -> tuple[str, ...]:
    """A user's order: every cause once (a subset is completed in the default order)."""
    bad = [c for c in order if c not in CAUSES]
    if bad:
        raise UsageError(f"--order names {', '.join(map(repr, bad))}: allowed {', '.join(CAUSES)}")
    if len(set(order)) != len(order):
        raise UsageError(f"--order={','.join(order)} names a cause twice: allowed each cause at most once")
    return tuple(order) + tuple(c for c in CAUSES if c not in order)


def waterfall(
    stage: Callable[[frozenset[str]], Stage],
    causes: Mapping[str, Cause],
    order: Sequence[str] = CAUSES,
    *,
    bound: torch.Tensor | None = None,
) -> Waterfall:
    """Fix the measured causes one at a time in ``order``; ``stage(fixed)`` gives the columns with the causes in
    ``fixed`` removed (every stage over the same tokens). ``bound``: the final stage's per-token rounding bound."""
    order = check_order(order)
    missing = [c for c in CAUSES if c not in causes]
    if missing:
        raise UsageError(f"no applicability given for {', '.join(missing)}")
    cache: dict[frozenset[str], PerSequence] = {}

    def per(fixed: frozenset[str]) -> PerSequence:
        if fixed not in cache:
            cache[fixed] = PerSequence.of(stage(fixed))
        return cache[fixed]

    first = per(frozenset())
    n_seq = first.n.numel()
    gen = torch.Generator().manual_seed(BOOTSTRAP_SEED)
    draws = torch.randint(0, n_seq, (BOOTSTRAP, n_seq), generator=gen)
    w = torch.zeros(BOOTSTRAP, n_seq, dtype=torch.float64)
    w.scatter_add_(1, draws, torch.ones_like(draws, dtype=torch.float64))
    start = first.point()
    fixed: frozenset[str] = frozenset()
    rows = []
    for c in order:
        info = causes[c]
        before_p = per(fixed)
        before = before_p.point()
        if info.status != "measured":
            nothing = {k: (0.0 if info.status == "not_applicable" else None) for k in MEASURES}
            rows.append(Row(c, info.status, info.reason, info.cost, before, before, nothing, dict(nothing),
                            dict.fromkeys(MEASURES), {k: info.status == "not_applicable" for k in MEASURES}))
            continue
        after_fixed = fixed | {c}
        after_p = per(after_fixed)
        after = after_p.point()
        boot_b, boot_a = before_p.measures(w), after_p.measures(w)
        drop: dict[str, float | None] = {k: before[k] - after[k] for k in MEASURES}
        noise: dict[str, float | None] = {k: MEAN_BIAS_Z * float((boot_b[k] - boot_a[k]).std()) for k in MEASURES}
        share = {k: (d / start[k] if d is not None and start[k] != 0.0 else None) for k, d in drop.items()}
        within = {k: abs(drop[k] or 0.0) <= (noise[k] or 0.0) for k in MEASURES}
        rows.append(Row(c, "measured", info.reason, info.cost, before, after, drop, share, noise, within))
        fixed = after_fixed
    last = per(fixed)
    remainder = last.point()
    remainder_share = {k: (remainder[k] / start[k] if start[k] != 0.0 else None) for k in MEASURES}
    bound_block = None
    if bound is not None:
        final = stage(fixed)
        diff = final.trainer - final.sampler
        bound_block = {"headroom": headroom(diff, bound), "mean_abs_delta": float(diff.abs().mean()),
                       "mean_bound": float(bound.double().mean())}
    return Waterfall(order, start, rows, remainder, remainder_share, bound_block)


def order_name(order: Sequence[str]) -> str:
    if tuple(order) == CAUSES:
        return "the default order"
    if tuple(order) == tuple(reversed(CAUSES)):
        return "the reversed order"
    return f"order {','.join(order)}"


def order_notes(a: Waterfall, b: Waterfall) -> list[str]:
    """Where two orders give a cause shares that differ by more than the noise of either (docs/budget.md)."""
    rb = {r.cause: r for r in b.rows}
    notes = []
    for r in a.rows:
        o = rb[r.cause]
        sa, sb = r.share.get(HEADLINE), o.share.get(HEADLINE)
        if sa is None or sb is None or r.status != "measured":
            continue
        start = a.start[HEADLINE]
        noise = max(r.noise.get(HEADLINE) or 0.0, o.noise.get(HEADLINE) or 0.0) / abs(start) if start else 0.0
        if abs(sa - sb) > noise:
            notes.append(f"{LABELS[r.cause]}: {sa:.1%} of {MEASURE_LABELS[HEADLINE]} in "
                         f"{order_name(a.order)}, {sb:.1%} in {order_name(b.order)} (noise {noise:.1%}): "
                         f"the share depends on the order")
    return notes
