"""``parity budget``'s waterfall as text: the terminal table, the report.md section and the waterfall plot."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from parity.report.blocks import BudgetBlock, BudgetRow, BudgetScenario, MismatchSplit, ReportJson

AFTER = ("mean_abs_delta", "mean_delta", "k3_kl", "outside_ppo", "seq_ratio_sd")


def _num(x: object) -> str:
    return format(x, ".3g") if isinstance(x, (int, float)) else "—"


def share_cell(row: BudgetRow, measure: str) -> str:
    """A row's share of ``measure``: a percentage, "within noise", or why it is 0 / not measured."""
    if row["status"] == "not_applicable":
        return "0 (n/a)"
    if row["status"] == "not_measured":
        return "not measured"
    if row["within_noise"].get(measure):
        return "within noise"
    return pct(row["share"].get(measure))


def pct(share: object) -> str:
    """A share as a percentage with two significant digits below 1 % (0.0% would hide a small remainder)."""
    if not isinstance(share, (int, float)):
        return "—"
    return f"{share:.1%}" if abs(share) >= 0.01 or share == 0 else f"{share * 100:.2g}%"


def _lines(s: BudgetScenario, headline: str, sep: str, md: bool) -> list[str]:
    head = ["cause", f"share of {headline}", "mean |δ| after", "mean δ after", "k3 KL after", "outside [0.8,1.2]",
            "seq ratio sd", "fix (cost) / reason"]
    rows = [["start (as configured)", "100%"] + [_num(s["start"][m]) for m in AFTER] + [""]]
    for i, r in enumerate(s["rows"], start=1):
        why = (r["reason"] or "") if r["status"] != "measured" else r["fix"] + (f" ({r['cost']})" if r["cost"] else "")
        if r["status"] == "measured" and r["reason"]:
            why += f"; {r['reason']}"
        rows.append([f"{i} {r['label']}", share_cell(r, "mean_abs_delta")] + [_num(r["after"][m]) for m in AFTER] + [why])
    rem = s["remainder"]
    b = rem["bound"]
    bound = "" if b is None else f"max |δ| / rounding bound {_num(b['headroom'])} (mean bound {_num(b['mean_bound'])})"
    share = rem["share"].get("mean_abs_delta")
    rows.append([rem["label"], pct(share)] + [_num(rem["after"][m]) for m in AFTER] + [bound])
    if md:
        def cells(row: list[str]) -> str:
            return "| " + " | ".join(c.replace("|", "\\|") for c in row) + " |"

        return [cells(head), "|---|" + "---:|" * 7 + "---|"] + [cells(row) for row in rows]
    widths = [max(len(row[j]) for row in [head, *rows]) for j in range(len(head) - 1)]
    return [sep.join(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)) + sep + row[-1] for row in [head, *rows]]


def terminal(block: BudgetBlock) -> str:
    """The terminal tables, one per scenario; each ends with its "fix first" line."""
    out = []
    for s in block["scenarios"]:
        out.append(f"budget: {s['scenario']} ({s['tokens']} tokens in {s['sequences']} sequences; trainer: {s['trainer']})")
        out += ["  " + ln for ln in _lines(s, "mean |δ|", "  ", md=False)]
        out += [f"  note: {n}" for n in s["notes"]]
        out.append(s["fix_first"])
        out.append("")
    return "\n".join(out).rstrip("\n")


def markdown(report: ReportJson, plots: set[str]) -> list[str]:
    """report.md's budget section (empty without a budget block)."""
    block = report.get("budget")
    if not block:
        return []
    lines = ["", "## Where the mismatch comes from (parity budget)", "",
             f"Each cause is removed in the order shown, on the same sampled tokens; shares are of the starting "
             f"mean |δ| (δ = trainer − sampler log-prob per token). Noise: {block['noise_method']}.", ""]
    for s in block["scenarios"]:
        lines += [f"### {s['scenario']}", "", f"{s['tokens']} tokens in {s['sequences']} sequences; trainer: {s['trainer']}.", ""]
        lines += _lines(s, "mean |δ|", " | ", md=True)
        lines += [""] + [f"- {n}" for n in s["notes"]] + ["", f"**{s['fix_first']}**", ""]
        name = plot_name(s)
        if name in plots:
            lines += [f"![waterfall of mean |δ|, {s['scenario']}]({name})", ""]
    return lines


