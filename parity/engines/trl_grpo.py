"""TRL's ``GRPOTrainer`` under parity: capture what it computes, and optionally fix its IS correction.

TRL 1.16 compares vLLM's processed ``log(p / S)`` with the trainer's full ``log p``: the difference is
``log S`` plus noise, and TRL's IS ratio its exp. Example: README, "TRL's GRPOTrainer under parity"."""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, TypedDict

import torch

from parity.core import estimators
from parity.core.capture import (
    DEFAULT_MAX_HEAD,
    FULL_VOCAB,
    CapturedSupport,
    CaptureHistory,
    CapturePlan,
    CaptureStats,
    plan_capture,
    support_from_heads,
)
from parity.core.penalties import penalise_sequence
from parity.core.spec import SamplingSpec
from parity.engines.sampler_rows import SamplerRows
from parity.engines.trl_hooks import Head, Hooks, Output, patch_trl
from parity.engines.vllm_offline import capture_outputs, rows_start
from parity.errors import EngineError, UsageError
from parity.records.vllm_outputs import spec_of_params

if TYPE_CHECKING:
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.grpo_trainer import GRPOTrainer
    from vllm import LLM, RequestOutput, SamplingParams

MODES = ("observe", "replay", "recompute")
CAPTURE_FORMAT = "parity-trl-grpo-capture"
CAPTURE_VERSION = 1

# What each captured sequence holds: one plain dict per completion (tensors are CPU, unpadded).
SEQUENCE_FIELDS = {
    "step": "int: trainer.state.global_step when the generation batch was made",
    "index": "int: row of the sequence in its generation batch",
    "prompt_ids": "list[int]: the prompt as TRL sent it to vLLM",
    "completion_ids": "list[int] (L): the sampled tokens",
    "mask": "bool [L]: TRL's completion_mask (x tool_mask) on this sequence; False tokens are not scored by TRL",
    "sampling_logps": "float32 [L]: vLLM's processed log-prob of each sampled token (TRL's sampling_per_token_logps)",
    "trainer_logps": "float32 [L]: TRL's full-vocabulary old_per_token_logps (trainer side, no fix)",
    "is_logps": "float32 [L]: the trainer log-probs TRL's IS correction and sampling/* metrics used "
    "(= trainer_logps in observe mode; renormalised in replay/recompute)",
    "log_s": "float64 [L]: log of the trainer's probability mass on the sampler's kept set S_q (0 when unfiltered)",
    "kept_ids": "long [L, K] (-1 padded): S_q per position from vLLM's processed head, or None (unfiltered)",
    "kept_logprobs": "float32 [L, K]: vLLM's processed log-probs of kept_ids, or None",
    "incomplete": "bool [L]: the captured head may not hold the whole support (never guessed)",
    "is_ratio": "float32 [1] (sequence_* modes) or [L] (token_* modes): TRL's importance_sampling_ratio row",
    "logits": "float32 [L, V] or None: the trainer's logits (before temperature) at the completion positions",
    "spec": "dict: temperature, top_k, top_p, min_p the sampler ran with",
    "is_mode": "str: TRL's vllm_importance_sampling_mode",
    "is_clip": "[clip_min, clip_max]: TRL's vllm_importance_sampling_clip_min/max (None = unbounded)",
    "fix": "str: observe | replay | recompute",
    "sampler_dtype": "str: the dtype vLLM ran the model in (colocate mode), or 'unknown'",
}

# Multimodal inputs the logits forward below does not thread through.
_UNSUPPORTED_FORWARD_KWARGS = (
    "pixel_values", "image_grid_thw", "pixel_attention_mask", "spatial_shapes", "image_sizes",
    "token_type_ids", "mm_token_type_ids", "image_position_ids",
)
# Sampling parameters that change vLLM's distribution beyond temperature, the filters and the penalties.
_UNMODELLED_SAMPLING = ("logit_bias", "allowed_token_ids", "bad_words", "structured_outputs")


