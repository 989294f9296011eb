"""TRL's asynchronous GRPO trainer (``trl.experimental.async_grpo``) as far as a CPU runs it: TRL's own
rollout worker (through the capture proxy), packing, policy and ``compute_loss``, with tree attention run by
standard attention instead of the CUDA-only FA3 kernel; and parity's fix, :class:`KeptSetReplay`. Derivation
and the repro: docs/trl_async.md."""

from __future__ import annotations

import dataclasses
import importlib
import queue
import time
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch

from parity.core.estimators import predicted_log_s
from parity.core.spec import SamplingSpec
from parity.errors import EngineError, TimedOut, UsageError

if TYPE_CHECKING:
    from parity.engines.vllm_server.capture_proxy import KeptSets

TREE_SDPA = "parity_tree_sdpa"  # the attention implementation name registered for the standard-attention copy
# The flags of TRL's vllm_serve command that decide what the server's log-probs are.
LOGPROB_FLAGS = ("--logprobs-mode", "--max-logprobs")
# TRL's metric names, as compute_loss logs them (the ones the repro reads).
METRICS = ("ratio", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "clip_ratio/low_min", "clip_ratio/high_max")


def trl_serve_flags(model: str | Path) -> dict[str, str]:
    """The log-prob flags TRL's ``trl/scripts/vllm_serve.py`` (``build_command``) passes to vLLM's server."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    cmd = build_command(ScriptArguments(model=str(model)))
    out = {}
    for flag in LOGPROB_FLAGS:
        if flag not in cmd:
            raise EngineError(f"TRL's vllm_serve command no longer passes {flag}: {cmd}")
        out[flag] = cmd[cmd.index(flag) + 1]
    return out


def config_defaults() -> dict[str, Any]:
    """``AsyncGRPOConfig``'s defaults for the fields the step-0 metrics depend on (read, not restated)."""
    from trl.experimental.async_grpo import AsyncGRPOConfig

    fields = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    return {k: fields[k] for k in ("epsilon", "epsilon_high", "temperature", "top_p", "top_k", "min_p",
                                    "repetition_penalty")}


# -- Tree attention with standard attention ---------------------------------------------------------


def tree_mask(n: int, kv_index: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor) -> torch.Tensor:
    """bool ``[n, n]``: packed position q attends k. Mirrors ``trl.experimental.async_grpo.packing.tree_attention``:
    segment s's queries see the keys ``kv_index[cu_k[s]:cu_k[s+1]]`` (its root-to-segment path), causally aligned to
    the path's end (FlashAttention's varlen ``causal=True`` with ``seqlen_q <= seqlen_k``)."""
    mask = torch.zeros(n, n, dtype=torch.bool)
    for s in range(cu_q.numel() - 1):
        a, b = int(cu_q[s]), int(cu_q[s + 1])
        path = kv_index[int(cu_k[s]):int(cu_k[s + 1])].long()
        offset = path.numel() - (b - a)
        if offset < 0:
            raise UsageError(f"tree segment {s}: {b - a} queries but a path of {path.numel()} keys")
        # query j sees the path's first offset + j + 1 keys
        mask[a:b, path] = torch.arange(path.numel())[None, :] <= (offset + torch.arange(b - a))[:, None]
    return mask


