"""``parity analyze``: the gates and report of ``parity run`` on records recorded anywhere (:mod:`parity.records`).

Composes the map step, the verdicts and the report writer (docs/records.md, section 1); the command line
is :mod:`parity.cli.analyze`."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal, cast

from parity.analyze.shards import as_int, summarize_paths
from parity.core.gates import Thresholds
from parity.errors import UsageError
from parity.judge.accumulators import Summary
from parity.judge.token_columns import Options
from parity.judge.verdict import judge
from parity.records.read import records_paths
from parity.records.schema import RecordsError
from parity.report.blocks import Json, ReportJson, Routing

if TYPE_CHECKING:
    from parity.judge.verdict import ScenarioVerdict


def _metadata_value(summary: Summary, key: str) -> Json:
    """``key``'s value in the records metadata where every file that names it agrees (decoded JSON), else None."""
    values = {json.dumps(m.get(key), sort_keys=True) for m in summary.metadata if key in m}
    if len(values) == 1:
        value: Json = json.loads(values.pop())
        return value
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


def _checksum_state(states: list[bool | None]) -> Literal["all", "some", "none", "unknown"]:
    """Files with page checksums: all, some, none (of those that could be checked), or unknown."""
    if states and all(s is True for s in states):
        return "all"
    return "some" if True in states else "none" if False in states else "unknown"


def require_tokens(summary: Summary, where: str) -> None:
    """Refuse an analysis with nothing in it (a user error: no scenario, no verdict to give)."""
    if summary.rows == 0:
        raise RecordsError(f"no rows in {where}: allowed a records file with at least one row (sequence)")
    if summary.tokens == 0:
        raise RecordsError(
            f"no completion tokens in {where}: its {summary.rows} row(s) all have empty completion_ids: allowed at "
            f"least one sampled token to judge"
        )


# The metadata key under which a producer stores the facts of its report that records do not hold (parity
# run: each scenario's capture plan, dtypes, RL view; the matrix's pair coverage, the invariance checks, its
# config): the report of its records then is its report, whoever builds it.
REPORT_FACTS = "report"


def _written_as_found(block: Mapping[str, object]) -> dict[str, Json]:
    """A report block, to merge values decoded from the records metadata into: they are written as the files
    hold them, unchecked here (:func:`parity.report.model.checked_report` checks their keys when the report
    is written; the producer, :data:`REPORT_FACTS`, chose their layout)."""
    return cast("dict[str, Json]", block)


def _object(x: Json) -> dict[str, Json]:
    return x if isinstance(x, dict) else {}


def _apply_facts(report: ReportJson, facts: Json) -> None:
    if not isinstance(facts, dict):
        return
    per = _object(facts.get("scenarios"))
    for sc in report["scenarios"]:
        extra = dict(_object(per.get(sc["name"])))
        raw = extra.pop("raw_logits_pass", None)
        if raw is not None:
            _written_as_found(sc["sampler_log_s"])["raw_logits_pass"] = raw
        _written_as_found(sc).update(extra)
    report["config"].update(_object(facts.get("config")))
    _written_as_found(report["environment"]).update(_object(facts.get("environment")))
    _written_as_found(report).update(_object(facts.get("top")))


def set_verdict(report: ReportJson) -> None:
    """The report's ``passed`` (every scenario passes every gate it could evaluate), ``verdict`` (``fail``
    when a gate failed; ``none`` when nothing failed but a scenario has no mean-bias gate or no gate at all;
    else ``pass``) and ``no_verdict`` (each such scenario's line: what it lacks and what supplies it)."""
    scenarios = report["scenarios"]
    determinism = report.get("determinism")
    failed = (any(s["verdict"] == "fail" for s in scenarios)
              or bool(isinstance(determinism, dict) and determinism.get("violations")))
    report["passed"] = not failed and bool(scenarios) and all(s["verdict"] == "pass" for s in scenarios)
    report["no_verdict"] = [why for s in scenarios if (why := s.get("no_verdict"))]
    if not scenarios:
        report["no_verdict"].append("the records hold no scenario")
    report["verdict"] = "fail" if failed else ("none" if report["no_verdict"] else "pass")


def _stored(facts: Json, key: str) -> dict[str, dict[str, Json]]:
    """Per scenario, a block a producer stored for the gate table (``native_capture``, ``routing``)."""
    per = facts.get("scenarios") if isinstance(facts, dict) else None
    return {name: block for name, f in _object(per).items() if isinstance(f, dict) and isinstance(block := f.get(key), dict)}


def _routing(facts: Json) -> dict[str, Routing] | None:
    """The routing sections a producer stored (``parity run`` on a MoE scenario: :func:`parity.run.routing_section`,
    its :class:`~parity.report.blocks.Routing` as JSON), per scenario."""
    return {name: cast("Routing", block) for name, block in _stored(facts, "routing").items()} or None


def _pair(x: Json) -> tuple[int, int]:
    if not isinstance(x, list):
        raise TypeError(f"a stored position: expected [prompt, position], got {type(x).__name__}")
    p, t = x
    return as_int(p), as_int(t)


