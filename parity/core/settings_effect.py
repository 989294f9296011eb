"""What an engine setting (prefix caching, chunked prefill) changes: the same prompts and seeds sampled with and
without it, compared sequence by sequence (engine-free). Measured and reported, never assumed: whether the
outputs are bitwise equal is a property of the engine build and the machine (docs/routing.md, section 4)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parity.core.matrix import Scenario
from parity.core.sequence import SequenceRecord


def settings_of(sc: Scenario, run_prefix_caching: bool) -> dict[str, bool | int | None]:
    pc = run_prefix_caching if sc.prefix_caching is None else sc.prefix_caching
    return {"prefix_caching": pc, "max_num_batched_tokens": sc.max_num_batched_tokens}


def compare_records(base: Sequence[SequenceRecord], other: Sequence[SequenceRecord]) -> dict[str, int | float | None]:
    """Sequences with the same tokens, bitwise-equal sampler log-probs, their largest gap, routed experts equal."""
    same_tokens = [a.completion_ids == b.completion_ids for a, b in zip(base, other, strict=True)]
    pairs = [(a, b) for a, b, s in zip(base, other, same_tokens, strict=True) if s]
    gaps = [float((a.logprobs.double() - b.logprobs.double()).abs().max()) for a, b in pairs if a.length]
    routed = [(a.extras["routed_experts"], b.extras["routed_experts"]) for a, b in pairs
              if "routed_experts" in a.extras and "routed_experts" in b.extras]
    both = [(x >= 0).all(-1).all(-1) & (y >= 0).all(-1).all(-1) for x, y in routed]
    equal_rows = sum(int((x[m] == y[m]).all(-1).all(-1).sum()) for (x, y), m in zip(routed, both, strict=True))
    covered = sum(int(m.sum()) for m in both)
    return {
        "sequences": len(base),
        "same_tokens": sum(same_tokens),
        "logprobs_bitwise_equal": sum(bool(torch.equal(a.logprobs, b.logprobs)) for a, b in pairs),
        "max_abs_logprob_diff": max(gaps, default=0.0),
        "routed_rows_compared": covered if routed else None,
        "routed_rows_equal": equal_rows if routed else None,
    }


def settings_effect(
    scenarios: Sequence[Scenario], records: Sequence[Sequence[SequenceRecord]], run_model: str, run_prefix_caching: bool
) -> list[dict[str, object]]:  # report.json's engine_settings (report.blocks.EngineSettingEffect)
    """Each scenario that differs from another only in engine settings, against the one without them."""
    def key(sc: Scenario) -> tuple[object, ...]:
        return (sc.model or run_model, sc.spec, sc.prompts, sc.max_tokens, sc.seed, sc.shared_prefix)

    out: list[dict[str, object]] = []
    for i, sc in enumerate(scenarios):
        mine = settings_of(sc, run_prefix_caching)
        if not mine["prefix_caching"] and mine["max_num_batched_tokens"] is None:
            continue
        base = next((j for j, b in enumerate(scenarios) if key(b) == key(sc) and not any(settings_of(b, run_prefix_caching)
                     .values())), None)
        if base is not None:
            out.append({"scenario": sc.name, "baseline": scenarios[base].name, "settings": mine,
                        **compare_records(records[base], records[i])})
    return out