def tree_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, *, tree_kv_index: torch.Tensor,
                        tree_cu_seqlens_q: torch.Tensor, tree_cu_seqlens_k: torch.Tensor,
                        tree_max_seqlen_q: int | None = None, tree_max_seqlen_k: int | None = None,
                        scaling: float | None = None, sliding_window: int | None = None,
                        softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """TRL's tree attention computed by transformers' SDPA with :func:`tree_mask` (same signature)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sliding_window or softcap:
        raise UsageError(f"tree attention on CPU: sliding_window={sliding_window}, softcap={softcap}: allowed none")
    mask = tree_mask(query.shape[2], tree_kv_index, tree_cu_seqlens_q, tree_cu_seqlens_k).to(query.device)
    out, _ = sdpa_attention_forward(module, query, key, value, mask[None, None], dropout=0.0, scaling=scaling,
                                    is_causal=False)
    return out, None


def load_policy(model: str | Path, *, temperature: float, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The policy as ``AsyncGRPOTrainer.__init__`` builds it: TRL's ``add_fused_lm_head`` with the temperature and
    ``("log_probs", "entropy")``; attention is :func:`tree_sdpa_attention` instead of ``tree_fa3``."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface
    from trl.trainer.utils import add_fused_lm_head

    AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
    AttentionMaskInterface.register(TREE_SDPA, lambda **kwargs: None)  # the mask comes from the tree kwargs
    m = AutoModelForCausalLM.from_pretrained(str(model), attn_implementation=TREE_SDPA, dtype=dtype)
    torch.nn.Module.eval(m)
    add_fused_lm_head(m, temperature=temperature, outputs=("log_probs", "entropy"))
    return m


# -- The trainer patch ------------------------------------------------------------------------------


@dataclasses.dataclass
class Scored:
    """What :class:`KeptSetReplay` saw at the labelled packed positions of its latest call."""

    positions: torch.Tensor  # long [M]: packed positions with a label
    labels: torch.Tensor  # long [M]
    log_s: torch.Tensor  # float32 [M]: logsumexp(z'_{S_q}) - logsumexp(z'); 0 where nothing was filtered
    scaled_logits: torch.Tensor  # float32 [M, V]: z / T
    kept: torch.Tensor | None  # long [M, K] (-1 padded); None when no position was filtered
    full_log_probs: torch.Tensor  # float32 [M]: TRL's fused head, before any patch


class KeptSetReplay:
    """The fix as a trainer patch: wraps the fused-head policy that ``compute_loss`` calls. Each labelled position's
    kept set is looked up by its token prefix (the tree path); ``mode="replay"`` subtracts log S from TRL's
    log-probs (renormalising them over S_q, ``parity.core.estimators.replay``), ``"observe"`` only records it."""

    MODES = ("observe", "replay")

    def __init__(self, policy: torch.nn.Module, sets: KeptSets, spec: SamplingSpec, *, mode: str) -> None:
        if mode not in self.MODES:
            raise UsageError(f"mode={mode!r}: allowed {', '.join(self.MODES)}")
        self.policy, self.sets, self.spec, self.mode = policy, sets, spec, mode
        self.last: Scored | None = None

    def __call__(self, *, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor,
                 fused_lm_head: bool = True, **tree: Any) -> Any:
        out = self.policy(input_ids=input_ids, position_ids=position_ids, shift_labels=shift_labels,
                          fused_lm_head=fused_lm_head, **tree)
        logits = self.policy(input_ids=input_ids, position_ids=position_ids, **tree).logits[0]
        labels = shift_labels[0]
        pos = torch.nonzero(labels != -100).squeeze(1)
        mask = tree_mask(input_ids.shape[1], tree["tree_kv_index"].cpu(), tree["tree_cu_seqlens_q"].cpu(),
                         tree["tree_cu_seqlens_k"].cpu())
        ids = input_ids[0].cpu()
        rows = [self.sets.lookup(ids[mask[int(q)]].tolist()) for q in pos]
        z = logits[pos].float()
        log_s = torch.zeros(pos.numel(), dtype=torch.float32, device=z.device)
        kept = None
        if any(r is not None for r in rows):
            if any(r is None for r in rows):
                raise EngineError("kept sets are missing at some positions of a filtered batch")
            sets = [torch.tensor(r, dtype=torch.long) for r in rows if r is not None]
            kept = torch.nn.utils.rnn.pad_sequence(sets, batch_first=True, padding_value=-1).to(z.device)
            log_s = predicted_log_s(z, kept, self.spec).float()  # differentiable: the replay's gradient
        t = self.spec.effective_temperature
        full = out.log_probs[0, pos].detach().float().clone()
        self.last = Scored(pos.cpu(), labels[pos].cpu(), log_s.detach().cpu(), (z / t).detach().cpu(),
                           None if kept is None else kept.cpu(), full.cpu())
        if self.mode == "replay":
            correction = torch.zeros_like(out.log_probs)
            correction[0, pos] = log_s.to(out.log_probs.dtype)
            out.log_probs = out.log_probs - correction
        return out


# -- compute_loss on a host object ------------------------------------------------------------------


class LossHost:
    """The attributes ``AsyncGRPOTrainer.compute_loss`` reads and writes, set as its ``__init__`` sets them."""

    def __init__(self, *, epsilon: float, epsilon_high: float | None) -> None:
        self.epsilon_low = epsilon
        self.epsilon_high = epsilon_high if epsilon_high is not None else epsilon
        self.aux_loss_enabled = False
        # One process: what compute_loss asks of Accelerator (reduce and gather are identities there).
        self.accelerator = SimpleNamespace(num_processes=1, reduce=lambda t, reduction="sum": t,
                                           gather=lambda t: t)
        self.current_gradient_accumulation_steps = 1
        self._metrics: dict[str, defaultdict[str, list[float]]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._last_forward_time_s = 0.0
        self._step_forward_tokens = self._step_trained_tokens = self._step_seq_len_weighted = 0.0
        self._step_samples = self._step_forward_s = 0.0


def trl_compute_loss(model: Any, inputs: dict[str, torch.Tensor], *, epsilon: float,
                     epsilon_high: float | None) -> tuple[float, dict[str, float]]:
    """Run ``AsyncGRPOTrainer.compute_loss`` (unbound, on a :class:`LossHost`); the loss and TRL's logged metrics."""
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    host = LossHost(epsilon=epsilon, epsilon_high=epsilon_high)
    with torch.no_grad():
        loss = AsyncGRPOTrainer.compute_loss(host, model, inputs)
    metrics = {k: float(v[-1]) for k, v in host._metrics["train"].items()}
    return float(loss), metrics


