# ruff: noqa: E402, B905
"""Source of the standalone scripts for the reproductions that run TRL's GRPOTrainer.

Nothing here imports parity except through ``# @inline`` lines, which the emitter replaces with the
named module's code: each emitted script is the ``prelude`` section plus one repro's section
(``parity/repro/standalone.py``). The script runs each configuration in a child process of itself
(``--child JSON``) with a timeout: a fresh process per trainer, as TRL's colocated engine expects.
"""

# ==================== section: prelude ====================
from __future__ import annotations  # the inlined parity modules' annotations name types only mypy imports

import argparse
import contextlib
import json
import math
import os
import re
import socket
import sys
import tempfile
import types
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TypedDict

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

if TYPE_CHECKING:
    from trl.generation.vllm_generation import VLLMGeneration
    from trl.trainer.grpo_trainer import GRPOTrainer

from parity.core.error_model import logprob_rounding_bound  # @inline parity.core.error_model
from parity.repro.standalone_child import (  # @inline parity.repro.standalone_child
    ChildRun,
    exceptions,
    frames,
    output_lines,
    run_child,
)

WORDS = ("the sampler and trainer must agree on every token once upon a time in small village by sea "
         "importance sampling corrects for gap between two distributions policy is updated from rollouts").split()
PROMPTS = ["the sampler and the trainer must agree", "once upon a time in a small village",
           "importance sampling corrects for the gap", "the policy is updated from rollouts"]


def parse_args(cfg: Mapping[str, object], title: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=title)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table and the checks to PATH")
    return p.parse_args()


