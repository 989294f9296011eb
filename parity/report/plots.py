"""The report's PNG plots (matplotlib, the ``report`` extra; without it no plot is written)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType

import numpy as np

from parity.core.display import NA
from parity.report import budget_section, rl_section
from parity.report.blocks import DriftHeadroom, ReportJson, dense_hist
from parity.report.overview import headroom_limit, sampler_name

# The histogram's range of |diff| / bound: below it (exact matches too) at the left edge, above it (NaN
# and inf too) at the right edge, so every compared token is drawn.
DRIFT_RANGE = (1e-4, 1e4)


def _number(x: object) -> float:
    """A plotted value; statistics a records file could not support (None) plot as gaps."""
    return float(x) if isinstance(x, (int, float)) else math.nan


def write_steps_plot(report: ReportJson, out: Path, plt: ModuleType) -> bool:
    """drift_steps.png: per scenario with a training-log view, mean |diff| per step, its least-squares line, the
    band of the baseline steps and the first step above it (``drift_trend``); False when no scenario has steps."""
    sc = [s for s in report["scenarios"] if s.get("per_step")]
    if not sc:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, s in enumerate(sc):
        color = f"C{i % 10}"
        steps = [e["step"] for e in s["per_step"]]
        means = [_number(e["mean_abs_diff"]) for e in s["per_step"]]
        tr: Mapping[str, object] = s.get("trend") or {}
        ax.plot(steps, means, "o-", color=color, markersize=3, linewidth=1,
                label=f"{s['name']} ({tr.get('comparison') or s['per_step'][0].get('comparison') or NA})")
        slope, icpt = _number(tr.get("slope")), _number(tr.get("intercept"))
        if math.isfinite(slope) and math.isfinite(icpt):
            ax.plot([steps[0], steps[-1]], [icpt + slope * steps[0], icpt + slope * steps[-1]], "--", color=color, linewidth=1)
        lo, hi = _number(tr.get("band_lo")), _number(tr.get("band_hi"))
        if math.isfinite(lo) and math.isfinite(hi):
            ax.fill_between([steps[0], steps[-1]], lo, hi, color=color, alpha=0.12, linewidth=0)
        first = tr.get("first_step_outside")
        if isinstance(first, int) and first in steps:
            ax.plot([first], [means[steps.index(first)]], "x", color="black", markersize=9)
    ax.set_xlabel("training step")
    ax.set_ylabel("mean |trainer − sampler| per token (nats)")
    ax.set_title("Drift per training step: fitted line (dashed), baseline band (shaded), first step above it (x)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "drift_steps.png", dpi=110)
    plt.close(fig)
    return True


def dense_drift_hist(h: DriftHeadroom) -> dict[str, list[float] | np.ndarray]:
    """A scenario's ``drift_headroom`` (filled bins only) as bin ``edges`` and a count array per estimator."""
    n = int(h["bins"])
    out: dict[str, list[float] | np.ndarray] = {"edges": [h["log10_lo"] + i * h["bin_width"] for i in range(n + 1)]}
    for est in ("replay", "recompute"):
        if est in h:
            out[est] = dense_hist(h[est], n)
    return out


def write_plots(report: ReportJson, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    sc = report["scenarios"]
    who = sampler_name(report)
    # the streamed histograms, of the scenarios that compared a token against its bound
    hists = [dense_drift_hist(h) for s in sc if (h := s.get("drift_headroom")) and ("replay" in h or "recompute" in h)]
    if hists:
        limit = headroom_limit(report)
        floor, ceiling = DRIFT_RANGE
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for est in ("replay", "recompute"):
            counts = [c for x in hists if isinstance(c := x.get(est), np.ndarray)]
            if counts:
                ax.stairs(sum(counts), hists[0]["edges"], fill=True, alpha=0.6, label=f"{est} − {who}")
        ax.axvline(math.log10(limit), color="black", linestyle="--", linewidth=1)
        ax.text(math.log10(limit), ax.get_ylim()[1] * 0.95, f"gate: |diff| = {limit:g} × bound ", va="top",
                ha="right", fontsize=8)
        ax.set_xlabel(f"log10 (|trainer − {who}| / rounding bound) per token (exact and < {floor:g}: left edge; > {ceiling:g}: right)")
        ax.set_ylabel("tokens")
        ax.set_title("Per-token drift after the fix against its rounding bound (all scenarios)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "drift_hist.png", dpi=110)
        plt.close(fig)
        written.append("drift_hist.png")
    if write_steps_plot(report, out, plt):
        written.append("drift_steps.png")
    written += budget_section.write_plots(report, out, plt)
    log_s = [_number(s["log_s"]["mean"]) for s in sc]
    naive = [_number(s["naive"]["bias_mean"]) for s in sc]
    # Logs alone carry neither a trainer-side log S nor a full-vocabulary trainer: no bars to draw.
    if any(math.isfinite(v) for v in (*log_s, *naive)):
        fig, ax = plt.subplots(figsize=(max(8, len(sc) * 0.45), 4.5))
        x = range(len(sc))
        ax.bar([i - 0.2 for i in x], log_s, width=0.4, label="predicted log S (mean)")
        ax.bar([i + 0.2 for i in x], naive, width=0.4, label=f"naive bias full − {who} (mean)")
        ax.set_xticks(list(x))
        ax.set_xticklabels([s["name"] for s in sc], rotation=70, ha="right", fontsize=7)
        ax.set_ylabel("nats per token")
        ax.set_title("The naive trainer's bias against log S (trainer-side, reported)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "log_s_bias.png", dpi=110)
        plt.close(fig)
        written.append("log_s_bias.png")
    written += rl_section.write_plot(report, out, plt)
    return written
