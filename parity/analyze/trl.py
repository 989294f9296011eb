"""Score a TRL GRPO run with parity: captured sequences -> records -> the full report (gates included).

Input, scenarios, the two sides, masked tokens and thresholds: docs/records.md, section 9.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import torch

from parity.core.error_model import UNIT_ROUNDOFF, logprob_rounding_bound
from parity.core.gates import Thresholds
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.core.token_table import build_table
from parity.errors import UsageError
from parity.report.blocks import ReportJson, ScenarioFacts, ScenarioJson

if TYPE_CHECKING:
    import pyarrow as pa

    from parity.judge.accumulators import Summary

# A captured sequence (parity.engines.trl_grpo.SEQUENCE_FIELDS) as torch.load gives it back: its values are
# read with the checks below.
Captured = Mapping[str, object]

SOURCE = "vllm (TRL GRPOTrainer, colocate)"
TRAINER_UNDER_TEST = "TRL GRPOTrainer IS numerator"


def _where(s: Captured) -> str:
    return f"sequence {s['index']} of step {s['step']}"


def _tensor(s: Captured, key: str) -> torch.Tensor:
    x = s[key]
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"{_where(s)}: {key} is {type(x).__name__}, allowed a tensor (SEQUENCE_FIELDS)")
    return x


def _int(s: Captured, key: str) -> int:
    x = s[key]
    if not isinstance(x, (int, float, str, torch.Tensor)):
        raise UsageError(f"{_where(s)}: {key} is {type(x).__name__}, allowed an integer (SEQUENCE_FIELDS)")
    return int(x)


def _ints(s: Captured, key: str) -> list[int]:
    x = s[key]
    if not isinstance(x, (list, tuple, torch.Tensor)):
        raise UsageError(f"{_where(s)}: {key} is {type(x).__name__}, allowed a list of token ids (SEQUENCE_FIELDS)")
    return [int(t) for t in x]


def _spec(s: Captured) -> Mapping[str, object]:
    x = s["spec"]
    if not isinstance(x, dict):
        raise UsageError(f"{_where(s)}: spec is {type(x).__name__}, allowed a dict (SEQUENCE_FIELDS)")
    return x


def to_records(sequences: Sequence[Captured]) -> tuple[list[SequenceRecord], list[torch.Tensor], list[torch.Tensor], int]:
    """Records (sampler side), trainer logits, TRL's IS numerator per sequence, and the masked-out count."""
    records, logits, used = [], [], []
    dropped = 0
    for s in sequences:
        if s.get("logits") is None:
            raise UsageError(f"sequence {s['index']} of step {s['step']} has no logits: capture with keep_logits=True")
        if s.get("sampling_logps") is None:
            raise UsageError(f"sequence {s['index']} of step {s['step']} has no sampler log-probs (TRL got none from vLLM)")
        m = _tensor(s, "mask")
        dropped += int((~m).sum())
        if not bool(m.any()):
            continue
        idx = m.nonzero().squeeze(1)
        comp = [t for t, keep in zip(_ints(s, "completion_ids"), m.tolist(), strict=True) if keep]
        kept_ids = None if s.get("kept_ids") is None else _tensor(s, "kept_ids")
        kept = kept_ids[idx] if kept_ids is not None else None
        records.append(
            SequenceRecord(
                source=SOURCE,
                prompt_index=_int(s, "index"),
                prompt_ids=_ints(s, "prompt_ids"),
                completion_ids=comp,
                spec=SamplingSpec.from_dict(_spec(s)),
                seed=-1,  # TRL's engine seed; not per request
                logprobs=_tensor(s, "sampling_logps")[idx].float(),
                kept_ids=kept,
                kept_logprobs=_tensor(s, "kept_logprobs")[idx] if kept is not None else None,
                incomplete=_tensor(s, "incomplete")[idx] if kept is not None else None,
            )
        )
        logits.append(_tensor(s, "logits")[idx].float())
        used.append(_tensor(s, "is_logps")[idx].double())
    return records, logits, used, dropped


class ScoredStep(TypedDict):
    """One generation batch judged as records (:func:`score_step`)."""

    part: Summary
    facts: ScenarioFacts
    thresholds: Thresholds
    dtype: str


