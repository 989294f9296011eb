"""``parity analyze``: the gates and report of ``parity run`` on records recorded anywhere (:mod:`parity.records`).

The map step and the verdicts are engine-free (:mod:`parity.records.columns`, :mod:`parity.records.verdict`); this module composes
them with what needs more: re-scoring with a transformers model (``--model``), files and shards over
local processes (``--jobs``), and the report writer (:mod:`parity.report.schema`). The command line is
:mod:`parity.cli.analyze`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from parity.errors import SetupError, TimedOut, UsageError

try:  # the records format needs pyarrow (the records extra); say so instead of a traceback
    import pyarrow  # noqa: F401
except ModuleNotFoundError as _exc:
    if _exc.name != "pyarrow":
        raise
    raise SetupError("records (Parquet) need pyarrow: pip install 'parity[records]'") from None

from parity.core.gates import Thresholds
from parity.records import format as rf
from parity.records.accumulators import Summary
from parity.records.columns import LOGIT_BUDGET, Options, TokenColumns, summarize_batch, token_columns
from parity.records.format import open_records
from parity.records.verdict import finalize

# ==================================================================================================
# re-scoring with a transformers model (--model)
# ==================================================================================================

_TRAINERS: dict[tuple[str, str, str], Any] = {}


def _trainer(model: str, dtype: str, device: str) -> Any:
    key = (model, dtype, device)
    if key not in _TRAINERS:
        from parity.engines.transformers_trainer import TransformersTrainer
        from parity.fixtures import resolve_model

        _TRAINERS[key] = TransformersTrainer(resolve_model(model), dtype=dtype, device=device)
    return _TRAINERS[key]


def rescored_columns(batch: Any, trainer: Any, dtypes: tuple[str, str]) -> TokenColumns:
    """Token columns with every trainer-side estimate and bound computed from ``trainer``'s logits (parity run's table)."""
    import torch

    from parity.core.table import build_table
    from parity.engines.trainer_under_test import reference_views
    from parity.records.convert import to_sequence_records

    vocab = int(trainer.vocab_size)
    cols = token_columns(batch, vocab_size=vocab)  # sampler-side flags and the trainer under test, if any
    for name, rag in (("prompt_ids", batch.prompt), ("completion_ids", batch.completion), ("kept_ids", batch.kept)):
        if rag is not None and rag.values.size and int(rag.values.max()) >= vocab:
            flat = int(np.flatnonzero(rag.values >= vocab)[0])
            r = int(np.searchsorted(rag.offsets, flat, side="right") - 1)
            raise rf.RecordsError(
                f"{batch.source} row {batch.first_row + r} column {name}: token id {int(rag.values[flat])} is outside the "
                f"vocabulary of --model ({vocab} tokens): allowed ids < {vocab} (is this the model that sampled?)"
            )
    empty = np.flatnonzero(batch.prompt.lengths == 0)
    if empty.size:
        raise rf.RecordsError(
            f"{batch.source} row {batch.first_row + int(empty[0])} column prompt_ids: empty: re-scoring with --model needs "
            f"the prompt (its last position predicts completion token 0)"
        )
    records = to_sequence_records(batch)
    filtered_spec = np.array([s.effective().filtered for s in batch.specs], dtype=bool)
    view_parts: dict[frozenset[str], np.ndarray] = {}
    has_user = cols.have["user"]
    for j, spec in enumerate(batch.specs):
        rows = np.flatnonzero(batch.spec_index == j)
        start = 0
        while start < rows.size:
            # As many sequences as fit the logit budget (at least one).
            stop, held = start, 0
            while stop < rows.size and (stop == start or held + int(batch.completion.lengths[rows[stop]]) * vocab <= LOGIT_BUDGET):
                held += int(batch.completion.lengths[rows[stop]]) * vocab
                stop += 1
            part = rows[start:stop]
            start = stop
            recs = [records[i] for i in part]
            logits = trainer.logits(recs)
            table = build_table(recs, logits, spec, dtype=dtypes)
            tok = np.concatenate([np.arange(batch.token_offsets[i], batch.token_offsets[i + 1]) for i in part])
            # A filtering spec without a kept set: build_table would take S_q as the whole vocabulary.
            known = np.repeat(batch.kept_rows()[part] | ~filtered_spec[j], batch.completion.lengths[part])
            for name in ("full", "recompute", "forced", "bound_full"):
                getattr(cols, name)[tok] = getattr(table, name).numpy()
                cols.have[name][tok] = True
            cols.systematic[tok] = np.where(known, table.systematic.numpy(), cols.systematic[tok])
            for name in ("replay", "log_s", "bound"):
                getattr(cols, name)[tok] = np.where(known, getattr(table, name).numpy(), 0.0)
                cols.have[name][tok] = known
            cols.recompute_support_equal[tok] = table.recompute_support_equal.numpy()
            cols.have["recompute_support"][tok] = known
            cols.kl[tok] = np.where(known, table.kl.numpy(), 0.0)
            cols.tv[tok] = np.where(known, table.tv.numpy(), 0.0)
            cols.have["kl"][tok] = known
            cols.logit_drift[tok] = np.where(known, table.logit_drift.numpy(), np.nan)
            if bool(has_user[tok].any()):
                ys = [torch.tensor(r.completion_ids, dtype=torch.long) for r in recs]
                views = reference_views(logits, ys, spec, [r.kept_ids for r in recs])
                for bugs, v in views.items():
                    if bugs:
                        view_parts.setdefault(bugs, np.full(batch.tokens, np.nan))[tok] = np.where(known, v.numpy(), np.nan)
    cols.views = {frozenset(): cols.views[frozenset()], **view_parts}
    return cols


# ==================================================================================================
# files, shards, processes
# ==================================================================================================


def _dtypes(meta: dict[str, Any], options: Options) -> tuple[str, str]:
    sampler = meta.get("dtype") or "float32"
    trainer = options.dtype if options.model else (meta.get("trainer_dtype") or sampler)
    return str(sampler), str(trainer)


def file_header(path: str, records: Any) -> Summary:
    """What an open records file (:func:`parity.records.format.open_records`) adds to a summary before any
    of its rows: its name, its metadata, whether its pages carry checksums."""
    return Summary(files=[str(path)], metadata=[{"file": str(path), **records.metadata}],
                   page_checksums={str(path): records.page_checksums})


def batch_summarizer(metadata: dict[str, Any], file_index: int, options: Options) -> Callable[[Any], Summary]:
    """The map step for the validated batches of one file: dtypes and vocabulary size from the file's
    metadata, the trainer's values re-scored with ``options.model`` when set (what every worker runs:
    local processes, Ray, Spark)."""
    dtypes = _dtypes(metadata, options)
    stated = (str(metadata.get("dtype") or ""), options.dtype if options.model else str(metadata.get("trainer_dtype") or ""))
    vocab = metadata.get("vocab_size")
    columns: Callable[[Any], TokenColumns] | None = None
    if options.model:
        trainer = _trainer(options.model, options.dtype, options.device)

        def columns(b: Any) -> TokenColumns:
            return rescored_columns(b, trainer, dtypes)

    def summarize(rb: Any) -> Summary:
        return summarize_batch(rb, file_index=file_index, options=options, dtypes=dtypes,
                               vocab_size=int(vocab) if vocab else None, columns=columns, stated_dtypes=stated)

    return summarize


def summarize_file(path: str, file_index: int, options: Options) -> Summary:
    """Summary of one records file, streamed batch by batch (what a worker process runs)."""
    rf = open_records(path)
    out = file_header(str(path), rf)
    summarize = batch_summarizer(rf.metadata, file_index, options)
    for rb in rf.batches(batch_rows=options.batch_rows):
        out.merge(summarize(rb))
    out.files = [str(path)]
    return out


def _worker_init(threads: int, model: bool) -> None:
    if model:  # torch only where a model scores (importing it costs a worker seconds of its start)
        import torch

        torch.set_num_threads(threads)


def summarize_paths(
    paths: Sequence[Path], options: Options, *, jobs: int = 1, timeout_s: float = 3600.0,
    progress: Callable[[str], None] | None = None,
) -> Summary:
    """Summaries of every file, merged; with ``jobs > 1`` in that many local processes (spawned)."""
    if jobs < 1:
        raise UsageError(f"--jobs {jobs} is invalid: allowed an integer >= 1")
    total = Summary()
    if jobs == 1 or len(paths) == 1:
        for i, p in enumerate(paths):
            total.merge(summarize_file(str(p), i, options))
            if progress:
                progress(f"parity analyze: [{i + 1}/{len(paths)}] {p}")
        return total
    import multiprocessing as mp

    threads = max(1, (os.cpu_count() or 1) // jobs)
    ctx = mp.get_context("spawn")
    pool = ctx.Pool(processes=min(jobs, len(paths)), initializer=_worker_init, initargs=(threads, bool(options.model)))
    try:
        pending = [pool.apply_async(summarize_file, (str(p), i, options)) for i, p in enumerate(paths)]
        deadline = time.monotonic() + timeout_s
        for i, (p, res) in enumerate(zip(paths, pending, strict=True)):
            left = deadline - time.monotonic()
            try:
                total.merge(res.get(timeout=max(left, 0.001)))
            except mp.TimeoutError:
                raise TimedOut(f"parity analyze: shard {p} did not finish within {timeout_s:.0f} s (raise --timeout)") from None
            if progress:
                progress(f"parity analyze: [{i + 1}/{len(paths)}] {p}")
        pool.close()
        pool.join()
    finally:
        pool.terminate()
    return total


# ==================================================================================================
# the report
# ==================================================================================================


def _metadata_value(summary: Summary, key: str) -> Any:
    values = {json.dumps(m.get(key), sort_keys=True) for m in summary.metadata if key in m}
    if len(values) == 1:
        return json.loads(values.pop())
    return None


def _sampler(summary: Summary) -> tuple[str | None, str | None]:
    """The sampler's name and version from the records metadata (``sampler``, ``sampler_version``; a
    ``vllm`` version or parity's own export names vLLM); ``(None, None)`` when the files do not say."""
    name, version = _metadata_value(summary, "sampler"), _metadata_value(summary, "sampler_version")
    vllm = _metadata_value(summary, "vllm")
    if name is None and (vllm is not None or _metadata_value(summary, "producer") == "parity run"):
        name = "vLLM"
    if version is None and name == "vLLM":
        version = vllm
    return (None if name is None else str(name)), (None if version is None else str(version))


