"""Converters into records: TRL tensors, server answers, vLLM output containers (canned, no engine).

The real engine's outputs go through the same converter in tests/e2e/test_records_e2e.py; here the
containers are built by hand in the two shapes vLLM 0.32 hands out (``FlatLogprobs`` and
``list[dict[int, Logprob]]``), including a sampled token outside the top-K.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_server_parsing import payload, processed_topk3

from parity.analyze import analyze
from parity.core.spec import SamplingSpec
from parity.engines.vllm_server.records import from_server_responses
from parity.records.convert import from_request_outputs, from_trl
from parity.records.schema import RecordsError
from parity.records.validate import validate_batch
from parity.records.write import write_records

LN = math.log


# -- TRL ------------------------------------------------------------------------------------------


def trl_batch(b: int = 3, width: int = 5, k: int = 4, seed: int = 0):
    """Tensors shaped as GRPOTrainer's: left-padded prompts, right-padded completions, a kept set [B, L, K]."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, width, 16, generator=g)
    kept = torch.topk(z, k, dim=-1).indices  # top_k=k: the kept set is the k largest logits
    kept_lp = torch.log_softmax(z.gather(2, kept), dim=-1)
    pick = torch.randint(0, k, (b, width), generator=g)
    ids = kept.gather(2, pick.unsqueeze(2)).squeeze(2)
    sampled = kept_lp.gather(2, pick.unsqueeze(2)).squeeze(2)
    full = torch.log_softmax(z, dim=-1).gather(2, ids.unsqueeze(2)).squeeze(2)
    mask = torch.ones(b, width, dtype=torch.long)
    mask[1, 3:] = 0  # an early EOS
    ids = ids.masked_fill(mask == 0, 0)  # TRL pads with the pad token
    prompt_ids = torch.tensor([[0, 0, 7, 8], [0, 9, 10, 11], [12, 13, 14, 15]])
    prompt_mask = (prompt_ids != 0).long()
    return dict(completion_ids=ids, completion_mask=mask, old_per_token_logps=full, sampling_per_token_logps=sampled,
                prompt_ids=prompt_ids, prompt_mask=prompt_mask, kept_ids=kept, kept_logprobs=kept_lp,
                kept_logits=z.gather(2, kept)), SamplingSpec(temperature=1.0, top_k=k)


def test_trl_tensors_become_records(tmp_path: Path) -> None:
    t, spec = trl_batch()
    table = from_trl(**t, spec=spec, step=7)
    b = validate_batch(table)
    assert b.completion.lengths.tolist() == [5, 3, 5]  # the mask cut row 1
    assert [b.prompt.row(i).tolist() for i in range(3)] == [[7, 8], [9, 10, 11], [12, 13, 14, 15]]
    assert b.step.tolist() == [7, 7, 7]
    assert b.kept_token_offsets[-1] == 4 * 13
    # TRL's tensors carry no per-token rounding bound: the trainer under test's drift is measured and
    # its gates are listed as not evaluated, with the input they lack.
    (sc,) = analyze(write_records(tmp_path / "trl.parquet", table))["scenarios"]
    reasons = {g["gate"]: g["reason"] for g in sc["not_evaluated"]}
    assert "trainer_bound" in reasons["trainer_under_test_drift"] and "trainer_under_test_drift" not in sc["gates_evaluated"]
    assert sc["trainer_under_test"]["max_abs_diff"] > 0.01 and "replay_support" in sc["gates_evaluated"]
    table = from_trl(**t, spec=spec, trainer_column="trainer_full_logprobs")
    (sc,) = analyze(write_records(tmp_path / "trl_full.parquet", table))["scenarios"]
    assert sc["log_s"]["mean"] < -0.01  # log S from the kept logits and the full values
    assert sc["naive"]["max_abs_gap_to_log_s"] <= 1e-5
    assert sc["replay"]["max_abs_diff"] <= 1e-5 and sc["verdict"] == "pass"


def test_trl_bad_tensors_are_refused() -> None:
    t, spec = trl_batch()
    holed = dict(t, completion_mask=t["completion_mask"].clone())
    holed["completion_mask"][0, 2] = 0
    with pytest.raises(RecordsError, match="completion_mask row 0: the mask has a hole at position 2"):
        from_trl(**holed, spec=spec)
    nan = dict(t, sampling_per_token_logps=t["sampling_per_token_logps"].clone())
    nan["sampling_per_token_logps"][2, 1] = float("nan")
    with pytest.raises(RecordsError, match="sampling_per_token_logps is NaN at sequence 2 position 1"):
        from_trl(**nan, spec=spec)
    # NaN after the mask is padding, not data.
    pad = dict(t, sampling_per_token_logps=t["sampling_per_token_logps"].clone())
    pad["sampling_per_token_logps"][1, 4] = float("nan")
    from_trl(**pad, spec=spec)
    with pytest.raises(RecordsError, match=r"old_per_token_logps has shape \(3, 4\)"):
        from_trl(**dict(t, old_per_token_logps=t["old_per_token_logps"][:, :4]), spec=spec)
    with pytest.raises(ValueError, match="trainer_column='trainer_recompute_logprobs' is invalid"):
        from_trl(**t, spec=spec, trainer_column="trainer_recompute_logprobs")


