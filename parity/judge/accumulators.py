"""Mergeable summaries of records, filled one batch at a time by :mod:`parity.judge.token_columns`.

:meth:`Summary.merge` is the reduce step; :meth:`Summary.to_json` / :meth:`Summary.from_json` carry a
map step's output between machines (docs/records.md, sections 1 and 5)."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from parity.core.error_model import StatedFacts, stated_facts
from parity.core.spec import SamplingSpec
from parity.core.violation import Position
from parity.errors import UsageError
from parity.judge.steps import StepAcc, merge_steps
from parity.judge.streams import (
    HEAD_BINS,
    HIST_BINS,
    BoundStream,
    DiffStream,
    First,
    Ratios,
    RatioStream,
    ViewMatch,
    Worst,
)
from parity.records.casts import CastNote
from parity.report.blocks import dense_hist, sparse_hist

SUMMARY_VERSION = 6  # 4: per-step accumulators (parity.judge.steps); 5: the two-column mean-bias sums; 6: ties and one-sided supports

DIFFS = ("naive", "gap", "replay", "recompute", "user", "user_gap", "penalty")
BOUNDED = ("replay", "recompute", "user", "naive")
FLAGS = ("replay_support", "recompute_support", "incomplete", "sampled_outside", "token_mismatch")
# The first positions kept per flag, and per two-column gate (the tokens outside the trainer's support).
FIRSTS = (*FLAGS, "trainer_support")
# Inputs a sequence may lack (parity.judge.verdict names each and what it is for).
INPUTS = ("kept", "replay", "recompute", "recompute_support", "full", "log_s", "user", "forced", "kl", "bound",
          "bound_full", "sampler_log_s")


@dataclass
class ScenarioAcc:
    """Everything one scenario's report and verdict need, as mergeable sums."""

    name: str
    spec: dict[str, float]  # SamplingSpec.to_dict
    first_order: tuple[int, int, int]
    n_listed: int
    sequences: int = 0
    tokens: int = 0
    compared: int = 0
    roundoff: float = 0.0
    lacking: dict[str, int] = field(default_factory=lambda: dict.fromkeys(INPUTS, 0))
    streams: dict[str, DiffStream] = field(default_factory=dict)
    bounds: dict[str, BoundStream] = field(default_factory=dict)
    log_s_n: int = 0
    log_s_sum: float = 0.0
    log_s_min: float = math.inf
    log_s_sum_exp: float = 0.0
    replay_ok: int = 0
    replay_n: int = 0
    recompute_eq: int = 0
    recompute_n: int = 0
    forced: int = 0
    ties_at_k: int = 0  # proven positions where |S_q| > top_k: the sampler kept tokens tied at the k-th value
    ties_dropped: int = 0  # of those, where recompute normalised over fewer tokens than S_q
    recompute_smaller: int = 0  # positions where recompute's set differs from S_q and is smaller
    recompute_larger: int = 0  # ... and is larger
    recompute_sized: int = 0  # proven positions whose recompute set size the records hold
    ratios: dict[str, Ratios] = field(default_factory=lambda: {k: Ratios() for k in ("naive", "replay", "recompute", "user")})
    kl_n: int = 0
    kl_sum: float = 0.0
    kl_max: float = 0.0
    tv_sum: float = 0.0
    tv_max: float = 0.0
    incomplete: int = 0
    sampled_outside: int = 0
    token_mismatch: int = 0
    captured: int = 0
    support_sum: int = 0
    support_max: int = 0
    mass_off: int = 0
    mass_off_worst: float = 1.0  # the kept-set mass farthest from 1
    bound_n: int = 0
    bound_sum: float = 0.0
    bound_max: float = 0.0
    s_n: int = 0
    s_lo_sum: float = 0.0
    s_hi_sum: float = 0.0
    s_sources: list[str] = field(default_factory=list)
    naive_gap_max: float = -math.inf
    drift_n: int = 0
    drift_sum: float = 0.0
    drift_max: float = -math.inf
    drift_replay_max: float = -math.inf
    views: dict[str, ViewMatch] = field(default_factory=dict)
    first: dict[str, First] = field(default_factory=dict)
    ratio: RatioStream = field(default_factory=RatioStream)  # the two log-prob columns' mean-bias gate
    vocab_size: int = 0  # the records' stated vocabulary size (0: not stated)
    dtypes: list[str] = field(default_factory=list)  # the stated dtypes of both sides ("" where not stated)
    unstepped: int = 0  # sequences without a training step (no step column, null or negative)
    steps: dict[int, StepAcc] = field(default_factory=dict)  # the training-log view, per step

    def __post_init__(self) -> None:
        for s in DIFFS:
            self.streams.setdefault(s, DiffStream())
        for s in BOUNDED:
            self.bounds.setdefault(s, BoundStream(worst=Worst(self.n_listed)))
        for f in FIRSTS:
            self.first.setdefault(f, First(self.n_listed))

    def facts(self) -> StatedFacts:
        """The stated facts the two-column gate uses (:func:`parity.core.error_model.stated_facts`)."""
        e = SamplingSpec.from_dict(self.spec).effective()
        sampler_dtype, trainer_dtype = (self.dtypes + ["", ""])[:2]
        return stated_facts(self.vocab_size, sampler_dtype, trainer_dtype, e.top_k if e.uses_top_k else 0)

    SUMS = ("sequences", "tokens", "compared", "log_s_n", "replay_ok", "replay_n", "recompute_eq", "recompute_n", "forced",
            "kl_n", "incomplete", "sampled_outside", "token_mismatch", "captured", "support_sum", "mass_off", "bound_n",
            "s_n", "drift_n", "log_s_sum", "log_s_sum_exp", "kl_sum", "tv_sum", "bound_sum", "s_lo_sum", "s_hi_sum",
            "drift_sum", "unstepped", "ties_at_k", "ties_dropped", "recompute_smaller", "recompute_larger", "recompute_sized")
    MAXES = ("kl_max", "tv_max", "support_max", "bound_max", "naive_gap_max", "drift_max", "drift_replay_max", "roundoff")

    def merge(self, o: ScenarioAcc) -> None:
        self.first_order = min(self.first_order, o.first_order)
        for k in self.SUMS:
            setattr(self, k, getattr(self, k) + getattr(o, k))
        for k in self.MAXES:
            setattr(self, k, max(getattr(self, k), getattr(o, k)))
        self.log_s_min = min(self.log_s_min, o.log_s_min)
        if abs(o.mass_off_worst - 1.0) > abs(self.mass_off_worst - 1.0):
            self.mass_off_worst = o.mass_off_worst
        self.s_sources = sorted(set(self.s_sources) | set(o.s_sources))
        for k in INPUTS:
            self.lacking[k] += o.lacking[k]
        for k in DIFFS:
            self.streams[k].merge(o.streams[k])
        for k in BOUNDED:
            self.bounds[k].merge(o.bounds[k])
        for k in self.ratios:
            self.ratios[k].merge(o.ratios[k])
        for k in FIRSTS:
            self.first[k].merge(o.first[k])
        self.ratio.merge(o.ratio)
        self.vocab_size = max(self.vocab_size, o.vocab_size)
        if self.dtypes != o.dtypes:  # files that state different dtypes: a side counts as not stated
            self.dtypes = [a if a == b else "" for a, b in zip(self.dtypes or o.dtypes, o.dtypes or self.dtypes, strict=False)]
        for k, v in o.views.items():
            self.views.setdefault(k, ViewMatch()).merge(v)
        merge_steps(self.steps, o.steps)