def records_warnings(summary: Summary) -> list[str]:
    """What the analysis could not vouch for in the files themselves: pages without checksums, values a
    float64 -> float32 cast changed, kept sets taken as complete for want of ``kept_incomplete``."""
    out = []
    files = summary.page_checksums
    without = [f for f, ok in files.items() if ok is False]
    unknown = [f for f, ok in files.items() if ok is None]
    for group, what in ((without, "carry no page checksums"), (unknown, "could not be checked for page checksums")):
        if group:
            out.append(
                f"{len(group)} of {len(files)} file(s) {what} ({', '.join(group[:3])}{' ...' if len(group) > 3 else ''}): "
                "a corrupt page then reads as data, and the analysis cannot tell it from a sampler or trainer fault; "
                "write records with page checksums (pyarrow: write_page_checksum=True; README, writing records)"
            )
    for key, note in sorted(summary.casts.items()):
        if note.changed:
            out.append(note.message(key.split("\x1f")[0]))
    if "kept_ids" in summary.columns and "kept_incomplete" not in summary.columns:
        out.append(
            "no kept_incomplete column: every kept set is taken as complete (the format's default), so a captured "
            "head cut short reads as sampled tokens outside S_q and unequal support; write kept_incomplete where the "
            "head may not hold the whole support"
        )
    return out


