# ruff: noqa: E402, B905, F811
"""Source of the standalone reproduction scripts that ``parity repro NAME --emit-script`` writes.

Each emitted script is the ``prelude`` section plus one repro's section (``parity/repro/standalone.py``).
Every parity import here is marked ``# @inline``: the emitted script carries that module's own code
instead, so it runs without parity. The file is valid Python, linted and imported by the tests.

The repros that are a module of their own (a section of one ``# @inline`` import) come last, in module
order: the import sorter treats consecutive import-only sections as one block and would move an import
out of its section otherwise.
"""

# ==================== section: prelude ====================
from __future__ import annotations  # the inlined parity modules' annotations name types only mypy imports

import argparse
import gc
import os
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypedDict, Unpack

# In-process vLLM engine with a small KV cache (CPU builds); ignored on GPU builds. Must precede the
# vLLM import.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

NEG_INF = float("-inf")

from parity.core.error_model import headroom, logprob_bound  # @inline parity.core.error_model


def parse_args(cfg: Mapping[str, object], title: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=title)
    p.add_argument("--prompts", type=int, default=cfg.get("prompts", 8), help="prompts (one completion each)")
    p.add_argument("--tokens", type=int, default=cfg.get("tokens", 16), help="completion length")
    p.add_argument("--seed", type=int, default=0, help="model and sampling seed")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table and the checks to PATH")
    return p.parse_args()


from parity.core.filters import reference_filter  # @inline parity.core.filters
from parity.core.spec import SamplingSpec  # @inline parity.core.spec
from parity.repro.script_engines import (  # @inline parity.repro.script_engines
    Sample,
    build_model,
    random_prompts,
    sample,
    save,
    setup,
    start_vllm,
    trainer_logits,
)


class ModelConfig(TypedDict):
    """What a sampling repro's CONFIG holds beside its own settings: the tiny model and the sampling size."""

    vocab: int
    logit_scale: float
    tokens: int
    prompts: int


class Filters(TypedDict, total=False):
    """vLLM's sampling filters as a repro's settings name them: keyword arguments of sample, score and vllm_filter."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float


def vllm_filter(z: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's sampling filters (v1 Sampler, PyTorch path) on logits [L, V] -> (z / T, kept mask)."""
    out = reference_filter(z.float(), SamplingSpec(temperature, top_k, top_p, min_p))
    return out.scaled, out.kept


