# ruff: noqa: B905
"""The prefix_cache_logprobs repro: vLLM's CPU engine with prefix caching, its prompt and completion
log-probs after a cache hit against a cold run and across request orders. Inlined into its script section
(``# @inline``) after the prelude, which carries what it imports.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TypedDict, Unpack

from parity.repro.script_engines import build_model, random_prompts, save
from parity.repro.standalone_report import Outcome

if TYPE_CHECKING:
    from vllm import RequestOutput


class PrefixCacheConfig(TypedDict):
    """The script's CONFIG: the tiny model's vocabulary, the shared prefix and each prompt's own tokens, the
    completion length."""

    vocab: int
    shared: int
    own: int
    tokens: int


class PrefixCacheRow(TypedDict):
    case: str
    cached: int  # the request's num_cached_tokens
    max_diff: float
    foreign: int  # prompt log-prob entries for a token other than the prompt's


class PrefixCacheAsk(TypedDict, total=False):
    """The SamplingParams a request adds to the greedy completion."""

    prompt_logprobs: int
    skip_reading_prefix_cache: bool


def pc_logprobs(out: RequestOutput) -> list[float]:
    return [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]


def pc_prompt_logprobs(out: RequestOutput) -> list[float]:
    return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]


def repro_prefix_cache_logprobs(cfg: PrefixCacheConfig, args: argparse.Namespace) -> Outcome:
    """Prefix caching on vLLM's CPU engine. vLLM #5543 (a cache hit recomputes the last block in another order)
    and #42019 (prompt log-probs depend on request order) need a cached prompt scored: vLLM 0.32 skips reading
    the cache for every request that asks prompt log-probs (SamplingParams.skip_reading_prefix_cache defaults to
    prompt_logprobs is not None), so prompt log-probs never see it. Completion log-probs with a cache hit are
    compared with a cold run and across request orders (measured). Forcing the cache read with prompt log-probs
    returns entries at the cached positions that are not the cold run's."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=save(build_model(cfg["vocab"], seed=args.seed)), skip_tokenizer_init=True, dtype="float32",
              seed=args.seed, max_model_len=1024, enforce_eager=True, enable_prefix_caching=True, max_logprobs=-1)
    shared = random_prompts(1, cfg["vocab"], args.seed, cfg["shared"])[0]
    a, b = (shared + p for p in random_prompts(2, cfg["vocab"], args.seed + 1, cfg["own"]))

    def gen(prompts: list[list[int]], **kw: Unpack[PrefixCacheAsk]) -> list[RequestOutput]:
        sp = SamplingParams(temperature=0.0, max_tokens=cfg["tokens"], logprobs=0, detokenize=False, **kw)
        out: list[RequestOutput] = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return out

    def fresh(prompts: list[list[int]], **kw: Unpack[PrefixCacheAsk]) -> list[RequestOutput]:
        llm.reset_prefix_cache()
        return gen(prompts, **kw)

    rows: list[PrefixCacheRow] = []
    cold, warm = fresh([a], prompt_logprobs=0)[0], gen([a], prompt_logprobs=0)[0]
    rows.append({"case": "prompt log-probs, asked again", "cached": warm.num_cached_tokens,
                 "max_diff": max(abs(x - y) for x, y in zip(pc_prompt_logprobs(cold), pc_prompt_logprobs(warm))),
                 "foreign": 0})
    cold, warm = fresh([a])[0], gen([a])[0]
    rows.append({"case": "completion log-probs, asked again", "cached": warm.num_cached_tokens,
                 "max_diff": max(abs(x - y) for x, y in zip(pc_logprobs(cold), pc_logprobs(warm))), "foreign": 0})
    ab, ba = fresh([a, b]), fresh([b, a])
    rows.append({"case": "completion log-probs, order a,b vs b,a", "cached": ab[1].num_cached_tokens,
                 "max_diff": max(abs(x - y) for p, q in ((ab[0], ba[1]), (ab[1], ba[0]))
                                 for x, y in zip(pc_logprobs(p), pc_logprobs(q))), "foreign": 0})
    cold = fresh([a], prompt_logprobs=0)[0]
    # An unrelated prompt's log-probs pass through the engine in between (b shares a's prefix, and so its values).
    gen(random_prompts(1, cfg["vocab"], args.seed + 2, len(a)), prompt_logprobs=0)
    forced = gen([a], prompt_logprobs=0, skip_reading_prefix_cache=False)[0]
    n: int = forced.num_cached_tokens
    gaps = [abs(x - y) for x, y in zip(pc_prompt_logprobs(cold), pc_prompt_logprobs(forced))]
    foreign = [next(iter(d)) != t for d, t in zip(forced.prompt_logprobs[1:], a[1:])]  # an entry for another token
    # Entry t scores prompt token t + 1 from position t's logits: the first n come from cached positions.
    for case, part in (("cached positions", slice(0, n)), ("the rest", slice(n, None))):
        rows.append({"case": f"prompt log-probs, cache read forced: {case}", "cached": n,
                     "max_diff": max(gaps[part], default=0.0), "foreign": sum(foreign[part])})
    return ([("case", "case", ""), ("cached", "cached tokens", ""), ("max_diff", "max |diff| vs a cold run", ".3g"),
             ("foreign", "entries not for the prompt's token", "")], rows, [
        ("a request with prompt log-probs reads no cached block (so #5543 and #42019 cannot arise)", rows[0]["cached"] == 0),
        ("completion log-probs after a cache hit were measured", rows[1]["cached"] > 0 and rows[2]["cached"] > 0),
        ("forcing the cache read returns prompt log-probs at cached positions that are not the cold run's",
         rows[3]["cached"] > 0 and rows[3]["max_diff"] > 1e-3),
        ("the positions computed in that request equal the cold run", rows[4]["max_diff"] == 0.0),
    ])