def _checksum_state(states: list[bool | None]) -> str:
    """Files with page checksums: all, some, none (of those that could be checked), or unknown."""
    if states and all(s is True for s in states):
        return "all"
    return "some" if True in states else "none" if False in states else "unknown"


def require_tokens(summary: Summary, where: str) -> None:
    """Refuse an analysis with nothing in it (a user error: no scenario, no verdict to give)."""
    if summary.rows == 0:
        raise rf.RecordsError(f"no rows in {where}: allowed a records file with at least one row (sequence)")
    if summary.tokens == 0:
        raise rf.RecordsError(
            f"no completion tokens in {where}: its {summary.rows} row(s) all have empty completion_ids: allowed at "
            f"least one sampled token to judge"
        )


# The metadata key under which a producer stores the facts of its report that records do not hold (parity
# run: each scenario's capture plan, dtypes, RL view; the matrix's pair coverage, the invariance checks, its
# config): the report of its records then is its report, whoever builds it.
REPORT_FACTS = "report"


def _apply_facts(report: dict[str, Any], facts: Any) -> None:
    if not isinstance(facts, dict):
        return
    per = facts.get("scenarios") or {}
    for sc in report["scenarios"]:
        extra = dict(per.get(sc["name"]) or {})
        raw = extra.pop("raw_logits_pass", None)
        if raw is not None:
            sc["sampler_log_s"]["raw_logits_pass"] = raw
        native = extra.pop("native_violations", None) or []
        sc.update(extra)
        if native:
            sc["violations"] = sc["violations"] + native
            sc["verdict"] = "fail"
    report["config"].update(facts.get("config") or {})
    report["environment"].update(facts.get("environment") or {})
    report.update(facts.get("top") or {})
    set_verdict(report)


