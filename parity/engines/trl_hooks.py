"""parity's patch of TRL's VLLMGeneration and GRPOTrainer, what every use of it shares: vLLM allowed any log-prob
head, TRL given the sampled token's log-prob alone (the head stays with the patch), and in each generation batch the
first scoring call (old_per_token_logps) returned less a per-row correction for TRL's IS correction, TRL's own values
put back for the policy ratio. :func:`parity.engines.trl_grpo.patch_grpo` runs it with parity's capture; the TRL
repro scripts inline it (``# @inline``), so it imports no engine at module top."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from parity.errors import EngineError

if TYPE_CHECKING:
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.grpo_trainer import GRPOTrainer
    from vllm import LLM

# VLLMGeneration.generate: prompt ids, completion ids, per position the head's log-probs and ids.
Generated = tuple[list[list[int]], list[list[int]], list[list[list[float | None]]] | None, list[list[list[int]]]]
Logps = tuple[torch.Tensor, torch.Tensor | None]  # _get_per_token_logps_and_entropies: log-probs, entropies
Output = dict[str, torch.Tensor]  # _generate_and_score_completions' batch (the tensors read here)
Head = tuple[list[int], list[float | None]]  # one position's head from vLLM: token ids, their log-probs (None: NaN)


class Hooks:
    """What one patch does at TRL's hooks. The defaults ask for the whole vocabulary and patch every batch."""

    fix = False  # put TRL's own old_per_token_logps back (policy ratio) once its IS correction read the corrected ones

    def plan(self, gen: VLLMGeneration) -> tuple[int, contextlib.AbstractContextManager[object]]:
        """The head to ask vLLM for (0: none, -1: the vocabulary) and what to hold around the call."""
        return -1, contextlib.nullcontext()

    def sampled(self, gen: VLLMGeneration, completion_ids: list[list[int]], logprobs: list[list[list[float | None]]] | None,
                heads: list[list[Head]] | None) -> None:
        """What vLLM sampled: per sequence TRL's log-prob of each token and the heads (None: vLLM gave none)."""

    def begin(self, trainer: GRPOTrainer) -> bool:
        """Whether to patch this ``_generate_and_score_completions`` call."""
        return True

    def scoring(self, kwargs: dict[str, object]) -> None:
        """The batch's first scoring call (old_per_token_logps), its keyword arguments, before its correction."""

    def correction(self, b: int, z: torch.Tensor, y: torch.Tensor, prompt: list[int]) -> torch.Tensor:
        """What TRL's IS correction subtracts from row ``b``'s log-probs: ``z`` its float32 logits, ``y`` its tokens."""
        raise NotImplementedError

    def end(self, trainer: GRPOTrainer, output: Output, full: torch.Tensor, used: torch.Tensor) -> None:
        """The scored batch: TRL's own old_per_token_logps (``full``) and those its IS correction read (``used``)."""


def sampled_first(completion_ids: list[list[int]], logprobs: list[list[list[float | None]]], token_ids: list[list[list[int]]],
                  ) -> tuple[list[list[list[float | None]]], list[list[list[int]]], list[list[Head]]]:
    """Per sequence and position: the sampled token's log-prob and id for TRL, and the head for the patch. TRL's
    extract_logprobs sorts the head by rank and _generate_single_turn reads entry 0 as the sampled token's: true
    only for logprobs=0, so the sampled entry alone goes to TRL."""
    lp_out: list[list[list[float | None]]] = []
    heads: list[list[Head]] = []
    for seq_ids, seq_lps, seq_tok in zip(completion_ids, logprobs, token_ids, strict=True):
        lp_rows: list[list[float | None]] = []
        rows: list[Head] = []
        for y, lps, toks in zip(seq_ids, seq_lps, seq_tok, strict=True):
            ids = [int(t) for t in toks]
            if int(y) not in ids:
                raise EngineError(f"vLLM's head at a position does not list the sampled token {int(y)}")
            lp_rows.append([lps[ids.index(int(y))]])
            rows.append((ids, list(lps)))
        lp_out.append(lp_rows)
        heads.append(rows)
    return lp_out, [[[int(y)] for y in seq] for seq in completion_ids], heads


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                   batch_size: int) -> torch.Tensor:
    """float32 logits ``[B, logits_to_keep, V]``: row t predicts completion token t (a plain forward)."""
    out = []
    with torch.no_grad():
        for a in range(0, input_ids.shape[0], batch_size):
            b = min(a + batch_size, input_ids.shape[0])
            z = model(input_ids=input_ids[a:b], attention_mask=attention_mask[a:b], use_cache=False).logits
            out.append(z[:, -logits_to_keep - 1 : -1].float())
    return torch.cat(out)


