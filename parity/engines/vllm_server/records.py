"""Records (:mod:`parity.records.format`) from an OpenAI-compatible vLLM server's ``/v1/completions`` answers,
parsed by :func:`parity.engines.vllm_server.protocol.parse_completion`, exactly as ``parity run --server`` reads them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import pyarrow as pa

from parity.core.capture import (
    DEFAULT_MAX_HEAD,
    CaptureHistory,
    CaptureStats,
    Heads,
    plan_capture,
    run_capture,
)
from parity.core.json_types import JsonObject
from parity.core.spec import SamplingSpec
from parity.engines.vllm_server.protocol import parse_completion
from parity.errors import UsageError
from parity.records.convert import heads_row
from parity.records.write import records_table


def from_server_responses(payloads: Sequence[object], prompts: Sequence[Sequence[int]],
                          spec: SamplingSpec | Sequence[SamplingSpec], *, requested: int | Sequence[int],
                          vocab_size: int, max_tokens: int, seeds: Sequence[int] | None = None,
                          scenario: str | None = None) -> pa.Table:
    """Records from ``/v1/completions`` JSON answers (decoded), one per prompt, parsed as the server rollout
    parses them. The requests must have asked ``logprobs=requested`` (one value, or one per answer as
    :func:`request_with_capture` returns them) with ``return_tokens_as_token_ids`` (the request shape:
    :mod:`parity.engines.vllm_server.protocol`)."""
    specs = list(spec) if not isinstance(spec, SamplingSpec) else [spec] * len(payloads)
    heads = [int(requested)] * len(payloads) if isinstance(requested, int) else [int(k) for k in requested]
    if not (len(payloads) == len(prompts) == len(specs) == len(heads)):
        raise UsageError(f"from_server_responses: {len(payloads)} answers, {len(prompts)} prompts, {len(specs)} specs, "
                         f"{len(heads)} requested heads: allowed equal counts")
    rows = []
    for i, (payload, prompt, sp, requested) in enumerate(zip(payloads, prompts, specs, heads, strict=True)):
        parsed = parse_completion(payload, max_tokens=max_tokens, requested=requested, vocab_size=vocab_size, where=f"answer {i}")
        rows.append(heads_row(parsed, prompt, sp, requested=requested, vocab_size=vocab_size, scenario=scenario,
                              prompt_index=i, seed=None if seeds is None else int(seeds[i])))
    return records_table(rows)


def request_with_capture(send: Callable[[list[JsonObject]], list[object]], bodies: Sequence[JsonObject],
                         spec: SamplingSpec, *, vocab_size: int, max_tokens: int,
                         max_head: int = DEFAULT_MAX_HEAD, history: CaptureHistory | None = None,
                         ) -> tuple[list[object], list[int], CaptureStats]:
    """Send ``/v1/completions`` bodies with a capture plan for ``spec``; ask unproven ones again. ``send`` (your
    client) POSTs a list of bodies and returns their answers in order; each body carries its ``seed``, ``n=1`` and
    ``return_tokens_as_token_ids``; ``logprobs`` is set here, up to ``max_head``. Returns the answers, the
    ``logprobs`` each was asked with (``requested`` of :func:`from_server_responses`) and the stats."""
    for i, b in enumerate(bodies):
        if b.get("seed") is None or b.get("n", 1) != 1:
            raise UsageError(
                f"request_with_capture: body {i} has seed={b.get('seed')!r}, n={b.get('n', 1)!r}: allowed "
                "a seed per body and n=1 (a sequence asked again with a wider head must be drawn again with "
                "its own seed)")
    plan = plan_capture(spec, vocab_size, max_head=max_head, suggested=history.start(spec) if history else None)

    def ask(indices: list[int], heads: list[int]) -> list[Heads]:
        sent = [{**copy.deepcopy(dict(bodies[i])), "logprobs": int(k)}
                for i, k in zip(indices, heads, strict=True)]
        answers = list(send(sent))
        if len(answers) != len(sent):
            raise UsageError(f"request_with_capture: send returned {len(answers)} answers for {len(sent)} bodies")
        return [parse_completion(a, max_tokens=max_tokens, requested=k, vocab_size=vocab_size, where=f"answer {i}")
                for i, k, a in zip(indices, heads, answers, strict=True)]

    result = run_capture(plan, len(bodies), ask, vocab_size=vocab_size, spec=spec, history=history)
    return [h.payload for h in result.heads], result.requested, result.stats