def score_step(sequences: Sequence[Captured], *, name: str, thresholds: Thresholds | None = None) -> ScoredStep:
    """One generation batch judged as records: ``{"part": Summary, "facts": ..., "thresholds": ..., "dtype": ...}``
    (:func:`score_capture` merges the steps into one report)."""
    from parity.engines.trainer_under_test import reference_views
    from parity.judge.scenario import rl_view, scenario_summary
    from parity.records.convert import from_sequence_records

    if not sequences:
        raise UsageError(f"scenario {name!r}: no captured sequences")
    specs = {tuple(sorted(_spec(s).items())) for s in sequences}
    if len(specs) != 1:
        raise UsageError(f"scenario {name!r}: sequences were sampled with {len(specs)} different specs; allowed one")
    spec = SamplingSpec.from_dict(_spec(sequences[0]))
    dtype = str(sequences[0]["sampler_dtype"])
    gate_dtype = dtype if dtype in UNIT_ROUNDOFF else "bfloat16"
    th = thresholds or Thresholds.for_dtype(dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16")
    records, logits, used, dropped = to_records(sequences)
    table = build_table(records, logits, spec, dtype=(gate_dtype, "float32"))
    table.user = torch.cat(used) if used else torch.zeros(0, dtype=torch.float64)
    table.user_name = TRAINER_UNDER_TEST
    ys = [torch.tensor(r.completion_ids, dtype=torch.long) for r in records]
    views = reference_views(logits, ys, spec, [r.kept_ids for r in records], [r.prompt_ids for r in records])
    export = from_sequence_records(records, scenario=name, table=table)
    vocab = int(logits[0].shape[-1]) if logits else None
    part = scenario_summary(export, dtypes=(gate_dtype, "float32"), vocab_size=vocab, views=views,
                            n_listed=th.max_violations_listed, source=SOURCE)
    # The sampler dtype's own per-token rounding bound, as a fact beside the gates' (which also carry the trainer's).
    bound = torch.cat([logprob_rounding_bound(z, y, spec, gate_dtype, kept=r.kept_ids)
                       for z, y, r in zip(logits, ys, records, strict=True)]) if ys else torch.zeros(0, dtype=torch.float64)
    first = sequences[0]
    facts: ScenarioFacts = {
        "model": "TRL GRPOTrainer",
        "rl_view": rl_view(table),
        "masked_tokens": dropped,
        "rounding_bound": {"dtype": dtype, "mean": float(bound.mean()) if bound.numel() else 0.0,
                           "max": float(bound.max()) if bound.numel() else 0.0},
        "trl": {"is_mode": str(first["is_mode"]), "fix": None if first["fix"] is None else str(first["fix"]),
                "sampler_dtype": dtype, "step": _int(first, "step")},
    }
    return {"part": part, "facts": facts, "thresholds": th, "dtype": dtype}


def score_capture(sequences: Sequence[Captured], *, label: str = "trl", thresholds: Thresholds | None = None) -> ReportJson:
    """The report (report.json's schema) of every captured step, one scenario per step, built as an analysis of
    the capture's records builds it (:func:`parity.analyze.report.build_report`)."""
    import json

    from parity.analyze.report import REPORT_FACTS, build_report
    from parity.judge.accumulators import Summary
    from parity.judge.token_columns import Options
    from parity.report.schema import environment, installed_version

    steps = sorted({_int(s, "step") for s in sequences})
    scored = [score_step([s for s in sequences if _int(s, "step") == st], name=f"{label}-step{st}", thresholds=thresholds)
              for st in steps]
    th = scored[0]["thresholds"] if scored else (thresholds or Thresholds())
    dtype = scored[0]["dtype"] if scored else "unknown"
    facts = {
        "scenarios": {f"{label}-step{st}": x["facts"] for st, x in zip(steps, scored, strict=True)},
        "config": {"source": "TRL GRPOTrainer capture", "fix": scored[0]["facts"]["trl"]["fix"] if scored else None},
        "environment": {"trl": installed_version("trl")},  # None: TRL is optional for scoring a saved capture
    }
    env = environment("cpu", dtype, "float32")  # the capture ran here: these are its versions
    metadata = json.loads(json.dumps({"producer": "TRL GRPOTrainer capture", "sampler": "vLLM", "dtype": dtype,
                                      **{k: env[k] for k in ("vllm", "torch", "transformers")},
                                      "trainer_dtype": "float32", "trainer_under_test": TRAINER_UNDER_TEST,
                                      REPORT_FACTS: facts}))
    total = Summary(files=[SOURCE], metadata=[{"file": SOURCE, **metadata}])
    first_row = 0
    for x in scored:
        part = x["part"]
        for acc in part.groups.values():
            acc.first_order = (0, first_row + acc.first_order[1], 0)
        first_row += part.rows
        total.merge(part)
    return build_report(total, th, options=Options(n_listed=th.max_violations_listed), paths=[])


def write_capture_report(sequences: Sequence[Captured], out: str | Path, *, label: str = "trl",
                         plots: bool = False) -> ReportJson:
    """Score and write report.json / report.md under ``out``; returns the report."""
    from parity.report.schema import write_report

    report = score_capture(sequences, label=label)
    write_report(report, Path(out), plots=plots)
    return report


def logged_columns(sequences: Sequence[Captured]) -> tuple[pa.Table, int]:
    """The capture as a run's own logs: a pyarrow table of the records format's minimal columns (README, "judge
    your run's logs"), the sampler's and TRL's IS numerator's log-prob of each token TRL's mask keeps, one
    row per sequence with its step; and the count of masked-out tokens dropped."""
    import json

    import pyarrow as pa

    rows, dropped = [], 0
    for s in sequences:
        if s.get("sampling_logps") is None:
            raise UsageError(f"sequence {s['index']} of step {s['step']} has no sampler log-probs (TRL got none from vLLM)")
        m = _tensor(s, "mask").bool()
        dropped += int((~m).sum())
        if not bool(m.any()):
            continue
        spec = SamplingSpec.from_dict(_spec(s))
        rows.append({"schema_version": 1, "prompt_ids": _ints(s, "prompt_ids"),
                     "completion_ids": [t for t, k in zip(_ints(s, "completion_ids"), m.tolist(), strict=True) if k],
                     **spec.to_dict(),
                     "step": _int(s, "step"), "sampler_logprobs": _tensor(s, "sampling_logps")[m].float().tolist(),
                     "trainer_logprobs": _tensor(s, "is_logps")[m].double().tolist()})
    vocab = next((int(_tensor(s, "logits").shape[-1]) for s in sequences if s.get("logits") is not None), None)
    meta = {"schema_version": 1, "sampler": "vLLM", "dtype": str(sequences[0]["sampler_dtype"]) if sequences else None,
            "trainer_dtype": "float32", **({"vocab_size": vocab} if vocab else {})}
    schema = pa.schema([("schema_version", pa.int32()), ("prompt_ids", pa.list_(pa.int32())),
                        ("completion_ids", pa.list_(pa.int32())), ("temperature", pa.float64()), ("top_k", pa.int64()),
                        ("top_p", pa.float64()), ("min_p", pa.float64()), ("repetition_penalty", pa.float64()),
                        ("presence_penalty", pa.float64()), ("frequency_penalty", pa.float64()), ("step", pa.int64()),
                        ("sampler_logprobs", pa.list_(pa.float32())), ("trainer_logprobs", pa.list_(pa.float64()))],
                       metadata={"parity.records": json.dumps(meta)})
    return pa.Table.from_pylist(rows, schema=schema), dropped


def judge_logged(sequences: Sequence[Captured], *, thresholds: Thresholds | None = None) -> ScenarioJson:
    """The verdict of TRL's logged per-token tensors alone (no logits, no kept set): the scenario entry of the
    two-column gates (``logprob_mean_bias``, ``trainer_support``), as ``parity analyze`` gives it on those
    logs, with ``masked_tokens``."""
    import json

    from parity.analyze.shards import batch_summarizer
    from parity.judge.accumulators import Summary
    from parity.judge.token_columns import Options
    from parity.judge.verdict import judge

    table, dropped = logged_columns(sequences)
    meta = json.loads(table.schema.metadata[b"parity.records"])
    dtype = meta.get("dtype") or "bfloat16"
    th = thresholds or Thresholds.for_dtype(dtype if dtype in ("float32", "bfloat16", "float16") else "bfloat16")
    summary = Summary().merge(batch_summarizer(meta, 0, Options(n_listed=th.max_violations_listed))(table))
    (verdict,) = judge(summary, th, trainer_name=TRAINER_UNDER_TEST)
    entry = verdict.entry
    entry["masked_tokens"] = dropped
    return entry
