"""Every fixture architecture loads in the real vLLM CPU engine and in transformers, and they agree.

One engine per fixture, shared by the tests of that fixture (module-scoped, parametrized: pytest
finishes one fixture's tests before it starts the next engine). The 32k-vocabulary family is loaded
once (llama-32k): the sweep variants differ from it only in the lm_head scale, which the fast tests
check in transformers.

The engine runs with ``logprobs_mode="raw_logits"`` so the values it returns are the lm_head outputs
themselves, comparable bitwise between tied tokens and numerically with transformers' logits.
"""

from __future__ import annotations

import gc
import itertools
import math

import pytest
import torch

from parity import fixtures as fx

pytestmark = pytest.mark.e2e

ENGINE_FIXTURES = ["qwen2-tiny", "qwen2-tiny-ties", "llama-tiny", "qwen3-tiny", "llama-32k"]
PROMPTS = [
    "The lighthouse keeper on the northern cape",
    "Bread needs four things: flour, water, salt and",
    "Numbers: 3, 7, 11, 42 and a question?",
]
SAMPLE_TEXT = "A river does not choose its course; it keeps the lowest path. Zebras café 1887!"
MAX_TOKENS = 8
# Above this vocabulary, ask for a top-K head instead of every logit (full-vocabulary capture of
# 32k tokens is slow on CPU, and these tests only need a few values per position).
FULL_VOCAB_LIMIT = 1024
HEAD_K = 20
# fp32 on both sides; measured max |vLLM - transformers| was ~5e-6 on these fixtures.
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module", params=ENGINE_FIXTURES)
def run(request):
    """Build the fixture, start one vLLM engine on it, generate once; shared by this fixture's tests."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM, SamplingParams

    name = request.param
    path = fx.resolve_model(name)
    meta = fx.fixture_metadata(path)
    k = -1 if meta["vocab_size"] <= FULL_VOCAB_LIMIT else HEAD_K
    llm = LLM(
        model=str(path),
        dtype="float32",
        seed=0,
        max_model_len=256,
        max_num_seqs=4,
        enforce_eager=True,
        logprobs_mode="raw_logits",
        max_logprobs=-1,
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=1234, logprobs=k, prompt_logprobs=k)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    hf_tok = AutoTokenizer.from_pretrained(path)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yield {
        "name": name,
        "path": path,
        "meta": meta,
        "llm": llm,
        "outputs": outputs,
        "hf_tok": hf_tok,
        "hf_model": hf_model,
        f"hf_model_{torch.float32}": hf_model,
    }
    # Drop the engine before the next fixture's engine starts (one engine at a time on 2 cores).
    # No distributed-state teardown: other tests in this process may hold their own engine.
    del llm, outputs
    gc.collect()


def _positions(output):
    """(row in the full sequence whose logits produced this entry, {token_id: logit}) per position.

    Prompt entries: prompt_logprobs[j] scores prompt token j from position j-1 (entry 0 is None).
    Generated entries: logprobs[j] scores generated token j from position len(prompt)+j-1.
    """
    n = len(output.prompt_token_ids)
    for j, entry in enumerate(output.prompt_logprobs or []):
        if entry is not None:
            yield j - 1, {tid: lp.logprob for tid, lp in entry.items()}
    for j, entry in enumerate(output.outputs[0].logprobs or []):
        yield n + j - 1, {tid: lp.logprob for tid, lp in entry.items()}


def _hf_logits(run, output, dtype=torch.float32):
    """transformers logits for the prompt + generated sequence, from a model loaded in ``dtype``."""
    from transformers import AutoModelForCausalLM

    key = f"hf_model_{dtype}"
    if key not in run:  # a separate load: casting the fp32 model down and back would round its weights
        run[key] = AutoModelForCausalLM.from_pretrained(run["path"], dtype=dtype).eval()
    ids = torch.tensor([list(output.prompt_token_ids) + list(output.outputs[0].token_ids)])
    with torch.no_grad():
        return run[key](input_ids=ids).logits[0]


def test_engine_generates(run):
    vocab = run["meta"]["vocab_size"]
    for out in run["outputs"]:
        ids = list(out.outputs[0].token_ids)
        assert 1 <= len(ids) <= MAX_TOKENS
        assert all(0 <= t < vocab for t in ids), ids
        assert isinstance(out.outputs[0].text, str)


def test_vocab_size_agrees(run):
    llm, meta = run["llm"], run["meta"]
    sizes = {
        "recipe": fx.load_recipe(run["name"]).vocab_size,
        "metadata": meta["vocab_size"],
        "vllm model": llm.llm_engine.model_config.get_vocab_size(),
        "vllm tokenizer": len(llm.get_tokenizer()),
        "transformers config": run["hf_model"].config.vocab_size,
        "transformers tokenizer": len(run["hf_tok"]),
        "transformers lm_head rows": run["hf_model"].lm_head.weight.shape[0],
    }
    assert len(set(sizes.values())) == 1, sizes


def test_tokenization_agrees(run):
    vllm_tok = run["llm"].get_tokenizer()
    hf_tok = run["hf_tok"]
    assert vllm_tok.encode(SAMPLE_TEXT) == hf_tok.encode(SAMPLE_TEXT)
    # What the engine actually fed the model is what the trainer tokenizer produces.
    for prompt, out in zip(PROMPTS, run["outputs"], strict=True):
        assert list(out.prompt_token_ids) == hf_tok.encode(prompt)
    assert hf_tok.decode(hf_tok.encode(SAMPLE_TEXT), skip_special_tokens=True) == SAMPLE_TEXT
    if fx.load_recipe(run["name"]).spec.add_bos:
        assert hf_tok.encode(SAMPLE_TEXT)[0] == hf_tok.bos_token_id


def test_logits_match_transformers(run):
    worst = 0.0
    checked = 0
    for out in run["outputs"]:
        hf = _hf_logits(run, out)
        for row, values in _positions(out):
            for tid, logit in values.items():
                worst = max(worst, abs(logit - hf[row, tid].item()))
                checked += 1
    assert checked > 0
    assert worst <= LOGIT_ATOL, f"max |vLLM - transformers| logit = {worst:.3g} over {checked} values"


def test_ties_exactly_where_planned(run):
    """Planned groups are bitwise tied on both engines and reach the top; nothing else ties there.

    A fixture without a tie plan is the control: no two of its top-5 logits are ever equal, so the
    ties a test sees come from the plan, not from chance.
    """
    groups = run["meta"]["tie_plan"]
    group_of = {t: i for i, g in enumerate(groups) for t in g}
    positions = 0
    near_top = 0
    for out in run["outputs"]:
        hf32 = _hf_logits(run, out, torch.float32) if groups else None
        hf16 = _hf_logits(run, out, torch.bfloat16) if groups else None
        for row, values in _positions(out):
            positions += 1
            top = sorted(values.items(), key=lambda kv: -kv[1])[:5]
            for (a, va), (b, vb) in itertools.pairwise(top):
                if va == vb:
                    assert group_of.get(a, -1) == group_of.get(b, -2), (
                        f"unplanned bitwise tie between tokens {a} and {b} at row {row}"
                    )
            for g in groups:
                engine_vals = {values[t] for t in g}  # full vocabulary: every id is present
                assert len(engine_vals) == 1, f"vLLM: group {g} not tied at row {row}: {engine_vals}"
                for label, hf in (("float32", hf32), ("bfloat16", hf16)):
                    col = hf[row, g]
                    assert bool((col == col[0]).all()), f"transformers {label}: group {g} at row {row}: {col}"
                # Among the top 5, a group straddles a top_k boundary k <= 5 (or sits right at it).
                if values[g[0]] >= top[-1][1]:
                    near_top += 1
    assert positions >= len(PROMPTS) * MAX_TOKENS
    if groups:
        # Ties must land where top_k/top_p boundaries fall, not only in the tail.
        assert near_top >= 3, f"tie groups reached the top 5 at only {near_top} of {positions} positions"


def test_engine_entropy_matches_metadata_scale(run):
    """The engine's full-vocabulary entropy sits in the band the recorded entropy promises."""
    meta = run["meta"]
    if meta["vocab_size"] > FULL_VOCAB_LIMIT:
        pytest.skip("only a top-K head was captured for the 32k vocabulary")
    ents = []
    for out in run["outputs"]:
        for _, values in _positions(out):
            z = torch.tensor([values[t] for t in range(meta["vocab_size"])], dtype=torch.float64)
            logp = torch.log_softmax(z, -1)
            ents.append(float(-(logp.exp() * logp).sum()))
    mean = sum(ents) / len(ents)
    assert 0.0 < mean < math.log(meta["vocab_size"])
    # Different positions than the builder's probe, same model: within a loose band.
    assert abs(mean - meta["mean_entropy_nats"]) < 1.0, (mean, meta["mean_entropy_nats"])