Rows = dict[int, tuple[torch.Tensor, torch.Tensor]]  # position -> S_q read from the sampler's row


class _Batch(TypedDict):  # one generation batch, as generate() leaves it for scoring
    completion_ids: list[list[int]]
    supports: list[CapturedSupport | None] | None
    spec: SamplingSpec
    dtype: str
    capture: CaptureStats | None


class _Row(TypedDict):
    logits: torch.Tensor | None
    log_s: torch.Tensor
    support: CapturedSupport | None


class _Adaptive(TypedDict, total=False):
    stats: CaptureStats
    requested: list[int]
    rows: list[Rows]


@dataclass
class GrpoCapture:
    """What one :func:`patch_grpo` context saw."""

    mode: str
    head: int | None = None
    max_head: int | None = None  # None: no cap where the sampler's rows are read, DEFAULT_MAX_HEAD elsewhere
    sequences: list[dict[str, object]] = field(default_factory=list)  # SEQUENCE_FIELDS
    capture_plans: list[dict[str, object]] = field(default_factory=list)  # per generation batch: CaptureStats + step
    history: CaptureHistory = field(default_factory=CaptureHistory, repr=False)
    counts: dict[str, int] = field(
        default_factory=lambda: {
            "generation_batches": 0,
            "sequences": 0,
            "tokens": 0,
            "masked_tokens": 0,  # tokens TRL's mask leaves out (recorded, not scored)
            "incomplete_positions": 0,
            "nan_sampler_logprobs": 0,  # vLLM returned NaN (TRL maps it to a zero IS difference)
            "replay_fallbacks": 0,  # incomplete capture: recompute used at that position
            "forced_includes": 0,  # recompute: sampled token outside the recomputed support
            "widened_sequences": 0,  # adaptive capture: sequences asked again with a wider head
            "resampled_differently": 0,  # adaptive capture: second draws that came back with other tokens
        }
    )
    _pending: list[_Batch] = field(default_factory=list, repr=False)


def save_sequences(sequences: list[dict[str, object]], path: str | Path) -> Path:
    """Write captured sequences as one ``torch.save`` file (plain dicts of CPU tensors and lists)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": CAPTURE_FORMAT, "version": CAPTURE_VERSION, "fields": SEQUENCE_FIELDS,
                "sequences": sequences}, p)
    return p


def load_sequences(path: str | Path) -> list[dict[str, Any]]:  # SEQUENCE_FIELDS, as analyze.trl reads them
    data = torch.load(Path(path), weights_only=False)
    if not isinstance(data, dict) or data.get("format") != CAPTURE_FORMAT:
        raise UsageError(f"{path}: not a {CAPTURE_FORMAT} file (format={data.get('format') if isinstance(data, dict) else None!r})")
    if data.get("version") != CAPTURE_VERSION:
        raise UsageError(f"{path}: capture version {data.get('version')!r}, allowed {CAPTURE_VERSION}")
    return list(data["sequences"])


# -- the sampler's side -----------------------------------------------------------------------------


def _spec_of(gen: VLLMGeneration) -> SamplingSpec:
    """The distribution TRL's VLLMGeneration samples from (mirrors the kwargs built in ``generate``)."""
    kw = {"temperature": gen.temperature, "top_p": gen.top_p, "top_k": gen.top_k,
          "min_p": 0.0 if gen.min_p is None else gen.min_p, "repetition_penalty": gen.repetition_penalty}
    kw.update(gen.generation_kwargs or {})
    if kw.get("repetition_penalty") is None:
        kw["repetition_penalty"] = 1.0
    for name in _UNMODELLED_SAMPLING:
        if kw.get(name) not in (None, 0, 0.0, {}, []):
            raise UsageError(f"generation_kwargs[{name!r}]={kw[name]!r} is not modelled by parity's filters: allowed unset")
    return spec_of_params(SimpleNamespace(**kw))