def set_verdict(report: dict[str, Any]) -> None:
    """The report's ``passed`` (every scenario passes every gate it could evaluate), ``verdict`` (``fail``
    when a gate failed; ``none`` when nothing failed but a scenario has no mean-bias gate or no gate at all;
    else ``pass``) and ``no_verdict`` (each such scenario's line: what it lacks and what supplies it)."""
    scenarios = report["scenarios"]
    determinism = report.get("determinism")
    failed = (any(s["verdict"] == "fail" for s in scenarios)
              or bool(isinstance(determinism, dict) and determinism.get("violations")))
    report["passed"] = not failed and bool(scenarios) and all(s["verdict"] == "pass" for s in scenarios)
    report["no_verdict"] = [s["no_verdict"] for s in scenarios if s.get("no_verdict")]
    if not scenarios:
        report["no_verdict"].append("the records hold no scenario")
    report["verdict"] = "fail" if failed else ("none" if report["no_verdict"] else "pass")


def build_report(summary: Summary, th: Thresholds, *, options: Options, paths: Sequence[Path | str],
                 engine: str = "local") -> dict[str, Any]:
    """report.json of a records summary: the one report builder (``parity analyze``, ``parity run`` on its own
    records, the TRL capture). A producer's facts stored under :data:`REPORT_FACTS` join the report."""
    from parity.report.schema import SCHEMA_VERSION, environment

    trainer_name = _metadata_value(summary, "trainer_under_test") or _metadata_value(summary, "trainer_name")
    scenarios = finalize(summary, th, trainer_name=trainer_name)
    models = _metadata_value(summary, "scenario_models") or {}
    for sc in scenarios:
        sc["violations"] = [v.to_dict() for v in sc["violations"]]
        sc["reference_violations"] = [v.to_dict() for v in sc["reference_violations"]]
        if isinstance(models, dict) and sc["name"] in models:
            sc["model"] = models[sc["name"]]
    rollout_dtype = _metadata_value(summary, "dtype") or "unknown"
    trainer_dtype = options.dtype if options.model else (_metadata_value(summary, "trainer_dtype") or "unknown")
    env = environment(options.device, rollout_dtype, trainer_dtype)
    recorded = {k: _metadata_value(summary, k) for k in ("vllm", "torch", "transformers")}
    env["analysis_machine"] = {k: env.get(k) for k in ("vllm", "torch", "transformers", "parity", "python")}
    for k, v in recorded.items():
        env[k] = v  # the versions that produced the records (None when the files do not say)
    env["sampler"], env["sampler_version"] = _sampler(summary)
    skipped: dict[tuple[str, str], list[str]] = {}
    for sc in scenarios:
        for g in sc["not_evaluated"]:
            skipped.setdefault((g["gate"], g["reason"]), []).append(sc["name"])
    report = {
        "schema_version": SCHEMA_VERSION,
        "source": "records",
        "environment": env,
        "config": {
            "records": [str(p) for p in paths],
            "model": options.model or _metadata_value(summary, "model"),
            "analysis": "re-scored with --model" if options.model else "records",
            "thresholds": th.to_dict(),
            "columns": sorted(summary.columns),
            "ignored_columns": sorted(summary.ignored_columns),
            "records_metadata": [{k: v for k, v in m.items() if k != REPORT_FACTS} for m in summary.metadata],
            "engine": engine,
        },
        "records": {
            "files": len(paths), "rows": summary.rows, "tokens": summary.tokens,
            "page_checksums": _checksum_state(list(summary.page_checksums.values())),
            "files_without_page_checksums": [f for f, ok in summary.page_checksums.items() if ok is False],
        },
        "warnings": records_warnings(summary),
        "scenarios": scenarios,
        # passed: every scenario passes every gate it could evaluate (and has one). complete: every gate was
        # evaluated in every scenario; where not, not_evaluated lists each gate, why, and where.
        "passed": all(s["verdict"] == "pass" for s in scenarios) and bool(scenarios),
        "verdict": "pass",
        "no_verdict": [],
        "complete": not skipped,
        "not_evaluated": [{"gate": g, "reason": r, "scenarios": names} for (g, r), names in skipped.items()],
    }
    _apply_facts(report, _metadata_value(summary, REPORT_FACTS))
    set_verdict(report)
    return report


