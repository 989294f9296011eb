"""Records (:mod:`parity.records.format`) from an OpenAI-compatible vLLM server's ``/v1/completions`` answers.

The answers are parsed by the server rollout's own parser (:func:`parity.engines.vllm_server.protocol.parse_completion`),
so what a user records from their server is read exactly as ``parity run --server`` reads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa

from parity.core.spec import SamplingSpec
from parity.engines.vllm_server.protocol import parse_completion
from parity.errors import UsageError
from parity.records.convert import kept_columns, spec_row
from parity.records.format import records_table


def from_server_responses(
    payloads: Sequence[Any],
    prompts: Sequence[Sequence[int]],
    spec: SamplingSpec | Sequence[SamplingSpec],
    *,
    requested: int,
    vocab_size: int,
    max_tokens: int,
    seeds: Sequence[int] | None = None,
    scenario: str | None = None,
) -> pa.Table:
    """Records from ``/v1/completions`` JSON answers, one per prompt, parsed as the server rollout parses them.

    The requests must have asked for ``logprobs=requested`` with ``return_tokens_as_token_ids`` (see
    :mod:`parity.engines.vllm_server.protocol` for the request shape).
    """

    specs = list(spec) if not isinstance(spec, SamplingSpec) else [spec] * len(payloads)
    if not (len(payloads) == len(prompts) == len(specs)):
        raise UsageError(f"from_server_responses: {len(payloads)} answers, {len(prompts)} prompts, {len(specs)} specs: allowed equal counts")
    rows = []
    for i, (payload, prompt, sp) in enumerate(zip(payloads, prompts, specs, strict=True)):
        parsed = parse_completion(payload, max_tokens=max_tokens, requested=requested, vocab_size=vocab_size, where=f"answer {i}")
        rows.append(
            {
                "scenario": scenario,
                "prompt_index": i,
                "seed": None if seeds is None else int(seeds[i]),
                "prompt_ids": [int(t) for t in prompt],
                "completion_ids": parsed.token_ids,
                **spec_row(sp),
                "sampler_logprobs": parsed.sampled_logprobs,
                **kept_columns(
                    parsed.token_ids,
                    parsed.head_ids,
                    parsed.head_logprobs,
                    spec=sp,
                    requested=requested if requested != 0 else 0,
                    vocab_size=vocab_size,
                ),
            }
        )
    return records_table(rows)
