"""The records file format's schema (schema_version 1): the column table, the file metadata key and the Arrow types.

README's "The records format" lists every column; docs/records.md, section 2, describes the layout."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from parity.errors import UsageError

SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = (1,)
METADATA_KEY = b"parity.records"


@dataclass(frozen=True)
class Column:
    name: str
    type: pa.DataType
    required: bool
    per: str  # "sequence", "token" (one value per completion token), "kept" (aligned with kept_ids), "offsets",
    # "routed" ((P + L - 1) x routed_layers x routed_top_k expert ids)
    doc: str


_I32 = pa.list_(pa.int32())
_F32 = pa.list_(pa.float32())
_F64 = pa.list_(pa.float64())
_BOOL = pa.list_(pa.bool_())

COLUMNS: tuple[Column, ...] = (
    Column("schema_version", pa.int32(), True, "sequence", "format version of this row; this parity reads 1"),
    Column("prompt_ids", _I32, True, "sequence", "prompt token ids (may be empty unless re-scoring with --model)"),
    Column("completion_ids", _I32, True, "sequence", "sampled token ids, L of them"),
    Column("temperature", pa.float64(), True, "sequence", "sampling temperature in [0, 2]; 0 = greedy"),
    Column("top_k", pa.int64(), True, "sequence", "0 or -1 = off, else >= 1"),
    Column("top_p", pa.float64(), True, "sequence", "in (0, 1]; 1 = off"),
    Column("min_p", pa.float64(), True, "sequence", "in [0, 1]; 0 = off"),
    Column("sampler_logprobs", _F32, True, "token", "the sampler's processed log-prob of each sampled token"),
    Column("repetition_penalty", pa.float64(), False, "sequence", "> 0; 1 = off (absent: 1); over prompt and output tokens"),
    Column("presence_penalty", pa.float64(), False, "sequence", "in [-2, 2]; 0 = off (absent: 0)"),
    Column("frequency_penalty", pa.float64(), False, "sequence", "in [-2, 2]; 0 = off (absent: 0)"),
    Column("scenario", pa.string(), False, "sequence", "group name in the report (default: the spec's label)"),
    Column("prompt_index", pa.int64(), False, "sequence", "prompt number, used to name positions in verdicts"),
    Column("seed", pa.int64(), False, "sequence", "per-request sampling seed"),
    Column("step", pa.int64(), False, "sequence", "training step the rollout belongs to"),
    Column("kept_ids", _I32, False, "kept", "the sampler's kept set S_q of every position, back to back"),
    Column("kept_offsets", pa.list_(pa.int64()), False, "offsets", "L + 1 offsets into kept_ids: position t is [o[t], o[t+1])"),
    Column("kept_logprobs", _F32, False, "kept", "the sampler's processed log-probs of kept_ids"),
    Column("kept_incomplete", _BOOL, False, "token", "True where the captured head may not hold the whole support"),
    Column("trainer_logprobs", _F64, False, "token", "the trainer under test's log-prob of each sampled token"),
    Column("trainer_token_ids", _I32, False, "token", "the token the trainer scored at each position (absent: completion_ids)"),
    Column("trainer_full_logprobs", _F64, False, "token", "log_softmax(z / T)[y] over the whole vocabulary"),
    Column("trainer_replay_logprobs", _F64, False, "token", "trainer logits renormalised over S_q"),
    Column("trainer_recompute_logprobs", _F64, False, "token", "trainer logits renormalised over the recomputed filters"),
    Column("trainer_log_s", _F64, False, "token", "log S predicted from the trainer's logits: logsumexp over S_q - logsumexp"),
    Column("trainer_penalty_term", _F64, False, "token", "full(penalised z)[y] - full(z)[y]: the penalties' part of a "
           "naive trainer's bias, beside log S (0 when no penalty is set)"),
    Column("trainer_recompute_forced", _BOOL, False, "token", "recompute had to force-include the sampled token"),
    Column("trainer_recompute_support_equal", _BOOL, False, "token", "the recomputed support equals S_q"),
    Column("trainer_recompute_support_size", _I32, False, "token", "how many tokens recompute normalised over "
           "(S_p with the sampled token), >= 1"),
    Column("trainer_recompute_boundary", _F64, False, "token", "where the recomputed support differs from S_q only "
           "at the cutoff, how far the boundary tokens' mass moves recompute (logsumexp over S_q less logsumexp over "
           "the recomputed set with the sampled token, in absolute value), else 0; >= 0. Recompute's drift bound is "
           "trainer_bound plus this"),
    Column("trainer_bound", _F64, False, "token", "rounding bound on |trainer - sampler| over S_q, >= 0 "
           "(parity.core.error_model.logprob_bound on the trainer's scaled logits)"),
    Column("trainer_bound_full", _F64, False, "token", "the same bound over the whole vocabulary (the naive estimator's), >= 0"),
    Column("trainer_systematic", _F64, False, "token", "what of |trainer - sampler| can point one way, >= 0 "
           "(parity.core.error_model.systematic_bound); absent: the float32 storage term 2 u |lp| alone"),
    Column("sampler_log_s_lo", _F64, False, "token", "log S from the sampler's side lies in [lo, hi] (raw-logits pass or the "
           "top_p bracket); lo may be -inf"),
    Column("sampler_log_s_hi", _F64, False, "token", "upper end of the sampler-side log S interval; may be +inf"),
    Column("sampler_log_s_source", pa.string(), False, "sequence", "where the sampler-side log S comes from: raw_logits, "
           "top_p_bracket or unfiltered"),
    Column("trainer_kept_logits", _F32, False, "kept", "the trainer's logits (after any penalties, before temperature) at kept_ids"),
    Column("routed_experts", _I32, False, "routed", "MoE: the sampler's top-k expert ids per position a forward ran "
           "(prompt and completion but the last token), layer, rank: (P + L - 1) x routed_layers x routed_top_k; "
           "-1 where no forward ran (a prefix-cache hit)"),
    Column("routed_layers", pa.int32(), False, "sequence", "MoE layers in routed_experts, >= 1"),
    Column("routed_top_k", pa.int32(), False, "sequence", "experts per token and layer in routed_experts, >= 1"),
    Column("routed_num_experts", pa.int32(), False, "sequence", "experts per layer, > routed_top_k: ids are < it"),
)
BY_NAME: dict[str, Column] = {c.name: c for c in COLUMNS}
REQUIRED = tuple(c.name for c in COLUMNS if c.required)
KEPT_GROUP = ("kept_ids", "kept_offsets", "kept_logprobs")  # present together or not at all
ROUTED_GROUP = ("routed_experts", "routed_layers", "routed_top_k", "routed_num_experts")  # the same
TRAINER_TOKEN_COLUMNS = tuple(c.name for c in COLUMNS if c.name.startswith("trainer_") and c.per == "token")
NONNEGATIVE_COLUMNS = ("trainer_bound", "trainer_bound_full", "trainer_systematic", "trainer_recompute_boundary")  # finite and >= 0
SAMPLER_LOG_S_SOURCES = ("raw_logits", "top_p_bracket", "unfiltered")


def records_schema(metadata: Mapping[str, Any] | None = None) -> pa.Schema:
    """The pyarrow schema of a records file (every column; optional ones nullable)."""
    fields = [pa.field(c.name, c.type, nullable=not c.required) for c in COLUMNS]
    blob = json.dumps({"schema_version": SCHEMA_VERSION, "metadata": dict(metadata or {})}, sort_keys=True)
    return pa.schema(fields, metadata={METADATA_KEY: blob.encode()})


def nearest_note(name: str, present: Iterable[str]) -> str:
    """`` (the records have X: misspelt?)`` where a column of ``present`` is near ``name`` (a misspelling:
    ``trainer_logps`` for ``trainer_logprobs``; difflib's ratio at least 0.6), else ``""``."""
    import difflib

    near = difflib.get_close_matches(name, [c for c in present if c != name], n=1, cutoff=0.6)
    if not near:
        return ""
    return f" (the records have a column {near[0]!r}, the closest present: a misspelling of {name}?)"


def require_columns(names: Iterable[str], source: str) -> None:
    """Refuse a file or batch without every required column, naming each missing one and, where a column
    present is near it, that column (a misspelling)."""
    present = set(names)
    missing = [c for c in REQUIRED if c not in present]
    if missing:
        unknown = present - set(BY_NAME)
        raise RecordsError(
            f"{source}: missing required column(s) {', '.join(missing)}"
            + "".join(nearest_note(c, unknown) for c in missing)
            + f": a records file (schema_version {SCHEMA_VERSION}) needs {', '.join(REQUIRED)}")


class RecordsError(UsageError):
    """Bad records input. The message names the file, the row, the column, the value and what is allowed."""


def where_in(source: str, row: int | None = None, column: str | None = None, position: int | None = None) -> str:
    parts = ((" row", row), (" column", column), (" position", position))
    return source + "".join(f"{label} {value}" for label, value in parts if value is not None)
