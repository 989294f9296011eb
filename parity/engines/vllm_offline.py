"""Rollout side: the real vLLM offline engine (``vllm.LLM``) with processed log-probs and S_q capture."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch

from parity.core.capture import (
    compare_supports,
    padded_ids,
    support_from_heads,
    validate_native_mask,
)
from parity.core.spec import SamplingSpec
from parity.engines.rollout_base import RolloutBase
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
    return box["value"]


def sampling_params(spec: SamplingSpec, **extra: Any) -> Any:
    """A ``vllm.SamplingParams`` with ``spec``'s filters; ``extra`` adds e.g. max_tokens, seed."""
    try:
        from vllm import SamplingParams
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise SetupError("vLLM sampling parameters need vLLM: install parity[cpu] (or parity[gpu] on CUDA)") from exc
    return SamplingParams(**spec.sampling_params_kwargs(), **extra)


class VllmRollout(RolloutBase):
    """The sampler under test. One engine per model; share it across scenarios."""

    name = "vllm"

    def __init__(self, model: str | Path, *, engine_kwargs: dict[str, Any] | None = None, **settings: Any) -> None:
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
            max_logprobs=-1,  # allow full-vocabulary capture for small vocabularies
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

        ``logprobs`` forces the head size without :func:`plan_capture`'s checks (diagnostics only: the
        capture-head reproduction asks for a head smaller than top_k on purpose); positions it cannot
        capture completely are still flagged incomplete.
        """
        from vllm.inputs import TokensPrompt

        if self.capture != "topk":
            validate_native_mask(spec)
        if logprobs is None:
            plan = self.plan(spec)
            logprobs = plan.logprobs if plan.logprobs is not None else 0
        captures = logprobs != 0
        params = [
            sampling_params(
                spec,
                max_tokens=max_tokens,
                seed=seed + i,
                logprobs=logprobs,
                # Candidate detokenization dominates capture cost (full-vocab capture did not finish
                # in minutes with it on); ids are all the harness needs.
                detokenize=False,
                flat_logprobs=True,
                ignore_eos=True,  # fixed-length completions: every scenario compares the same count
            )
            for i in range(len(prompts))
        ]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        start = time.perf_counter()
        outputs = call_with_timeout(
            lambda: self.llm.generate(inputs, params, use_tqdm=False), self.timeout_s, f"vLLM generate ({spec.label()})"
        )
        self.capture_s += time.perf_counter() - start
        records = []
        for i, out in enumerate(outputs):
            comp = out.outputs[0]
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
            kept = kept_lp = incomplete = None
            extras: dict[str, torch.Tensor] = {}
            if captures:
                cap = support_from_heads(ids, heads, head_lps, requested=logprobs, vocab_size=self.vocab_size)
                kept, kept_lp, incomplete = cap.kept_ids, cap.kept_logprobs, cap.incomplete
                extras["sampled_missing"] = cap.sampled_missing
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
            records.append(
                SequenceRecord(
                    source=self.name,
                    prompt_index=i,
                    prompt_ids=list(prompts[i]),
                    completion_ids=ids,
                    spec=spec,
                    seed=seed + i,
                    logprobs=torch.tensor(sampled_lp, dtype=torch.float32),
                    kept_ids=kept,
                    kept_logprobs=kept_lp,
                    incomplete=incomplete,
                    extras=extras,
                )
            )
        return records

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            del self.llm
            import gc

            gc.collect()


def _logprobs_for(ids: torch.Tensor, heads: list, head_lps: list) -> torch.Tensor:
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