def _vocab_size(gen: VLLMGeneration) -> int:
    cfg = gen.model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text.vocab_size)


def engine_dtype(gen: VLLMGeneration) -> str:
    """The dtype TRL's colocated engine runs the model in (``gen``: its ``VLLMGeneration``), or 'unknown'."""
    try:  # no colocated engine (server mode: llm is None) raises the AttributeError below
        return str(gen.llm.llm_engine.model_config.dtype).removeprefix("torch.")
    except AttributeError:
        return "unknown"


def _supports(completion_ids: list[list[int]], heads: list[list[Head]], requested: int | list[int], vocab: int,
              rows: list[Rows] | None = None) -> list[CapturedSupport | None]:
    """S_q per sequence from vLLM's heads (:func:`parity.engines.trl_hooks.sampled_first`). ``requested``: the head
    each sequence was asked with (one value for all, or one per sequence)."""
    per_seq = requested if isinstance(requested, list) else [requested] * len(completion_ids)
    seq_rows = rows if rows is not None and len(rows) == len(completion_ids) else [{}] * len(completion_ids)
    supports: list[CapturedSupport | None] = []
    for seq_ids, seq_heads, req, kept_rows in zip(completion_ids, heads, per_seq, seq_rows, strict=True):
        # NaN entries are not kept (support_from_heads keeps finite values only once NaN is -inf).
        clean = [[(-math.inf if x is None or math.isnan(x) else float(x)) for x in lps] for _, lps in seq_heads]
        supports.append(None if req == 0 else support_from_heads(seq_ids, [ids for ids, _ in seq_heads], clean,
                                                                   requested=req, vocab_size=vocab, rows=kept_rows))
    return supports


# -- the trainer's side -----------------------------------------------------------------------------


