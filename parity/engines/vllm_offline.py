"""Rollout side: the real vLLM offline engine (``vllm.LLM``) with processed log-probs and S_q capture."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, Unpack, cast

import torch

from parity.core.capture import (
    DEFAULT_MAX_HEAD,
    CaptureHistory,
    CapturePlan,
    CaptureStats,
    Heads,
    compare_supports,
    padded_ids,
    plan_capture,
    run_capture,
    validate_native_mask,
)
from parity.core.spec import SamplingSpec
from parity.engines.rollout_base import RolloutBase, RolloutSettings
from parity.errors import EngineError, SetupError, TimedOut, UsageError
from parity.records.sequence import SequenceRecord

T = TypeVar("T")


def configure_cpu_env(kv_cache_gib: int = 1) -> None:
    """Engine settings measured on CPU machines; must be set before vLLM is imported.

    The default KV cache grabs ~11 GiB and makes the first generate 10x slower on fixture models; the
    in-process engine avoids the ``__main__`` guard that multiprocessing needs.
    """
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def call_with_timeout(fn: Callable[[], T], timeout_s: float, what: str) -> T:
    """Run ``fn`` in a worker thread; raise :class:`~parity.errors.TimedOut` naming ``what`` if it does not finish.

    The offline engine has no timeout of its own; a stuck engine must end the run with an error, not
    hang it.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=target, name=f"parity-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimedOut(f"{what} did not finish within {timeout_s:.0f} s (raise --timeout if the model is large)")
    if "error" in box:
        raise box["error"]
    return cast(T, box["value"])


def sampling_params(spec: SamplingSpec, **extra: Any) -> Any:
    """A ``vllm.SamplingParams`` with ``spec``'s filters; ``extra`` adds e.g. max_tokens, seed."""
    try:
        from vllm import SamplingParams
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SetupError("vLLM sampling parameters need vLLM: install parity[cpu] (or parity[gpu] on CUDA)") from exc
    return SamplingParams(**spec.sampling_params_kwargs(), **extra)


