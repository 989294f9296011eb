"""The adaptive capture plan without an engine: start heads, the sentinel proof, widening, the cap, history.

A fake engine holds, per sequence, the processed log-prob rows the sampler would produce (the reference
filters of parity.core.filters on fixed logits) and answers an ask with ``torch.topk`` of them, sorted
descending as vLLM's ``Sampler.gather_logprobs`` is. Its draws are fixed per sequence (the same seed
gives the same tokens) unless a test makes one come back different.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from parity.core.capture import (
    FULL_VOCAB,
    MASS_SLACK,
    NEG_INF,
    CaptureHistory,
    CapturePlan,
    CaptureStats,
    Heads,
    plan_capture,
    run_capture,
    start_head,
    support_from_heads,
    support_lower_bound,
)
from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec

S = SamplingSpec


def processed(z: torch.Tensor, spec: SamplingSpec) -> torch.Tensor:
    """What vLLM returns under processed_logprobs: log_softmax over the kept set, -inf elsewhere."""
    kept = reference_filter(z, spec).kept
    return torch.log_softmax((z / spec.temperature).masked_fill(~kept, NEG_INF), dim=-1)


class FakeEngine:
    """Sequences of fixed processed rows; ``ask`` returns their top-K heads and logs every call."""

    def __init__(self, rows: list[torch.Tensor], tokens: list[list[int]] | None = None) -> None:
        self.rows = rows
        self.tokens = tokens or [[int(r[t].argmax()) for t in range(r.shape[0])] for r in rows]
        self.calls: list[tuple[list[int], list[int]]] = []
        self.redraw: dict[int, list[int]] = {}  # sequence -> tokens its next draw returns instead

    def ask(self, indices: list[int], heads: list[int]) -> list[Heads]:
        self.calls.append((list(indices), list(heads)))
        out = []
        for i, k in zip(indices, heads, strict=True):
            p = self.rows[i]
            v = p.shape[1]
            toks = self.redraw.pop(i, self.tokens[i])
            sampled = [float(p[t, y]) for t, y in enumerate(toks)]
            if k == 0:
                out.append(Heads(list(toks), sampled, [[] for _ in toks], [[] for _ in toks]))
                continue
            vals, ids = torch.topk(p, v if k == FULL_VOCAB else k, dim=-1)
            out.append(Heads(list(toks), sampled, ids.tolist(), vals.tolist()))
        return out


def rows_for(spec: SamplingSpec, scales: list[float], *, length: int = 4, vocab: int = 2000, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [processed(torch.randn(length, vocab, generator=g) * s, spec) for s in scales]


def sizes(rows: list[torch.Tensor]) -> list[list[int]]:
    return [(r > NEG_INF).sum(-1).tolist() for r in rows]


# -- start heads and plans ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "start"),
    [
        (S(1.0, top_p=0.9), 4096),
        (S(1.3, top_p=0.95), 4096),
        (S(0.7, top_p=0.9), 1024),
        (S(1.0, top_p=0.5), 64),
        (S(0.7, top_p=0.05), 64),
        (S(1.0, min_p=0.1), 64),  # 4 / 0.1 = 40 -> 64
        (S(0.7, min_p=0.05), 128),  # 80 -> 128
        (S(1.0, min_p=0.5), 16),  # 8 -> the floor of 16
        (S(0.7, top_p=0.9, min_p=0.1), 64),  # both: the smaller
        (S(1.0, top_k=1_000_000, top_p=0.9), 4096),  # top_k >= V is no cap
    ],
)
def test_start_head_from_the_spec(spec: SamplingSpec, start: int) -> None:
    assert start_head(spec) == start


def test_adaptive_plans_are_capped_and_small_vocabularies_read_whole() -> None:
    p = plan_capture(S(1.0, top_p=0.9), 49152)
    assert (p.logprobs, p.max_head, p.adaptive) == (4096, 4096, True)
    p = plan_capture(S(0.7, top_p=0.9), 49152)
    assert (p.logprobs, p.max_head) == (1024, 4096)
    p = plan_capture(S(0.7, top_p=0.9), 49152, max_head=65536)  # the cap reaches the vocabulary
    assert (p.logprobs, p.max_head) == (1024, FULL_VOCAB)
    p = plan_capture(S(0.7, min_p=0.1), 400)  # V <= 1024: the whole row at once
    assert (p.logprobs, p.max_head) == (FULL_VOCAB, FULL_VOCAB)
    p = plan_capture(S(0.7, min_p=0.1), 400, start=8)  # unless the start is forced
    assert (p.logprobs, p.max_head) == (8, FULL_VOCAB)
    p = plan_capture(S(0.7, min_p=0.1), 49152, suggested=300)
    assert p.logprobs == 300
    p = plan_capture(S(0.7, min_p=0.1), 49152, suggested=9000)  # a suggestion above the cap: the cap
    assert p.logprobs == 4096
    assert not plan_capture(S(1.0, top_k=20), 49152).adaptive
    assert not plan_capture(S(1.0, top_p=0.9), 49152, head=64).adaptive  # forced: never widened


# -- the sentinel proof and the lower bound ----------------------------------------------------


def test_a_head_ending_in_minus_inf_proves_the_position() -> None:
    spec = S(1.0, top_p=0.9)
    eng = FakeEngine(rows_for(spec, [4.0], length=3))
    need = max(sizes(eng.rows)[0])
    res = run_capture(CapturePlan(need + 1, "", max_head=1000), 1, eng.ask, vocab_size=2000)
    assert res.stats.incomplete_positions == 0 and res.stats.rounds == 0 and len(eng.calls) == 1
    eng = FakeEngine(rows_for(spec, [4.0], length=3))
    res = run_capture(CapturePlan(need, "", max_head=need), 1, eng.ask, vocab_size=2000)
    # K = |S_q| at the widest position: all K finite, nothing shows the support ends there.
    assert res.stats.incomplete_positions >= 1 and res.stats.largest_support < need


def test_lower_bound_from_the_missing_mass() -> None:
    assert support_lower_bound([]) == 0
    # A complete distribution (mass 1) needs nothing beyond the head.
    full = torch.tensor([0.5, 0.3, 0.2]).log().tolist()
    assert support_lower_bound(full) == 3
    # Half the mass in the head, the smallest entry 0.1: at least 0.5 / 0.1 more tokens (minus the slack).
    half = torch.tensor([0.2, 0.2, 0.1], dtype=torch.float64).log().tolist()
    assert support_lower_bound(half) == 3 + math.ceil((0.5 - MASS_SLACK) / 0.1)
    # Never above the truth on a real processed row.
    spec = S(1.0, top_p=0.95)
    row = rows_for(spec, [0.5], length=1)[0][0]
    n = int((row > NEG_INF).sum())
    for k in (4, 16, 64, 256):
        head = torch.topk(row, k).values.tolist()
        assert support_lower_bound(head) <= n


# -- widening ----------------------------------------------------------------------------------


def test_widening_asks_only_unproven_sequences_with_growing_heads_and_matches_the_full_capture() -> None:
    spec = S(1.0, top_p=0.9)
    eng = FakeEngine(rows_for(spec, [6.0, 3.0, 1.5, 8.0], length=5))
    widest = [max(s) for s in sizes(eng.rows)]
    plan = CapturePlan(16, "", max_head=FULL_VOCAB)
    res = run_capture(plan, 4, eng.ask, vocab_size=2000)
    assert eng.calls[0] == ([0, 1, 2, 3], [16, 16, 16, 16])
    for idx, _ in eng.calls[1:]:
        assert all(widest[i] + 1 > 16 for i in idx)  # only sequences the first heads did not prove
    for i in range(4):
        asked = [k for idx, ks in eng.calls for j, k in zip(idx, ks, strict=True) if j == i]
        assert all(b >= 4 * a or b == FULL_VOCAB for a, b in zip(asked, asked[1:], strict=False))  # x4 at least
    assert res.stats.incomplete_positions == 0 and res.stats.resampled_differently == 0
    assert res.stats.largest_support == max(widest)
    assert res.stats.widened_sequences == sum(w + 1 > 16 for w in widest)
    # The kept sets are exactly those of a full-vocabulary capture.
    for i, (h, k) in enumerate(zip(res.heads, res.requested, strict=True)):
        cap = support_from_heads(h.completion_ids, h.head_ids, h.head_logprobs, requested=k, vocab_size=2000)
        full = FakeEngine(eng.rows).ask([i], [FULL_VOCAB])[0]
        ref = support_from_heads(full.completion_ids, full.head_ids, full.head_logprobs, requested=FULL_VOCAB,
                                 vocab_size=2000)
        assert torch.equal(cap.kept_ids, ref.kept_ids) and torch.equal(cap.kept_logprobs, ref.kept_logprobs)
        assert not bool(cap.incomplete.any())


def test_a_flat_tail_skips_ahead_to_what_the_missing_mass_needs() -> None:
    spec = S(1.0, top_p=0.9)
    eng = FakeEngine(rows_for(spec, [0.3], length=2))  # near-flat: the nucleus is most of the 2000 tokens
    res = run_capture(CapturePlan(16, "", max_head=FULL_VOCAB), 1, eng.ask, vocab_size=2000)
    assert eng.calls[1][1][0] > 16 * 4  # not 64: the bound shows hundreds are missing
    assert res.stats.incomplete_positions == 0 and res.stats.rounds <= 2


def test_the_cap_stops_widening_and_counts_what_is_left() -> None:
    spec = S(1.0, top_p=0.999999)
    eng = FakeEngine(rows_for(spec, [0.01, 5.0], length=3))  # sequence 0: a flat row, the nucleus is ~V
    plan = CapturePlan(16, "", max_head=256)
    res = run_capture(plan, 2, eng.ask, vocab_size=2000)
    assert all(k <= 256 for _, ks in eng.calls for k in ks)  # never past the cap: memory stays bounded
    assert 0 not in [i for idx, _ in eng.calls[1:] for i in idx]  # the flat one is not asked again at all
    st = res.stats
    assert st.incomplete_positions >= 3 and st.beyond_cap_positions >= 3
    assert st.widest_head <= 256 and st.max_head == 256


def test_a_bad_spec_on_a_real_vocabulary_is_capped_not_read_whole() -> None:
    """top_p=0.999999 on a flat 49,152-token row: one generation at most at the cap, counted."""
    vocab = 49152
    spec = S(1.0, top_p=0.999999)
    plan = plan_capture(spec, vocab)
    assert plan.logprobs == plan.max_head == 4096
    eng = FakeEngine([processed(torch.zeros(2, vocab), spec)])
    res = run_capture(plan, 1, eng.ask, vocab_size=vocab)
    assert eng.calls == [([0], [4096])]
    assert res.stats.incomplete_positions == 2 == res.stats.beyond_cap_positions
    assert "incomplete at the cap 2 (2 beyond it)" in res.stats.summary()


def test_a_resample_that_comes_back_different_is_counted_and_never_mixed() -> None:
    spec = S(1.0, top_p=0.9)
    rows = rows_for(spec, [4.0, 4.0], length=3)
    eng = FakeEngine(rows)
    first = [list(t) for t in eng.tokens]
    eng.redraw = {}
    calls = []

    def ask(indices: list[int], heads: list[int]) -> list[Heads]:
        calls.append(list(indices))
        if len(calls) == 2:  # the second draw of sequence 0 differs
            eng.redraw[0] = [t + 1 for t in first[0]]
        return eng.ask(indices, heads)

    res = run_capture(CapturePlan(4, "", max_head=FULL_VOCAB), 2, ask, vocab_size=2000)
    assert res.stats.resampled_differently == 1 and res.stats.resampled_prompts == [0]
    assert res.heads[0].completion_ids == first[0] and res.requested[0] == 4  # the first capture is kept
    assert all(0 not in c for c in calls[2:])  # and not asked again
    assert res.stats.incomplete_positions >= 1


def test_kept_sets_that_differ_between_two_proven_draws_are_counted() -> None:
    spec = S(1.0, top_p=0.9)
    rows = rows_for(spec, [2.0], length=3)
    eng = FakeEngine(rows)
    n0 = sizes(rows)[0]
    # Position 0 proven by the first head; position 1 not: the sequence is asked again, and its second draw
    # keeps one token fewer at position 0.
    small, big = min(n0), max(n0)
    assert small < big
    changed = rows[0].clone()
    t0 = n0.index(small)
    worst = int(changed[t0].masked_fill(changed[t0] == NEG_INF, float("inf")).argmin())
    changed[t0, worst] = NEG_INF

    def ask(indices: list[int], heads: list[int]) -> list[Heads]:
        if eng.calls:
            eng.rows = [changed]
        return eng.ask(indices, heads)

    res = run_capture(CapturePlan(small + 1, "", max_head=FULL_VOCAB), 1, ask, vocab_size=2000)
    assert res.stats.support_changed_positions == 1 and res.stats.resampled_differently == 0


def test_fixed_plans_ask_once_and_count_unproven_positions() -> None:
    spec = S(1.0, top_k=5)
    eng = FakeEngine(rows_for(spec, [3.0, 3.0], length=4))
    res = run_capture(CapturePlan(5, "top_k=5"), 2, eng.ask, vocab_size=2000)
    assert len(eng.calls) == 1 and res.stats.rounds == 0 and not res.stats.adaptive
    assert res.stats.incomplete_positions == 8  # K = top_k: every head is full of finite values
    res = run_capture(CapturePlan(None, "none"), 2, FakeEngine(eng.rows).ask, vocab_size=2000)
    assert res.requested == [0, 0] and res.stats.positions == 8 and res.stats.incomplete_positions == 0
    assert run_capture(CapturePlan(5, ""), 0, eng.ask, vocab_size=2000).heads == []


def test_an_engine_that_returns_too_few_sequences_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="asked for 2 sequences and got 1"):
        run_capture(CapturePlan(5, ""), 2, lambda idx, ks: FakeEngine(rows_for(S(top_p=0.9), [1.0])).ask([0], [5]),
                    vocab_size=2000)


def test_stats_round_trip_and_summary() -> None:
    st = CaptureStats(1024, "why", adaptive=True, max_head=4096, sequences=8, widened_sequences=2, widened_positions=3,
                      rounds=1, largest_support=2827, incomplete_positions=0)
    assert CaptureStats.from_dict(st.to_dict()) == st
    assert st.summary() == ("capture: adaptive, start K=1024, cap 4096; widened 2/8 sequences (3 positions) in 1 "
                            "round(s); largest |S_q| 2827; incomplete at the cap 0")
    assert CaptureStats(36, "top_k=20 + 16").summary() == "capture: top_k=20 + 16"


# -- history -----------------------------------------------------------------------------------


def test_history_suggests_the_widest_need_of_the_same_or_a_stricter_spec() -> None:
    h = CaptureHistory()
    assert h.start(S(1.0, top_p=0.9)) is None
    h.record(S(1.0, top_p=0.9), [30, 700, 90])
    assert h.start(S(1.0, top_p=0.9)) == 1024  # the same spec: its own widest need, a power of two
    # Looser (hotter, wider top_p): at least the stricter one's need, and at least its own spec start.
    assert h.start(S(1.3, top_p=0.95)) == 4096
    assert h.start(S(1.0, top_p=0.95, min_p=0.0)) == 4096
    # Not comparable or stricter: nothing to go on.
    assert h.start(S(0.7, top_p=0.9)) is None
    assert h.start(S(1.0, min_p=0.1)) is None
    h.record(S(1.0, min_p=0.1), [9, 12])
    assert h.start(S(1.0, min_p=0.1)) == 16  # the floor
    assert h.start(S(1.3, min_p=0.05)) == max(start_head(S(1.3, min_p=0.05)), 16)
    h.record(S(1.0, top_p=0.9), [])  # nothing new: the last need stays
    assert h.start(S(1.0, top_p=0.9)) == 1024


def test_run_capture_records_per_sequence_needs_into_the_history() -> None:
    spec = S(1.0, top_p=0.9)
    eng = FakeEngine(rows_for(spec, [6.0, 3.0], length=3))
    h = CaptureHistory()
    run_capture(CapturePlan(8, "", max_head=FULL_VOCAB), 2, eng.ask, vocab_size=2000, spec=spec, history=h)
    need = max(max(s) for s in sizes(eng.rows)) + 1
    assert h.start(spec) == max(16, 1 << (need - 1).bit_length())


# -- the dense support path --------------------------------------------------------------------


def test_dense_and_per_position_support_agree_with_ties_in_any_order() -> None:
    rng = random.Random(3)
    for _ in range(50):
        n, k = rng.randint(1, 5), rng.randint(1, 6)
        heads, vals, sampled = [], [], []
        for _ in range(n):
            ids = rng.sample(range(20), k)
            v = sorted((rng.choice([-0.5, -1.0, -1.0, -2.0, NEG_INF]) for _ in range(k)), reverse=True)
            heads.append(ids)
            vals.append(v)
            sampled.append(rng.choice(ids + [19]))
        dense = support_from_heads(sampled, heads, vals, requested=k, vocab_size=20)
        # The per-position loop runs for ragged heads: pad one extra dropped entry onto the first position.
        ragged = support_from_heads(sampled, [heads[0] + [99]] + heads[1:], [vals[0] + [NEG_INF]] + vals[1:],
                                    requested=k, vocab_size=20)
        w = dense.kept_ids.shape[1]
        assert torch.equal(dense.kept_ids, ragged.kept_ids[:, :w]) and (ragged.kept_ids[:, w:] == -1).all()
        assert torch.equal(dense.kept_logprobs, ragged.kept_logprobs[:, :w])
        assert torch.equal(dense.sampled_missing, ragged.sampled_missing)
        assert torch.equal(dense.incomplete[1:], ragged.incomplete[1:])
        # The order: value descending, then id ascending, whatever the head's order among ties.
        for row_ids, row_lps in zip(dense.kept_ids.tolist(), dense.kept_logprobs.tolist(), strict=True):
            pairs = [(i, v) for i, v in zip(row_ids, row_lps, strict=True) if i >= 0]
            assert pairs == sorted(pairs, key=lambda iv: (-iv[1], iv[0]))


# -- records from a server: request_with_capture and per-answer heads ----------------------------


def test_request_with_capture_widens_through_your_client_and_the_records_prove_every_position() -> None:
    from parity.engines.vllm_server.records import from_server_responses, request_with_capture
    from parity.records.validate import validate_batch

    vocab, spec = 2000, S(1.0, top_p=0.9)
    rows = rows_for(spec, [3.0, 0.8], length=3, vocab=vocab)
    tokens = [[int(r[t].argmax()) for t in range(3)] for r in rows]

    def answer(body: dict) -> dict:
        i, k = body["seed"] - 100, body["logprobs"]
        r = rows[i]
        vals, ids = torch.topk(r, vocab if k == FULL_VOCAB else k, dim=-1)
        tops = []
        for t, y in enumerate(tokens[i]):
            entries = {f"token_id:{y}": float(r[t, y])}
            for j, v in zip(ids[t].tolist(), vals[t].tolist(), strict=True):
                entries.setdefault(f"token_id:{j}", max(v, -9999.0))
            tops.append(entries)
        lp = {"tokens": [f"token_id:{y}" for y in tokens[i]], "token_logprobs": [float(r[t, y]) for t, y in
                                                                               enumerate(tokens[i])], "top_logprobs": tops}
        return {"choices": [{"index": 0, "text": "", "logprobs": lp, "finish_reason": "length"}]}

    sent: list[list[int]] = []

    def send(bodies: list[dict]) -> list[dict]:
        sent.append([b["logprobs"] for b in bodies])
        return [answer(b) for b in bodies]

    bodies = [{"prompt": [1, 2], "seed": 100 + i, "n": 1, "max_tokens": 3} for i in range(2)]
    history = CaptureHistory()
    history.record(spec, [8])  # as if an earlier step needed 8: this one starts at 16 and widens
    answers, requested, stats = request_with_capture(send, bodies, spec, vocab_size=vocab, max_tokens=3, history=history)
    assert sent[0] == [16, 16] and len(sent) >= 2 and stats.widened_sequences >= 1
    assert all(k > 16 or k == FULL_VOCAB for k in requested)  # each answer carries the head it was asked with
    b = validate_batch(from_server_responses(answers, [[1, 2]] * 2, spec, requested=requested, vocab_size=vocab,
                                             max_tokens=3, seeds=[100, 101]))
    assert not bool(b.kept_incomplete.any()) and stats.incomplete_positions == 0
    n_kept = [int(b.kept_token_offsets[t + 1] - b.kept_token_offsets[t]) for t in range(6)]
    assert n_kept == [n for s in sizes(rows) for n in s]
    with pytest.raises(ValueError, match="body 0 has seed=None"):
        request_with_capture(send, [{"prompt": [1]}], spec, vocab_size=vocab, max_tokens=3)
    with pytest.raises(ValueError, match="1 answers, 1 prompts, 1 specs, 2 requested heads"):
        from_server_responses(answers[:1], [[1]], spec, requested=[16, 16], vocab_size=vocab, max_tokens=3)


def uniform_rows(sizes_per_position: list[int], vocab: int = 100) -> torch.Tensor:
    """Processed rows with exactly n kept tokens of probability 1/n each (the lower bound is then exact)."""
    out = torch.full((len(sizes_per_position), vocab), NEG_INF)
    for t, n in enumerate(sizes_per_position):
        out[t, (torch.arange(n) * 7 + t) % vocab] = math.log(1.0 / n)
    return out


def test_every_count_of_the_capture_pinned_on_known_supports() -> None:
    # Kept-set sizes per position; cap 64: sequence 2's first position (90 tokens) cannot be proven.
    eng = FakeEngine([uniform_rows([3, 10]), uniform_rows([40, 2]), uniform_rows([90, 5])])
    h = CaptureHistory()
    res = run_capture(CapturePlan(4, "why", max_head=64), 3, eng.ask, vocab_size=100, spec=S(1.0, top_p=0.99), history=h)
    assert eng.calls == [([0, 1, 2], [4, 4, 4]), ([0, 1, 2], [16, 64, 16])]
    assert res.requested == [16, 64, 16]
    assert res.stats.to_dict() == {
        "logprobs": 4, "reason": "why", "adaptive": True, "max_head": 64, "sequences": 3, "positions": 6,
        "rounds": 1, "asks": [{"sequences": 3, "head": 64}], "unproven_positions": 4, "widened_sequences": 3,
        "widened_positions": 4, "largest_support": 40, "widest_head": 64, "incomplete_positions": 1,
        "beyond_cap_positions": 1, "resampled_differently": 0, "resampled_prompts": [], "support_changed_positions": 0,
        "sampler_rows": "", "row_positions": 0, "row_mismatched": 0,
    }
    # The history keeps the widest need, 91 (the unproven position's bound + 1): the next start is 128.
    assert h.start(S(1.0, top_p=0.99)) == 128
    assert support_lower_bound(uniform_rows([90])[0].topk(16).values.tolist()) == 90


def test_a_nan_in_a_head_bounds_nothing_beyond_it() -> None:
    assert support_lower_bound([-0.5, float("nan"), -2.0]) == 3


def test_a_capture_head_cap_below_two_is_a_readable_error(capsys) -> None:
    from parity.cli.main import main

    assert main(["run", "--max-capture-head", "1"]) == 2
    assert "--max-capture-head=1 is invalid: allowed an integer >= 2" in capsys.readouterr().err


def test_a_scenario_can_widen_its_own_cap(tmp_path) -> None:
    """``max_capture_head`` per scenario (the real matrix's T=1.3 top_p=0.9 needs more than 4096)."""
    from parity.core.matrix import Scenario, load_matrix
    from parity.run import RunConfig, preflight

    toml = tmp_path / "m.toml"
    toml.write_text('[[scenario]]\nname = "wide"\ntop_k = 300\nmax_capture_head = 400\n')
    m = load_matrix(toml)
    assert m.scenarios[0].max_capture_head == 400
    preflight(m, RunConfig(model="qwen2-tiny", matrix=m, max_capture_head=128))  # its own cap: no refusal
    with pytest.raises(ValueError, match="max_capture_head=1 is invalid"):
        Scenario(name="x", spec=S(1.0, top_p=0.9), max_capture_head=1)
    real = {s.name: s for s in load_matrix("real").scenarios}
    assert real["T=1.3 top_p=0.9"].max_capture_head == 16384 and real["T=1 top_p=0.9"].max_capture_head is None


def test_a_vanishing_min_p_starts_at_a_finite_head() -> None:
    """min_p = 5e-324 (the smallest float) makes 4 / min_p infinite: the start head stays an integer."""
    from parity.core.capture import MIN_P_START_CAP, plan_capture, start_head
    from parity.core.spec import SamplingSpec

    tiny = SamplingSpec(1.0, min_p=5e-324)
    assert start_head(tiny) == MIN_P_START_CAP
    plan = plan_capture(tiny, 49_152, max_head=4096)
    assert plan.logprobs is not None and 2 <= plan.logprobs <= 4096