def analyze(
    path: str | Path,
    *,
    thresholds: Thresholds | None = None,
    options: Options | None = None,
    jobs: int = 1,
    out: str | Path | None = None,
    plots: bool = True,
    timeout_s: float = 3600.0,
    progress: Callable[[str], None] | None = None,
    engine: str = "local",
) -> dict[str, Any]:
    """Analyse a records file or a directory of shards; write report.json/report.md/plots under ``out``.

    ``engine``: where the map step runs: ``local`` (this process, or ``jobs`` local processes), or Ray
    or Spark (:func:`parity.cluster.parse_engine` lists the forms), merged here either way.
    """
    from parity.cluster import parse_engine, summarize_on_engine
    from parity.report.schema import write_report

    opts = options or Options()
    th = thresholds or Thresholds.for_dtype(opts.dtype)
    opts.n_listed = th.max_violations_listed
    eng = parse_engine(engine)
    paths = rf.records_paths(path)
    t0 = time.perf_counter()
    if eng.kind == "local":
        summary = summarize_paths(paths, opts, jobs=jobs, timeout_s=timeout_s, progress=progress)
    else:
        if jobs != 1:
            raise UsageError(f"--jobs {jobs} applies to --engine local: {eng.kind} runs as many tasks as its cluster has room for")
        summary = summarize_on_engine(eng, paths, opts, timeout_s=timeout_s, progress=progress)
    require_tokens(summary, str(path) if Path(path).is_file() else f"any of the {len(paths)} *.parquet file(s) under {path}")
    report = build_report(summary, th, options=opts, paths=paths, engine=engine)
    report["timings"] = {"total_s": time.perf_counter() - t0}
    if out is not None:
        write_report(report, Path(out), plots=plots)
    return report
