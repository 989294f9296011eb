# ruff: noqa: B905
"""The standalone scripts' engines: a tiny random Llama built from code, a vLLM engine on it, sampling with
processed log-probs and top-K heads, and the trainer's logits. Inlined into every emitted script of
``standalone_src.py`` (``# @inline``), so it imports nothing from parity.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM, PreTrainedModel
    from vllm import LLM, SamplingParams


def build_model(vocab: int, *, hidden: int = 64, layers: int = 2, logit_scale: float = 1.0, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama (float32). lm_head rows are N(0, 1/hidden): the final RMSNorm output has norm
    ~sqrt(hidden), so the logits at a position are ~N(0, logit_scale^2) across the vocabulary
    (logit_scale 1: near-uniform; 12: peaked)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=1, num_key_value_heads=1, head_dim=hidden, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    torch.manual_seed(seed)
    model: LlamaForCausalLM = LlamaForCausalLM(config).float().eval()  # type: ignore[no-untyped-call]  # unannotated in transformers
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, logit_scale / math.sqrt(hidden))
    return model


def save(model: PreTrainedModel) -> str:
    """Save to a fresh temporary folder (no tokenizer: vLLM runs with skip_tokenizer_init)."""
    path = tempfile.mkdtemp(prefix="repro-model-")
    model.save_pretrained(path)
    return path


def start_vllm(path: str, seed: int = 0) -> LLM:
    from vllm import LLM

    return LLM(
        model=path, skip_tokenizer_init=True, dtype="float32", seed=seed, logprobs_mode="processed_logprobs",
        max_logprobs=-1, max_model_len=1024, enforce_eager=True, enable_prefix_caching=False,
    )


def random_prompts(n: int, vocab: int, seed: int, length: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def setup(vocab: int, logit_scale: float, args: argparse.Namespace) -> tuple[LlamaForCausalLM, LLM, list[list[int]]]:
    """The tiny model, a vLLM engine on it, and the prompts."""
    model = build_model(vocab, logit_scale=logit_scale, seed=args.seed)
    llm = start_vllm(save(model), seed=args.seed)
    return model, llm, random_prompts(args.prompts, vocab, args.seed)


class Sample:
    def __init__(self, prompt: list[int], completion: list[int], logprobs: torch.Tensor, heads: list[dict[int, float]]) -> None:
        self.prompt = prompt
        self.completion = completion  # sampled ids
        self.logprobs = logprobs  # float64 [L]: vLLM's processed log-prob of each sampled token
        self.heads = heads  # per position {token id: processed log-prob} of the requested top-K


def sample(llm: LLM, prompts: list[list[int]], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, tokens: int = 16, logprobs: int = 0, seed: int = 0) -> list[Sample]:
    """One completion per prompt (seed + i), with the sampled token's processed log-prob and a top-K head
    (logprobs=-1: the whole vocabulary)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def params(i: int) -> SamplingParams:
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=tokens,
                  seed=seed + i, logprobs=logprobs, detokenize=False, ignore_eos=True)
        try:
            return SamplingParams(flat_logprobs=True, **kw)
        except TypeError:  # an older vLLM: per-position dicts
            return SamplingParams(**kw)

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        [params(i) for i in range(len(prompts))], use_tqdm=False)
    samples: list[Sample] = []
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        lp = comp.logprobs
        lps: list[float] = []
        heads: list[dict[int, float]] = []
        if hasattr(lp, "start_indices"):  # flat: entry a is the sampled token, a+1..b the top-K
            for a, b in zip(lp.start_indices, lp.end_indices):
                lps.append(lp.logprobs[a])
                heads.append({int(i): float(v) for i, v in zip(lp.token_ids[a + 1 : b], lp.logprobs[a + 1 : b])})
        else:  # dicts: the top-K plus the sampled token when it is not among them
            for t, d in enumerate(lp):
                lps.append(d[ids[t]].logprob)
                heads.append({int(i): float(v.logprob) for i, v in d.items()
                              if logprobs < 0 or len(d) <= logprobs or i != ids[t]})
        samples.append(Sample(prompt, ids, torch.tensor(lps, dtype=torch.float64), heads))
    return samples


@torch.no_grad()
def trainer_logits(model: torch.nn.Module, prompt: Sequence[int], completion: Sequence[int]) -> torch.Tensor:
    """float32 logits [L, V]: row t predicts completion token t (what an RL trainer scores)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    z: torch.Tensor = model(input_ids=ids).logits[0].float()
    return z[len(prompt) - 1 : len(prompt) - 1 + len(completion)]
