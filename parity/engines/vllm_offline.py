"""Rollout side: the real vLLM offline engine (``vllm.LLM``) with processed log-probs and S_q capture."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, Unpack

import torch

from parity.core import capture as cap
from parity.core.capture_plan import SMALL_VOCAB
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.engines.rollout_base import RolloutBase, RolloutSettings, Support
from parity.engines.routed_experts import RoutedExperts, attach_routes, moe_shape
from parity.engines.sampler_rows import SamplerRows
from parity.errors import EngineError, SetupError, TimedOut, UsageError
from parity.records.vllm_outputs import ROWS_ATTR, heads_of_output, spec_of_params

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase
    from vllm import LLM, RequestOutput, SamplingParams

T = TypeVar("T")
ROWS_HEAD = 64  # the head asked where the sampler's rows prove what it cannot (docs/capture_plan.md, section 9)


def rows_start(limit: int, vocab_size: int) -> int | None:
    """The start head of an adaptive plan where the sampler's rows are read: ``ROWS_HEAD`` (within the cap);
    None for a vocabulary small enough to read whole (the plan's own rule)."""
    return min(ROWS_HEAD, limit) if vocab_size > SMALL_VOCAB else None

# Engine settings measured on CPU machines. The default KV cache grabs ~11 GiB and makes the first
# generate 10x slower on fixture models; the in-process engine avoids the ``__main__`` guard that
# multiprocessing needs.
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false"}


def fresh_parallel_groups() -> None:
    """Drop the model-parallel groups an earlier in-process engine left, so the next start makes its own.
    On CPU the engine runs in this process and keeps its groups in ``vllm.distributed.parallel_state``'s
    globals. ``ensure_model_parallel_initialized`` reuses groups that exist, and the expert-parallel group is
    made only when the first model is a MoE, so a MoE engine started after a dense one fails in
    ``get_ep_group``. With one rank every group has size 1: engines still open get the new ones."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()


def configure_cpu_env(env: MutableMapping[str, str] | None = None) -> None:
    """Default :data:`CPU_ENV` into ``env`` (this process's environment: before vLLM is imported; or a
    spawned server's); values already set are kept."""
    target = os.environ if env is None else env
    for name, value in CPU_ENV.items():
        target.setdefault(name, value)


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` in a worker thread; raise :class:`~parity.errors.TimedOut` naming ``what`` if it does not finish
    (the offline engine has no timeout of its own, and a stuck engine must end the run, not hang it)."""
    value: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            value.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            error.append(exc)

    worker = threading.Thread(target=target, name=f"parity-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimedOut(f"{what} did not finish within {timeout_s:.0f} s (raise --timeout if the model is large)")
    if error:
        raise error[0]
    return value[0]


def sampling_params(spec: SamplingSpec, **extra: object) -> SamplingParams:
    """A ``vllm.SamplingParams`` with ``spec``'s filters; ``extra`` adds e.g. max_tokens, seed."""
    try:
        from vllm import SamplingParams
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SetupError("vLLM sampling parameters need vLLM: install parity[cpu] (or parity[gpu] on CUDA)") from exc
    return SamplingParams(**spec.sampling_params_kwargs(), **extra)


def capture_outputs(generate: Callable[[list[object], list[SamplingParams]], Sequence[RequestOutput]],
                    prompts: Sequence[object], params: Sequence[SamplingParams], plan: cap.CapturePlan, *,
                    spec: SamplingSpec, vocab_size: int, history: cap.CaptureHistory | None = None,
                    deadline: float | None = None, nan_as_dropped: bool = False,
                    rows: SamplerRows | None = None) -> cap.CaptureResult:
    """``plan`` run over ``generate(prompts, params)`` (``LLM.generate`` or a wrapper): each round clones ``params[i]``
    (seeded, ``n=1``) with its head; ``Heads.payload`` is ``(RequestOutput, SamplingParams)``; ``deadline`` bounds
    the whole capture; ``rows`` (a hook on the engine) proves from the sampler's row what a head could not."""
    mismatched = [0]

    def ask(indices: list[int], heads: list[int]) -> list[cap.Heads]:
        batch = [params[i].clone() for i in indices]
        for q, k in zip(batch, heads, strict=True):
            q.logprobs = k

        def run() -> Sequence[RequestOutput]:
            return generate([prompts[i] for i in indices], batch)

        if rows is not None:
            rows.take()  # anything left behind
            rows.arm()
        outs = run() if deadline is None else call_with_timeout(
            run, max(deadline - time.monotonic(), 1.0), f"vLLM generate ({spec.label()})")
        got = [heads_of_output(o.outputs[0], k, f"prompt {i} ({spec.label()})", error=EngineError,
                               nan_as_dropped=nan_as_dropped, payload=(o, q))
               for i, k, q, o in zip(indices, heads, batch, outs, strict=True)]
        if rows is not None:
            mismatched[0] += rows.attach(got, [str(o.request_id) for o in outs], rows.take())
            for h, o in zip(got, outs, strict=True):
                setattr(o.outputs[0], ROWS_ATTR, h.rows)  # from_request_outputs reads them back
        return got

    result = cap.run_capture(plan, len(prompts), ask, vocab_size=vocab_size, spec=spec, history=history)
    if rows is not None:
        result.stats.sampler_rows = rows.describe()
        result.stats.row_mismatched = mismatched[0]
    return result


def generate_with_capture(llm: LLM, prompts: Sequence[object],
                          params: SamplingParams | Sequence[SamplingParams], *, max_head: int | None = None,
                          history: cap.CaptureHistory | None = None, start: int | None = None,
                          timeout_s: float | None = None,
                          ) -> tuple[list[RequestOutput], list[SamplingParams], cap.CaptureStats]:
    """``llm.generate`` with the kept set captured (engine: ``logprobs_mode="processed_logprobs"``). ``params``: one
    ``SamplingParams`` (``n=1``) or one per prompt; ``logprobs`` from the plan, widened up to ``max_head`` or the engine's
    ``max_logprobs``; unseeded requests seeded; the rest as :func:`parity.core.capture.plan_capture` / :func:`capture_outputs`.
    Returns the outputs, the params each was drawn with (for :func:`parity.records.convert.from_request_outputs`), the stats."""
    prompts = list(prompts)
    plist: list[SamplingParams] = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise UsageError(f"generate_with_capture: {len(plist)} SamplingParams for {len(prompts)} prompts: allowed one or one per prompt")
    for i, p in enumerate(plist):
        if int(getattr(p, "n", 1)) != 1:
            raise UsageError(f"generate_with_capture: params {i} has n={p.n}: allowed n=1 (repeat the prompt instead; "
                             f"each completion must be drawn again on its own)")
    mc = llm.llm_engine.model_config
    vocab = int(mc.get_vocab_size())
    engine_max = int(mc.max_logprobs)
    rows = SamplerRows(llm, cap=max_head, timeout_s=timeout_s or 60.0)
    rows_on = rows.install()
    max_head = cap.DEFAULT_MAX_HEAD if max_head is None else max_head
    if engine_max != -1 and engine_max < max_head:
        if engine_max < 2:
            raise UsageError(f"generate_with_capture: the engine allows max_logprobs={engine_max}: allowed -1 or >= 2 "
                             f"(build it with LLM(..., max_logprobs=-1))")
        max_head = engine_max
    base = random.Random(0x5EED).randrange(0, 2**31 - len(prompts) - 1)
    seeded = [p.clone() for p in plist]
    for i, q in enumerate(seeded):
        q.seed = base + i if q.seed is None else q.seed
    specs = [spec_of_params(q) for q in seeded]
    if len({(s.temperature, s.top_k, s.top_p, s.min_p) for s in specs}) != 1:
        raise UsageError("generate_with_capture: the prompts' SamplingParams differ in temperature/top_k/top_p/min_p: "
                         "allowed one sampling spec per call")
    spec = specs[0]
    if rows_on and start is None:
        start = rows_start(max_head, vocab)
    plan = cap.plan_capture(spec, vocab, max_head=max_head, start=start,
                        suggested=history.start(spec) if history else None)
    result = capture_outputs(lambda ps, qs: llm.generate(ps, qs, use_tqdm=False), prompts, seeded, plan,
                             spec=spec, vocab_size=vocab, history=history, rows=rows if rows_on else None,
                             deadline=None if timeout_s is None else time.monotonic() + timeout_s)
    return [h.payload[0] for h in result.heads], [h.payload[1] for h in result.heads], result.stats


class VllmRollout(RolloutBase):
    """The sampler under test. One engine per model; share it across scenarios."""

    name = "vllm"

    def __init__(self, model: str | Path, *, engine_kwargs: Mapping[str, object] | None = None,
                 **settings: Unpack[RolloutSettings]) -> None:
        """``settings``: those of :class:`~parity.engines.rollout_base.RolloutBase`; ``engine_kwargs`` go to
        ``vllm.LLM`` last (they override)."""
        super().__init__(model, **settings)
        capture, device = self.capture, self.device
        if capture not in ("topk", "native", "both"):
            raise UsageError(f"capture={capture!r} is invalid: allowed topk, native, both")
        if device == "cuda" and not torch.cuda.is_available():
            raise SetupError("--device cuda requested but CUDA is not available on this machine "
                             "(torch.cuda.is_available() is False)")
        if capture != "topk" and device != "cuda":
            raise UsageError(f"capture={capture!r} uses vLLM's return_sampling_mask, which needs Model "
                             f"Runner V2 on CUDA (refused on {device}): use capture='topk'")
        if device == "cpu":
            configure_cpu_env()
        if capture != "topk":
            # return_sampling_mask is only accepted by Model Runner V2 (VllmConfig._verify_sampling_replay_config).
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise SetupError("the rollout engine needs vLLM: install parity[cpu] (or parity[gpu] on CUDA)") from exc
        kwargs: dict[str, object] = dict(
            model=self.model, dtype=self.dtype, seed=self.seed, logprobs_mode="processed_logprobs",
            max_logprobs=-1,  # any head a plan asks: adaptive widening up to the cap, a forced full vocabulary
            max_model_len=self.max_model_len_arg, enforce_eager=True,
            # Off by default so no scenario's numbers can depend on what an earlier scenario left
            # in the KV cache (on the CPU fixtures, a repeated run with it on was bitwise equal;
            # --prefix-caching turns it on to test the production setting).
            enable_prefix_caching=self.prefix_caching,
        )
        if self.max_num_batched_tokens is not None:  # a step's token budget: prompts longer than it are chunked
            n = self.max_num_batched_tokens
            kwargs.update(enable_chunked_prefill=True, max_num_batched_tokens=n, max_num_seqs=min(n, 256))
        self.moe = moe_shape(self.model)  # (layers, top_k, experts) of a MoE checkpoint, else None
        if self.moe is not None and device == "cuda":
            kwargs["enable_return_routed_experts"] = True  # Model Runner V2's own capture (routed_experts.NATIVE)
        if self.capture != "topk":
            kwargs["return_sampling_mask"] = True
            kwargs["max_logprobs"] = 4096  # the native path refuses unbounded (-1) log-prob requests
        kwargs.update(engine_kwargs or {})
        if device == "cpu":
            fresh_parallel_groups()
        self.llm = call_with_timeout(lambda: LLM(**kwargs), self.timeout_s, "vLLM engine start-up")
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self.rows = SamplerRows(self.llm, cap=self.max_head, timeout_s=self.timeout_s)
        if self.capture == "topk":
            self.rows.install()
        self.routes = RoutedExperts(self.llm, timeout_s=self.timeout_s)
        if self.moe is not None and device != "cuda" and not self.routes.install():
            raise EngineError(f"routed-expert capture on {self.model}: {self.routes.reason}")
        self.last_routes: dict[str, object] | None = None

    def plan(self, spec: SamplingSpec) -> cap.CapturePlan:
        """The head route's plan; where the sampler's rows are read, adaptive plans start at ``ROWS_HEAD``
        (the head proves the narrow positions, the rows the wide ones, in one generation)."""
        limit = self.max_head or cap.DEFAULT_MAX_HEAD
        start = rows_start(limit, self.vocab_size)
        if not self.rows.active or self.start_head is not None or self.head is not None or start is None:
            return super().plan(spec)
        plan = cap.plan_capture(spec, self.vocab_size, tie_margin=self.tie_margin, max_head=limit, start=start)
        if not plan.adaptive:
            return plan
        wide = "no cap" if self.max_head is None else f"below {self.max_head} tokens (--max-capture-head)"
        return replace(plan, reason=f"{plan.reason}; kept sets the head cannot prove read whole from the "
                                    f"sampler's row ({wide})")

    def tokenizer(self) -> PreTrainedTokenizerBase:
        tok: PreTrainedTokenizerBase = self.llm.get_tokenizer()
        return tok

    def generate(self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, max_tokens: int, seed: int,
                 logprobs: int | None = None) -> list[SequenceRecord]:
        """Sample one completion per prompt (seed ``seed + i``); record log-probs and S_q under :meth:`plan`, what the
        capture did in ``self.last_capture``. ``logprobs`` forces the head without the plan's checks or widening (the
        capture-head repro asks less than top_k); positions it cannot capture are still flagged. The engine timeout
        bounds the whole call."""
        from vllm.inputs import TokensPrompt

        if self.capture != "topk":
            cap.validate_native_mask(spec)
        if logprobs is None:
            plan = self.plan(spec)
        else:
            plan = cap.CapturePlan(logprobs if logprobs != 0 else None, f"top-{logprobs} (asked directly)")
        params = [
            sampling_params(
                spec,
                max_tokens=max_tokens,
                # Greedy draws use no generator: unseeded, as vLLM 0.32's CPU engine cannot rewind a seeded one
                # under chunked prefill (parity.run.preflight refuses T > 0 there).
                seed=None if spec.greedy and self.max_num_batched_tokens else seed + i,
                # Candidate detokenization dominates capture cost (full-vocab capture did not finish
                # in minutes with it on); ids are all the harness needs.
                detokenize=False,
                flat_logprobs=True,
                ignore_eos=True,  # fixed-length completions: every scenario compares the same count
            )
            for i in range(len(prompts))
        ]
        self.routes.arm()
        result = capture_outputs(lambda ps, qs: self.llm.generate(ps, qs, use_tqdm=False),
                                 [TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, plan,
                                 spec=spec, vocab_size=self.vocab_size, rows=self._rows(logprobs),
                                 history=self.capture_history if logprobs is None else None,
                                 deadline=time.monotonic() + self.timeout_s)
        steps = self.routes.take()
        records = self.records(prompts, spec, seed, result)
        if self.moe is not None:
            outs = [h.payload[0] for h in result.heads]
            self.last_routes = attach_routes(records, outs, steps if self.routes.active else None, self.moe[2])
        return records

    def _rows(self, forced: int | None) -> SamplerRows | None:
        """The sampler-row hook for the next generate, its cap brought to this scenario's; none for a
        forced head (diagnostics ask for a head on purpose)."""
        if not self.rows.active or forced is not None or self.head is not None:
            return None
        if self.rows.cap != self.max_head:
            self.rows.cap = self.max_head
            self.rows.install()
        return self.rows

    def support(self, i: int, h: cap.Heads, requested: int, spec: SamplingSpec) -> Support:
        """S_q from the top-K heads, or from vLLM's own sampling mask (``capture`` native or both)."""
        kept, kept_lp, incomplete, extras = super().support(i, h, requested, spec)
        if self.capture == "topk":
            return kept, kept_lp, incomplete, extras
        native = getattr(h.payload[0].outputs[0], "sampling_mask", None)
        if native is None or len(native.token_ids) != len(h.completion_ids):
            raise EngineError(f"vLLM returned no sampling mask for prompt {i} although return_sampling_mask is on")
        native_ids = cap.padded_ids(native.token_ids)
        extras["native_kept_ids"] = native_ids
        if self.capture == "native":
            kept, incomplete = native_ids, torch.zeros(len(h.completion_ids), dtype=torch.bool)
            kept_lp = _logprobs_for(native_ids, h.head_ids, h.head_logprobs)
        elif kept is not None:
            bad = cap.compare_supports(native_ids, kept, skip=incomplete)
            extras["native_vs_topk_mismatch"] = torch.tensor(bad, dtype=torch.long)
        return kept, kept_lp, incomplete, extras

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
            import gc

            gc.collect()


def _logprobs_for(ids: torch.Tensor, heads: list[list[int]], head_lps: list[list[float]]) -> torch.Tensor:
    """The sampler's processed log-probs of natively captured ids, looked up in the top-K heads. An id the
    head did not list gets NaN: the support-mass check then reports it instead of guessing."""
    out = torch.full(ids.shape, float("-inf"), dtype=torch.float32)
    for t in range(ids.shape[0]):
        table = dict(zip(heads[t], head_lps[t], strict=True))
        for j, i in enumerate(ids[t].tolist()):
            if i >= 0:
                out[t, j] = table.get(i, float("nan"))
    return out
