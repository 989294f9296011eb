"""The terminal summary and the head of report.md, drawn from scenarios scored and gated by the real core
on synthetic sampler records (no engine): every number in the text is read back against the report."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from judged import scenario_entry

from parity.core.filters import reference_filter
from parity.core.gates import Thresholds
from parity.core.matrix import default_matrix
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.core.token_table import TrainerFaults, build_table
from parity.report import overview
from parity.report.markdown import render_details, render_markdown
from parity.report.plots import dense_drift_hist
from parity.report.schema import json_safe

V = 48
LENGTH = 8


def _records(spec: SamplingSpec, n_seq: int = 4, seed: int = 0) -> tuple[list[SequenceRecord], list[torch.Tensor]]:
    """Sampler records drawn from the reference filters over random logits; the trainer sees the same logits."""
    g = torch.Generator().manual_seed(seed)
    records, logits = [], []
    for i in range(n_seq):
        z = torch.randn(LENGTH, V, generator=g) * 3
        if spec.penalised:  # position t is penalised from the prompt and the tokens before it
            ys: list[int] = []
            for t in range(LENGTH):
                row = reference_filter(z[t : t + 1], spec, prompt_ids=[[1]], output_ids=[list(ys)]).logprobs
                ys.append(int(torch.multinomial(row.exp(), 1, generator=g)))
            lp = torch.cat([reference_filter(z[t : t + 1], spec, prompt_ids=[[1]], output_ids=[ys[:t]]).logprobs
                            for t in range(LENGTH)])
            y = torch.tensor(ys)
        else:
            lp = reference_filter(z, spec).logprobs
            y = torch.multinomial(lp.exp(), 1, generator=g).squeeze(1)
        kept = kept_lp = None
        if spec.effective().filtered:
            order = torch.argsort(lp, dim=-1, descending=True)
            kept_lp = lp.gather(1, order)
            kept = order.masked_fill(torch.isinf(kept_lp), -1)
        records.append(SequenceRecord(
            source="sampler", prompt_index=i, prompt_ids=[1], completion_ids=y.tolist(), spec=spec, seed=i,
            logprobs=lp.gather(1, y.unsqueeze(1)).squeeze(1), kept_ids=kept, kept_logprobs=kept_lp,
        ))
        logits.append(z)
    return records, logits


def _scenario(name: str, spec: SamplingSpec, faults: TrainerFaults | None = None) -> dict:
    records, logits = _records(spec)
    table = build_table(records, logits, spec, faults=faults)
    return scenario_entry(records, logits, table, name)


def _report(scenarios: list[dict]) -> dict:
    return {
        "schema_version": 4,
        "environment": {"vllm": "x", "torch": "x", "transformers": "x", "device": "cpu", "dtype": "float32",
                        "trainer_dtype": "float32"},
        "config": {"thresholds": Thresholds().to_dict()},
        "scenarios": scenarios,
        "determinism": None,
        "passed": all(s["verdict"] == "pass" for s in scenarios),
    }


@pytest.fixture(scope="module")
def mixed() -> dict:
    return _report([
        _scenario("top_p=0.9 T=0.7", SamplingSpec(temperature=0.7, top_p=0.9)),
        _scenario("baseline T=1", SamplingSpec(temperature=1.0)),
        _scenario("top_k=5 planted", SamplingSpec(temperature=1.0, top_k=5), TrainerFaults(shift_bounds=4.0)),
    ])


def _rows(text: str) -> dict[str, str]:
    """Table lines of the terminal block, by scenario name."""
    table = text.split("\n\n", 1)[0].splitlines()[1:]
    return {name: line for line in table for name in ("top_p=0.9 T=0.7", "baseline T=1", "top_k=5 planted") if name in line}


def test_one_line_per_scenario_with_its_own_numbers(mixed: dict) -> None:
    text = overview.render_terminal(mixed)
    header = text.splitlines()[0].split()
    assert header[:2] == ["verdict", "scenario"] and "support" in header
    rows = _rows(text)
    assert len(rows) == 3
    for s in mixed["scenarios"]:
        cells = rows[s["name"]].replace(s["name"], "NAME").split()
        assert cells[0] == s["verdict"].upper()
        log_s, drift = cells[2:4]
        rep, rec = drift.split("/")
        assert float(log_s) == pytest.approx(s["log_s"]["mean"], abs=5e-5, rel=1e-3)
        assert float(rep) == pytest.approx(s["headroom"]["replay"], abs=5e-3)
        assert float(rec) == pytest.approx(s["headroom"]["recompute"], abs=5e-3)
        mean, resolution = cells[-2:] if not s["violations"] else cells[-2 - 1 - len(dict.fromkeys(
            v["gate"] for v in s["violations"])):][:2]
        entry = s["mean_bias"]["replay"]
        assert float(resolution) == pytest.approx(entry["limit"], rel=0.05)
        assert float(mean) == pytest.approx(abs(entry["mean"]) / entry["limit"], abs=5e-3)
    assert "full V" in rows["baseline T=1"] and "equal" in rows["top_p=0.9 T=0.7"]
    failed = [v["gate"] for v in mixed["scenarios"][2]["violations"]]
    assert failed and rows["top_k=5 planted"].endswith("← " + ", ".join(dict.fromkeys(failed)))
    assert "←" not in rows["top_p=0.9 T=0.7"]


def test_the_paragraph_reads_its_numbers_from_the_report(mixed: dict) -> None:
    text = overview.paragraph(mixed)
    e = mixed["scenarios"][0]  # top_p alone nearest 0.9: the scenario the paragraph speaks of
    s_token = e["is_ratio"]["naive"]["token"]["mean"]
    assert s_token < 1
    assert f"under-weight every token by S = {s_token:.2f} at top_p=0.9 T=0.7" in text
    assert f"{overview._article(LENGTH)} {LENGTH}-token completion by {e['is_ratio']['naive']['sequence']['mean']:.2g}" in text
    # The planted fault fails replay and recompute in that scenario alone, and its drift is named.
    assert "Replay fails in 1 scenario(s): top_k=5 planted." in text
    assert "Recompute fails in 1 scenario(s): top_k=5 planted." in text
    worst = mixed["scenarios"][2]["headroom"]
    h = max(worst["replay"], worst["recompute"])
    assert h > 1 and f"gap to vLLM reaches {h:.2f} times its rounding bound in top_k=5 planted" in text


def test_ajson_safe_run_says_the_fixes_remove_the_bias() -> None:
    report = _report([
        _scenario("top_p=0.9 T=0.7", SamplingSpec(temperature=0.7, top_p=0.9)),
        _scenario("top_p=0.8 T=1.3", SamplingSpec(temperature=1.3, top_p=0.8)),
    ])
    assert report["passed"]
    text = overview.paragraph(report)
    gap = max(s[k]["max_abs_diff"] for s in report["scenarios"] for k in ("replay", "recompute"))
    assert f"Replay and recompute remove it: their largest per-token gap to vLLM is {gap:.1e} nats." in text
    h, name = max((s["headroom"][k], s["name"]) for s in report["scenarios"] for k in ("replay", "recompute"))
    assert f"Remaining kernel drift is within {h:.2g} of its rounding bound (worst: {name}" in text
    lo = min(report["scenarios"], key=lambda s: s["is_ratio"]["naive"]["token"]["mean"])
    assert f"S per token runs from {lo['is_ratio']['naive']['token']['mean']:.2f} ({lo['name']})" in text


def test_without_truncation_the_paragraph_says_so() -> None:
    report = _report([_scenario("baseline T=1", SamplingSpec(temperature=1.0)),
                      _scenario("greedy", SamplingSpec(temperature=0.0))])
    text = overview.paragraph(report)
    assert text.startswith("No scenario's filters removed any probability mass")
    assert "under-weight" not in text and "In RL terms" not in text


def test_report_json_renders_the_same(mixed: dict) -> None:
    """report.json writes non-finite numbers as strings; the loaded report renders identically."""
    mixed = json.loads(json.dumps(json_safe(mixed)))
    mixed["scenarios"][1]["headroom"]["recompute"] = float("inf")
    loaded = json.loads(json.dumps(json_safe(mixed)))
    assert loaded["scenarios"][1]["headroom"]["recompute"] == "inf"
    assert overview.render_terminal(loaded) == overview.render_terminal(mixed)
    assert "/inf " in _rows(overview.render_terminal(loaded))["baseline T=1"]


def test_the_default_matrix_fits_a_terminal() -> None:
    m = default_matrix()
    report = _report([_scenario(sc.name, sc.spec) for sc in m.scenarios])
    table = overview.render_terminal(report).split("\n\n", 1)[0].splitlines()
    assert len(table) == len(m.scenarios) + 1
    assert max(len(line) for line in table) <= overview.WIDTH
    assert all(len(line) <= overview.WIDTH for line in overview.render_terminal(report).splitlines())


def test_report_md_opens_with_the_verdict_the_paragraph_and_a_narrow_table(mixed: dict) -> None:
    md = render_markdown({**mixed, "plots": ["log_s_bias.png", "drift_hist.png"]})
    lines = md.splitlines()
    assert lines[0] == "# parity report"
    # top_k=5 without a raw-logits pass has no sampler-side log S: its naive gate is listed, not passed.
    assert lines[2] == ("**FAIL** — 2/3 scenarios pass; 1 gate(s) were not evaluated in 1 scenario(s) and neither pass "
                        "nor fail (see \"Gates not evaluated\").")
    assert lines[4] == overview.paragraph(mixed)
    header = next(i for i, line in enumerate(lines) if line.startswith("| scenario |"))
    assert [c.strip() for c in lines[header].strip("|").split("|")] == [
        "scenario", "verdict", "log S", "naive bias", "replay headroom", "recompute headroom", "support equal",
        "mean bias / limit", "resolution (nats)"]
    body = lines[header + 2 : header + 5]
    assert [row.split("|")[1].strip() for row in body] == [s["name"] for s in mixed["scenarios"]]
    assert "FAIL (replay_drift" in body[2]
    # The plots sit by what they explain: log S vs bias under the narrow table, drift after the verdict's reasons;
    # the per-scenario detail is a second file, linked at the end.
    assert md.index("| scenario |") < md.index("](log_s_bias.png)") < md.index("](drift_hist.png)")
    assert "## Detail per scenario" not in md and md.rstrip().endswith("[details.md](details.md).")
    assert "## Detail per scenario" in render_details(mixed)
    assert "](log_s_bias.png)" not in render_markdown(mixed)


def test_glance_cells_are_report_values_formatted(mixed: dict) -> None:
    for row, s in zip(overview.glance_rows(mixed), mixed["scenarios"], strict=True):
        assert row["scenario"] == s["name"] and row["verdict"] == s["verdict"].upper()
        v = float(row["log S"]) if row["log S"] != "0" else 0.0
        assert math.isclose(v, s["log_s"]["mean"], rel_tol=1e-3, abs_tol=5e-5)
        assert re.fullmatch(r"\d+\.\d\d|inf|—|n/a", row["replay"])


def test_a_trainer_under_test_is_named_with_its_diagnosis(mixed: dict) -> None:
    report = json.loads(json.dumps(json_safe(mixed)))
    s = report["scenarios"][0]
    s["trainer_under_test"] = {"name": "mymodule:my_logprobs", "diagnosis": "it forgets the temperature"}
    s["violations"].append({"gate": "trainer_under_test_drift", "message": "m"})
    report["scenarios"][1]["trainer_under_test"] = {"name": "mymodule:my_logprobs", "diagnosis": "matches"}
    text = overview.paragraph(report)
    assert ("The trainer under test (mymodule:my_logprobs) fails in 1 of 2 scenario(s) (top_p=0.9 T=0.7); "
            "diagnosis at top_p=0.9 T=0.7: it forgets the temperature.") in text
    assert "Other failed gates" not in text


def test_the_drift_histogram_draws_diff_over_bound_for_every_compared_token() -> None:
    from judged import judged

    spec = SamplingSpec(temperature=0.7, top_p=0.9)
    records, logits = _records(spec)
    faults = TrainerFaults(shift_bounds=4.0)
    clean = judged(records, logits, build_table(records, logits, spec))
    planted = judged(records, logits, build_table(records, logits, spec, faults=faults))
    for e in (clean, planted):
        h = dense_drift_hist(e["drift_headroom"])
        assert int(h["replay"].sum()) == e["compared_tokens"]  # every compared token is drawn
        # The highest filled bin holds the scenario's headroom, the statistic the drift gate compares with its limit.
        top = max(i for i, c in enumerate(h["replay"]) if c)
        head = min(max(e["headroom"]["replay"], 10 ** h["edges"][0]), 10 ** h["edges"][-1])
        assert h["edges"][top] - 1e-9 <= math.log10(head) <= h["edges"][top + 1] + 1e-9
    assert planted["headroom"]["replay"] > 1.0 > clean["headroom"]["replay"]


@pytest.mark.parametrize(("log_s", "expected"), [(-0.216, True), (-0.014, False)])
def test_truncation_is_judged_against_the_mean_bias_limit_not_the_per_token_bound(log_s, expected) -> None:
    """A bfloat16 TRL step: per-token bound 1.27 nats on average, mean-bias limit 0.14. A real log S of
    -0.216 (top_p=0.8) truncates; -0.014 (a tenth of the limit) is rounding."""
    s = {"spec": SamplingSpec(top_p=0.8).to_dict(), "log_s": {"mean": log_s},
         "bound": {"mean": 1.2734, "max": 1.5866}, "mean_bias_limit": {"replay": 0.1403}}
    assert overview.truncates(s) is expected
    del s["mean_bias_limit"]  # a report without the limit falls back to the per-token bound
    assert overview.truncates(s) is False
