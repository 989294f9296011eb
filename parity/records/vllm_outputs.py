"""vLLM's sampling parameters and completion log-probs read without importing vLLM (the engine adapter
and :func:`parity.records.convert.from_request_outputs` both read them here)."""

from __future__ import annotations

import math
from typing import Any

from parity.core.capture import FULL_VOCAB, NEG_INF, Heads
from parity.core.spec import SamplingSpec

ROWS_ATTR = "parity_rows"  # CompletionOutput attribute: position -> (kept ids, log-probs) from the sampler


def spec_of_params(params: object) -> SamplingSpec:
    """The filters of a ``vllm.SamplingParams`` (top_k < 1 and a missing min_p mean off)."""
    top_k = int(getattr(params, "top_k", 0) or 0)
    return SamplingSpec(
        temperature=float(getattr(params, "temperature")),  # noqa: B009 (params is any object)
        top_k=top_k if top_k >= 1 else 0,
        top_p=float(getattr(params, "top_p", 1.0)),
        min_p=float(getattr(params, "min_p", 0.0) or 0.0),
        repetition_penalty=float(getattr(params, "repetition_penalty", 1.0)),
        presence_penalty=float(getattr(params, "presence_penalty", 0.0) or 0.0),
        frequency_penalty=float(getattr(params, "frequency_penalty", 0.0) or 0.0),
    )


def heads_of_output(comp: Any, requested: int, where: str, *, error: type[Exception],
                    nan_as_dropped: bool = False, payload: Any = None) -> Heads:
    """One ``CompletionOutput`` as sampled tokens and per-position heads (the sampled entry excluded); ``requested``:
    the ``logprobs`` asked (-1: the vocabulary); ``nan_as_dropped`` reads NaN as ``-inf``. Missing log-probs, or ones
    not led by the sampled token, raise ``error`` (the two layouts: docs/records.md, section 4)."""
    ids = [int(t) for t in comp.token_ids]
    logprobs = comp.logprobs
    if logprobs is None or len(logprobs) != len(ids):
        n_lp = 0 if logprobs is None else len(logprobs)
        raise error(f"{where}: vLLM returned log-probs for {n_lp} of {len(ids)} tokens: allowed "
                    "SamplingParams(logprobs=K >= 0), and an engine with logprobs_mode='processed_logprobs'")
    sampled: list[float] = []
    heads: list[list[int]] = []
    head_lps: list[list[float]] = []
    if hasattr(logprobs, "start_indices"):
        for t, (a, b) in enumerate(zip(logprobs.start_indices, logprobs.end_indices, strict=True)):
            if b <= a or logprobs.token_ids[a] != ids[t]:
                got = logprobs.token_ids[a] if b > a else None
                raise error(f"{where} position {t}: vLLM's first log-prob entry is token {got}, sampled {ids[t]}")
            sampled.append(float(logprobs.logprobs[a]))
            heads.append(list(logprobs.token_ids[a + 1 : b]))
            head_lps.append([float(v) for v in logprobs.logprobs[a + 1 : b]])
    else:
        for t, (y, entry) in enumerate(zip(ids, logprobs, strict=True)):
            if not entry or y not in entry:
                raise error(f"{where} position {t}: no log-prob for the sampled token {y}")
            items = list(entry.items())
            head = items if requested == FULL_VOCAB or len(items) == requested else [kv for kv in items if kv[0] != y]
            sampled.append(float(entry[y].logprob))
            heads.append([int(k) for k, _ in head])
            head_lps.append([float(v.logprob) for _, v in head])
    if nan_as_dropped:
        head_lps = [[NEG_INF if math.isnan(v) else v for v in row] for row in head_lps]
    h = Heads(ids, sampled, heads, head_lps, payload=payload)
    # Kept sets that parity's capture read whole from the sampler's rows (parity.engines.sampler_rows).
    h.rows = dict(getattr(comp, ROWS_ATTR, None) or {})
    return h
