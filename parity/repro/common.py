"""What every reproduction reads and writes: the result type, the engine cache, sampling, Markdown/JSON output.

A reproduction computes two things from two independent sources and states whether they agree:
*predicted* values come from the trainer's logits (transformers, float32 unless the repro says
otherwise) run through parity's reference filters; *measured* values come from the vLLM run (the
sampler's processed log-probs, its captured kept set). Nothing a repro checks is typed in.

Engines: one vLLM engine at a time is what two CPU cores afford, so :class:`Context` keeps at most
``max_engines`` rollouts alive (least recently used is closed first) and one trainer per
(fixture, dtype). ``parity repro all`` orders the repros so that each fixture's engine starts once.
"""

from __future__ import annotations

import json
import math
import sys
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from parity.core import estimators
from parity.core.error_model import logprob_bound
from parity.core.spec import SamplingSpec
from parity.records.sequence import SequenceRecord

if TYPE_CHECKING:  # pragma: no cover
    from parity.engines.transformers_trainer import TransformersTrainer
    from parity.engines.vllm_offline import VllmRollout


def token_bound(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    spec: SamplingSpec,
    kept: torch.Tensor | None = None,
    dtype: str | tuple[str, str] = "float32",
) -> torch.Tensor:
    """Per-token rounding bound on ``|measured - predicted|`` log-probs for one record's logits ``[L, V]``.

    From :mod:`parity.core.error_model`: the scaled logits' magnitude (so temperature and peaked
    checkpoints widen it), the support the log-probs are normalised over (``kept``: bool ``[L, V]``
    or kept ids padded with -1; ``None`` = the vocabulary) and the looser dtype of the two sides.
    """
    support = None
    if kept is not None:
        support = kept if kept.dtype == torch.bool else estimators.ids_to_mask(kept, logits.shape[-1])
    return logprob_bound(estimators.scale(logits, spec), sampled, support, dtype=dtype)