def split_line(name: str, sp: MismatchSplit) -> str:
    """One line for ``parity analyze``: the records-alone split of mean |δ| (docs/budget.md, section 6)."""
    res = ("" if sp["resolved"] is None or sp["limit"] is None else
           f", {'beyond' if sp['resolved'] else 'within'} its resolution {sp['limit']:.2g}")
    text = (f"[{name}] mean |δ| {sp['mean_abs_delta']:.3g} ({sp['comparison']}, {sp['tokens']} tokens) = systematic "
            f"shift {sp['systematic']:.3g} ({pct(sp['systematic_share'])}{res}) + symmetric spread {sp['spread']:.3g}")
    steps = sp["per_step"]
    growth = sp["growth"]
    if growth is not None and growth > 0:
        top = max((e for e in steps if e["share_of_growth"] is not None), key=lambda e: e["share_of_growth"] or 0.0)
        text += (f"; it grew {growth:.3g} from step {steps[0]['step']} to {steps[-1]['step']}, most at step "
                 f"{top['step']} ({pct(top['share_of_growth'])})")
    elif growth is not None:
        text += f"; no growth from step {steps[0]['step']} to {steps[-1]['step']}"
    return text + "; needs the model (parity budget --model M): " + ", ".join(
        x.split(":")[0].split(" (")[0] for x in sp["needs_the_model"])


def split_markdown(report: ReportJson) -> list[str]:
    """details.md's records-alone split, one row per scenario that has one."""
    sc = [(s["name"], sp) for s in report["scenarios"] if (sp := s.get("mismatch_split")) is not None]
    if not sc:
        return []
    lines = ["", "## Where the gap comes from, on records alone", "",
             "mean |δ| = the systematic shift |mean δ| (a bias class: every token moved one way) + the symmetric spread "
             "(rounding, precision, layout). The split into causes needs the model: `parity budget` (docs/budget.md).",
             "", "| scenario | comparison | tokens | mean abs δ | systematic shift | share | resolution | spread | growth "
             "over steps |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, sp in sc:
        lines.append("| " + " | ".join([name, sp["comparison"], str(sp["tokens"]), _num(sp["mean_abs_delta"]),
                                         _num(sp["systematic"]), pct(sp["systematic_share"]), _num(sp["limit"]),
                                         _num(sp["spread"]), _num(sp["growth"])]) + " |")
    lines += ["", "Needs the model: " + "; ".join(sc[0][1]["needs_the_model"]) + "."]
    return lines


def plot_name(s: BudgetScenario) -> str:
    safe = "".join(ch if ch.isalnum() else "_" for ch in s["scenario"]).strip("_")
    return f"budget_{safe}.png"


def write_plots(report: ReportJson, out: Path, plt: ModuleType) -> list[str]:
    """One waterfall per scenario: the starting mean |δ|, each fix's drop, the remainder."""
    block = report.get("budget")
    if not block:
        return []
    written = []
    for s in block["scenarios"]:
        labels, bottoms, heights, colors = ["start"], [0.0], [s["start"]["mean_abs_delta"]], ["C0"]
        level = s["start"]["mean_abs_delta"]
        for r in s["rows"]:
            after = r["after"]["mean_abs_delta"]
            labels.append(r["label"] + ("" if r["status"] == "measured" else " (n/a)" if r["status"] == "not_applicable" else " (not measured)"))
            bottoms.append(min(level, after))
            heights.append(abs(level - after))
            colors.append("C7" if r["within_noise"].get("mean_abs_delta") or r["status"] != "measured" else
                          ("C2" if after <= level else "C3"))
            level = after
        labels.append(s["remainder"]["label"])
        bottoms.append(0.0)
        heights.append(s["remainder"]["after"]["mean_abs_delta"])
        colors.append("C1")
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ax.bar(range(len(labels)), heights, bottom=bottoms, color=colors)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("mean |trainer − sampler| per token (nats)")
        ax.set_title(f"{s['scenario']}: {s['fix_first']}", fontsize=9)
        fig.tight_layout()
        name = plot_name(s)
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    return written