def _native(facts: Json) -> dict[str, list[tuple[int, int]]] | None:
    """The native-mask mismatches a producer stored (``parity run --capture both``), per scenario."""
    out = {}
    for name, n in _stored(facts, "native_capture").items():
        positions = n.get("positions", [])
        if not isinstance(positions, list):
            raise TypeError(f"native_capture positions of {name!r}: expected a list, got {type(positions).__name__}")
        out[name] = [_pair(x) for x in positions]
    return out or None


def build_report(summary: Summary, th: Thresholds, *, options: Options, paths: Sequence[Path | str],
                 engine: str = "local", verdicts: Sequence[ScenarioVerdict] | None = None) -> ReportJson:
    """report.json of a records summary: the one report builder (``parity analyze``, ``parity run`` on its own
    records, the TRL capture). A producer's facts stored under :data:`REPORT_FACTS` join the report.
    ``verdicts``: the scenarios as the producer already judged them (:func:`parity.judge.verdict.judge` on the
    same statistics); without, they are judged here."""
    from parity.report.model import SCHEMA_VERSION
    from parity.report.schema import environment

    named = _metadata_value(summary, "trainer_under_test") or _metadata_value(summary, "trainer_name")
    trainer_name = None if named is None else str(named)
    if verdicts is None:
        facts = _metadata_value(summary, REPORT_FACTS)
        verdicts = judge(summary, th, trainer_name=trainer_name, native=_native(facts), routing=_routing(facts))
    scenarios = [v.entry for v in verdicts]
    models = _metadata_value(summary, "scenario_models") or {}
    for sc in scenarios:
        if isinstance(models, dict) and sc["name"] in models:
            _written_as_found(sc)["model"] = models[sc["name"]]
    rollout_dtype = str(_metadata_value(summary, "dtype") or "unknown")
    trainer_dtype = options.dtype if options.model else str(_metadata_value(summary, "trainer_dtype") or "unknown")
    env = environment(options.device, rollout_dtype, trainer_dtype)
    recorded = {k: _metadata_value(summary, k) for k in ("vllm", "torch", "transformers")}
    env["analysis_machine"] = {"vllm": env["vllm"], "torch": env["torch"], "transformers": env["transformers"],
                               "parity": env["parity"], "python": env["python"]}
    for k, v in recorded.items():
        _written_as_found(env)[k] = v  # the versions that produced the records (None when the files do not say)
    env["sampler"], env["sampler_version"] = _sampler(summary)
    skipped: dict[tuple[str, str], list[str]] = {}
    for sc in scenarios:
        for g in sc["not_evaluated"]:
            skipped.setdefault((g["gate"], g["reason"]), []).append(sc["name"])
    warnings = records_warnings(summary)
    report: ReportJson = {
        "schema_version": SCHEMA_VERSION,
        "source": "records",
        "environment": env,
        "config": {
            "records": [str(p) for p in paths],
            "model": options.model or _metadata_value(summary, "model"),
            "analysis": "re-scored with --model" if options.model else "records",
            "thresholds": {k: v for k, v in th.to_dict().items()},
            "columns": [c for c in sorted(summary.columns)],
            "ignored_columns": [c for c in sorted(summary.ignored_columns)],
            "records_metadata": [{k: v for k, v in m.items() if k != REPORT_FACTS} for m in summary.metadata],
            "engine": engine,
        },
        "records": {
            "files": len(paths), "rows": summary.rows, "tokens": summary.tokens,
            "page_checksums": _checksum_state(list(summary.page_checksums.values())),
            "files_without_page_checksums": [f for f, ok in summary.page_checksums.items() if ok is False],
        },
        "warnings": warnings,
        "scenarios": scenarios,
        "passed": False,  # passed, verdict and no_verdict: set_verdict, once the producer's facts are in
        "verdict": "pass",
        "no_verdict": [],
        "complete": not skipped,  # where not, not_evaluated lists each gate, why, and where
        "not_evaluated": [{"gate": g, "reason": r, "scenarios": names} for (g, r), names in skipped.items()],
    }
    _apply_facts(report, _metadata_value(summary, REPORT_FACTS))
    unjudged = [s["name"] for s in scenarios if "routing" not in s]
    if "routed_experts" in summary.columns and unjudged:
        warnings.append(f"routed_experts is present but the routing gates were not evaluated in {len(unjudged)} "
                        f"scenario(s) ({', '.join(unjudged[:4])}): they need the trainer's router logits, which "
                        f"parity run computes (parity.engines.routing_replay.routing_report)")
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
) -> ReportJson:
    """Analyse a records file or a directory of shards; write report.json/report.md/plots under ``out``.
    ``engine``: where the map step runs: ``local`` (this process, or ``jobs`` local processes), or Ray
    (:func:`parity.analyze.cluster.parse_engine` lists the forms), merged here either way."""
    from parity.analyze.cluster import parse_engine, summarize_on_engine
    from parity.report.schema import write_report

    opts = options or Options()
    th = thresholds or Thresholds.for_dtype(opts.dtype)
    opts.n_listed = th.max_violations_listed
    eng = parse_engine(engine)
    paths = records_paths(path)
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
