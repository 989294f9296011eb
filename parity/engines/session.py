"""The engine pair of a run: one rollout engine and one trainer per model, their shared vocabulary
check and the fixed prompts both sides see as the same token ids."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from parity.engines.engine_log import waiting
from parity.engines.settings import EngineSettings, HasEngineSettings, as_engine_settings
from parity.errors import UsageError
from parity.fixtures import resolve_model

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from parity.core.capture import CaptureHistory, CaptureStats
    from parity.core.sequence import SequenceRecord
    from parity.core.spec import SamplingSpec
    from parity.engines.rollout_base import RolloutSettings
    from parity.engines.vllm_offline import VllmRollout


class Tokenizer(Protocol):
    """What parity asks of either side's tokenizer."""

    def encode(self, text: str, *, add_special_tokens: bool = ...) -> list[int]: ...

    def __len__(self) -> int: ...


class Rollout(Protocol):
    """A rollout adapter (:class:`~parity.engines.vllm_offline.VllmRollout`,
    :class:`~parity.engines.vllm_server.client.ServerRollout`) as a run uses it."""

    head: int | None  # the capture head of the next generate() (None: planned per spec)
    max_head: int | None  # the capture cap of the next generate() (None: no cap where sampler rows are read)
    capture_history: CaptureHistory
    last_capture: CaptureStats | None  # what the latest generate() captured
    model: str
    vocab_size: int

    def tokenizer(self) -> Tokenizer: ...

    def generate(
        self, prompts: Sequence[Sequence[int]], spec: SamplingSpec, *, max_tokens: int, seed: int
    ) -> list[SequenceRecord]: ...

    def close(self) -> None: ...


class Trainer(Protocol):
    """The trainer side (:class:`~parity.engines.transformers_trainer.TransformersTrainer`) as a run uses it."""

    model_path: str
    vocab_size: int

    @property
    def model(self) -> torch.nn.Module: ...

    def tokenizer(self) -> Tokenizer: ...

    def logits(self, records: Sequence[SequenceRecord]) -> list[torch.Tensor]: ...

# Fixed prompt texts, tokenized by the trainer's tokenizer and sent to vLLM as token ids so that
# tokenization cannot drift between the sides.
PROMPT_TEXTS = (
    "The sampler and the trainer must agree on every token",
    "Once upon a time in a small village by the sea",
    "def log_softmax(logits):",
    "Importance sampling corrects for the gap between two distributions",
    "The quick brown fox jumps over the lazy dog",
    "In reinforcement learning the policy is updated from rollouts",
    "Numbers: 1, 2, 3, 5, 8, 13, 21",
    "A kept set is the support of the filtered distribution",
)
SAMPLE_TEXT = "Parity checks that both sides tokenize this sentence identically, 12345!"


def check_same_vocabulary(rollout: Rollout, trainer: Trainer) -> None:
    """The two sides must agree on ids before any comparison means anything."""
    problems = []
    if rollout.vocab_size != trainer.vocab_size:
        problems.append(f"vocab size: vllm={rollout.vocab_size} trainer={trainer.vocab_size}")
    tv, tt = rollout.tokenizer(), trainer.tokenizer()
    if len(tv) != len(tt):
        problems.append(f"tokenizer length: vllm={len(tv)} trainer={len(tt)}")
    # Padding the embedding past the tokenizer is common and harmless; a tokenizer that can emit ids
    # the model has no row for is not (the ids past the embedding would be scored as garbage or crash).
    for side, tok, rows in (("vllm", tv, rollout.vocab_size), ("trainer", tt, trainer.vocab_size)):
        if len(tok) > rows:
            problems.append(f"{side} tokenizer has {len(tok)} tokens but the model's vocabulary (embedding "
                            f"rows) is {rows}: allowed a tokenizer no larger than the model's vocabulary")
    ev, et = tv.encode(SAMPLE_TEXT, add_special_tokens=False), tt.encode(SAMPLE_TEXT, add_special_tokens=False)
    if list(ev) != list(et):
        problems.append(f"tokenization of {SAMPLE_TEXT!r}: vllm={list(ev)[:12]}... trainer={list(et)[:12]}...")
    if problems:
        raise UsageError(f"tokenizer/vocabulary mismatch between rollout model {rollout.model!r} and trainer "
                         f"model {trainer.model_path!r}: " + "; ".join(problems))


