"""Adaptive capture on the real CPU engine, tiny vocabulary: widened heads give the full-vocabulary kept sets.

qwen2-tiny (V=400) is read whole by default (a vocabulary that small costs nothing to read), so the
start head is forced to 4 here. On the head route (the sampler-row hook off, as on a server) every
sequence is widened, round by round; with the hook, the kept sets a head of 4 cannot prove come from
the sampler's rows in one generation. Either way they must equal those of a full-vocabulary capture of
the same seeds, bit for bit. One engine for the module.
"""

from __future__ import annotations

import pytest
import torch

from parity.core.spec import SamplingSpec
from parity.engines.session import make_prompts
from parity.fixtures import resolve_model

pytestmark = pytest.mark.e2e

SPECS = (SamplingSpec(1.0, top_p=0.9), SamplingSpec(0.7, min_p=0.1),
         # Penalties move the logits before the filters: the processed log-probs carry them, and capture is unchanged.
         SamplingSpec(1.0, top_p=0.9, repetition_penalty=1.3),
         SamplingSpec(0.7, min_p=0.1, presence_penalty=0.5, frequency_penalty=0.5))


@pytest.fixture(scope="module")
def tiny():
    from parity.engines.vllm_offline import VllmRollout

    r = VllmRollout(resolve_model("qwen2-tiny"))
    yield r
    r.close()


def _same_as_full(got, full) -> None:
    for a, b in zip(got, full, strict=True):
        assert a.completion_ids == b.completion_ids and torch.equal(a.logprobs, b.logprobs)
        assert int(a.incomplete.sum()) == 0
        w = a.kept_ids.shape[1]
        assert torch.equal(a.kept_ids, b.kept_ids[:, :w]) and bool((b.kept_ids[:, w:] == -1).all())
        assert torch.equal(a.kept_logprobs, b.kept_logprobs[:, :w])


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_widened_kept_sets_equal_the_full_vocabulary_capture(tiny, spec) -> None:
    prompts = make_prompts(tiny.tokenizer(), 4)
    tiny.start_head, tiny.rows.active = 4, False
    try:
        got = tiny.generate(prompts, spec, max_tokens=8, seed=3)
        stats = tiny.last_capture
    finally:
        tiny.start_head, tiny.rows.active = None, True
    full = tiny.generate(prompts, spec, max_tokens=8, seed=3, logprobs=-1)
    assert stats.adaptive and stats.logprobs == 4 and stats.rounds >= 1 and stats.widened_sequences >= 1
    assert stats.incomplete_positions == 0 and stats.resampled_differently == 0 and stats.row_positions == 0
    assert all(k == -1 or k > 4 for a in stats.asks for k in [a["head"]])
    _same_as_full(got, full)
    assert stats.largest_support == max(int((r.kept_ids >= 0).sum(-1).max()) for r in full)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_sampler_rows_equal_the_full_vocabulary_capture(tiny, spec) -> None:
    """The hook's kept sets, where a head of 4 proves nothing wider than 3 tokens: one generation, no
    widening, every wide position from the sampler's row, bit for bit the full-vocabulary capture's."""
    prompts = make_prompts(tiny.tokenizer(), 4)
    assert tiny.rows.active, tiny.rows.reason
    forced = tiny.generate(prompts, spec, max_tokens=8, seed=3, logprobs=4)  # a forced head reads no rows
    assert tiny.last_capture.row_positions == 0 and any(bool(r.incomplete.any()) for r in forced)
    from vllm.inputs import TokensPrompt

    from parity.core.capture import CapturePlan
    from parity.engines.vllm_offline import capture_outputs, sampling_params

    params = [sampling_params(spec, max_tokens=8, seed=3 + i, detokenize=False, flat_logprobs=True, ignore_eos=True)
              for i in range(len(prompts))]
    plan = CapturePlan(4, "head of 4, rows beyond it", max_head=4)  # a cap of 4: no widening round can help
    tiny.rows.cap = None
    tiny.rows.install()
    res = capture_outputs(lambda ps, qs: tiny.llm.generate(ps, qs, use_tqdm=False),
                          [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, plan, spec=spec,
                          vocab_size=tiny.vocab_size, rows=tiny.rows)
    got = tiny.records(prompts, spec, 3, res)
    stats = res.stats
    assert stats.rounds == 0 and stats.incomplete_positions == 0 and stats.row_mismatched == 0
    assert stats.unproven_positions == 0 and stats.row_positions > 0
    _same_as_full(got, tiny.generate(prompts, spec, max_tokens=8, seed=3, logprobs=-1))


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
    from parity.records.validate import validate_batch

    history = CaptureHistory()
    prompts = ["Numbers: 1, 2, 3", "A kept set is", "In reinforcement learning"]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=6)
    outputs, used, stats = generate_with_capture(tiny.llm, prompts, params, history=history, start=4, timeout_s=300)
    # What a head of 4 cannot prove comes from the sampler's rows, in the same generation.
    assert stats.adaptive and stats.logprobs == 4 and stats.incomplete_positions == 0
    assert stats.row_positions >= 1 and stats.rounds == 0
    # The hook stays on the engine, but a generate call of your own afterwards leaves no rows behind.
    tiny.llm.generate(prompts, SamplingParams(temperature=1.0, top_p=0.99, max_tokens=4, logprobs=2, seed=1),
                      use_tqdm=False)
    assert tiny.rows.take() == {}
    assert history.start(SamplingSpec(0.8, top_p=0.9)) is not None  # the next call starts from what this one needed
    assert [p.seed for p in used] == sorted({p.seed for p in used})  # a seed of its own per prompt
    batch = validate_batch(from_request_outputs(outputs, used, vocab_size=tiny.vocab_size))
    assert not bool(batch.kept_incomplete.any())