def generate_with_capture(
    llm: Any,
    prompts: Sequence[Any],
    params: Any,
    *,
    max_head: int = DEFAULT_MAX_HEAD,
    history: CaptureHistory | None = None,
    start: int | None = None,
    timeout_s: float | None = None,
) -> tuple[list[Any], list[Any], CaptureStats]:
    """``llm.generate`` with the kept set captured: your engine, parity's capture plan.

    ``params``: one ``SamplingParams`` for every prompt, or one per prompt, each with ``n=1``; their
    ``logprobs`` is set from :func:`parity.core.capture.plan_capture` (adaptive for top_p/min_p
    without top_k: unproven sequences are asked again, same seed, wider head, up to ``max_head`` or
    the engine's ``max_logprobs``, whichever is smaller). A request without a seed gets one (a
    sequence asked again must be drawn again). The engine must run with
    ``logprobs_mode="processed_logprobs"``. Returns the outputs (per prompt, those of the capture
    that proved it, else of its first draw), the ``SamplingParams`` each was generated with (pass
    both to :func:`parity.records.convert.from_request_outputs`) and what the capture did.
    ``history`` carries what earlier calls needed into the start head of this one; ``start`` forces it;
    ``timeout_s`` bounds the whole call, widening included.
    """
    import random

    prompts = list(prompts)
    plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(plist) != len(prompts):
        raise UsageError(f"generate_with_capture: {len(plist)} SamplingParams for {len(prompts)} prompts: allowed one or one per prompt")
    for i, p in enumerate(plist):
        if int(getattr(p, "n", 1)) != 1:
            raise UsageError(f"generate_with_capture: params {i} has n={p.n}: allowed n=1 (repeat the prompt instead; "
                             f"each completion must be drawn again on its own)")
    mc = llm.llm_engine.model_config
    vocab = int(mc.get_vocab_size())
    engine_max = int(mc.max_logprobs)
    if engine_max != -1 and engine_max < max_head:
        if engine_max < 2:
            raise UsageError(f"generate_with_capture: the engine allows max_logprobs={engine_max}: allowed -1 or >= 2 "
                             f"(build it with LLM(..., max_logprobs=-1))")
        max_head = engine_max
    base = random.Random(0x5EED).randrange(0, 2**31 - len(prompts) - 1)
    seeded = []
    for i, p in enumerate(plist):
        q = p.clone()
        if q.seed is None:
            q.seed = base + i
        seeded.append(q)
    specs = [_spec_of_params(q) for q in seeded]
    if len({(s.temperature, s.top_k, s.top_p, s.min_p) for s in specs}) != 1:
        raise UsageError("generate_with_capture: the prompts' SamplingParams differ in temperature/top_k/top_p/min_p: "
                         "allowed one sampling spec per call")
    spec = specs[0]
    plan = plan_capture(spec, vocab, max_head=max_head, start=start,
                        suggested=history.start(spec) if history else None)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    used: list[Any] = list(seeded)

    def ask(indices: list[int], heads: list[int]) -> list[Heads]:
        batch = []
        for i, k in zip(indices, heads, strict=True):
            q = seeded[i].clone()
            q.logprobs = k
            batch.append(q)

        def run() -> Any:
            return llm.generate([prompts[i] for i in indices], batch, use_tqdm=False)

        outs = run() if deadline is None else call_with_timeout(run, max(deadline - time.monotonic(), 1.0),
                                                                f"vLLM generate ({spec.label()})")
        res = []
        for i, q, o in zip(indices, batch, outs, strict=True):
            used[i] = q
            comp = o.outputs[0]
            ids = [int(t) for t in comp.token_ids]
            sampled, heads_, lps = _heads_of_output(comp.logprobs, ids, int(q.logprobs), f"prompt {i}")
            res.append(Heads(ids, sampled, heads_, lps, payload=(o, q)))
        return res

    result = run_capture(plan, len(prompts), ask, vocab_size=vocab, spec=spec, history=history)
    outputs = [h.payload[0] for h in result.heads]
    return outputs, [h.payload[1] for h in result.heads], result.stats


def _spec_of_params(params: Any) -> SamplingSpec:
    top_k = int(getattr(params, "top_k", 0) or 0)
    return SamplingSpec(temperature=float(params.temperature), top_k=top_k if top_k >= 1 else 0,
                        top_p=float(getattr(params, "top_p", 1.0)), min_p=float(getattr(params, "min_p", 0.0) or 0.0))