@dataclass
class Summary:
    """Mergeable summary of any number of record batches: per-scenario accumulators plus provenance
    (``casts``: what reading float64 as float32 changed, per ``source\x1fcolumn``; ``page_checksums``: per
    file, None where it could not be told)."""

    groups: dict[str, ScenarioAcc] = field(default_factory=dict)
    rows: int = 0
    tokens: int = 0
    files: list[str] = field(default_factory=list)
    metadata: list[dict[str, Any]] = field(default_factory=list)
    columns: set[str] = field(default_factory=set)
    ignored_columns: set[str] = field(default_factory=set)
    casts: dict[str, CastNote] = field(default_factory=dict)
    page_checksums: dict[str, bool | None] = field(default_factory=dict)

    def merge(self, other: Summary) -> Summary:
        for k, acc in other.groups.items():
            if k in self.groups:
                self.groups[k].merge(acc)
            else:
                self.groups[k] = acc
        self.rows += other.rows
        self.tokens += other.tokens
        self.files += [f for f in other.files if f not in self.files]
        self.metadata += other.metadata
        self.columns |= other.columns
        self.ignored_columns |= other.ignored_columns
        for k, note in other.casts.items():
            if k in self.casts:
                self.casts[k].merge(note)
            else:
                self.casts[k] = CastNote(**note.__dict__)
        self.page_checksums.update(other.page_checksums)
        return self

    # -- serialisation: the map step's output on a distributed engine --------------------------------

    def to_json(self) -> str:
        return json.dumps(_encode(self), allow_nan=True)

    @classmethod
    def from_json(cls, text: str) -> Summary:
        data = json.loads(text)
        if data.get("summary_version") != SUMMARY_VERSION:
            raise UsageError(f"summary_version {data.get('summary_version')!r} is not supported: allowed {SUMMARY_VERSION}")
        return _decode(data)