def score(model: torch.nn.Module, s: Sample, **filters: Unpack[Filters]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sample on the trainer: its sampled ids, the trainer's z / T and kept mask under ``filters``."""
    zs, kept = vllm_filter(trainer_logits(model, s.prompt, s.completion), **filters)
    return torch.tensor(s.completion), zs, kept


def strict_top_k(z: torch.Tensor, k: int) -> torch.Tensor:
    """What a trainer gets from torch.topk: exactly k tokens, ties at the k-th value broken arbitrarily."""
    kept = torch.zeros_like(z, dtype=torch.bool)
    return kept.scatter_(1, z.topk(k, dim=-1).indices, True)


def log_prob_over(z: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """z_y - logsumexp(z over kept) per row, as log_softmax computes it (float32 shift by the kept max,
    then the sum in float64); -inf where y is not kept."""
    vals = z.masked_fill(~kept, NEG_INF)
    m = vals.amax(-1, keepdim=True)
    lse = (vals - m).double().exp().sum(-1).log()
    out = (z.gather(1, y[:, None]) - m).double().squeeze(1) - lse
    return out.masked_fill(~kept.gather(1, y[:, None]).squeeze(1), NEG_INF)


def log_mass(z: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """log S: log of the probability mass of softmax(z) on the kept tokens, per row."""
    s = (z - z.amax(-1, keepdim=True)).double()
    return s.masked_fill(~kept, NEG_INF).exp().sum(-1).log() - s.exp().sum(-1).log()


def over_bound(diff: torch.Tensor, zs: torch.Tensor, y: torch.Tensor, kept: torch.Tensor) -> float:
    """max |diff| / bound: the rounding bound of each token's log-prob over ``kept`` (<= 1 holds)."""
    return headroom(diff, logprob_bound(zs, y, kept, dtype="float32"))


def seq_over_bound(pred_seq: torch.Tensor, meas_seq: torch.Tensor, zs_list: list[torch.Tensor], ys: list[torch.Tensor],
                   kepts: list[torch.Tensor]) -> float:
    """The same for sequence ratios e^sum: |e^a - e^b| <= e^max(a, b) * |a - b|."""
    b = torch.stack([logprob_bound(zs, y, k, dtype="float32").sum() for zs, y, k in zip(zs_list, ys, kepts)])
    return float(((pred_seq - meas_seq).abs() / (torch.maximum(pred_seq, meas_seq) * b.exp() * b)).max())


def kept_from_heads(heads: list[dict[int, float]], vocab: int) -> torch.Tensor:
    """S_q from captured heads: the tokens with a finite processed log-prob."""
    kept = torch.zeros(len(heads), vocab, dtype=torch.bool)
    for t, h in enumerate(heads):
        kept[t, [i for i, v in h.items() if v > NEG_INF]] = True
    return kept


def with_token(kept: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return kept.clone().scatter_(1, y[:, None], True)


def seq_ratio(per_token: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-sequence importance ratios exp(sum over the sequence)."""
    return torch.stack([s.sum() for s in torch.split(per_token, lengths)]).exp()


from parity.repro.standalone_report import Outcome, report  # noqa: F401 (the emitted main calls report)  # @inline parity.repro.standalone_report


# ==================== section: top_p_bias ====================
class TopPBiasConfig(ModelConfig):
    top_ps: list[float]


def repro_top_p_bias(cfg: TopPBiasConfig, args: argparse.Namespace) -> Outcome:
    """Under top_p < 1 the trainer's full-vocabulary log-prob is below vLLM's processed log-prob by exactly log S
    per token; the sequence IS ratio is the product of S; replay and recompute remove the bias."""
    model, llm, prompts = setup(cfg["vocab"], cfg["logit_scale"], args)
    rows: list[dict[str, float]] = []
    for top_p in cfg["top_ps"]:
        filtered = top_p < 1.0
        # The whole vocabulary per position when filtered, so that replay knows S_q exactly.
        samples = sample(llm, prompts, top_p=top_p, tokens=args.tokens, logprobs=-1 if filtered else 0, seed=args.seed)
        keys = ("full", "vllm", "log_s", "replay", "recompute", "zs", "y", "kept_q")
        cols: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for s in samples:
            y, zs, kept_p = score(model, s, top_p=top_p)
            everything = torch.ones_like(kept_p)
            kept_q = kept_from_heads(s.heads, zs.shape[-1]) if filtered else everything
            cols["full"].append(log_prob_over(zs, y, everything))
            cols["vllm"].append(s.logprobs)
            cols["log_s"].append(log_mass(zs, kept_p))  # predicted from trainer logits alone
            cols["replay"].append(log_prob_over(zs, y, kept_q))
            cols["recompute"].append(log_prob_over(zs, y, with_token(kept_p, y)))
            cols["zs"].append(zs)
            cols["y"].append(y)
            cols["kept_q"].append(kept_q)
        c = {k: torch.cat(v) for k, v in cols.items()}
        lengths = [len(s.completion) for s in samples]
        gap = c["full"] - c["vllm"]
        pred_seq, meas_seq = seq_ratio(c["log_s"], lengths), seq_ratio(gap, lengths)
        rows.append({
            "top_p": top_p, "mean_s": float(c["log_s"].exp().mean()),
            "pred": abs(float(c["log_s"].mean())), "meas": abs(float(gap.mean())),
            "err": abs(abs(float(c["log_s"].mean())) - abs(float(gap.mean()))),
            "gap": over_bound(gap - c["log_s"], c["zs"], c["y"], c["kept_q"]),
            "pred_seq": float(pred_seq.mean()), "meas_seq": float(meas_seq.mean()),
            "seq_err": seq_over_bound(pred_seq, meas_seq, cols["zs"], cols["y"], cols["kept_q"]),
            "replay": float((c["replay"] - c["vllm"]).abs().max()),
            "recompute": float((c["recompute"] - c["vllm"]).abs().max()),
            "replay_h": over_bound(c["replay"] - c["vllm"], c["zs"], c["y"], c["kept_q"]),
            "recompute_h": over_bound(c["recompute"] - c["vllm"], c["zs"], c["y"], c["kept_q"]),
        })
    L = args.tokens
    return ([("top_p", "top_p", "g"), ("mean_s", "mean S", ".6f"), ("pred", "predicted abs(log S)", ".4f"),
                    ("meas", "measured abs(mean(full - vLLM))", ".4f"), ("err", "abs err", ".1e"),
                    ("pred_seq", f"predicted S^{L}", ".6f"), ("meas_seq", "measured seq IS ratio", ".6f"),
                    ("replay", "replay max abs diff", ".1e"), ("recompute", "recompute max abs diff", ".1e")], rows, [
        ("per token, full - vLLM = log S (trainer logits) within the rounding bound", all(r["gap"] <= 1 for r in rows)),
        ("per sequence, IS ratio = prod S within the rounding bound", all(r["seq_err"] <= 1 for r in rows)),
        ("top_p < 1 shrinks the IS ratio (bias > 1e-3)", all(r["pred"] > 1e-3 and r["meas_seq"] < 1 for r in rows if r["top_p"] < 1)),
        ("replay and recompute agree with vLLM within the rounding bound",
         all(max(r["replay_h"], r["recompute_h"]) <= 1 for r in rows)),
    ])


# ==================== section: top_k_entropy ====================
class TopKEntropyConfig(TypedDict):
    vocab: int
    scales: list[float]
    tokens: int
    prompts: int
    settings: list[tuple[str, Filters]]


def repro_top_k_entropy(cfg: TopKEntropyConfig, args: argparse.Namespace) -> Outcome:
    """top_p keeps the surviving mass S near top_p whatever the entropy; top_k's S collapses on flat (uncertain)
    distributions and approaches 1 on peaked ones."""
    rows: list[dict[str, float]] = []
    for scale in cfg["scales"]:
        model, llm, prompts = setup(cfg["vocab"], scale, args)
        row = {"scale": scale, "gap": 0.0, "ratio": 0.0}
        entropies: list[torch.Tensor] = []
        for label, kw in cfg["settings"]:
            samples = sample(llm, prompts, tokens=args.tokens, seed=args.seed, **kw)
            per: dict[str, list[torch.Tensor]] = {"pred": [], "meas": [], "tol": []}
            for s in samples:
                y, zs, kept = score(model, s, **kw)
                per["tol"].append(logprob_bound(zs, y, kept, dtype="float32"))
                per["pred"].append(log_mass(zs, kept))
                per["meas"].append(log_prob_over(zs, y, torch.ones_like(kept)) - s.logprobs)
                logp = zs.double().log_softmax(-1)
                entropies.append(-(logp.exp() * logp).sum(-1))
            pred, meas, tol = (torch.cat(v) for v in per.values())
            row[label + " pred"] = float(pred.exp().mean())
            row[label + " meas"] = float(meas.exp().mean())
            row["gap"] = max(row["gap"], float((pred - meas).abs().max()))
            row["ratio"] = max(row["ratio"], float(((pred - meas).abs() / tol).max()))
        row["entropy"] = float(torch.cat(entropies).mean())
        rows.append(row)
        # Shut this engine down before the next starts: a late destructor would tear down the new one's state.
        del llm
        gc.collect()
    cols = [("scale", "logit scale", "g"), ("entropy", "entropy (nats)", ".3f")]
    for label, _ in cfg["settings"]:
        cols += [(label + " pred", f"S @ {label} (pred)", ".4f"), (label + " meas", f"S @ {label} (meas)", ".4f")]
    p_label, p = cfg["settings"][0][0], cfg["settings"][0][1]["top_p"]
    k_labels = [label for label, kw in cfg["settings"] if "top_k" in kw]
    flat, peaked = rows[0], rows[-1]
    return (cols + [("gap", "max abs(log S gap)", ".1e")], rows, [
        ("per token, measured log S = predicted within the rounding bound", all(r["ratio"] <= 1 for r in rows)),
        ("top_p: S >= top_p and within 0.1 of it at every entropy",
         all(p - 1e-6 <= r[p_label + " meas"] <= p + 0.1 for r in rows)),
        ("top_k: S rises with the logit scale", all(b[k + " meas"] >= a[k + " meas"] - 1e-3
                                                     for k in k_labels for a, b in zip(rows, rows[1:]))),
        ("top_k is severe on the flattest model (S below top_p's)", all(flat[k + " meas"] < flat[p_label + " meas"] for k in k_labels)),
        ("top_k is harmless on the most peaked model (S above top_p's)", all(peaked[k + " meas"] > peaked[p_label + " meas"] for k in k_labels)),
    ])


# ==================== section: temperature ====================
class TemperatureConfig(ModelConfig):
    temperatures: list[float]


def repro_temperature(cfg: TemperatureConfig, args: argparse.Namespace) -> Outcome:
    """A trainer scoring log_softmax(z) while vLLM sampled from softmax(z / T) is biased by exactly
    log_softmax(z)[y] - log_softmax(z / T)[y] per token, non-zero for every T != 1; dividing by T removes it."""
    model, llm, prompts = setup(cfg["vocab"], cfg["logit_scale"], args)
    rows: list[dict[str, float]] = []
    for temp in cfg["temperatures"]:
        samples = sample(llm, prompts, temperature=temp, tokens=args.tokens, seed=args.seed)
        keys = ("right", "forgot", "pred", "vllm", "b_t", "b_1")
        cols: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for s in samples:
            z = trainer_logits(model, s.prompt, s.completion)
            y = torch.tensor(s.completion)
            everything = torch.ones_like(z, dtype=torch.bool)
            cols["right"].append(log_prob_over(z / temp, y, everything))
            cols["forgot"].append(log_prob_over(z, y, everything))
            cols["pred"].append(z.double().log_softmax(-1).gather(1, y[:, None]).squeeze(1)
                                - (z.double() / temp).log_softmax(-1).gather(1, y[:, None]).squeeze(1))
            cols["vllm"].append(s.logprobs)
            cols["b_t"].append(logprob_bound(z / temp, y, everything, dtype="float32"))
            cols["b_1"].append(logprob_bound(z, y, everything, dtype="float32"))
        right, forgot, pred, vllm, b_t, b_1 = (torch.cat(v) for v in cols.values())
        rows.append({"T": temp, "pred": float(pred.mean()), "forgot": float((forgot - vllm).mean()),
                     "gap": float(((forgot - vllm) - pred).abs().max()), "right": float((right - vllm).abs().max()),
                     "gap_h": float((((forgot - vllm) - pred).abs() / (b_t + b_1)).max()),
                     "right_h": float(((right - vllm).abs() / b_t).max())})
    return ([("T", "T", "g"), ("pred", "predicted bias (forgot T)", ".4f"), ("forgot", "measured mean(forgot - vLLM)", ".4f"),
                    ("gap", "max abs(measured - predicted)", ".1e"), ("right", "divides by T: max abs(full - vLLM)", ".1e")], rows, [
        ("dividing by T: no bias (within the rounding bound)", all(r["right_h"] <= 1 for r in rows)),
        ("forgetting T: biased exactly as predicted from trainer logits (within the rounding bound)",
         all(r["gap_h"] <= 1 for r in rows)),
        ("the bias is non-zero for T != 1 and zero at T = 1",
         all((abs(r["pred"]) > 1e-3) == (r["T"] != 1.0) for r in rows)),
    ])


# ==================== section: recompute_boundary ====================
class RecomputeBoundaryConfig(ModelConfig):
    settings: list[Filters]


class RecomputeBoundaryRow(TypedDict):
    setting: str
    trainer: str  # its dtype
    tokens: int
    differ: int  # positions where the recomputed support is not vLLM's
    lost: int  # -inf without force-include
    forced: int  # -inf with force-include
    replay: int  # -inf under replay


def repro_recompute_boundary(cfg: RecomputeBoundaryConfig, args: argparse.Namespace) -> Outcome:
    """With a bf16 trainer, recomputing the filters on its own logits moves the boundary: the sampled token
    sometimes falls outside the recomputed support and scores -inf; force-include removes every -inf and replay
    never produces one."""
    model, llm, prompts = setup(cfg["vocab"], cfg["logit_scale"], args)
    # transformers wraps nn.Module.to with functools.wraps, which mypy reads as unbound (self: the dtype)
    bf16 = build_model(cfg["vocab"], logit_scale=cfg["logit_scale"], seed=args.seed).to(torch.bfloat16)  # type: ignore[arg-type]
    rows: list[RecomputeBoundaryRow] = []
    for kw in cfg["settings"]:
        k = kw["top_k"]
        samples = sample(llm, prompts, tokens=args.tokens, logprobs=k + 16, seed=args.seed, **kw)
        for name, trainer in (("float32", model), ("bfloat16", bf16)):
            n = differ = lost = lost_forced = replay_lost = 0
            for s in samples:
                y, zs, kept_p = score(trainer, s, **kw)
                kept_q = kept_from_heads(s.heads, zs.shape[-1])
                n += len(y)
                differ += int((kept_p != kept_q).any(-1).sum())
                lost += int(torch.isinf(log_prob_over(zs, y, kept_p)).sum())
                lost_forced += int(torch.isinf(log_prob_over(zs, y, with_token(kept_p, y))).sum())
                replay_lost += int(torch.isinf(log_prob_over(zs, y, kept_q)).sum())
            rows.append({"setting": " ".join(f"{a}={b}" for a, b in kw.items()), "trainer": name, "tokens": n,
                         "differ": differ, "lost": lost, "forced": lost_forced, "replay": replay_lost})
    return ([("setting", "setting", ""), ("trainer", "trainer", ""), ("tokens", "tokens", ""),
                    ("differ", "S_p != S_q", ""), ("lost", "-inf without force-include", ""),
                    ("forced", "-inf with force-include", ""), ("replay", "replay -inf", "")], rows, [
        ("float32 trainer: the sampled token is always inside the recomputed support",
         all(r["lost"] == 0 for r in rows if r["trainer"] == "float32")),
        ("bfloat16 trainer: some sampled tokens fall outside it (-inf)", sum(r["lost"] for r in rows if r["trainer"] == "bfloat16") > 0),
        ("force-include removes every -inf", all(r["forced"] == 0 for r in rows)),
        ("replay is immune (no -inf)", all(r["replay"] == 0 for r in rows)),
    ])


# ==================== section: top_k_ties ====================
if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


class TopKTiesConfig(ModelConfig):
    tie_sizes: list[int]
    top_ks: list[int]
    margin: int


def plant_ties(model: LlamaForCausalLM, prompts: list[list[int]], sizes: Sequence[int], rank_top: int = 4) -> list[list[int]]:
    """Make groups of lm_head rows identical, so those tokens' logits are bitwise equal everywhere. Each
    group copies the token most often among the rank_top largest logits (so ties sit where top_k
    boundaries fall) into size - 1 other tokens."""
    with torch.no_grad():
        z = torch.cat([model(input_ids=torch.tensor([p])).logits[0] for p in prompts])
        counts = torch.bincount(z.topk(rank_top, dim=-1).indices.flatten(), minlength=z.shape[-1])
        order = [int(i) for i in counts.argsort(descending=True, stable=True) if int(i) > 2]
        g = torch.Generator().manual_seed(1)
        used: set[int] = set()
        groups: list[list[int]] = []
        for size in sizes:
            source = next(i for i in order if i not in used)
            free = [i for i in range(3, z.shape[-1]) if i not in used and i != source]
            copies = [free[int(j)] for j in torch.randperm(len(free), generator=g)[: size - 1]]
            for c in copies:
                model.lm_head.weight[c] = model.lm_head.weight[source]
            used.update([source, *copies])
            groups.append([source, *copies])
    return groups


def repro_top_k_ties(cfg: TopKTiesConfig, args: argparse.Namespace) -> Outcome:
    """vLLM keeps every token tied with the k-th logit, so len(S_q) > k at tie positions; a trainer that
    recomputes with a strict torch.topk disagrees on the support exactly there; replay and a tie-aware
    recompute agree."""
    model = build_model(cfg["vocab"], logit_scale=cfg["logit_scale"], seed=args.seed)
    prompts = random_prompts(args.prompts, cfg["vocab"], args.seed)
    groups = plant_ties(model, prompts, cfg["tie_sizes"])
    print(f"tie groups (token ids with identical lm_head rows): {groups}")
    llm = start_vllm(save(model), seed=args.seed)
    rows: list[dict[str, float]] = []  # counts and the k as ints, the errors as floats
    for k in cfg["top_ks"]:
        head = k + cfg["margin"]
        samples = sample(llm, prompts, top_k=k, tokens=args.tokens, logprobs=head, seed=args.seed)
        r: dict[str, float] = {"k": k, "tokens": 0, "over": 0, "max": 0, "pred": 0, "agree": 0, "strict": 0, "lost": 0,
             "strict_err": 0.0, "replay": 0.0, "replay_h": 0.0, "incomplete": 0}
        for s in samples:
            y, zs, kept_p = score(model, s, top_k=k)
            kept_q = kept_from_heads(s.heads, zs.shape[-1])
            size_q = kept_q.sum(-1)
            strict = strict_top_k(zs, k)
            r["tokens"] += len(y)
            r["incomplete"] += int((size_q >= head).sum())
            r["over"] += int((size_q > k).sum())
            r["max"] = max(r["max"], int(size_q.max()))
            r["pred"] += int(((kept_p.sum(-1) > k) == (size_q > k)).logical_not().sum())
            r["agree"] += int((kept_p == kept_q).all(-1).logical_not().sum())
            r["strict"] += int((strict == kept_q).all(-1).logical_not().sum())
            r["lost"] += int(torch.isinf(log_prob_over(zs, y, strict)).sum())
            forced = log_prob_over(zs, y, with_token(strict, y))
            r["strict_err"] = max(r["strict_err"], float((forced - s.logprobs).abs().max()))
            d_replay = log_prob_over(zs, y, kept_q) - s.logprobs
            r["replay"] = max(r["replay"], float(d_replay.abs().max()))
            r["replay_h"] = max(r["replay_h"], over_bound(d_replay, zs, y, kept_q))
        rows.append(r)
    return ([("k", "top_k", ""), ("tokens", "tokens", ""), ("over", "positions with len(S_q) > k", ""),
                    ("max", "max len(S_q)", ""), ("strict", "torch.topk support != S_q", ""),
                    ("lost", "torch.topk drops the sampled token (-inf)", ""),
                    ("strict_err", "torch.topk (force-include) max abs diff", ".3f"),
                    ("agree", "tie-aware recompute != S_q", ""), ("replay", "replay max abs diff", ".1e")], rows, [
        ("vLLM keeps every token tied at the k-th value: len(S_q) > k somewhere", sum(r["over"] for r in rows) > 0),
        ("the capture head held S_q everywhere", all(r["incomplete"] == 0 for r in rows)),
        ("trainer ties at the k-th value predict exactly where len(S_q) > k", all(r["pred"] == 0 for r in rows)),
        ("a strict torch.topk recompute disagrees on the support exactly there",
         all(r["strict"] == r["over"] for r in rows)),
        ("a tie-aware recompute agrees everywhere", all(r["agree"] == 0 for r in rows)),
        ("replay agrees with vLLM within the rounding bound", all(r["replay_h"] <= 1 for r in rows)),
    ])


# ==================== section: capture_head ====================
class CaptureHeadConfig(ModelConfig):
    cases: list[tuple[int, Filters]]


class CaptureHeadRow(TypedDict):
    setting: str
    head: int
    tokens: int
    pred: int  # positions whose support (trainer logits) fills the head
    flag: int  # heads full of finite values
    wrong: int  # mis-scored by replay over the head
    unflagged: int  # mis-scored and not flagged
    err: float


def repro_capture_head(cfg: CaptureHeadConfig, args: argparse.Namespace) -> Outcome:
    """vLLM silently returns a top-K head smaller than the support when asked; replay over it mis-scores the
    positions whose support does not fit, and a completeness check (a head full of finite values) flags every
    one of them."""
    model, llm, prompts = setup(cfg["vocab"], cfg["logit_scale"], args)
    rows: list[CaptureHeadRow] = []
    for head, kw in cfg["cases"]:
        samples = sample(llm, prompts, tokens=args.tokens, logprobs=head, seed=args.seed, **kw)
        r: CaptureHeadRow = {"setting": " ".join(f"{a}={b}" for a, b in kw.items()), "head": head, "tokens": 0, "pred": 0,
             "flag": 0, "wrong": 0, "unflagged": 0, "err": 0.0}
        for s in samples:
            y, zs, kept_p = score(model, s, **kw)
            kept_head = kept_from_heads(s.heads, zs.shape[-1])
            flagged = kept_head.sum(-1) >= head  # a head full of finite values may hide more kept tokens
            err = (log_prob_over(zs, y, with_token(kept_head, y)) - s.logprobs).abs()
            wrong = err > logprob_bound(zs, y, with_token(kept_head, y), dtype="float32")
            r["tokens"] += len(y)
            r["pred"] += int((kept_p.sum(-1) >= head).sum())
            r["flag"] += int(flagged.sum())
            r["wrong"] += int(wrong.sum())
            r["unflagged"] += int((wrong & ~flagged).sum())
            r["err"] = max(r["err"], float(err.max()))
        rows.append(r)
    return ([("setting", "setting", ""), ("head", "top-K head", ""), ("tokens", "tokens", ""),
                    ("pred", "len(S_p) >= K (trainer logits)", ""), ("flag", "head full (flag)", ""),
                    ("wrong", "mis-scored by replay over the head", ""), ("unflagged", "mis-scored, not flagged", ""),
                    ("err", "max abs error (nats)", ".3f")], rows, [
        ("a head smaller than the support mis-scores positions", all(r["wrong"] > 0 for r in rows)),
        ("trainer logits predict which heads are full (len(S_p) >= K)", all(r["pred"] == r["flag"] for r in rows)),
        ("a completeness check (head full of finite values) flags every one of them", all(r["unflagged"] == 0 for r in rows)),
    ])


# ==================== section: torch_cpu_log_softmax ====================
from parity.repro.log_softmax_offsets import (  # @inline parity.repro.log_softmax_offsets
    LSM_CHILD,
    LSM_COLUMNS,
    LSM_DEFAULT,
    LSM_IN_PROCESS,
    LsmRow,
    lsm_checks,
    lsm_measure,
    lsm_parse,
    lsm_print,
)
from parity.repro.standalone_child import run_child  # @inline parity.repro.standalone_child


class LogSoftmaxConfig(TypedDict):
    vocabs: list[int]
    scales: list[float]
    rows: int
    verdict_scale: float
    timeout_s: float


def repro_torch_cpu_log_softmax(cfg: LogSoftmaxConfig, args: argparse.Namespace) -> Outcome:
    """At the largest V on N(0, 4^2) logits, every float32 torch.log_softmax log-prob of a row is high by one
    constant on both CPU kernel paths (this process's native kernels, and this script again under
    ATEN_CPU_CAPABILITY=default): its sum of exponentials drops small terms. Per seeded row and (V, sigma): the
    offset (mean over the row's tokens of float32 - float64 log_softmax), its within-row spread beside float32
    rounding's, and the same offset for z - logsumexp(z) (the control) and a written-out max + exp + sum."""
    def measure() -> list[LsmRow]:
        return lsm_measure(cfg["vocabs"], cfg["scales"], cfg["rows"], args.seed)

    if os.environ.get(LSM_CHILD):
        lsm_print(measure())
        sys.exit(0)
    rows = [dict(r, path=LSM_IN_PROCESS) for r in measure()]
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", **{LSM_CHILD: "1"})
    p = run_child([sys.executable, os.path.abspath(__file__), "--seed", str(args.seed)], env, cfg["timeout_s"])
    child = lsm_parse(p.stdout)
    rows += [dict(r, path=LSM_DEFAULT) for r in child]
    error = "" if child else p.error
    return (LSM_COLUMNS, rows, lsm_checks(rows, max(cfg["vocabs"]), cfg["verdict_scale"], error))


# ==================== section: batch_invariant_cpu ====================
from parity.repro.batch_invariant import repro_batch_invariant_cpu  # noqa: F401 (the emitted main calls it)  # @inline parity.repro.batch_invariant

# ==================== section: cpu_capability_default ====================
from parity.repro.cpu_capability import repro_cpu_capability_default  # noqa: F401 (the emitted main calls it)  # @inline parity.repro.cpu_capability

# ==================== section: prefix_cache_logprobs ====================
from parity.repro.prefix_cache import repro_prefix_cache_logprobs  # noqa: F401 (the emitted main calls it)  # @inline parity.repro.prefix_cache
