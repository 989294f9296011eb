"""The invariance checks, measured, never assumed: bitwise (``torch.equal``), with ``max_abs_diff`` for a failure.

``check_rollout_invariance``: a target prompt alone vs inside mixed batches (greedy and seeded), plus repeats.
``check_trainer_invariance``: a sequence alone vs right-padded, left-padded and packed batches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NotRequired, Protocol, TypedDict

import torch

from parity.core.metrics import max_abs_difference
from parity.determinism.attention_kernel import ATTENTION_NAME as CPU_ATTENTION
from parity.determinism.attention_kernel import implementation
from parity.determinism.knobs import UNAVAILABLE
from parity.errors import UsageError

if TYPE_CHECKING:  # pragma: no cover
    from parity.core.sequence import SequenceRecord
    from parity.core.spec import SamplingSpec


class Generates(Protocol):
    """A rollout engine as the rollout check drives it (seed ``seed + i`` for prompt ``i``)."""

    def generate(
        self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, max_tokens: int, seed: int
    ) -> list[SequenceRecord]: ...


class HasModel(Protocol):
    """A trainer as the trainer check drives it: its model (and, optionally, a ``device`` attribute)."""

    @property
    def model(self) -> torch.nn.Module: ...


# -- what the checks return (report.json's determinism section) ----------------------------------


class RecordComparison(TypedDict):
    """Two records of the same prompt compared (:func:`compare_records`)."""

    bitwise: bool
    tokens_equal: bool
    first_token_mismatch: int | None
    support_equal: bool | None
    max_abs_diff: float | None


class RolloutBatchCheck(RecordComparison):
    """The target prompt inside a batch of ``batch_size`` against the target alone."""

    name: str
    side: str
    mode: str
    kind: str  # "batch"
    batch_size: int
    position: int
    filler_lengths: list[int]


class RunToRunCheck(TypedDict):
    """``repeats`` identical requests of the target alone: one unique output."""

    name: str
    side: str
    mode: str
    kind: str  # "run_to_run"
    repeats: int
    unique_outputs: int
    bitwise: bool
    tokens_equal: bool
    max_abs_diff: float | None


class TrainerCheck(TypedDict):
    """One batch layout against each sequence alone (``status`` unavailable: not measured, and why)."""

    name: str
    side: str
    layout: str
    status: str
    reason: NotRequired[str | None]
    bitwise: bool | None
    tokens_equal: bool | None
    max_abs_diff: float | None
    records_not_bitwise: NotRequired[int]
    worst_record: NotRequired[int | None]


class RolloutInvariance(TypedDict):
    side: str
    engine: str
    modes: dict[str, dict[str, float]]
    target_prompt_tokens: int
    max_tokens: int
    seed: int
    batch_sizes: list[int]
    repeats: int
    checks: list[RolloutBatchCheck | RunToRunCheck]
    invariant: bool


class TrainerInvariance(TypedDict):
    side: str
    attention: str | None
    dtype: str
    records: int
    lengths: list[int]
    checks: list[TrainerCheck]
    invariant: bool


# -- comparisons ---------------------------------------------------------------------------------


def _kept_logprobs(rec: SequenceRecord) -> torch.Tensor:
    if rec.kept_logprobs is None:
        raise UsageError(f"{rec.source} record {rec.prompt_index} has kept_ids but no kept_logprobs")
    return rec.kept_logprobs


def compare_records(ref: SequenceRecord, got: SequenceRecord) -> RecordComparison:
    """Bitwise comparison of two records of the same prompt: tokens, log-probs, kept set.

    Log-probs are compared up to the first token that differs (after it the contexts differ);
    ``max_abs_diff`` is None when the very first token differs.
    """
    a, b = list(ref.completion_ids), list(got.completion_ids)
    tokens_equal = a == b
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    diffs = [max_abs_difference(ref.logprobs[:n], got.logprobs[:n])] if n else []
    support_equal = None
    bitwise = tokens_equal and torch.equal(ref.logprobs, got.logprobs)
    rk, gk = ref.kept_ids, got.kept_ids
    if rk is not None or gk is not None:
        support_equal = False
        if rk is not None and gk is not None and rk.shape == gk.shape:
            support_equal = torch.equal(rk, gk)
            bitwise = bitwise and support_equal and torch.equal(_kept_logprobs(ref), _kept_logprobs(got))
            if n:
                rows = (rk[:n] == gk[:n]).all(dim=-1)
                diffs.append(max_abs_difference(_kept_logprobs(ref)[:n][rows], _kept_logprobs(got)[:n][rows]))
        bitwise = bitwise and support_equal
    return {
        "bitwise": bool(bitwise),
        "tokens_equal": tokens_equal,
        "first_token_mismatch": None if tokens_equal else n,
        "support_equal": support_equal,
        "max_abs_diff": max(diffs) if diffs else None,
    }


def _fingerprint(rec: SequenceRecord) -> tuple[tuple[int, ...] | bytes, ...]:
    parts: list[tuple[int, ...] | bytes] = [tuple(rec.completion_ids), rec.logprobs.numpy().tobytes()]
    if rec.kept_ids is not None:
        parts += [rec.kept_ids.numpy().tobytes(), _kept_logprobs(rec).numpy().tobytes()]
    return tuple(parts)


# -- rollout side --------------------------------------------------------------------------------


def _modes(spec: SamplingSpec) -> list[tuple[str, SamplingSpec]]:
    from parity.core.spec import SamplingSpec

    greedy = SamplingSpec(temperature=0.0)
    sampled = spec if not spec.greedy else SamplingSpec(temperature=1.0)
    return [("greedy", greedy), ("sampled", sampled)]


def _fillers(others: Sequence[Sequence[int]], count: int) -> list[list[int]]:
    """``count`` prompts of other lengths: the given ones in turn, cut shorter on each further lap."""
    out = []
    for k in range(count):
        p = list(others[k % len(others)])
        cut = k // len(others)
        out.append(p[: max(1, len(p) - cut)])
    return out


def check_rollout_invariance(
    rollout: Generates,
    prompts: list[list[int]],
    spec: SamplingSpec,
    *,
    max_tokens: int,
    seed: int,
    batch_sizes: Sequence[int] = (2, 4, 8, 16, 32),
    repeats: int = 4,
    perturb: Callable[[str, SequenceRecord], SequenceRecord] | None = None,
) -> RolloutInvariance:
    """The rollout engine's answer for ``prompts[0]`` must not depend on what else is in the batch.

    Greedy and seeded sampling (T=1 if ``spec`` is greedy): the target alone is the reference, then it sits in
    the middle of each batch size among ``prompts[1:]``, seeded so it keeps its seed; ``repeats`` identical
    requests must give one output. ``perturb(name, record)``: a negative-control hook on compared records.
    """
    if len(prompts) < 2:
        raise UsageError(
            f"check_rollout_invariance needs a target and at least one filler prompt, got {len(prompts)}"
        )
    if any(isinstance(b, bool) or not isinstance(b, int) or b < 2 for b in batch_sizes):
        raise UsageError(
            f"batch_sizes={tuple(batch_sizes)!r} is invalid: allowed ints >= 2 (1 is the reference)"
        )
    if repeats < 2:
        raise UsageError(f"repeats={repeats!r} is invalid: allowed >= 2")
    target, others = list(prompts[0]), prompts[1:]

    def gen(batch: list[list[int]], s: SamplingSpec, base_seed: int) -> list[SequenceRecord]:
        return rollout.generate(batch, s, max_tokens=max_tokens, seed=base_seed)

    checks: list[RolloutBatchCheck | RunToRunCheck] = []
    modes: dict[str, dict[str, float]] = {}
    for mode, mspec in _modes(spec):
        modes[mode] = mspec.to_dict()
        ref = gen([target], mspec, seed)[0]
        for b in batch_sizes:
            pos = b // 2
            batch = _fillers(others, b - 1)
            batch.insert(pos, target)
            got = gen(batch, mspec, seed - pos)[pos]
            name = f"rollout {mode} batch={b}"
            if perturb is not None:
                got = perturb(name, got)
            checks.append({"name": name, "side": "rollout", "mode": mode, "kind": "batch", "batch_size": b,
                           "position": pos, "filler_lengths": sorted({len(p) for p in batch} - {len(target)}),
                           **compare_records(ref, got)})
        runs = [gen([target], mspec, seed)[0] for _ in range(repeats)]
        if perturb is not None:
            runs = runs[:1] + [perturb(f"rollout {mode} run-to-run #{r}", o) for r, o in enumerate(runs[1:], 1)]
        checks.append(_run_to_run(mode, runs))
    return {
        "side": "rollout",
        "engine": str(getattr(rollout, "name", type(rollout).__name__)),
        "modes": modes,
        "target_prompt_tokens": len(target),
        "max_tokens": max_tokens,
        "seed": seed,
        "batch_sizes": list(batch_sizes),
        "repeats": repeats,
        "checks": checks,
        "invariant": all(c["bitwise"] for c in checks),
    }


def _run_to_run(mode: str, runs: list[SequenceRecord]) -> RunToRunCheck:
    """One check of ``len(runs)`` identical requests: one unique output, compared against the first."""
    per_run = [compare_records(runs[0], o) for o in runs[1:]]
    unique = len({_fingerprint(o) for o in runs})
    diffs = [c["max_abs_diff"] for c in per_run if c["max_abs_diff"] is not None]
    return {"name": f"rollout {mode} run-to-run x{len(runs)}", "side": "rollout", "mode": mode, "kind": "run_to_run",
            "repeats": len(runs), "unique_outputs": unique, "bitwise": unique == 1,
            "tokens_equal": all(c["tokens_equal"] for c in per_run), "max_abs_diff": max(diffs) if diffs else None}


# -- trainer side --------------------------------------------------------------------------------


def _packed_mask(
    impl: str | None, seg: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor | None, str | None]:
    """Block-diagonal causal mask for one packed row, as the attention implementation reads it: boolean for sdpa
    and the CPU kernels, additive 0 / min for eager. Always explicit: transformers derives it from restarting
    position ids only without a KV cache, and a forward creates one by default.
    """
    t = seg.shape[0]
    allowed = (seg[:, None] == seg[None, :]) & torch.ones(t, t, dtype=torch.bool, device=seg.device).tril()
    if impl in ("sdpa", CPU_ATTENTION):
        return allowed[None, None], None
    if impl == "eager":
        mask = torch.zeros(t, t, dtype=dtype, device=seg.device)
        mask.masked_fill_(~allowed, torch.finfo(dtype).min)
        return mask[None, None], None
    return None, (
        f"attention implementation {impl!r}: parity builds an explicit block-diagonal mask only for "
        f"'eager' (additive), 'sdpa' and {CPU_ATTENTION!r} (boolean)"
    )


@torch.no_grad()
def check_trainer_invariance(
    trainer: HasModel,
    records: Sequence[SequenceRecord],
    *,
    perturb: Callable[[str, list[torch.Tensor]], list[torch.Tensor]] | None = None,
) -> TrainerInvariance:
    """The trainer's logits for a sequence must not depend on how it is batched.

    Each record alone is the reference for the same sequences right-padded, left-padded and packed (restarting
    position ids, block-diagonal mask), compared bitwise on the rows that predict the completion.
    ``perturb(name, rows)``: a negative-control hook on the batched rows.
    """
    if not records:
        raise UsageError("check_trainer_invariance needs at least one record")
    model = trainer.model
    device = getattr(trainer, "device", None) or next(model.parameters()).device
    impl = implementation(model.config)
    seqs = [list(r.prompt_ids) + list(r.completion_ids) for r in records]
    # Row p - 1 + t predicts completion token t (as TransformersTrainer.logits reads them).
    spans = [(len(r.prompt_ids) - 1, r.length) for r in records]
    dtype = next(model.parameters()).dtype

    def forward(ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
        out = model(input_ids=ids.to(device), attention_mask=None if mask is None else mask.to(device),
                    position_ids=pos.to(device))
        logits: torch.Tensor = out.logits.float().cpu()
        return logits

    alone = []
    for s, (start, n) in zip(seqs, spans, strict=True):
        ids = torch.tensor([s])
        alone.append(forward(ids, torch.ones_like(ids), torch.arange(len(s))[None])[0, start : start + n])
    checks: list[TrainerCheck] = []
    for layout, build in _layouts(forward, seqs, spans, impl, dtype).items():
        name = f"trainer {layout.replace('_', '-')}"
        got, why = build()
        if got is None:
            checks.append({"name": name, "side": "trainer", "layout": layout, "status": UNAVAILABLE, "reason": why,
                           "bitwise": None, "tokens_equal": None, "max_abs_diff": None})
            continue
        if perturb is not None:
            got = perturb(name, got)
        per = [max_abs_difference(a, g) for a, g in zip(alone, got, strict=True)]
        equal = [torch.equal(a, g) for a, g in zip(alone, got, strict=True)]
        worst = max(range(len(seqs)), key=lambda i: per[i])
        checks.append({
            "name": name, "side": "trainer", "layout": layout, "status": "measured", "bitwise": all(equal),
            "tokens_equal": all(torch.equal(a.argmax(-1), g.argmax(-1)) for a, g in zip(alone, got, strict=True)),
            "max_abs_diff": max(per), "records_not_bitwise": sum(not e for e in equal),
            "worst_record": worst if per[worst] else None,
        })
    measured = [c for c in checks if c["status"] == "measured"]
    return {"side": "trainer", "attention": impl, "dtype": str(dtype).removeprefix("torch."), "records": len(seqs),
            "lengths": [len(s) for s in seqs], "checks": checks, "invariant": all(c["bitwise"] for c in measured)}


Rows = tuple[list[torch.Tensor] | None, str | None]


def _layouts(
    forward: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor],
    seqs: list[list[int]], spans: list[tuple[int, int]], impl: str | None, dtype: torch.dtype,
) -> dict[str, Callable[[], Rows]]:
    """Per layout, a call that runs the batch and returns each record's completion rows (or None and why)."""
    lens = [len(s) for s in seqs]
    width, count = max(lens), len(seqs)

    def rows(logits: torch.Tensor, offsets: list[int]) -> list[torch.Tensor]:
        # Record i sits in batch row i (padded layouts) or at offset o of the single packed row.
        row = (lambda i: 0) if logits.shape[0] == 1 else (lambda i: i)
        return [logits[row(i), o + s : o + s + n] for i, ((s, n), o) in enumerate(zip(spans, offsets, strict=True))]

    def padded(left: bool) -> Rows:
        ids = torch.zeros(count, width, dtype=torch.long)
        mask = torch.zeros(count, width, dtype=torch.long)
        offsets = []
        for i, s in enumerate(seqs):
            o = width - len(s) if left else 0
            ids[i, o : o + len(s)] = torch.tensor(s)
            mask[i, o : o + len(s)] = 1
            offsets.append(o)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return rows(forward(ids, mask, pos), offsets), None

    def packed() -> Rows:
        seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lens)])
        mask, why = _packed_mask(impl, seg, dtype)
        if mask is None:
            return None, why
        ids = torch.tensor([t for s in seqs for t in s])[None]
        pos = torch.cat([torch.arange(n) for n in lens])[None]
        return rows(forward(ids, mask, pos), [sum(lens[:i]) for i in range(count)]), None

    return {"right_padded": lambda: padded(left=False), "left_padded": lambda: padded(left=True), "packed": packed}