def _heads_of_output(
    logprobs: Any, ids: list[int], requested: int, where: str
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Sampled log-probs and heads (sampled entry excluded) from a ``CompletionOutput.logprobs``.

    ``FlatLogprobs``: per position the sampled entry, then the top-K. ``list[dict]``: the same keyed by
    id, the sampled token first, so K entries when it is in the top-K and K + 1 when not.
    """
    if logprobs is None or len(logprobs) != len(ids):
        raise EngineError(f"{where}: vLLM returned log-probs for {0 if logprobs is None else len(logprobs)} of "
                          f"{len(ids)} tokens (allowed an engine with logprobs_mode='processed_logprobs')")
    sampled: list[float] = []
    heads: list[list[int]] = []
    head_lps: list[list[float]] = []
    if hasattr(logprobs, "start_indices"):
        for a, b in zip(logprobs.start_indices, logprobs.end_indices, strict=True):
            sampled.append(float(logprobs.logprobs[a]))
            heads.append(list(logprobs.token_ids[a + 1 : b]))
            head_lps.append(list(logprobs.logprobs[a + 1 : b]))
        return sampled, heads, head_lps
    for y, entry in zip(ids, logprobs, strict=True):
        items = list(entry.items())
        head = items if requested == -1 or len(items) == requested else [kv for kv in items if kv[0] != y]
        sampled.append(float(entry[y].logprob))
        heads.append([int(k) for k, _ in head])
        head_lps.append([float(v.logprob) for _, v in head])
    return sampled, heads, head_lps


class VllmRollout(RolloutBase):
    """The sampler under test. One engine per model; share it across scenarios."""

    name = "vllm"

    def __init__(self, model: str | Path, *, engine_kwargs: dict[str, Any] | None = None,
                 **settings: Unpack[RolloutSettings]) -> None:
        """``settings``: those of :class:`~parity.engines.rollout_base.RolloutBase`; ``engine_kwargs``
        go to ``vllm.LLM`` last (they override)."""
        super().__init__(model, **settings)
        capture, device = self.capture, self.device
        if capture not in ("topk", "native", "both"):
            raise UsageError(f"capture={capture!r} is invalid: allowed topk, native, both")
        if device == "cuda" and not torch.cuda.is_available():
            raise SetupError("--device cuda requested but CUDA is not available on this machine (torch.cuda.is_available() is False)")
        if capture != "topk" and device != "cuda":
            raise UsageError(
                f"capture={capture!r} uses vLLM's return_sampling_mask, which needs Model Runner V2 on CUDA "
                f"(refused on {device}): use capture='topk'"
            )
        if device == "cpu":
            configure_cpu_env()
        if capture != "topk":
            # return_sampling_mask is only accepted by Model Runner V2 (VllmConfig._verify_sampling_replay_config).
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        try:
            from vllm import LLM
        except ImportError as exc:
            raise SetupError("the rollout engine needs vLLM: install parity[cpu] (or parity[gpu] on CUDA)") from exc
        kwargs: dict[str, Any] = dict(
            model=self.model,
            dtype=self.dtype,
            seed=self.seed,
            logprobs_mode="processed_logprobs",
            max_logprobs=-1,  # any head a plan asks: adaptive widening up to the cap, a forced full vocabulary
            max_model_len=self.max_model_len_arg,
            enforce_eager=True,
            # Off by default so no scenario's numbers can depend on what an earlier scenario left
            # in the KV cache (on the CPU fixtures, a repeated run with it on was bitwise equal;
            # --prefix-caching turns it on to test the production setting).
            enable_prefix_caching=self.prefix_caching,
        )
        if self.capture != "topk":
            kwargs["return_sampling_mask"] = True
            kwargs["max_logprobs"] = 4096  # the native path refuses unbounded (-1) log-prob requests
        kwargs.update(engine_kwargs or {})
        start = time.perf_counter()
        self.llm = call_with_timeout(lambda: LLM(**kwargs), self.timeout_s, "vLLM engine start-up")
        self.init_s = time.perf_counter() - start
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())

    def tokenizer(self) -> Any:
        return self.llm.get_tokenizer()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        spec: SamplingSpec,
        *,
        max_tokens: int,
        seed: int,
        logprobs: int | None = None,
    ) -> list[SequenceRecord]:
        """Sample one completion per prompt (seed ``seed + i``); record log-probs and S_q.

        The capture follows :meth:`plan`; adaptive plans (top_p/min_p without top_k) ask the sequences
        with an unproven position again, same seeds, wider heads (:func:`parity.core.capture.run_capture`);
        what the capture did is left in ``self.last_capture``. ``logprobs`` forces the head size
        without :func:`plan_capture`'s checks and without widening (diagnostics only: the
        capture-head reproduction asks for a head smaller than top_k on purpose); positions it cannot
        capture completely are still flagged incomplete. The engine timeout bounds the whole call,
        widening rounds included.
        """
        from vllm.inputs import TokensPrompt

        if self.capture != "topk":
            validate_native_mask(spec)
        if logprobs is None:
            plan = self.plan(spec)
        else:
            plan = CapturePlan(logprobs if logprobs != 0 else None, f"top-{logprobs} (asked directly)")
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        deadline = time.monotonic() + self.timeout_s

        def ask(indices: list[int], heads: list[int]) -> list[Heads]:
            params = [
                sampling_params(
                    spec,
                    max_tokens=max_tokens,
                    seed=seed + i,
                    logprobs=k,
                    # Candidate detokenization dominates capture cost (full-vocab capture did not finish
                    # in minutes with it on); ids are all the harness needs.
                    detokenize=False,
                    flat_logprobs=True,
                    ignore_eos=True,  # fixed-length completions: every scenario compares the same count
                )
                for i, k in zip(indices, heads, strict=True)
            ]
            start = time.perf_counter()
            left = max(deadline - time.monotonic(), 1.0)
            outputs = call_with_timeout(
                lambda: self.llm.generate([inputs[i] for i in indices], params, use_tqdm=False),
                left,
                f"vLLM generate ({spec.label()})",
            )
            self.capture_s += time.perf_counter() - start
            return [_heads(out.outputs[0], i, spec) for i, out in zip(indices, outputs, strict=True)]

        result = run_capture(plan, len(prompts), ask, vocab_size=self.vocab_size, spec=spec,
                             history=self.capture_history if logprobs is None else None)
        self.last_capture = result.stats
        records = []
        for i, (h, requested) in enumerate(zip(result.heads, result.requested, strict=True)):
            comp, ids, heads, head_lps = h.payload, h.completion_ids, h.head_ids, h.head_logprobs
            kept, kept_lp, incomplete, extras = self.topk_support(h, requested)
            native = getattr(comp, "sampling_mask", None)
            if self.capture != "topk":
                if native is None or len(native.token_ids) != len(ids):
                    raise EngineError(f"vLLM returned no sampling mask for prompt {i} although return_sampling_mask is on")
                native_ids = padded_ids(native.token_ids)
                extras["native_kept_ids"] = native_ids
                if self.capture == "native":
                    kept, incomplete = native_ids, torch.zeros(len(ids), dtype=torch.bool)
                    kept_lp = _logprobs_for(native_ids, heads, head_lps)
                elif kept is not None:
                    bad = compare_supports(native_ids, kept, skip=incomplete)
                    extras["native_vs_topk_mismatch"] = torch.tensor(bad, dtype=torch.long)
            support = (kept, kept_lp, incomplete, extras)
            records.append(self.sampler_record(i, prompts[i], h, spec, seed + i, support))
        return records

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
            import gc

            gc.collect()


def _heads(comp: Any, i: int, spec: SamplingSpec) -> Heads:
    """One ``CompletionOutput`` (``flat_logprobs=True``) as sampled tokens and per-position heads."""
    ids = list(comp.token_ids)
    flat = comp.logprobs
    if flat is None or len(flat.start_indices) != len(ids):
        raise EngineError(
            f"vLLM returned log-probs for {0 if flat is None else len(flat.start_indices)} of {len(ids)} "
            f"tokens of prompt {i} ({spec.label()})"
        )
    sampled_lp, heads, head_lps = [], [], []
    for t, (a, b) in enumerate(zip(flat.start_indices, flat.end_indices, strict=True)):
        # Entry a is the sampled token (Sampler.gather_logprobs puts it first), then the top-K.
        if flat.token_ids[a] != ids[t]:
            raise EngineError(f"vLLM log-prob entry for prompt {i} position {t} is token {flat.token_ids[a]}, sampled {ids[t]}")
        sampled_lp.append(flat.logprobs[a])
        heads.append(flat.token_ids[a + 1 : b])
        head_lps.append(flat.logprobs[a + 1 : b])
    return Heads(ids, sampled_lp, heads, head_lps, payload=comp)


def _logprobs_for(ids: torch.Tensor, heads: list[list[int]], head_lps: list[list[float]]) -> torch.Tensor:
    """The sampler's processed log-probs of natively captured ids, looked up in the top-K heads.

    An id the head did not list gets NaN: the support-mass check then reports it instead of guessing.
    """
    out = torch.full(ids.shape, float("-inf"), dtype=torch.float32)
    for t in range(ids.shape[0]):
        table = dict(zip(heads[t], head_lps[t], strict=True))
        for j, i in enumerate(ids[t].tolist()):
            if i >= 0:
                out[t, j] = table.get(i, float("nan"))
    return out