@contextlib.contextmanager
def patch_trl(hooks: Hooks) -> Iterator[None]:
    """Patch TRL's VLLMGeneration and GRPOTrainer with ``hooks``; restore on exit. Enter it before constructing the
    trainer (its colocated engine is made under it)."""
    from trl.generation import vllm_generation as vg
    from trl.trainer import grpo_trainer as gt

    Gen, Trainer = vg.VLLMGeneration, gt.GRPOTrainer
    saved = (vg.LLM, Gen.generate, Trainer._generate_and_score_completions, Trainer._get_per_token_logps_and_entropies)
    llm_cls, original_generate, original_score, original_logps = saved
    batch: dict[str, Any] = {}  # the batch being scored: what vLLM sampled for it, then TRL's own and the corrected log-probs

    def make_llm(*args: object, **kwargs: object) -> LLM:
        kwargs.setdefault("max_logprobs", -1)  # vLLM refuses a head wider than max_logprobs (default 20)
        return llm_cls(*args, **kwargs)

    def generate(self: VLLMGeneration, *args: object, **kwargs: object) -> Generated:
        head, around = hooks.plan(self)
        old, self.logprobs = self.logprobs, head
        try:
            with around:
                prompt_ids, completion_ids, logprobs, token_ids = original_generate(self, *args, **kwargs)
        finally:
            self.logprobs = old
        if batch:
            batch["completions"] = completion_ids
        lps, ids, heads = sampled_first(completion_ids, logprobs, token_ids) if logprobs is not None else (None, token_ids, None)
        hooks.sampled(self, completion_ids, lps, heads)
        return prompt_ids, completion_ids, lps, ids

    def logps(self: GRPOTrainer, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
              logits_to_keep: int, batch_size: int | None = None, **kwargs: object) -> Logps:
        out: Logps = original_logps(self, model, input_ids, attention_mask, logits_to_keep, batch_size=batch_size, **kwargs)
        # The first scoring call inside _generate_and_score_completions is old_per_token_logps.
        completions = batch.get("completions")
        if completions is None or "old" in batch:
            return out
        hooks.scoring(kwargs)
        full = out[0]
        logits = forward_logits(model, input_ids, attention_mask, logits_to_keep, batch_size or input_ids.shape[0])
        used = full.clone()
        cut = input_ids.shape[1] - logits_to_keep  # the prompt part (left-padded by TRL)
        for b, comp in enumerate(completions):
            n = len(comp)
            y = input_ids[b, cut:][:n].long().cpu()
            if y.tolist() != list(comp):
                raise EngineError(f"row {b}: the scored completion differs from what vLLM sampled")
            prompt = input_ids[b, :cut][attention_mask[b, :cut].bool()].tolist()
            used[b, :n] = full[b, :n] - hooks.correction(b, logits[b, :n], y, prompt).to(full.dtype).to(full.device)
        batch["old"] = full.detach().clone(), used.detach().clone()
        return (used, *out[1:])

    def score(self: GRPOTrainer, inputs: object) -> Output:
        if not hooks.begin(self):
            output: Output = original_score(self, inputs)
            return output
        batch["completions"] = None
        try:
            output = original_score(self, inputs)
        finally:
            old = batch.pop("old", None)
            batch.clear()
        if old is None:
            raise EngineError("TRL scored the batch without computing old_per_token_logps")
        if hooks.fix:  # the policy ratio keeps TRL's full-vocabulary values: only the IS correction is fixed
            output["old_per_token_logps"] = old[0]
        hooks.end(self, output, *old)
        return output

    vg.LLM, Gen.generate, Trainer._generate_and_score_completions, Trainer._get_per_token_logps_and_entropies = (
        make_llm, generate, score, logps)
    try:
        yield
    finally:
        vg.LLM, Gen.generate, Trainer._generate_and_score_completions, Trainer._get_per_token_logps_and_entropies = saved
