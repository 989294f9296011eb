"""vLLM's own v1 ``Sampler``, called in-process on a logits tensor (no model, no engine): the ground truth of
the reference filters, fed a hand-built ``SamplingMetadata`` with one row per spec; min_p goes through
vLLM's ``MinPLogitsProcessor``, driven by the engine's ``BatchUpdate`` protocol."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from parity.core.spec import SamplingSpec
from parity.engines.vllm_offline import sampling_params
from parity.errors import SetupError, UsageError

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclass
class SamplerOutput:
    kept: torch.Tensor  # bool [N, V]: finite processed log-probs
    logprobs: torch.Tensor  # float32 [N, V]: vLLM's processed log-probs (logprobs=-1)
    sampled: torch.Tensor  # long [N]: the token the sampler drew


class VllmSampler:
    """Callable wrapper: ``VllmSampler()(logits, specs, seed=0)`` → :class:`SamplerOutput`."""

    def __init__(self, logprobs_mode: str = "processed_logprobs", max_num_seqs: int = 1024) -> None:
        try:
            from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
            from vllm.v1.sample.sampler import Sampler
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise SetupError("VllmSampler needs vLLM: install parity[cpu] (or parity[gpu] on CUDA)") from exc
        self._sampler = Sampler(logprobs_mode=logprobs_mode)
        self._min_p_cls = MinPLogitsProcessor
        self._max_num_seqs = max_num_seqs
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec], *, seed: int = 0,
                 prompt_ids: Sequence[Sequence[int]] | None = None,
                 output_ids: Sequence[Sequence[int]] | None = None) -> SamplerOutput:
        """``prompt_ids`` / ``output_ids``: each row's prompt and the tokens generated before this step (needed
        when a row sets a penalty; vLLM reads them only then)."""
        from vllm.sampling_params import SamplingType
        from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
        from vllm.v1.sample.metadata import SamplingMetadata

        n, vocab = logits.shape
        if n > self._max_num_seqs:
            raise UsageError(f"batch of {n} rows exceeds max_num_seqs={self._max_num_seqs}")
        row_specs = [specs] * n if isinstance(specs, SamplingSpec) else list(specs)
        params = [sampling_params(s) for s in row_specs]  # SamplingParams resets greedy filters
        # Read greedy-ness and temperature off the SamplingParams, as InputBatch.add_request does
        # (sampling_type), not off the spec: the ground truth must not inherit the spec's assumptions.
        greedy = [p.sampling_type == SamplingType.GREEDY for p in params]

        config = SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=self._max_num_seqs))
        min_p = self._min_p_cls(config, torch.device("cpu"), False)
        min_p.update_state(BatchUpdate(batch_size=n, removed=[], added=[(i, p, [], []) for i, p in enumerate(params)], moved=[]))

        # Mirrors InputBatch.add_request / _make_sampling_metadata (vllm/v1/worker/gpu_input_batch.py):
        # greedy temperature 0.0; top_k disabled rows get V; None when no row uses the filter.
        temperature = torch.tensor([0.0 if g else p.temperature for g, p in zip(greedy, params, strict=True)])
        top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        any_k = any(0 < p.top_k < vocab for p in params)
        any_p = any(p.top_p < 1 for p in params)
        no_penalties = not any(p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
                                   for p in params)  # InputBatch.no_penalties: every row's request at neutral
        prompts = [list(x) for x in prompt_ids] if prompt_ids is not None else [[] for _ in range(n)]
        outputs = [list(x) for x in output_ids] if output_ids is not None else [[] for _ in range(n)]
        if not no_penalties and (prompt_ids is None or output_ids is None or len(prompts) != n or len(outputs) != n):
            raise UsageError(f"a row sets a penalty: allowed prompt_ids and output_ids with one history per row ({n})")
        # InputBatch._make_prompt_token_ids_cpu_tensor: prompts right-padded with the id V (no token has it).
        width = max((len(x) for x in prompts), default=0)
        prompt_t = torch.tensor([x + [vocab] * (width - len(x)) for x in prompts], dtype=torch.int64).reshape(n, width)
        generators = {i: torch.Generator().manual_seed(seed + i) for i in range(n)}
        def per_row(name: str) -> torch.Tensor:
            return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32)

        meta = SamplingMetadata(
            temperature=None if all(greedy) else temperature, all_greedy=all(greedy),
            all_random=not any(greedy), top_p=per_row("top_p") if any_p else None,
            top_k=torch.tensor(top_ks, dtype=torch.int32) if any_k else None,
            generators=generators, max_num_logprobs=-1, no_penalties=no_penalties,
            prompt_token_ids=None if no_penalties else prompt_t,
            frequency_penalties=per_row("frequency_penalty"), presence_penalties=per_row("presence_penalty"),
            repetition_penalties=per_row("repetition_penalty"),
            output_token_ids=[] if no_penalties else outputs,
            allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors([min_p]),
        )
        out = self._sampler(logits.to(torch.float32).clone(), meta)
        lp = out.logprobs_tensors.logprobs
        return SamplerOutput(kept=lp > float("-inf"), logprobs=lp, sampled=out.sampled_token_ids.squeeze(1).long())
