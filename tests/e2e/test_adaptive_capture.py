"""Adaptive capture on the real CPU engine, tiny vocabulary: widened heads give the full-vocabulary kept sets.

qwen2-tiny (V=400) is read whole by default (a vocabulary that small costs nothing to read), so the
start head is forced to 4 here: every sequence is widened, round by round, and its kept sets must equal
those of a full-vocabulary capture of the same seeds, bit for bit. One engine for the module.
"""

from __future__ import annotations

import pytest
import torch

from parity.core.spec import SamplingSpec
from parity.engines.session import make_prompts
from parity.fixtures import resolve_model

pytestmark = pytest.mark.e2e

SPECS = (SamplingSpec(1.0, top_p=0.9), SamplingSpec(0.7, min_p=0.1))


@pytest.fixture(scope="module")
def tiny():
    from parity.engines.vllm_offline import VllmRollout

    r = VllmRollout(resolve_model("qwen2-tiny"))
    yield r
    r.close()


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_widened_kept_sets_equal_the_full_vocabulary_capture(tiny, spec) -> None:
    prompts = make_prompts(tiny.tokenizer(), 4)
    tiny.start_head = 4
    try:
        got = tiny.generate(prompts, spec, max_tokens=8, seed=3)
        stats = tiny.last_capture
    finally:
        tiny.start_head = None
    full = tiny.generate(prompts, spec, max_tokens=8, seed=3, logprobs=-1)
    assert stats.adaptive and stats.logprobs == 4 and stats.rounds >= 1 and stats.widened_sequences >= 1
    assert stats.incomplete_positions == 0 and stats.resampled_differently == 0
    assert all(k == -1 or k > 4 for a in stats.asks for k in [a["head"]])
    for a, b in zip(got, full, strict=True):
        assert a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)
        assert int(a.incomplete.sum()) == 0
        w = a.kept_ids.shape[1]
        assert torch.equal(a.kept_ids, b.kept_ids[:, :w]) and bool((b.kept_ids[:, w:] == -1).all())
        assert torch.equal(a.kept_logprobs, b.kept_logprobs[:, :w])
    assert stats.largest_support == max(int((r.kept_ids >= 0).sum(-1).max()) for r in full)


def test_default_plan_reads_a_small_vocabulary_whole(tiny) -> None:
    prompts = make_prompts(tiny.tokenizer(), 2)
    recs = tiny.generate(prompts, SPECS[0], max_tokens=4, seed=0)
    st = tiny.last_capture
    assert st.logprobs == -1 and st.rounds == 0 and st.incomplete_positions == 0
    assert all(int(r.incomplete.sum()) == 0 for r in recs)


def test_generate_with_capture_on_your_own_engine_and_the_converter(tiny) -> None:
    """The user-facing helper: the user's LLM and SamplingParams, parity's plan, records that prove S_q."""
    from vllm import SamplingParams

    from parity.core.capture import CaptureHistory
    from parity.engines.vllm_offline import generate_with_capture
    from parity.records.convert import from_request_outputs
    from parity.records.format import validate_batch

    history = CaptureHistory()
    prompts = ["Numbers: 1, 2, 3", "A kept set is", "In reinforcement learning"]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6)
    outputs, used, stats = generate_with_capture(tiny.llm, prompts, params, history=history, start=4, timeout_s=300)
    assert stats.adaptive and stats.logprobs == 4 and stats.widened_sequences >= 1 and stats.incomplete_positions == 0
    assert history.start(SamplingSpec(0.8, top_p=0.9)) is not None  # the next call starts from what this one needed
    assert [p.seed for p in used] == sorted({p.seed for p in used})  # a seed of its own per prompt
    batch = validate_batch(from_request_outputs(outputs, used, vocab_size=tiny.vocab_size))
    assert not bool(batch.kept_incomplete.any())
