"""Penalised sampling through the comparison table and the gates (no engine).

The sampler side is the reference pipeline stepping through each sequence (position t penalised from the
prompt and the tokens before it); the trainer side gets the same raw logits. A trainer that applies the
penalties passes; one that ignores them fails near the gates' own resolution and is diagnosed by its class.
"""

from __future__ import annotations

import math

import pytest
import torch
from judged import failed as failed_gates
from judged import judged

from parity.core.capture import support_from_heads
from parity.core.filters import reference_filter
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.core.token_table import TrainerFaults, build_table
from parity.engines.trainer_under_test import reference_views

V = 64
S = SamplingSpec


def penalised_records(spec: SamplingSpec, n_seq: int = 6, length: int = 12, seed: int = 0, prompt_len: int = 8):
    """Records drawn step by step as vLLM samples them: each position's logits penalised by its own history."""
    g = torch.Generator().manual_seed(seed)
    records, logits = [], []
    for i in range(n_seq):
        z = torch.randn(length, V, generator=g) * 3.0
        prompt = torch.randint(0, V, (prompt_len,), generator=g).tolist()
        ys: list[int] = []
        rows = []
        for t in range(length):
            ref = reference_filter(z[t : t + 1], spec, prompt_ids=[prompt], output_ids=[list(ys)])
            ys.append(int(torch.multinomial(ref.logprobs.exp(), 1, generator=g)))
            rows.append(ref.logprobs[0])
        lp = torch.stack(rows)
        y = torch.tensor(ys)
        kept = kept_lp = incomplete = None
        extras: dict = {}
        if spec.effective().filtered:
            order = torch.argsort(lp, dim=-1, descending=True)
            cap = support_from_heads(ys, order.tolist(), lp.gather(1, order).tolist(), requested=-1, vocab_size=V)
            kept, kept_lp, incomplete = cap.kept_ids, cap.kept_logprobs, cap.incomplete
            extras["sampled_missing"] = cap.sampled_missing
        records.append(SequenceRecord(source="sampler", prompt_index=i, prompt_ids=prompt, completion_ids=ys, spec=spec,
                                      seed=i, logprobs=lp.gather(1, y.unsqueeze(1)).squeeze(1), kept_ids=kept,
                                      kept_logprobs=kept_lp, incomplete=incomplete, extras=extras))
        logits.append(z)
    return records, logits


def gates(spec: SamplingSpec, faults: TrainerFaults | None = None, **kw):
    records, logits = penalised_records(spec, **kw)
    table = build_table(records, logits, spec, faults=faults)
    summary = judged(records, logits, table)
    return failed_gates(summary), table, summary


PENALISED = [
    S(1.0, repetition_penalty=1.3),
    S(0.7, top_p=0.9, repetition_penalty=1.2),
    S(1.0, top_k=10, presence_penalty=0.5, frequency_penalty=0.3),
    S(0.0, repetition_penalty=1.5),  # greedy rows are penalised too
    S(0.8, top_k=20, top_p=0.8, min_p=0.05, repetition_penalty=0.8, presence_penalty=-0.4),
]


@pytest.mark.parametrize("spec", PENALISED, ids=S.label)
def test_a_trainer_that_applies_the_penalties_passes_every_gate(spec: SamplingSpec) -> None:
    failed, table, summary = gates(spec)
    assert failed == set(), summary["headroom"]
    assert summary["recompute"]["support_equal_frac"] == 1.0
    assert bool((table.penalty != 0).any()), "the penalty term should be non-zero somewhere"


@pytest.mark.parametrize("spec", PENALISED[:3], ids=S.label)
def test_a_trainer_that_ignores_them_fails(spec: SamplingSpec) -> None:
    failed, _, summary = gates(spec, TrainerFaults(ignore_penalty=True))
    assert {"replay_drift", "recompute_drift"} & failed, summary["headroom"]


def _statistic(log_r: float, spec: SamplingSpec) -> tuple[set[str], float]:
    """Failed gates and max(per-token headroom, |mean| / mean limit) of replay for a penalty-ignoring trainer."""
    s = S(spec.temperature, spec.top_k, spec.top_p, spec.min_p, repetition_penalty=math.exp(log_r))
    failed, _, summary = gates(s, TrainerFaults(ignore_penalty=True), n_seq=8, length=16)
    mean = abs(summary["mean_bias"]["replay"]["mean"]) / summary["mean_bias_limit"]["replay"]
    return failed, max(summary["headroom"]["replay"], mean)


@pytest.mark.parametrize("spec", [S(1.0), S(0.7, top_k=20, top_p=0.9)], ids=S.label)
def test_penalty_ignoring_trainer_fails_at_three_resolutions_and_passes_at_a_third(spec: SamplingSpec) -> None:
    """The resolution's equivalent: the log r at which the replay gates' statistic reaches its limit (measured
    at a probe, linear in log r for small r). 1 + 3x of it fails a trainer that ignores the penalty; 0.3x passes."""
    probe = 1e-2
    _, stat = _statistic(probe, spec)
    equivalent = probe / stat
    three, s3 = _statistic(3 * equivalent, spec)
    assert {"replay_drift", "replay_mean_bias"} & three, (equivalent, s3)
    third, s03 = _statistic(0.3 * equivalent, spec)
    assert not {"replay_drift", "replay_mean_bias"} & third, (equivalent, s03)
    assert 1.5 < s3 < 6 and s03 < 0.6, "the statistic should scale with log r"


def test_the_penalty_ignoring_trainer_under_test_is_diagnosed_by_its_class() -> None:
    spec = S(0.7, top_p=0.9, repetition_penalty=1.3)
    records, logits = penalised_records(spec)
    table = build_table(records, logits, spec)
    ys = [torch.tensor(r.completion_ids) for r in records]
    views = reference_views(logits, ys, spec, [r.kept_ids for r in records], [r.prompt_ids for r in records])
    wrong = views[frozenset({"ignores_penalty"})]
    assert not torch.equal(wrong, views[frozenset()])
    table.user, table.user_name = wrong, "mine"
    s = judged(records, logits, table, views=views)
    assert {"trainer_under_test_drift", "trainer_under_test_mean_bias"} & failed_gates(s)
    assert "ignores the repetition penalty" in s["trainer_under_test"]["diagnosis"]
    # and the correct trainer is diagnosed as matching
    table.user = views[frozenset()]
    ok = judged(records, logits, table, views=views)
    assert ok["trainer_under_test"]["diagnosis"] == "matches the sampler's processed log-probs"


def test_the_naive_bias_splits_into_log_s_and_the_penalty_term() -> None:
    """A trainer ignoring filters and penalties reads vllm + log S - penalty at every token."""
    spec = S(0.7, top_p=0.9, repetition_penalty=1.3)
    records, logits = penalised_records(spec)
    table = build_table(records, logits, spec)
    naive = torch.cat([torch.log_softmax(z / 0.7, -1).gather(1, torch.tensor(r.completion_ids).unsqueeze(1)).squeeze(1)
                       for r, z in zip(records, logits, strict=True)]).double()
    parts = table.vllm + table.log_s - table.penalty
    assert float((naive - parts).abs().max()) < 1e-5
    assert float(table.penalty.abs().mean()) > 1e-2 and float(table.log_s.abs().mean()) > 1e-2
    # report.json states both parts: log S and the penalty term (the records carry it per token)
    s = judged(records, logits, table)
    assert s["naive"]["penalty_term_mean"] == pytest.approx(float(table.penalty.mean()), abs=1e-9)
    assert s["log_s"]["mean"] == pytest.approx(float(table.log_s.mean()), abs=1e-9)