def build_model(path: str, vocab: int = 400, hidden: int = 128, logit_scale: float = 3.0, seed: int = 1) -> str:
    """A tiny random Qwen2 (head_dim 64, which vLLM's CPU attention accepts) and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    words = list(dict.fromkeys(WORDS)) + [f"w{i}" for i in range(vocab)]
    table = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for w in words:
        if len(table) == vocab:
            break
        table.setdefault(w, len(table))
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")  # type: ignore[no-untyped-call]  # unannotated in transformers
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=hidden // 64, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).float().eval()  # type: ignore[no-untyped-call]  # unannotated in transformers
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, logit_scale / math.sqrt(hidden))
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


# parity's own patch of TRL (the one parity.engines.trl_grpo.patch_grpo runs): vLLM's whole-vocabulary processed
# log-probs give S_q; a repro's hooks say what TRL's IS correction reads (old - log S for the replay fix).
from parity.engines.trl_hooks import Head, Hooks, patch_trl  # @inline parity.engines.trl_hooks

# vLLM's CPU build packs each linear weight and drops layer.weight; TRL's colocated weight sync then fails:
# parity's own patch keeps the weights (vLLM's fallback branch).
from parity.engines.vllm_cpu_linear import keep_linear_weights  # @inline parity.engines.vllm_cpu_linear


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class GrpoRun(TypedDict, total=False):
    """One configuration of the sweep: the sampler's filters and TRL's IS mode (``off``: the module repro's
    extra phase, unused here)."""

    top_p: float
    top_k: int
    min_p: float
    is_mode: str
    off: bool


class TrainConfig(GrpoRun):
    steps: int
    batch: int
    num_generations: int
    tokens: int  # max_completion_length


def train(path: str, cfg: TrainConfig, seed: int) -> list[dict[str, float]]:
    """TRL's GRPOTrainer, colocated vLLM on CPU, one process; returns TRL's logged sampling/* metrics."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    n = cfg["steps"] * cfg["batch"] // cfg["num_generations"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_vllm=True, vllm_mode="colocate", use_cpu=True, bf16=False,
        per_device_train_batch_size=cfg["batch"], num_generations=cfg["num_generations"],
        max_completion_length=cfg["tokens"], max_steps=cfg["steps"], logging_steps=1, report_to=[],
        save_strategy="no", seed=seed, top_p=cfg.get("top_p", 1.0), top_k=cfg.get("top_k", 0),
        min_p=cfg.get("min_p") or None, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode=cfg.get("is_mode", "sequence_mask"), vllm_max_model_length=256,
    )
    trainer = GRPOTrainer(model=path, reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
                          args=args, train_dataset=Dataset.from_dict({"prompt": [PROMPTS[i % 4] for i in range(n)]}))
    trainer.train()
    return [{k: v for k, v in h.items() if k.startswith("sampling/")} for h in trainer.state.log_history
            if "sampling/sampling_logp_difference/mean" in h]


def run_self(payload: Mapping[str, object], timeout_s: float) -> tuple[Any, ChildRun]:
    """This script in a fresh process on one configuration: (its parsed JSON result or None, the child). The
    result is the child's RESULT line as json.loads gives it (Any: decoded JSON, whichever repro's it is)."""
    p = run_child([sys.executable, __file__, "--child", json.dumps(payload)], None, timeout_s)
    m = re.search(r"^RESULT (.*)$", p.stdout, re.MULTILINE)
    return (json.loads(m.group(1)) if m and p.rc == 0 else None), p


from parity.repro.standalone_report import Outcome, report  # noqa: F401 (the emitted main calls report)  # @inline parity.repro.standalone_report


# ==================== section: trl_grpo_top_p ====================
class LogSRecord(TypedDict):
    seq: tuple[int, int]  # (generation batch, row)
    log_s: float  # trainer logits over S_q
    bound: float  # parity's bfloat16 rounding bound of the token's log-prob


class Replay(Hooks):
    """Per token of each batch, log S (the trainer's logits over S_q) and parity's bfloat16 rounding bound of its
    log-prob; with ``fix`` the correction TRL's IS correction reads is log S."""

    def __init__(self, fix: bool) -> None:
        self.fix, self.batch, self.temperature = fix, 0, 1.0
        self.record: list[LogSRecord] = []
        self.kept: list[list[list[int]]] = []  # per sequence, per position: the token ids of S_q

    def sampled(self, gen: VLLMGeneration, completion_ids: list[list[int]], logprobs: list[list[list[float | None]]] | None,
                heads: list[list[Head]] | None) -> None:
        self.kept = [[[t for t, v in zip(ids, lps) if v is not None and v > -math.inf] for ids, lps in seq]
                     for seq in heads or []]

    def begin(self, trainer: GRPOTrainer) -> bool:
        self.batch, self.temperature = self.batch + 1, trainer.temperature
        return True

    def correction(self, b: int, z: torch.Tensor, y: torch.Tensor, prompt: list[int]) -> torch.Tensor:
        rows = self.kept[b]
        width = max(len(ids) for ids in rows)
        kept = torch.tensor([ids + [-1] * (width - len(ids)) for ids in rows])
        # bfloat16 engine, float32 trainer: parity's per-token rounding bound for this row's logits
        spec = types.SimpleNamespace(effective_temperature=self.temperature, greedy=False)
        bound = logprob_rounding_bound(z, y, spec, "bfloat16", kept=kept)
        zt = z / self.temperature
        log_s = torch.stack([torch.logsumexp(zt[t, ids], 0) - torch.logsumexp(zt[t], 0) for t, ids in enumerate(rows)])
        self.record += [{"seq": (self.batch, b), "log_s": float(v), "bound": float(u)} for v, u in zip(log_s, bound)]
        return log_s if self.fix else torch.zeros_like(log_s)


class GrpoPayload(TypedDict):
    path: str
    cfg: TrainConfig
    seed: int
    fix: bool


class GrpoChildResult(TypedDict):
    metrics: list[dict[str, float]]  # TRL's logged sampling/* metrics, one per step
    abs_log_s: float
    mean_s: float
    seq_s: float  # mean over sequences of S^L
    bound: float


class GrpoConfig(TypedDict):
    configs: list[GrpoRun]
    steps: int
    batch: int
    num_generations: int
    tokens: int
    timeout_s: float  # per child


class GrpoRow(TypedDict):
    config: str
    mode: str
    control: bool  # unfiltered
    S: float
    abs_log_s: float
    bound: float
    before: float
    after: float
    closed_is: float
    is_before: float
    is_after: float


def child_trl_grpo_top_p(payload: GrpoPayload) -> GrpoChildResult:
    replay = Replay(payload["fix"])
    with keep_linear_weights(), patch_trl(replay):
        metrics = train(payload["path"], payload["cfg"], payload["seed"])
    record = replay.record
    log_s = torch.tensor([r["log_s"] for r in record], dtype=torch.float64)
    per_seq: dict[tuple[int, int], float] = {}
    for r in record:
        per_seq[r["seq"]] = per_seq.get(r["seq"], 0.0) + r["log_s"]
    return {"metrics": metrics, "abs_log_s": float(log_s.abs().mean()), "mean_s": float(log_s.exp().mean()),
            "seq_s": sum(math.exp(v) for v in per_seq.values()) / len(per_seq),
            "bound": sum(r["bound"] for r in record) / len(record)}


def repro_trl_grpo_top_p(cfg: GrpoConfig, args: argparse.Namespace) -> Outcome:
    """TRL's own sampling/* metrics as shipped and under the replay patch, beside the closed form log S / S^L."""
    if args.child:
        payload = json.loads(args.child)
        print("RESULT " + json.dumps(child_trl_grpo_top_p(payload)), flush=True)
        sys.exit(0)
    path = build_model(tempfile.mkdtemp(prefix="repro-qwen2-"))
    rows: list[GrpoRow] = []
    for c in cfg["configs"]:
        run: TrainConfig = {**c, "steps": cfg["steps"], "batch": cfg["batch"], "num_generations": cfg["num_generations"],
               "tokens": cfg["tokens"]}
        res: dict[bool, GrpoChildResult] = {}
        for fix in (False, True):
            out, p = run_self({"path": path, "cfg": run, "seed": args.seed, "fix": fix}, cfg["timeout_s"])
            if out is None:
                print(p.text[-3000:] + "\n" + p.error, file=sys.stderr)
                sys.exit(1)
            res[fix] = out

        def mean(ms: list[dict[str, float]], k: str) -> float:
            return sum(m[k] for m in ms) / len(ms)

        seq = c.get("is_mode", "sequence_mask").startswith("sequence")
        rows.append({
            "config": " ".join(f"{k}={v}" for k, v in c.items() if k in ("top_p", "top_k", "min_p")),
            "mode": c.get("is_mode", "sequence_mask"),
            "control": not (c.get("top_p", 1.0) < 1 or c.get("top_k", 0) > 0 or c.get("min_p", 0.0) > 0),
            "S": res[False]["mean_s"], "abs_log_s": res[False]["abs_log_s"],
            "bound": max(res[False]["bound"], res[True]["bound"]),
            "before": mean(res[False]["metrics"], "sampling/sampling_logp_difference/mean"),
            "after": mean(res[True]["metrics"], "sampling/sampling_logp_difference/mean"),
            "closed_is": res[False]["seq_s"] if seq else res[False]["mean_s"],
            "is_before": mean(res[False]["metrics"], "sampling/importance_sampling_ratio/mean"),
            "is_after": mean(res[True]["metrics"], "sampling/importance_sampling_ratio/mean"),
        })
    # The bound: mean over the recorded tokens of parity's bfloat16 rounding bound, from this run's logits.
    return ([("config", "config", ""), ("mode", "TRL IS mode", ""), ("S", "S", ".4f"),
                    ("abs_log_s", "abs(log S)", ".4f"), ("before", "logp_difference/mean (as shipped)", ".4f"),
                    ("after", "logp_difference/mean (replay)", ".4f"), ("bound", "bf16 bound", ".4f"),
                    ("closed_is", "S^L or S", ".4f"), ("is_before", "IS ratio/mean (as shipped)", ".4f"),
                    ("is_after", "IS ratio/mean (replay)", ".4f")], rows, [
        ("as shipped, TRL's logp_difference/mean = abs(log S) within the bf16 rounding bound",
         all(abs(r["before"] - r["abs_log_s"]) <= r["bound"] for r in rows)),
        ("control: top_p=1 has TRL's metric within the bound",
         any(r["control"] for r in rows) and all(r["before"] <= r["bound"] for r in rows if r["control"])),
        ("every filtered config's TRL metric exceeds the bound", all(r["before"] > r["bound"] for r in rows if not r["control"])),
        ("with the replay patch it falls within the bound", all(r["after"] <= r["bound"] for r in rows)),
    ])


# ==================== section: trl_weight_sync ====================
class WeightSyncPayload(TypedDict):
    path: str
    seed: int
    keep: bool  # keep_linear_weights
    dtype: str | None  # None: TRL's default


class WeightSyncConfig(TypedDict):
    timeout_s: float  # per child
    default_dtype_row: bool  # also run with TRL's default dtype (reported, not checked)


class WeightSyncRow(TypedDict):
    dtype: str
    keep: bool
    trained: bool
    error: str
    where: str  # the last frame in vLLM's layers/linear.py


def child_trl_weight_sync(payload: WeightSyncPayload) -> dict[str, bool]:
    from trl.generation import vllm_generation as vg

    original = vg.LLM
    if payload["dtype"]:  # TRL passes no dtype
        vg.LLM = lambda *a, **k: original(*a, **{**k, "dtype": payload["dtype"]})
    with keep_linear_weights() if payload["keep"] else contextlib.nullcontext():
        train(payload["path"], {"steps": 1, "batch": 8, "num_generations": 4, "tokens": 8}, payload["seed"])
    return {"trained": True}


def repro_trl_weight_sync(cfg: WeightSyncConfig, args: argparse.Namespace) -> Outcome:
    """TRL's colocated weight sync on vLLM's CPU engine forced to float32: the first sync fails in vLLM's linear.py
    load_weights ('Parameter' object has no attribute 'weight_loader'), because the CPU build replaced each packed
    linear weight by an empty Parameter; keeping the weights lets the same run train. With TRL's default dtype the
    packing (and the crash) depends on the CPU's AVX-512 BF16 / AMX: that row is reported, not checked."""
    if args.child:
        print("RESULT " + json.dumps(child_trl_weight_sync(json.loads(args.child))), flush=True)
        sys.exit(0)
    path = build_model(tempfile.mkdtemp(prefix="repro-qwen2-"))
    rows: list[WeightSyncRow] = []
    for keep, dtype in ((False, "float32"), (True, "float32"), (False, None))[: 3 if cfg["default_dtype_row"] else 2]:
        out, p = run_self({"path": path, "seed": args.seed, "keep": keep, "dtype": dtype}, cfg["timeout_s"])
        lines = output_lines(p.text)
        errors = exceptions(lines)
        where = [f"linear.py:{f['line']} in {f['func']}" for f in frames(lines) if f["file"].endswith("layers/linear.py")]
        rows.append({"dtype": dtype or "TRL's default", "keep": keep, "trained": out is not None, "error": errors[-1] if errors and out is None else "",
                     "where": where[-1] if where and out is None else ""})
    crash, control = rows[:2]
    return ([("dtype", "engine dtype", ""), ("keep", "linear weights kept", ""), ("trained", "trained", ""), ("error", "error", ""),
                    ("where", "raised in", "")], rows, [
        ("float32 engine: AttributeError 'Parameter' object has no attribute 'weight_loader'",
         not crash["trained"] and "has no attribute 'weight_loader'" in crash["error"]),
        ("raised in vLLM's linear.py load_weights", crash["where"].endswith("in load_weights")),
        ("control: with the weights kept the same run trains", control["trained"]),
    ])
