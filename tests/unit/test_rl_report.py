"""The RL view wired into the comparison table and the report, on synthetic sampler records (no engine)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from judged import scenario_entry

from parity.core.filters import reference_filter
from parity.core.rl_catalogue import METHODS, METRICS, catalogue
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.core.token_table import build_table
from parity.judge.scenario import rl_view
from parity.report.markdown import render_details, render_markdown
from parity.report.rl_section import headline
from parity.report.schema import SCHEMA_VERSION, environment, report_schema, write_report

V = 48
GSPO = "GSPO [1-3e-4, 1+4e-4]"


def records_for(spec: SamplingSpec, n_seq: int = 4, length: int = 8, seed: int = 0):
    """Sampler records from the reference filters over random logits; the trainer gets the same logits."""
    g = torch.Generator().manual_seed(seed)
    records, logits = [], []
    for i in range(n_seq):
        z = torch.randn(length, V, generator=g) * 3
        ref = reference_filter(z, spec)
        y = torch.multinomial(ref.logprobs.exp(), 1, generator=g).squeeze(1)
        kept = kept_lp = None
        if spec.effective().filtered:
            order = torch.argsort(ref.logprobs, dim=-1, descending=True)
            kept_lp = ref.logprobs.gather(1, order)
            kept = order.masked_fill(torch.isinf(kept_lp), -1)
        records.append(
            SequenceRecord(
                source="sampler",
                prompt_index=i,
                prompt_ids=[1],
                completion_ids=y.tolist(),
                spec=spec,
                seed=i,
                logprobs=ref.logprobs.gather(1, y.unsqueeze(1)).squeeze(1),
                kept_ids=kept,
                kept_logprobs=kept_lp,
            )
        )
        logits.append(z)
    return records, logits


def scenario(name: str, spec: SamplingSpec) -> tuple[dict, object]:
    records, logits = records_for(spec)
    table = build_table(records, logits, spec)
    return scenario_entry(records, logits, table, name), table


def test_scenario_summary_carries_the_three_trainers() -> None:
    s, table = scenario("top_p=0.9", SamplingSpec(temperature=0.7, top_p=0.9))
    rl = s["rl_view"]
    assert set(rl) == {"naive", "replay", "recompute"}
    for view in rl.values():
        assert set(view["metrics"]) == {e.name for e in METRICS}
        assert set(view["methods"]) == {e.name for e in METHODS}
        assert view["tokens"] == table.tokens and view["sequences"] == len(table.seq_lengths)
    # The naive trainer's δ is log S per token: its mean |δ| is -mean log S, and GSPO (A < 0) drops
    # exactly the sequences whose mean log S is below log(1 - 3e-4).
    assert rl["naive"]["metrics"]["sampling/sampling_logp_difference/mean"] == pytest.approx(
        -float(table.log_s.mean()), abs=1e-6
    )
    per_seq = torch.stack([x.mean() for x in torch.split(table.log_s, table.seq_lengths)])
    assert rl["naive"]["methods"][GSPO]["-"]["affected"] == int((per_seq < math.log(1 - 3e-4)).sum())
    assert rl["naive"]["methods"][GSPO]["-"]["affected"] > 0
    # Same logits on both sides: after replay nothing is masked, dropped or vetoed.
    for name in ("replay", "recompute"):
        for m in METHODS:
            if m.action in ("mask", "drop", "veto"):
                assert all(r["affected"] == 0 for r in rl[name]["methods"][m.name].values()), (name, m.name)


def test_trainer_under_test_joins_the_view() -> None:
    spec = SamplingSpec(temperature=1.0, top_k=5)
    records, logits = records_for(spec)
    table = build_table(records, logits, spec)
    table.user = table.full.clone()
    table.user_name = "mine"
    rl = rl_view(table)
    assert rl["trainer_under_test"]["metrics"] == rl["naive"]["metrics"]


def test_report_md_and_json_carry_both_tables(tmp_path) -> None:
    s1, _ = scenario("top_p=0.9 T=0.7", SamplingSpec(temperature=0.7, top_p=0.9))
    s2, _ = scenario("baseline T=1", SamplingSpec())
    report = {
        "schema_version": SCHEMA_VERSION,
        "environment": environment("cpu", "float32", "float32"),
        "rl_view": catalogue(),
        "scenarios": [s1, s2],
        "passed": True, "verdict": "pass", "no_verdict": [],
        "source": "records", "config": {}, "records": {"files": 0, "rows": 2, "tokens": 8, "page_checksums": "unknown", "files_without_page_checksums": []}, "warnings": [], "complete": True, "not_evaluated": [],
    }
    assert "## RL view" not in render_markdown(report)  # per-scenario detail lives in details.md
    md = render_details(report)
    assert "## RL view: framework mismatch metrics and IS corrections" in md
    assert "Assumption: First update after a rollout" in md
    h = headline(s1)
    assert h is not None and h.startswith("under top_p=0.9 T=0.7 with the naive trainer, GSPO")
    assert "after replay, 0 % and 0 %" in h
    assert f"- U{h[1:]}" in md
    assert (
        "No method masks, drops or vetoes anything, and no metric is over its threshold, for any trainer, in: baseline T=1."
        in md
    )
    assert "| framework | metric | naive | replay | recompute | documented threshold |" in md
    assert "| NeMo-RL | `token_mult_prob_error` |" in md and "< 1.05" in md
    for m in METHODS:
        assert f"| {m.name} |" in md
    write_report(report, tmp_path)
    data = json.loads((tmp_path / "report.json").read_text())
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.validate(data, report_schema())
    assert data["rl_view"]["assumption"]
    assert data["scenarios"][0]["rl_view"]["naive"]["methods"][GSPO]["-"]["affected_frac"] > 0
    assert "rl_methods.png" in data["plots"] and (tmp_path / "rl_methods.png").stat().st_size > 1000
