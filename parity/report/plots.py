"""The report's PNG plots (matplotlib, the ``report`` extra; without it no plot is written)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from parity.report import rl as rl_report


def write_plots(report: dict[str, Any], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    sc = report["scenarios"]
    tables = [(s["name"], s.get("_table")) for s in sc if s.get("_table") is not None]
    if tables:
        limit = float((report.get("config") or {}).get("thresholds", {}).get("max_headroom") or 1.0)
        # Drawn at the edges: below floor (exact matches included), above ceiling (NaN and inf included).
        floor, ceiling = 1e-4, 1e4
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for est in ("replay", "recompute"):
            ok = [~t.incomplete for _, t in tables]
            d = torch.cat([(getattr(t, est) - t.vllm)[m] for (_, t), m in zip(tables, ok, strict=True)]).abs()
            b = torch.cat([t.bound[m] for (_, t), m in zip(tables, ok, strict=True)])
            h = (d / b.clamp(min=torch.finfo(torch.float64).tiny)).nan_to_num(ceiling, posinf=ceiling)
            ax.hist(torch.log10(h.clamp(min=floor, max=ceiling)).numpy(), bins=60, alpha=0.6, label=f"{est} − vLLM")
        ax.axvline(math.log10(limit), color="black", linestyle="--", linewidth=1)
        ax.text(math.log10(limit), ax.get_ylim()[1] * 0.95, f" gate: |diff| = {limit:g} × bound", va="top", fontsize=8)
        ax.set_xlabel(f"log10 (|trainer − vLLM| / rounding bound) per token (exact and < {floor:g}: left edge; > {ceiling:g}: right)")
        ax.set_ylabel("tokens")
        ax.set_title("Per-token drift after the fix against its rounding bound (all scenarios)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "drift_hist.png", dpi=110)
        plt.close(fig)
        written.append("drift_hist.png")
    fig, ax = plt.subplots(figsize=(max(8, len(sc) * 0.45), 4.5))
    x = range(len(sc))
    ax.bar([i - 0.2 for i in x], [s["log_s"]["mean"] for s in sc], width=0.4, label="predicted log S (mean)")
    ax.bar([i + 0.2 for i in x], [s["naive"]["bias_mean"] for s in sc], width=0.4, label="naive bias full − vLLM (mean)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([s["name"] for s in sc], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("nats per token")
    ax.set_title("The naive trainer's bias against log S (trainer-side, reported)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "log_s_bias.png", dpi=110)
    plt.close(fig)
    written.append("log_s_bias.png")
    written += rl_report.write_plot(report, out, plt)
    return written