def make_prompts(tokenizer: Tokenizer, n: int, *, shared_prefix: int = 0) -> list[list[int]]:
    """``n`` prompts from PROMPT_TEXTS; ``shared_prefix`` > 0 puts the same that many tokens before each (the
    texts tokenized back to back), so prefix caching has something to hit."""
    prompts = []
    for i in range(n):
        text = PROMPT_TEXTS[i % len(PROMPT_TEXTS)]
        if i >= len(PROMPT_TEXTS):
            text = f"{text} ({i // len(PROMPT_TEXTS)})"
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise UsageError(f"prompt {i} ({text!r}) tokenizes to no ids")
        prompts.append(ids)
    if shared_prefix:
        pool = [t for text in PROMPT_TEXTS for t in tokenizer.encode(text + ". ", add_special_tokens=False)]
        prefix = (pool * (shared_prefix // len(pool) + 1))[:shared_prefix]
        prompts = [prefix + p for p in prompts]
    return prompts


def rollout_settings(cfg: EngineSettings) -> RolloutSettings:
    """The settings every rollout engine of a run starts with (the raw-logits engine included; only
    the run's own rollout takes ``capture``)."""
    return {"dtype": cfg.dtype, "device": cfg.device, "seed": cfg.seed, "max_head": cfg.max_capture_head,
            "head": cfg.capture_head, "timeout_s": cfg.timeout_s, "prefix_caching": cfg.prefix_caching,
            "max_num_batched_tokens": cfg.max_num_batched_tokens}


class EnginePool:
    """One rollout engine and one trainer per model, started on first use and shared across runs."""

    def __init__(self) -> None:
        self._engines: dict[tuple[str, str], tuple[Rollout, Trainer]] = {}
        self._raw: dict[tuple[str, str, str], VllmRollout] = {}

    def raw(self, model_name: str, settings: EngineSettings | HasEngineSettings,
            progress: Callable[[str], None]) -> VllmRollout:
        """A second offline engine on the same model with ``logprobs_mode="raw_logits"``: with the same seeds it
        draws the same tokens (the caller checks) and hands back the sampler's own logits, the source of a log S
        the trainer did not compute (:mod:`parity.core.log_s`; docs/error_model.md, section 7)."""
        from parity.engines.vllm_offline import VllmRollout

        cfg = as_engine_settings(settings)
        key = (model_name, cfg.dtype, cfg.device)
        if key not in self._raw:
            progress(f"parity: starting a raw-logits vLLM engine on {model_name} (sampler-side log S)")
            with waiting("raw-logits vLLM engine start-up"):
                self._raw[key] = VllmRollout(resolve_model(model_name), **rollout_settings(cfg),
                                             engine_kwargs={"logprobs_mode": "raw_logits"})
        return self._raw[key]

    def get(self, model_name: str, settings: EngineSettings | HasEngineSettings,
            progress: Callable[[str], None]) -> tuple[Rollout, Trainer]:
        """The rollout engine and trainer for ``model_name``, started on first use. ``settings``:
        :class:`~parity.engines.settings.EngineSettings`, or a configuration that carries them (``parity run``'s ``RunConfig``)."""
        from parity.engines.transformers_trainer import TransformersTrainer
        from parity.engines.vllm_offline import VllmRollout

        cfg = as_engine_settings(settings)
        trainer_dtype = cfg.trainer_dtype or cfg.dtype
        trainer_name = cfg.trainer_model if cfg.trainer_model and model_name == cfg.model else model_name
        key = (model_name, f"{trainer_name}|{cfg.dtype}|{trainer_dtype}|{cfg.device}|{cfg.server or 'offline'}|{cfg.capture}|"
                           f"{cfg.prefix_caching}|{cfg.max_num_batched_tokens}")
        if key not in self._engines:
            model_path, trainer_path = resolve_model(model_name), resolve_model(trainer_name)
            progress(f"parity: starting vLLM ({cfg.device}, {cfg.dtype}) and transformers ({trainer_dtype}) on {model_name}")
            with waiting("transformers model load"):
                trainer = TransformersTrainer(trainer_path, dtype=trainer_dtype, device=cfg.device)
            common = rollout_settings(cfg)
            if cfg.capture != "topk":
                common["capture"] = cfg.capture
            if cfg.server:
                from parity.engines.vllm_server.client import ServerRollout, describe_generation_defaults

                rollout: Rollout
                with waiting("vLLM server start-up and ready" if cfg.server == "spawn" else "vLLM server connection"):
                    rollout = ServerRollout(model_path, server=cfg.server, **common)
                try:  # what a framework that omits a field would sample with (parity sends every field)
                    rollout.generation_defaults = rollout.probe_generation_defaults()
                except Exception:
                    rollout.close()
                    raise
                progress("parity: " + describe_generation_defaults(rollout.generation_defaults))
            else:
                with waiting("vLLM engine start-up"):
                    rollout = VllmRollout(model_path, **common)
            try:
                check_same_vocabulary(rollout, trainer)
            except Exception:
                rollout.close()
                raise
            self._engines[key] = (rollout, trainer)
        return self._engines[key]

    def close(self) -> None:
        for rollout, _ in self._engines.values():
            rollout.close()
        for raw in self._raw.values():
            raw.close()
        self._engines.clear()
        self._raw.clear()