def _log_mass_correction(cap: GrpoCapture, z: torch.Tensor, y: torch.Tensor, spec: SamplingSpec,
                         support: CapturedSupport | None, prompt: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(log S over S_q — what parity measures —, what the fix subtracts from TRL's full-vocabulary log-prob) per
    position, float64. ``z``: the model's logits; with a penalty the sampler's are ``penalise_sequence(z)`` (from
    ``prompt`` and the earlier tokens), and the fix also subtracts the penalty term TRL leaves out."""
    n = y.shape[0]
    zp = penalise_sequence(z, spec, prompt or [], y.tolist()) if spec.penalised else z
    log_s_q = torch.zeros(n, dtype=torch.float64)
    if support is not None:
        log_s_q = estimators.predicted_log_s(zp, support.kept_ids, spec).double()
    if cap.mode == "observe":
        return log_s_q, torch.zeros(n, dtype=torch.float64)
    full = estimators.full(z, y, spec).double()  # TRL's own value: no penalty, no filter
    full_p = estimators.full(zp, y, spec).double() if spec.penalised else full
    if cap.mode == "recompute" or support is None and spec.effective().filtered:
        rec = estimators.recompute(zp, y, spec)
        cap.counts["forced_includes"] += int(rec.forced.sum())
        return log_s_q, full - rec.logprobs.double()
    correction = log_s_q + (full - full_p)  # replay = full_p - log S_q
    if support is not None and bool(support.incomplete.any()):
        rec = estimators.recompute(zp, y, spec)
        bad = support.incomplete
        correction[bad] = (full - rec.logprobs.double())[bad]
        cap.counts["replay_fallbacks"] += int(bad.sum())
    return log_s_q, correction


def _adaptive_generate(generate: Callable[..., list[RequestOutput]], plan: CapturePlan, spec: SamplingSpec, vocab: int,
                       history: CaptureHistory, seeds: random.Random, batch: _Adaptive, rows: SamplerRows | None = None
                       ) -> Callable[..., list[RequestOutput]]:
    """``LLM.generate`` for one TRL batch under an adaptive plan, unproven requests asked again; each request is
    seeded (TRL sends none), candidate detokenization off (TRL decodes from ids). TRL gets per sequence the
    capture that proved it (or its first draw); ``batch`` gets what it needed."""

    def wrapped(prompts: list[object], sampling_params: SamplingParams | list[SamplingParams] | None = None,
                *args: object, **kwargs: object) -> list[RequestOutput]:
        sp = sampling_params
        if sp is None or isinstance(sp, (list, tuple)) or getattr(sp, "n", 1) != 1 or args:
            return generate(prompts, sampling_params, *args, **kwargs)
        prompts = list(prompts)
        base = seeds.randrange(0, 2**31 - len(prompts) - 1)
        params = []
        for i in range(len(prompts)):
            p = sp.clone()
            p.detokenize = bool(sp.detokenize) and bool(sp.stop)  # stop strings need the text
            p.seed = sp.seed if sp.seed is not None else base + i
            params.append(p)
        result = capture_outputs(lambda ps, qs: generate(ps, qs, **kwargs), prompts, params, plan, spec=spec,
                                 vocab_size=vocab, history=history, nan_as_dropped=True, rows=rows)
        batch["stats"], batch["requested"] = result.stats, result.requested
        batch["rows"] = [h.rows for h in result.heads]  # TRL's lists carry heads only: S_q rides here
        return [h.payload[0] for h in result.heads]

    return wrapped


def _fixed_stats(plan: CapturePlan, supports: list[CapturedSupport | None], completion_ids: list[list[int]]) -> CaptureStats:
    """What a one-generation capture (top_k, forced head, no colocated engine) met."""
    stats = CaptureStats(plan.logprobs, plan.reason, sequences=len(completion_ids),
                         positions=sum(len(c) for c in completion_ids), widest_head=plan.logprobs or 0)
    for sup in supports:
        if sup is not None:
            stats.incomplete_positions += int(sup.incomplete.sum())
            done = ~sup.incomplete
            if bool(done.any()):
                stats.largest_support = max(stats.largest_support, int((sup.kept_ids[done] >= 0).sum(-1).max()))
    return stats


# -- the patch --------------------------------------------------------------------------------------


@contextlib.contextmanager
def patch_grpo(mode: str = "replay", *, head: int | None = None, keep_logits: bool = True,
               max_head: int | None = None) -> Iterator[GrpoCapture]:
    """Patch TRL's GRPOTrainer/VLLMGeneration to capture S_q per generation batch; restore on exit. Enter it before
    constructing the trainer. ``mode``: ``observe`` changes nothing TRL computes, ``replay`` / ``recompute``
    renormalise what its IS correction reads; ``head`` forces the head (-1: the vocabulary), ``max_head`` caps
    adaptive plans, ``keep_logits`` keeps the trainer's ``[L, V]`` logits (docs/internals.md, section 5)."""
    if mode not in MODES:
        raise UsageError(f"patch_grpo mode={mode!r} is invalid: allowed {', '.join(MODES)}")
    cap = GrpoCapture(mode=mode, head=head, max_head=max_head)
    with patch_trl(_GrpoHooks(cap, keep_logits)):
        yield cap


class _GrpoHooks(Hooks):
    """patch_grpo at TRL's hooks (:mod:`parity.engines.trl_hooks`): generate asks for the capture plan's head and
    records S_q per sequence; the batch's first scoring call (``old_per_token_logps``) returns the mode's log-probs
    (``old - log S_q`` for replay), TRL's full-vocabulary values kept for the record and the policy ratio."""

    call: tuple[SamplingSpec, int, CapturePlan, int, _Adaptive]  # the generate call in progress (plan() sets it)
    pending: _Batch  # the batch being scored, as generate() left it
    rows: list[_Row]  # its rows so far

    def __init__(self, cap: GrpoCapture, keep_logits: bool) -> None:
        self.cap, self.keep_logits, self.fix, self.step = cap, keep_logits, cap.mode != "observe", 0
        # Per-request seeds of adaptive batches: their own stream, so TRL's torch RNG is left untouched.
        self.seeds = random.Random(0x5EED)

    def plan(self, gen: VLLMGeneration) -> tuple[int, contextlib.AbstractContextManager[object]]:
        cap, head, max_head = self.cap, self.cap.head, self.cap.max_head
        spec = _spec_of(gen)
        vocab = _vocab_size(gen)
        # None (server mode) only with a plan made non-adaptive just below.
        llm: LLM | None = getattr(gen, "llm", None) if getattr(gen, "mode", "colocate") == "colocate" else None
        rows = SamplerRows(llm, cap=max_head) if llm is not None and head is None else None
        if rows is not None and not rows.install():
            rows = None
        limit = max_head or DEFAULT_MAX_HEAD
        plan = plan_capture(spec, vocab, head=head, max_head=limit, suggested=cap.history.start(spec),
                            start=rows_start(limit, vocab) if rows is not None else None)
        if plan.adaptive and llm is None:
            # TRL's server client sends no per-request seed, so a sequence cannot be drawn again: one
            # generation at the cap, unproven positions flagged.
            cap_k = plan.max_head if plan.max_head is not None else -1
            plan = CapturePlan(cap_k, f"{plan.reason.split(':')[0]}: one generation at the cap (no colocated "
                               f"engine to ask again with the same seed)")
        elif plan.adaptive and plan.logprobs == FULL_VOCAB:
            # The first head is the whole vocabulary (V <= SMALL_VOCAB): it proves every position and no
            # sequence is asked again, so the requests keep TRL's own unseeded draws (what TRL samples with
            # no patch) rather than seeds of their own.
            plan = CapturePlan(FULL_VOCAB, plan.reason)
        requested = plan.logprobs if plan.logprobs is not None and plan.captures_support else 0
        batch: _Adaptive = {}
        self.call = (spec, vocab, plan, requested, batch)
        around = contextlib.ExitStack()
        if plan.adaptive and llm is not None:  # an adaptive plan has a colocated engine (see above)
            llm.generate = _adaptive_generate(llm.generate, plan, spec, vocab, cap.history, self.seeds, batch, rows)
            around.callback(delattr, llm, "generate")  # the instance attribute: the class's method shows through again
        return requested, around

    def sampled(self, gen: VLLMGeneration, completion_ids: list[list[int]], logprobs: list[list[list[float | None]]] | None,
                heads: list[list[Head]] | None) -> None:
        cap = self.cap
        spec, vocab, plan, requested, batch = self.call
        if logprobs is None or heads is None:
            cap._pending.append({"completion_ids": completion_ids, "supports": None, "spec": spec,
                                 "dtype": engine_dtype(gen), "capture": None})
            return
        cap.counts["nan_sampler_logprobs"] += sum(row[0] is None for seq in logprobs for row in seq)
        supports = _supports(completion_ids, heads, batch.get("requested", requested), vocab, batch.get("rows"))
        stats = batch.get("stats") or _fixed_stats(plan, supports, completion_ids)
        cap.counts["widened_sequences"] += stats.widened_sequences
        cap.counts["resampled_differently"] += stats.resampled_differently
        cap._pending.append({"completion_ids": [list(c) for c in completion_ids], "supports": supports,
                             "spec": spec, "dtype": engine_dtype(gen), "capture": stats})

    def begin(self, trainer: GRPOTrainer) -> bool:
        if not (getattr(trainer, "use_vllm", False) and getattr(trainer, "vllm_importance_sampling_correction", False)):
            if self.cap.mode != "observe":
                raise UsageError(
                    f"patch_grpo(mode={self.cap.mode!r}) fixes the vLLM importance-sampling correction: it needs "
                    f"use_vllm=True and vllm_importance_sampling_correction=True (got use_vllm="
                    f"{getattr(trainer, 'use_vllm', None)!r}, vllm_importance_sampling_correction="
                    f"{getattr(trainer, 'vllm_importance_sampling_correction', None)!r})")
            return False
        self.cap._pending.clear()
        self.step = int(trainer.state.global_step)
        return True

    def scoring(self, kwargs: dict[str, object]) -> None:
        # generate() ran earlier in this _generate_and_score_completions call and left its batch here.
        pend = self.pending = self.cap._pending[-1]
        extra = [k for k in _UNSUPPORTED_FORWARD_KWARGS if kwargs.get(k) is not None]
        if extra:
            raise UsageError(f"patch_grpo scores text-only batches: got {', '.join(extra)}")
        if pend["supports"] is None and pend["spec"].effective().filtered and self.cap.mode == "replay":
            raise EngineError("patch_grpo(mode='replay'): vLLM returned no log-probs, so S_q was not captured")
        self.rows = []

    def correction(self, b: int, z: torch.Tensor, y: torch.Tensor, prompt: list[int]) -> torch.Tensor:
        pend = self.pending
        support = pend["supports"][b] if pend["supports"] is not None else None
        log_s_q, correction = _log_mass_correction(self.cap, z.cpu(), y, pend["spec"], support, prompt)
        self.rows.append({"logits": z.cpu() if self.keep_logits else None, "log_s": log_s_q, "support": support})
        return correction

    def end(self, trainer: GRPOTrainer, output: Output, full: torch.Tensor, used: torch.Tensor) -> None:
        """One captured sequence per row (SEQUENCE_FIELDS): ``full`` is TRL's old_per_token_logps, ``used``
        what its IS correction read."""
        cap, step, pend = self.cap, self.step, self.pending
        clip = [trainer.vllm_importance_sampling_clip_min, trainer.vllm_importance_sampling_clip_max]
        mask = output["completion_mask"]
        if "tool_mask" in output:
            mask = mask * output["tool_mask"]
        sampling = output.get("sampling_per_token_logps")
        ratio = output.get("importance_sampling_ratio")
        prompts, prompt_mask, spec = output["prompt_ids"], output["prompt_mask"], pend["spec"]
        cap.counts["generation_batches"] += 1
        if pend["capture"] is not None:
            cap.capture_plans.append({"step": step, **pend["capture"].to_dict()})
        for b, comp in enumerate(pend["completion_ids"]):
            n = len(comp)
            row = self.rows[b]
            support = row["support"]
            m = mask[b, :n].bool().cpu()
            r = ratio[b].detach().float().cpu() if ratio is not None else None
            if r is not None and r.numel() > 1:
                r = r[:n]
            incomplete = support.incomplete if support is not None else torch.zeros(n, dtype=torch.bool)
            seq: dict[str, object] = {
                "step": step, "index": b, "prompt_ids": prompts[b][prompt_mask[b].bool()].tolist(),
                "completion_ids": list(comp), "mask": m,
                "sampling_logps": sampling[b, :n].detach().float().cpu() if sampling is not None else None,
                "trainer_logps": full[b, :n].detach().float().cpu(),
                "is_logps": used[b, :n].detach().float().cpu(),
                "log_s": row["log_s"], "kept_ids": support.kept_ids if support is not None else None,
                "kept_logprobs": support.kept_logprobs if support is not None else None,
                "incomplete": incomplete, "is_ratio": r, "logits": row["logits"], "spec": spec.to_dict(),
                "is_mode": str(trainer.vllm_importance_sampling_mode), "is_clip": list(clip), "fix": cap.mode,
                "sampler_dtype": pend["dtype"],
            }
            cap.sequences.append(seq)
            cap.counts["sequences"] += 1
            cap.counts["tokens"] += n
            cap.counts["masked_tokens"] += int((~m).sum())
            cap.counts["incomplete_positions"] += int(incomplete.sum())