# -- the OpenAI-compatible server ---------------------------------------------------------------------


def test_server_answers_become_records() -> None:
    spec = SamplingSpec(temperature=1.0, top_k=2)
    table = from_server_responses([processed_topk3()], [[1, 2, 3]], spec, requested=3, vocab_size=8, max_tokens=2, seeds=[5])
    b = validate_batch(table)
    assert b.completion.values.tolist() == [4, 1]
    kept = [sorted(b.kept.values[b.kept_token_offsets[t] : b.kept_token_offsets[t + 1]].tolist()) for t in range(2)]
    assert kept == [[1, 4], [1, 5]]  # the -9999.0 entries are off the support
    assert b.seed.tolist() == [5] and not b.kept_incomplete.any()
    # Unfiltered: no kept set is recorded (S_q is the vocabulary).
    plain = from_server_responses([processed_topk3()], [[1]], SamplingSpec(), requested=3, vocab_size=8, max_tokens=2)
    assert validate_batch(plain).kept is None


def test_server_answer_with_a_full_head_is_flagged_incomplete() -> None:
    d = payload([2], [LN(0.2)], [[(2, LN(0.2)), (5, LN(0.5)), (3, LN(0.3))]])  # K=2, all finite, sampled outside
    b = validate_batch(from_server_responses([d], [[1]], SamplingSpec(top_p=0.9), requested=2, vocab_size=8, max_tokens=1))
    assert b.kept_incomplete.tolist() == [True]


# -- vLLM's output containers ---------------------------------------------------------------------------


def lp(v, rank):
    return SimpleNamespace(logprob=v, rank=rank, decoded_token=None)


def outputs(flat: bool):
    """Two positions, top-2 under top_k=2 with logprobs=3: position 1's sampled token (6) is outside the top-3."""
    heads = [
        (4, LN(0.7), 1, [(4, LN(0.7)), (1, LN(0.3)), (0, -math.inf)]),
        (6, -math.inf, 5, [(1, LN(0.4)), (5, LN(0.6)), (3, -math.inf)]),
    ]
    if flat:
        c = SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[])
        for y, v, _, head in heads:
            c.start_indices.append(len(c.token_ids))
            c.token_ids += [y] + [i for i, _ in head]
            c.logprobs += [v] + [x for _, x in head]
            c.end_indices.append(len(c.token_ids))
        container = FlatLike(c)
    else:
        container = []
        for y, v, rank, head in heads:
            d = {y: lp(v, rank)}
            for r, (i, x) in enumerate(head, start=1):
                d[i] = lp(x, r)
            container.append(d)
    comp = SimpleNamespace(token_ids=[4, 6], logprobs=container)
    return [SimpleNamespace(request_id="r0", prompt_token_ids=[1, 2], outputs=[comp])]


class FlatLike:
    """The attributes of vllm.logprobs.FlatLogprobs the converter reads."""

    def __init__(self, c):
        self.__dict__.update(c.__dict__)

    def __len__(self):
        return len(self.start_indices)


@pytest.mark.parametrize("flat", [True, False], ids=["FlatLogprobs", "dict"])
def test_request_outputs_become_records(flat: bool) -> None:
    params = SimpleNamespace(temperature=1.0, top_k=2, top_p=1.0, min_p=0.0, logprobs=3, seed=11)
    b = validate_batch(from_request_outputs(outputs(flat), params))
    assert b.completion.values.tolist() == [4, 6]
    assert b.sampler_logprobs[1] == -math.inf  # a sampled token off the support: an engine fault, kept as data
    kept = [sorted(b.kept.values[b.kept_token_offsets[t] : b.kept_token_offsets[t + 1]].tolist()) for t in range(2)]
    assert kept == [[1, 4], [1, 5]]
    assert b.prompt.row(0).tolist() == [1, 2] and b.seed.tolist() == [11]


def test_request_outputs_without_log_probs_are_refused() -> None:
    out = [SimpleNamespace(request_id="r0", prompt_token_ids=[1], outputs=[SimpleNamespace(token_ids=[4], logprobs=None)])]
    params = SimpleNamespace(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, logprobs=None, seed=None)
    with pytest.raises(RecordsError, match=r"log-probs for 0 of 1 tokens: allowed SamplingParams\(logprobs=K >= 0\)"):
        from_request_outputs(out, params)
