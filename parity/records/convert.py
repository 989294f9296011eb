"""Converters into the records format from what engines and trainers hand out: vLLM's offline outputs,
TRL's ``GRPOTrainer`` tensors and parity's own records. Each returns a ``pyarrow.Table`` in the records
schema and none imports vLLM (docs/records.md, section 4)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch

from parity.core.capture import Heads, support_from_heads
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.errors import UsageError
from parity.records.schema import RecordsError
from parity.records.vllm_outputs import heads_of_output, spec_of_params
from parity.records.write import records_table

if TYPE_CHECKING:
    from parity.core.token_table import TokenTable

# A vocabulary no model reaches: with no vocab_size given, only logprobs=-1 counts as the full vocabulary.
_UNKNOWN_VOCAB = 2**31 - 1


def _kept_columns(kept: torch.Tensor, logprobs: torch.Tensor, incomplete: torch.Tensor | None = None,
                  logits: torch.Tensor | None = None) -> dict[str, object]:
    """Padded kept ids ``[L, K]`` (-1 = none), their aligned log-probs (and the trainer's logits at them)
    as the records' kept-set columns: the ids back to back, L + 1 offsets, the values alike."""
    mask = kept >= 0
    offsets = [0] + torch.cumsum(mask.sum(dim=1), 0).tolist()
    out: dict[str, object] = {"kept_ids": kept[mask].tolist(), "kept_offsets": offsets,
                              "kept_logprobs": logprobs[mask].tolist()}
    if incomplete is not None:
        out["kept_incomplete"] = incomplete.tolist()
    if logits is not None:
        out["trainer_kept_logits"] = logits[mask].tolist()
    return out


def heads_row(h: Heads, prompt: Sequence[int], spec: SamplingSpec, *, requested: int, vocab_size: int,
              **fields: object) -> dict[str, object]:
    """The record row of one sequence as the engine returned it (``fields``: scenario, prompt_index, seed);
    kept-set columns from its top-K heads, none for an unfiltered spec or ``requested=0``
    (docs/records.md, section 4)."""
    row = {**fields, "prompt_ids": [int(t) for t in prompt], "completion_ids": h.completion_ids,
           **spec.to_dict(), "sampler_logprobs": h.sampled_logprobs}
    if requested != 0 and spec.effective().filtered:
        cap = support_from_heads(h.completion_ids, h.head_ids, h.head_logprobs, requested=requested,
                                 vocab_size=vocab_size, rows=h.rows)
        row.update(_kept_columns(cap.kept_ids, cap.kept_logprobs, cap.incomplete))
    return row


# -- vLLM offline API --------------------------------------------------------------------------------


def from_request_outputs(outputs: Sequence[Any], params: Any, *, vocab_size: int | None = None,
                         scenario: str | None = None) -> pa.Table:
    """Records from ``LLM.generate`` outputs (vLLM's ``RequestOutput``s, typed ``Any``: records import no
    engine, not even for types), one row per completion (``n > 1`` gives several rows).
    ``params``: the ``SamplingParams`` used, one or one per output (those ``generate_with_capture`` returns);
    ``vocab_size`` tells when K covers the vocabulary. Engine setup: README, "Records from your own vLLM engine"."""
    outs = list(outputs)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(outs)
    if len(plist) != len(outs):
        raise UsageError(f"from_request_outputs: {len(plist)} SamplingParams for {len(outs)} outputs: allowed one or one per output")
    vocab = int(vocab_size) if vocab_size else _UNKNOWN_VOCAB
    rows = []
    for i, (out, p) in enumerate(zip(outs, plist, strict=True)):
        spec = spec_of_params(p)
        requested = int(p.logprobs) if getattr(p, "logprobs", None) is not None else 0
        prompt = out.prompt_token_ids or []
        for j, comp in enumerate(out.outputs):
            where = f"output {i} (request {getattr(out, 'request_id', i)}) completion {j}"
            h = heads_of_output(comp, requested, where, error=RecordsError)
            rows.append(heads_row(h, prompt, spec, requested=requested, vocab_size=vocab,
                                  scenario=scenario, prompt_index=i, seed=getattr(p, "seed", None)))
    return records_table(rows)


# -- TRL ---------------------------------------------------------------------------------------------

TRL_TRAINER_COLUMNS = ("trainer_logprobs", "trainer_full_logprobs", "trainer_replay_logprobs")


def _prefix_length(mask_row: torch.Tensor, where: str) -> int:
    """Length of a right-padded row's 1-prefix; a hole in the mask is refused (positions would shift)."""
    m = mask_row.bool()
    n = int(m.sum())
    if bool(m[n:].any()) or not bool(m[:n].all()):
        first_gap = int((~m).nonzero()[0]) if bool((~m).any()) else n
        raise RecordsError(f"{where}: the mask has a hole at position {first_gap} (1s after a 0): allowed a "
                           "right-padded mask (1 for the completion's tokens, then 0s)")
    return n


def _check_trl_shapes(b: int, width: int, completion_mask: torch.Tensor, old_per_token_logps: torch.Tensor,
                      sampling_per_token_logps: torch.Tensor, kept_ids: torch.Tensor | None,
                      kept_logprobs: torch.Tensor | None, kept_logits: torch.Tensor | None,
                      kept_incomplete: torch.Tensor | None) -> None:
    """from_trl's tensors: every [B, L] one of completion_ids' shape, the kept-set ones [B, L, K] and together."""
    for name, t in (("completion_mask", completion_mask), ("old_per_token_logps", old_per_token_logps),
                    ("sampling_per_token_logps", sampling_per_token_logps)):
        if tuple(t.shape) != (b, width):
            raise RecordsError(f"from_trl: {name} has shape {tuple(t.shape)}: allowed completion_ids' shape {(b, width)}")
    if (kept_ids is None) != (kept_logprobs is None):
        raise RecordsError("from_trl: kept_ids and kept_logprobs come together: allowed both or neither")
    if kept_ids is not None:
        for name, kt in (("kept_ids", kept_ids), ("kept_logprobs", kept_logprobs), ("kept_logits", kept_logits)):
            if kt is not None and (kt.dim() != 3 or tuple(kt.shape[:2]) != (b, width) or kt.shape[2] != kept_ids.shape[2]):
                raise RecordsError(f"from_trl: {name} has shape {tuple(kt.shape)}: allowed [B, L, K] = [{b}, {width}, K]")
    elif kept_logits is not None or kept_incomplete is not None:
        raise RecordsError("from_trl: kept_logits/kept_incomplete need kept_ids and kept_logprobs")


def from_trl(
    *,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    old_per_token_logps: torch.Tensor,
    sampling_per_token_logps: torch.Tensor,
    spec: SamplingSpec,
    prompt_ids: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    kept_ids: torch.Tensor | None = None,
    kept_logprobs: torch.Tensor | None = None,
    kept_incomplete: torch.Tensor | None = None,
    kept_logits: torch.Tensor | None = None,
    trainer_column: str = "trainer_logprobs",
    scenario: str | None = None,
    step: int | None = None,
) -> pa.Table:
    """Records from one TRL ``GRPOTrainer`` batch: ``[B, L]`` right-padded completion ids, mask and log-probs,
    ``[B, P]`` left-padded prompts, an optional kept set ``[B, L, K]`` (-1 padded; ``kept_incomplete`` ``[B, L]``).
    ``old_per_token_logps`` is written as ``trainer_column`` (one of :data:`TRL_TRAINER_COLUMNS`); NaN inside the
    mask raises :class:`RecordsError` (shapes and columns: docs/records.md, section 4)."""
    if trainer_column not in TRL_TRAINER_COLUMNS:
        raise UsageError(f"trainer_column={trainer_column!r} is invalid: allowed {', '.join(TRL_TRAINER_COLUMNS)}")
    b, width = completion_ids.shape
    _check_trl_shapes(b, width, completion_mask, old_per_token_logps, sampling_per_token_logps, kept_ids,
                      kept_logprobs, kept_logits, kept_incomplete)
    rows = []
    for i in range(b):
        n = _prefix_length(completion_mask[i], f"from_trl: completion_mask row {i}")
        sampler = sampling_per_token_logps[i, :n].double()
        trainer = old_per_token_logps[i, :n].double()
        for name, v in (("sampling_per_token_logps", sampler), ("old_per_token_logps", trainer)):
            if bool(torch.isnan(v).any()):
                pos = int(torch.isnan(v).nonzero()[0])
                raise RecordsError(f"from_trl: {name} is NaN at sequence {i} position {pos} (inside the "
                                   "completion mask): allowed finite log-probs (TRL writes NaN where vLLM "
                                   "returned no log-prob)")
        prompt: list[int] = []
        if prompt_ids is not None:
            prompt = (prompt_ids[i] if prompt_mask is None else prompt_ids[i][prompt_mask[i].bool()]).tolist()
        row: dict[str, object] = {
            "scenario": scenario, "prompt_index": i, "step": step, "prompt_ids": prompt,
            "completion_ids": completion_ids[i, :n].tolist(), **spec.to_dict(),
            "sampler_logprobs": sampler.float().tolist(), trainer_column: trainer.float().tolist(),
        }
        if kept_ids is not None:
            assert kept_logprobs is not None
            inc = None if kept_incomplete is None else kept_incomplete[i, :n].bool()
            z = None if kept_logits is None else kept_logits[i, :n].float()
            row.update(_kept_columns(kept_ids[i, :n].long(), kept_logprobs[i, :n].float(), inc, z))
        rows.append(row)
    return records_table(rows)


# -- parity's own records and run tables -------------------------------------------------------------


def from_sequence_records(records: Sequence[SequenceRecord], *, scenario: str | None = None,
                          table: TokenTable | None = None) -> pa.Table:
    """Records of sampler-side :class:`SequenceRecord` s, with the trainer's estimates when ``table`` (the run's
    :class:`parity.core.token_table.TokenTable` of these records) is given: its columns, and from ``table.kept_seen``
    the kept sets and the logits at the kept ids as the (possibly planted) trainer saw them (docs/records.md,
    section 4)."""
    rows = []
    seen = table.kept_seen if table is not None and table.kept_seen else None
    split = None
    if table is not None:
        lengths = [r.length for r in records]
        if list(table.seq_lengths) != lengths:
            raise UsageError(f"table sequence lengths {list(table.seq_lengths)[:8]}... do not match the records' {lengths[:8]}...")
        cols = {
            "trainer_full_logprobs": table.full, "trainer_replay_logprobs": table.replay,
            "trainer_recompute_logprobs": table.recompute, "trainer_log_s": table.log_s,
            "trainer_penalty_term": table.penalty, "trainer_recompute_forced": table.forced,
            "trainer_recompute_support_equal": table.recompute_support_equal,
            "trainer_recompute_support_size": table.recompute_support_size,
            "trainer_recompute_boundary": table.recompute_boundary, "trainer_bound": table.bound,
            "trainer_bound_full": table.bound_full, "trainer_systematic": table.systematic,
        }
        if table.user is not None:
            cols["trainer_logprobs"] = table.user
        split = {k: torch.split(v, lengths) for k, v in cols.items()}
        tokens = torch.split(table.token, lengths)
        s_lo, s_hi = torch.split(table.s_lo, lengths), torch.split(table.s_hi, lengths)
    for i, r in enumerate(records):
        row: dict[str, object] = {
            "scenario": scenario, "prompt_index": r.prompt_index, "seed": r.seed,
            "prompt_ids": list(r.prompt_ids), "completion_ids": list(r.completion_ids), **r.spec.to_dict(),
            "sampler_logprobs": r.logprobs.float().tolist(),
        }
        kept, logits_at = seen[i] if seen is not None else (r.kept_ids, None)
        if kept is not None and r.kept_logprobs is not None:
            incomplete = r.incomplete if r.incomplete is not None else torch.zeros(r.length, dtype=torch.bool)
            row.update(_kept_columns(kept, r.kept_logprobs.float(), incomplete, logits_at))
        routed = r.extras.get("routed_experts")
        if routed is not None:  # [P + L - 1, layers, top_k] (parity.engines.routed_experts)
            row.update(routed_experts=routed.reshape(-1).tolist(), routed_layers=int(routed.shape[1]),
                       routed_top_k=int(routed.shape[2]), routed_num_experts=int(r.extras["routed_num_experts"]))
        if split is not None:
            for k, parts in split.items():
                v = parts[i]
                row[k] = v.bool().tolist() if v.dtype == torch.bool else v.double().tolist()
            if tokens[i].tolist() != list(r.completion_ids):
                row["trainer_token_ids"] = tokens[i].tolist()
            lo, hi = s_lo[i], s_hi[i]
            if r.length and bool(torch.isfinite(lo).all()):
                row["sampler_log_s_lo"], row["sampler_log_s_hi"] = lo.tolist(), hi.tolist()
                row["sampler_log_s_source"] = _log_s_source(r)
        rows.append(row)
    return records_table(rows)


def _log_s_source(r: SequenceRecord) -> str:
    """Which sampler-side source :func:`parity.core.token_table.build_table` used for this record."""
    if not r.spec.effective().filtered:
        return "unfiltered"
    return "raw_logits" if r.extras and r.extras.get("sampler_log_s") is not None else "top_p_bracket"


def to_sequence_records(batch: Any, rows: Sequence[int] | None = None, *, source: str = "records") -> list[SequenceRecord]:
    """Rows of a validated :class:`parity.records.arrays.RecordsBatch` as sampler-side SequenceRecords (kept sets
    padded ``[L, K]`` with -1; ``prompt_index`` from the file's column when present, else the row number)."""
    out = []
    idx = range(batch.n_rows) if rows is None else rows
    for i in idx:
        a, b = int(batch.token_offsets[i]), int(batch.token_offsets[i + 1])
        n = b - a
        kept = kept_lp = incomplete = None
        if batch.kept is not None and bool(batch.kept.valid[i]):
            kto = batch.kept_token_offsets[a : b + 1]
            counts = np.diff(kto)
            width = max(int(counts.max()) if n else 1, 1)
            kept = torch.full((n, width), -1, dtype=torch.long)
            kept_lp = torch.full((n, width), -math.inf, dtype=torch.float32)
            if n and int(kto[-1]) > int(kto[0]):
                pos = np.repeat(np.arange(n), counts)
                col = np.arange(int(kto[-1]) - int(kto[0])) - np.repeat(kto[:-1] - kto[0], counts)
                kept[pos, col] = torch.from_numpy(batch.kept.values[kto[0] : kto[-1]].astype(np.int64))
                kept_lp[pos, col] = torch.from_numpy(batch.kept_logprobs[kto[0] : kto[-1]].astype(np.float32))
            incomplete = torch.from_numpy(batch.kept_incomplete[a:b].copy())
        pidx = int(batch.prompt_index[i]) if batch.prompt_index is not None and batch.prompt_index[i] >= 0 else batch.first_row + i
        out.append(SequenceRecord(
            source=source, prompt_index=pidx, prompt_ids=batch.prompt.row(i).astype(np.int64).tolist(),
            completion_ids=batch.completion.row(i).astype(np.int64).tolist(), spec=batch.spec_of(i),
            seed=int(batch.seed[i]) if batch.seed is not None else -1,
            logprobs=torch.from_numpy(batch.sampler_logprobs[a:b].copy()),
            kept_ids=kept, kept_logprobs=kept_lp, incomplete=incomplete,
        ))
    return out