def seq_bound(values: torch.Tensor, bound: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Bound on ``|exp(sum a) - exp(sum b)|`` per sequence, given per-token ``|a - b| <= bound``.

    ``|e^a - e^b| <= e^max(a, b) * |a - b|``; ``values`` are the per-sequence ratios ``e^sum`` of one
    side, so ``e^max`` is at most ``values * e^sum(bound)``.
    """
    b = seq_sums(bound, lengths)
    return values * b.exp() * b


@dataclass
class Check:
    """One stated relation and whether the measured table shows it."""

    statement: str
    passed: bool
    detail: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Column:
    key: str
    title: str
    fmt: str = ""  # a format spec for numbers ("" = str())


@dataclass
class ReproResult:
    name: str
    number: int
    title: str
    finding: str  # one sentence: what the table shows when the checks hold
    columns: list[Column]
    rows: list[dict[str, Any]]
    checks: list[Check]
    notes: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # everything else worth keeping (JSON only)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

    @property
    def verdict(self) -> str:
        return "REPRODUCED" if self.passed else "NOT REPRODUCED"

    def markdown(self) -> str:
        lines = [f"## Repro {self.number}: {self.title} (`{self.name}`)", "", self.finding, "",
                 markdown_table(self.columns, self.rows), ""]
        lines.append("Checks (measured from the vLLM run vs predicted from trainer logits):")
        lines.append("")
        for c in self.checks:
            mark = "x" if c.passed else " "
            lines.append(f"- [{mark}] {c.statement}" + (f" — {c.detail}" if c.detail else ""))
        lines.append("")
        failed = [c.statement for c in self.checks if not c.passed]
        lines.append(f"**{self.verdict}**" + (f": {len(failed)} check(s) failed" if failed else "") + f" ({self.seconds:.1f} s)")
        if self.notes:
            lines.append("")
            lines.extend(f"> {n}" for n in self.notes)
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = _clean(
            {
                "schema_version": 1,
                "name": self.name,
                "number": self.number,
                "title": self.title,
                "finding": self.finding,
                "verdict": self.verdict,
                "passed": self.passed,
                "columns": [{"key": c.key, "title": c.title} for c in self.columns],
                "rows": self.rows,
                "checks": [c.to_dict() for c in self.checks],
                "notes": self.notes,
                "data": self.data,
                "seconds": round(self.seconds, 3),
            }
        )
        return data

    def write(self, out: Path) -> list[Path]:
        """result.json and table.md under ``out`` (created)."""
        out.mkdir(parents=True, exist_ok=True)
        j = out / "result.json"
        j.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False) + "\n", encoding="utf-8")
        md = out / "table.md"
        md.write_text(self.markdown(), encoding="utf-8")
        return [j, md]


def _clean(obj: Any) -> Any:
    """JSON-safe: tensors to lists, non-finite floats to strings ("inf", "-inf", "nan")."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _clean(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, Path):
        return str(obj)
    return obj


def fmt_cell(value: Any, spec: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return format(value, spec) if spec else f"{value:g}"
    if isinstance(value, int) and spec and spec[-1] in "dn":
        return format(value, spec)
    return str(value)


def markdown_table(columns: Sequence[Column], rows: Sequence[dict[str, Any]]) -> str:
    head = "| " + " | ".join(c.title for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt_cell(r.get(c.key), c.fmt) for c in columns) + " |" for r in rows]
    return "\n".join([head, sep, *body])


# --------------------------------------------------------------------------------------------------
# engines


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Context:
    """Settings of one ``parity repro`` invocation and the engines it has started."""

    def __init__(
        self,
        *,
        small: bool = False,
        seed: int = 0,
        timeout_s: float = 900.0,
        model: str | None = None,
        max_engines: int = 2,
        progress: Callable[[str], None] = _stderr,
    ) -> None:
        self.small = small
        self.seed = seed
        self.timeout_s = timeout_s
        # ``--model``: a fixture name or checkpoint directory in place of the repro's own fixture
        # (only repros with ``TAKES_MODEL``; None: each repro's own).
        self.model = model
        self.max_engines = max_engines
        self.progress = progress
        self._rollouts: OrderedDict[str, VllmRollout] = OrderedDict()
        self._trainers: dict[tuple[str, str], TransformersTrainer] = {}
        self._paths: dict[str, Path] = {}

    def model_path(self, fixture: str) -> Path:
        if fixture not in self._paths:
            from parity.fixtures import resolve_model

            self._paths[fixture] = resolve_model(fixture)
        return self._paths[fixture]

    def trainer(self, fixture: str, dtype: str = "float32") -> TransformersTrainer:
        key = (fixture, dtype)
        if key not in self._trainers:
            from parity.engines.transformers_trainer import TransformersTrainer

            self._trainers[key] = TransformersTrainer(self.model_path(fixture), dtype=dtype)
        return self._trainers[key]

    def rollout(self, fixture: str) -> VllmRollout:
        """The vLLM engine for ``fixture`` (float32, CPU), started on first use and shared."""
        if fixture in self._rollouts:
            self._rollouts.move_to_end(fixture)
            return self._rollouts[fixture]
        while len(self._rollouts) >= self.max_engines:
            old, engine = self._rollouts.popitem(last=False)
            self.progress(f"parity repro: closing the vLLM engine of {old}")
            engine.close()
        from parity.engines.session import check_same_vocabulary
        from parity.engines.vllm_offline import VllmRollout

        self.progress(f"parity repro: starting vLLM on {fixture}")
        engine = VllmRollout(self.model_path(fixture), seed=self.seed, timeout_s=self.timeout_s)
        check_same_vocabulary(engine, self.trainer(fixture))
        self._rollouts[fixture] = engine
        return engine

    def alive(self) -> list[str]:
        """Fixtures whose vLLM engine is running now (least recently used first)."""
        return list(self._rollouts)

    def prompts(self, fixture: str, n: int) -> list[list[int]]:
        from parity.engines.session import make_prompts

        return make_prompts(self.trainer(fixture).tokenizer(), n)

    def close(self) -> None:
        for engine in self._rollouts.values():
            engine.close()
        self._rollouts.clear()
        self._trainers.clear()


# --------------------------------------------------------------------------------------------------
# sampling


def sample(
    ctx: Context,
    fixture: str,
    spec: SamplingSpec,
    *,
    prompts: int,
    max_tokens: int,
    head: int | None = None,
    logprobs: int | None = None,
) -> list[SequenceRecord]:
    """Sample through the harness's own path (``VllmRollout.generate``: capture planned and checked).

    ``head`` forces the capture head (-1: the whole vocabulary, e.g. for a flat 32k row whose nucleus
    is most of it); by default the harness plans it (adaptive for top_p/min_p without top_k).
    ``logprobs`` instead asks for exactly that many top-K processed log-probs, bypassing the capture plan:
    what a user's code does when it asks vLLM directly (vLLM accepts any K, including one smaller than
    top_k). ``logprobs=0`` returns the sampled token's processed log-prob only (no S_q); otherwise the
    head is parsed into ``kept_ids`` with the harness's completeness flags.
    """
    rollout = ctx.rollout(fixture)
    old = rollout.head
    rollout.head = head
    try:
        return rollout.generate(ctx.prompts(fixture, prompts), spec, max_tokens=max_tokens, seed=ctx.seed,
                                logprobs=logprobs)
    finally:
        rollout.head = old


# --------------------------------------------------------------------------------------------------
# small numeric helpers


def seq_sums(values: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """Per-sequence sums of a flat per-token tensor (float64)."""
    return torch.stack([v.sum() for v in torch.split(values.double(), list(lengths))])


def fmax(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def fmean(t: torch.Tensor) -> float:
    return float(t.double().mean()) if t.numel() else 0.0


def cat(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat(list(parts)) if parts else torch.zeros(0)
