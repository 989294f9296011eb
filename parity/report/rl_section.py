"""report.md section and plot for the RL view (each scenario's ``rl_view`` field, see parity.core.rl)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from parity.report import routing_section
from parity.report.blocks import ReportJson, ScenarioJson

if TYPE_CHECKING:
    from parity.core.rl import Method
    from parity.core.rl_catalogue import TrainerSummary

# parity.core.rl (and torch with it) is imported where a scenario has an RL view: a records analysis has
# none, and renders its report without torch.

TRAINERS = ("naive", "replay", "recompute")
FIXED = ("replay", "recompute")
# The two methods the headline names: a sequence-level drop and a token-level mask.
HEADLINE_METHODS = ("GSPO [1-3e-4, 1+4e-4]", "Token MIS/IcePop [0.5, 5]")
UNIT = {"token": "tokens", "sequence": "sequences"}
STAT = {"ratio": "r", "tv": "p − q", "seq_ratio": "Π r", "geo_ratio": "exp(mean δ)",
        "seq_mean_k3": "mean (r − log r − 1)", "min_ratio": "min r"}
SIGN = {"any": "any", "+": "A > 0", "-": "A < 0"}  # an advantage sign a method is reported for
VERB = {"clip": "clips", "mask": "masks", "veto": "vetoes", "drop": "drops", "none": "touches"}


def _num(x: object) -> str:
    if x is None:
        return "—"
    if isinstance(x, str):
        return x
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.4g}"


def _pct(x: float | None) -> str:
    if x is None:
        return "—"
    if x == 0:
        return "0 %"
    return f"{100 * x:.3g} %"


def _interval(m: Method) -> str:
    lo, hi = m.interval
    # Ratios are never negative: a lower bound of 0 is no bound.
    no_low = math.isinf(lo) or (lo == 0.0 and m.statistic in ("ratio", "seq_ratio", "geo_ratio", "min_ratio"))
    if no_low:
        return "—" if math.isinf(hi) else f"≤ {hi:g}"
    if math.isinf(hi):
        return f"≥ {lo:g}"
    return f"[{lo:.6g}, {hi:.6g}]"


def _worst(view: TrainerSummary, method: Method) -> tuple[float | None, str]:
    """The largest affected fraction over the reported advantage signs, and which sign."""
    res = view["methods"][method.name]
    best: tuple[float | None, str] = (None, "any")
    for s in method.signs:
        f = res[s]["affected_frac"]
        if f is not None and (best[0] is None or f > best[0]):
            best = (f, s)
    return best


def headline(scenario: ScenarioJson) -> str | None:
    """'under <scenario> with the naive trainer, GSPO drops X % of sequences and IcePop masks Y % of tokens; after replay, ...'."""
    rl = scenario.get("rl_view")
    if not rl or "naive" not in rl:
        return None
    from parity.core.rl_catalogue import METHODS

    by_name = {m.name: m for m in METHODS}
    methods = [by_name[n] for n in HEADLINE_METHODS]
    parts = []
    for m in methods:
        frac, sign = _worst(rl["naive"], m)
        where = f" ({SIGN[sign]})" if sign != "any" else ""
        parts.append(f"{m.name} {VERB[m.action]} {_pct(frac)} of {UNIT[m.level]}{where}")
    after = [f"after {t}, " + " and ".join(_pct(_worst(rl[t], m)[0]) for m in methods)
             for t in FIXED if t in rl]
    return f"under {scenario['name']} with the naive trainer, " + " and ".join(parts) + "; " + "; ".join(after) + "."


def _trainers(rl: Mapping[str, TrainerSummary]) -> list[str]:
    return [t for t in TRAINERS if t in rl] + [t for t in rl if t not in TRAINERS]


def metrics_table(rl: Mapping[str, TrainerSummary]) -> list[str]:
    from parity.core.rl_catalogue import METRICS

    trainers = _trainers(rl)
    lines = [
        "| framework | metric | " + " | ".join(trainers) + " | documented threshold |",
        "|---|---|" + "---|" * len(trainers) + "---|",
    ]
    for e in METRICS:
        cells = [_num(rl[t]["metrics"].get(e.name)) + (" ⚠" if e.name in rl[t]["over_threshold"] else "")
                 for t in trainers]
        lines.append(f"| {e.framework} | `{e.name}` | " + " | ".join(cells)
                     + f" | {e.threshold.label() if e.threshold else '—'} |")
    return lines


def methods_table(rl: Mapping[str, TrainerSummary]) -> list[str]:
    from parity.core.rl_catalogue import METHODS

    trainers = _trainers(rl)
    lines = ["| method | frameworks | level | statistic | kept interval | action | advantage | "
             + " | ".join(f"{t}: affected · mean w · ESS" for t in trainers) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * len(trainers)]
    for m in METHODS:
        for s in m.signs:
            cells = [f"{_pct(r['affected_frac'])} · {_num(r['mean_weight'])} · {_num(r['ess'])}"
                     for r in (rl[t]["methods"][m.name][s] for t in trainers)]
            lines.append(
                f"| {m.name} | {', '.join(m.frameworks)} | {m.level} | {STAT[m.statistic]} | {_interval(m)} | {m.action} | "
                f"{SIGN[s]} | " + " | ".join(cells) + " |"
            )
    return lines


def markdown(report: ReportJson) -> list[str]:
    """The report.md lines of the RL view: assumption, headlines, then both tables per scenario."""
    scenarios = [s for s in report["scenarios"] if s.get("rl_view")]
    if not scenarios:
        return []
    cat = report.get("rl_view") or {}
    lines = ["", "## RL view: framework mismatch metrics and IS corrections", ""]
    if cat.get("assumption"):
        lines += [f"Assumption: {cat['assumption']}", ""]
    lines += [
        "Metrics are each framework's own reduction of δ = log p_trainer − log q_sampler, under its dashboard "
        "name (⚠: outside its documented threshold). Methods use their frameworks' default parameters; "
        "'affected' is the fraction of units (tokens or sequences) clipped, masked, vetoed or dropped, "
        "ESS = (Σw)² / (n Σw²).",
        "",
    ]
    from parity.core.rl_catalogue import METHODS

    quiet = []
    for s in scenarios:
        rl = s["rl_view"]
        # Clips are left out: TOPR clips every product above 1, so kernel noise of 1e-7 "clips" half the
        # sequences of an exact trainer by a weight change of 1e-7 (visible in the tables below).
        moved = any((_worst(rl[t], m)[0] or 0) > 0 for t in rl for m in METHODS
                    if m.action in ("mask", "drop", "veto")) or any(rl[t]["over_threshold"] for t in rl)
        if not moved:
            quiet.append(s["name"])
            continue
        h = headline(s)
        if h:
            lines.append(f"- {h[0].upper()}{h[1:]}")
    if quiet:
        lines += ["", "No method masks, drops or vetoes anything, and no metric is over its threshold, for "
                  "any trainer, in: " + ", ".join(quiet) + "."]
    for s in scenarios:
        rl = s["rl_view"]
        lines += ["", f"### {s['name']}", ""]
        lines += metrics_table(rl)
        lines += [""] + methods_table(rl)
        lines += routing_section.replay_lines(s)
    return lines


def write_plot(report: ReportJson, out: Path, plt: ModuleType) -> list[str]:
    """rl_methods.png: fraction dropped per method (rows) and scenario (columns), naive vs fixed; only the
    methods that drop units (mask, drop, veto): clips change weights and are in the tables."""
    scenarios = [s for s in report["scenarios"] if s.get("rl_view")]
    if not scenarios:
        return []
    from parity.core.rl_catalogue import METHODS

    rows = [(m, s) for m in METHODS if m.action in ("mask", "drop", "veto") for s in m.signs]
    labels = [m.name + ("" if s == "any" else f" ({SIGN[s]})") for m, s in rows]
    # A trainer's panel is drawn only where some method drops something: an all-zero panel is an empty plot
    # (after replay or recompute nothing is dropped on a correct run; the tables in details.md say so).
    trainers = [t for t in TRAINERS if all(t in sc["rl_view"] for sc in scenarios) and any(
        (sc["rl_view"][t]["methods"][m.name][sign]["affected_frac"] or 0) > 0
        for sc in scenarios for m, sign in rows)]
    if not trainers:
        return []
    size = (max(9, 0.42 * len(scenarios) + 5), (0.3 * len(rows) + 2.2) * len(trainers))
    fig, axes = plt.subplots(len(trainers), 1, figsize=size, squeeze=False, constrained_layout=True)
    image = None
    for ax, t in zip(axes[:, 0], trainers, strict=True):
        grid = [[sc["rl_view"][t]["methods"][m.name][sign]["affected_frac"] for sc in scenarios]
                for m, sign in rows]
        values = [[float("nan") if v is None else v for v in row] for row in grid]
        image = ax.imshow(values, vmin=0.0, vmax=1.0, cmap="Reds", aspect="auto")
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                if v == v and v > 0:
                    ax.text(j, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=5,
                            color="black" if v < 0.6 else "white")
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=6)
        ax.set_xticks(range(len(scenarios)))
        ax.set_xticklabels([sc["name"] for sc in scenarios], rotation=70, ha="right", fontsize=6)
        ax.set_title(f"{t} trainer: % of tokens or sequences masked / vetoed / dropped", fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=axes[:, 0].tolist(), fraction=0.02, pad=0.01, label="fraction dropped")
    fig.suptitle("Each correction method on the recorded tokens, naive against fixed trainers", fontsize=10)
    fig.savefig(Path(out) / "rl_methods.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return ["rl_methods.png"]