# ScenarioAcc's fields that are not plain values: encoded and decoded one by one.
_NESTED = ("streams", "bounds", "ratios", "first", "lacking", "views", "steps", "ratio")


def _encode(s: Summary) -> dict[str, object]:
    def stream(d: DiffStream) -> dict[str, object]:
        return {**d.__dict__, "hist": sparse_hist(d.hist)}

    def bounded(b: BoundStream) -> dict[str, object]:
        worst = {"n": b.worst.n, "items": [[k, list(o), asdict(p)] for k, o, p in b.worst.items]}
        return {**b.__dict__, "worst": worst, "hist": sparse_hist(b.hist)}

    groups = {}
    for k, a in s.groups.items():
        plain = {f: getattr(a, f) for f in a.__dataclass_fields__ if f not in _NESTED}
        plain["first_order"] = list(a.first_order)
        groups[k] = {
            **plain,
            "lacking": dict(a.lacking),
            "streams": {n: stream(d) for n, d in a.streams.items()},
            "bounds": {n: bounded(b) for n, b in a.bounds.items()},
            "ratios": {n: r.__dict__ for n, r in a.ratios.items()},
            "first": {n: {"n": f.n, "items": [[list(o), asdict(p)] for o, p in f.items]}
                      for n, f in a.first.items()},
            "views": {n: [v.known, v.over, v.diff_sum] for n, v in a.views.items()},
            "steps": {str(step): acc.to_json() for step, acc in a.steps.items()},
            "ratio": dict(a.ratio.__dict__),
        }
    return {
        "summary_version": SUMMARY_VERSION,
        "rows": s.rows,
        "tokens": s.tokens,
        "files": s.files,
        "metadata": s.metadata,
        "columns": sorted(s.columns),
        "ignored_columns": sorted(s.ignored_columns),
        "casts": {k: dict(c.__dict__) for k, c in s.casts.items()},
        "page_checksums": dict(s.page_checksums),
        "groups": groups,
    }


def _decode(data: dict[str, Any]) -> Summary:
    def stream(d: dict[str, Any]) -> DiffStream:
        return DiffStream(**{**d, "hist": dense_hist(d["hist"], HIST_BINS)})

    def bounded(d: dict[str, Any]) -> BoundStream:
        w = d["worst"]
        worst = Worst(w["n"], [(k, tuple(o), Position(**p)) for k, o, p in w["items"]])
        return BoundStream(**{**d, "worst": worst, "hist": dense_hist(d["hist"], HEAD_BINS)})

    out = Summary(rows=data["rows"], tokens=data["tokens"], files=list(data["files"]), metadata=list(data["metadata"]),
                  columns=set(data["columns"]), ignored_columns=set(data["ignored_columns"]),
                  casts={k: CastNote(**c) for k, c in data.get("casts", {}).items()},
                  page_checksums=dict(data.get("page_checksums", {})))
    for k, g in data["groups"].items():
        plain = {f: v for f, v in g.items() if f not in _NESTED}
        plain["first_order"] = tuple(plain["first_order"])
        out.groups[k] = ScenarioAcc(
            **plain,
            lacking=dict(g["lacking"]),
            streams={n: stream(d) for n, d in g["streams"].items()},
            bounds={n: bounded(d) for n, d in g["bounds"].items()},
            ratios={n: Ratios(**r) for n, r in g["ratios"].items()},
            first={n: First(f["n"], [(tuple(o), Position(**p)) for o, p in f["items"]]) for n, f in g["first"].items()},
            views={n: ViewMatch(*v) for n, v in g["views"].items()},
            steps={int(step): StepAcc.from_json(v) for step, v in g["steps"].items()},
            ratio=RatioStream(**g["ratio"]),
        )
    return out