# -- Rollouts and packing ---------------------------------------------------------------------------


def parity_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    """A reward with spread inside every group (the share of even token ids), so advantages take both signs.
    Module-level: TRL's worker pickles its reward functions into a spawned process."""
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def chat_tokenizer(model: str | Path) -> tuple[Any, str | None]:
    """The tokenizer TRL's worker renders prompts with; where TRL cannot parse the model's chat template (or there is
    none), TRL's own Qwen2.5 template is set. Returns it and the substitution made (None: none)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    tok = AutoTokenizer.from_pretrained(str(model))
    if tok.chat_template:
        try:
            add_response_schema(AutoTokenizer.from_pretrained(str(model)))
            return tok, None
        except ValueError:  # TRL's own refusal of a template it cannot parse
            pass
    tok.chat_template = qwen2_5_chat_template
    return tok, "prompts rendered with TRL's Qwen2.5 chat template (TRL's worker cannot parse the model's own)"


def collect_rollouts(*, url: str, served_model: str, tokenizer: Any, prompts: Sequence[str], spec: SamplingSpec,
                     num_generations: int, max_tokens: int, timeout_s: float) -> list[Any]:
    """Run TRL's ``AsyncRolloutWorker`` against ``url`` until every prompt's group is scored; its ``RolloutSample``s
    of the first ``len(prompts)`` groups. The worker is stopped on return and on error."""
    from datasets import Dataset
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    importlib.import_module("accelerate.state").PartialState()  # TRL's logger needs accelerate's state here
    ds = Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in prompts]})
    want = len(prompts) * num_generations
    worker = AsyncRolloutWorker(
        model_name=served_model, dataset=ds, reward_funcs=[parity_reward], processing_class=tokenizer,
        eos_token_ids=[tokenizer.eos_token_id], num_generations=num_generations, max_inflight_tasks=want,
        vllm_server_url=url, max_tokens=max_tokens, temperature=spec.temperature, top_p=spec.top_p,
        top_k=spec.top_k, min_p=spec.min_p if spec.min_p > 0 else None, repetition_penalty=1.0,
        request_timeout=int(max(timeout_s, 1)), child_ready_timeout=int(max(timeout_s, 1)))
    samples: list[Any] = []
    deadline = time.monotonic() + timeout_s
    try:
        worker.start()
        while len(samples) < want:
            if time.monotonic() > deadline:
                raise TimedOut(f"TRL's rollout worker gave {len(samples)} of {want} samples in {timeout_s:.0f} s")
            try:
                samples.append(worker.rollout_buffer.get(timeout=1.0))
            except queue.Empty:
                worker.check_health(stale_after_s=timeout_s)
    finally:
        worker.stop()
    groups = sorted({s.group_id for s in samples})[: len(prompts)]
    return [s for s in samples if s.group_id in groups]


def pack(samples: Sequence[Any], pad_token_id: int) -> dict[str, torch.Tensor]:
    """One micro-batch as TRL's trainer builds it: every sample in one ``TreeRow``, collated by
    ``DataCollatorForRollout`` (one process)."""
    from trl.experimental.async_grpo.async_grpo_trainer import DataCollatorForRollout
    from trl.experimental.async_grpo.packing import TreeRow

    row = TreeRow()
    for s in samples:
        row.add({"input_ids": torch.as_tensor(s.input_ids), "completion_mask": torch.as_tensor(s.completion_mask),
                 "old_log_probs": torch.as_tensor(s.old_log_probs), "advantage": s.advantage,
                 "group_id": s.group_id, "metrics": s.metrics})
    batch: dict[str, torch.Tensor] = DataCollatorForRollout(pad_token_id=pad_token_id).torch_call([[row]])
    return batch


def per_sample(inputs: dict[str, torch.Tensor], values: torch.Tensor) -> list[torch.Tensor]:
    """Split a per-trained-token tensor (aligned with ``token_index``) into one tensor per sample (``segment_id``)."""
    sel = inputs["token_index"][0] >= 0
    seg = inputs["segment_id"][0][sel]
    n = int(seg.max()) + 1 if seg.numel() else 0
    return [values[seg == i] for i in range(n)]


def at_tokens(scored: Scored, token_index: torch.Tensor) -> dict[str, torch.Tensor]:
    """:class:`Scored`'s per-position values at each trained token (``token_index``: packed position per token;
    several tokens can share a position in the tree)."""
    row = {int(q): i for i, q in enumerate(scored.positions)}
    idx = torch.tensor([row[int(q)] for q in token_index], dtype=torch.long)
    out = {"log_s": scored.log_s[idx], "labels": scored.labels[idx], "full": scored.full_log_probs[idx],
           "scaled_logits": scored.scaled_logits[idx]}
    if scored.kept is not None:
        out["kept"] = scored.kept[idx]
    return out