def test_penalised_kept_sets_are_the_penalised_filters(tiny) -> None:
    """The captured S_q of a penalised request is the reference pipeline's kept set on the trainer's logits with
    the penalty applied from each position's own history (bit for bit away from float32 boundary drift), and the
    penalty did change it: the same pipeline without the penalty keeps other sets at some positions."""
    from parity.core.error_model import logprob_bound
    from parity.core.estimators import ids_to_mask
    from parity.core.filters import reference_filter
    from parity.core.metrics import boundary_only
    from parity.core.penalties import penalise_sequence
    from parity.engines.transformers_trainer import TransformersTrainer

    spec = SamplingSpec(1.0, top_p=0.9, repetition_penalty=1.5, frequency_penalty=0.3)
    prompts = make_prompts(tiny.tokenizer(), 4)
    got = tiny.generate(prompts, spec, max_tokens=12, seed=5, logprobs=-1)
    logits = TransformersTrainer(resolve_model("qwen2-tiny")).logits(got)
    equal = differs_unpenalised = positions = 0
    for r, z in zip(got, logits, strict=True):
        zp = penalise_sequence(z, spec, r.prompt_ids, r.completion_ids)
        bare = spec.without_penalties()
        want = reference_filter(zp, bare).kept
        q = ids_to_mask(r.kept_ids, z.shape[-1])
        same = (want == q).all(dim=-1)
        # A set that differs only at the cutoff, within the two engines' logit drift, is the same filter.
        zs = zp / spec.temperature
        bound = logprob_bound(zs, torch.tensor(r.completion_ids), q, dtype="float32")
        same |= boundary_only(want, q, zs, bound)
        equal += int(same.sum())
        differs_unpenalised += int((reference_filter(z, bare).kept != q).any(dim=-1).sum())
        positions += r.length
    assert equal == positions, f"{positions - equal} of {positions} captured kept sets are not the penalised filters'"
    assert differs_unpenalised >= 1, "the penalty should change the kept set somewhere"
