# ruff: noqa: E402, B905, F811
"""Source of the standalone reproduction scripts that ``parity repro NAME --emit-script`` writes.

Nothing here imports parity: each emitted script is the ``prelude`` section plus one repro's section
(see ``parity/repro/standalone.py``). The file is valid Python on its own so that it is linted and
imported by the tests like any module; run the emitted scripts, not this file.
"""

# ==================== section: prelude ====================
from __future__ import annotations  # the inlined parity modules' annotations name types only mypy imports

import argparse
import gc
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# In-process vLLM engine with a small KV cache (CPU builds); ignored on GPU builds. Must precede the
# vLLM import.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

NEG_INF = float("-inf")

# parity's rounding model for per-token log-probs; emitted scripts carry its source here.
from parity.core.error_model import logprob_bound  # @inline parity.core.error_model


def parse_args(cfg: dict[str, Any], title: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=title)
    p.add_argument("--prompts", type=int, default=cfg.get("prompts", 8), help="prompts (one completion each)")
    p.add_argument("--tokens", type=int, default=cfg.get("tokens", 16), help="completion length")
    p.add_argument("--seed", type=int, default=0, help="model and sampling seed")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the table and the checks to PATH")
    return p.parse_args()


def build_model(vocab: int, *, hidden: int = 64, layers: int = 2, logit_scale: float = 1.0, seed: int = 0) -> Any:
    """A tiny random Llama (float32). lm_head rows are N(0, 1/hidden): the final RMSNorm output has norm
    ~sqrt(hidden), so the logits at a position are ~N(0, logit_scale^2) across the vocabulary
    (logit_scale 1: near-uniform; 12: peaked)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=1, num_key_value_heads=1, head_dim=hidden, max_position_embeddings=1024,
        rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float().eval()  # type: ignore[no-untyped-call]  # unannotated in transformers
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, logit_scale / math.sqrt(hidden))
    return model


def save(model: Any) -> str:
    """Save to a fresh temporary folder (no tokenizer: vLLM runs with skip_tokenizer_init)."""
    path = tempfile.mkdtemp(prefix="repro-model-")
    model.save_pretrained(path)
    return path


def start_vllm(path: str, seed: int = 0) -> Any:
    from vllm import LLM

    return LLM(
        model=path, skip_tokenizer_init=True, dtype="float32", seed=seed, logprobs_mode="processed_logprobs",
        max_logprobs=-1, max_model_len=1024, enforce_eager=True, enable_prefix_caching=False,
    )


def random_prompts(n: int, vocab: int, seed: int, length: int = 8) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def setup(cfg: dict[str, Any], args: argparse.Namespace, logit_scale: float | None = None) -> tuple[Any, Any, list[list[int]]]:
    """The tiny model (cfg's logit scale unless given), a vLLM engine on it, and the prompts."""
    model = build_model(cfg["vocab"], logit_scale=cfg["logit_scale"] if logit_scale is None else logit_scale,
                        seed=args.seed)
    llm = start_vllm(save(model), seed=args.seed)
    return model, llm, random_prompts(args.prompts, cfg["vocab"], args.seed)


class Sample:
    def __init__(self, prompt: list[int], completion: list[int], logprobs: torch.Tensor, heads: list[dict[int, float]]) -> None:
        self.prompt = prompt
        self.completion = completion  # sampled ids
        self.logprobs = logprobs  # float64 [L]: vLLM's processed log-prob of each sampled token
        self.heads = heads  # per position {token id: processed log-prob} of the requested top-K


def sample(llm: Any, prompts: list[list[int]], *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           min_p: float = 0.0, tokens: int = 16, logprobs: int = 0, seed: int = 0) -> list[Sample]:
    """One completion per prompt (seed + i), with the sampled token's processed log-prob and a top-K head
    (logprobs=-1: the whole vocabulary)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    def params(i: int) -> Any:
        kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, max_tokens=tokens,
                  seed=seed + i, logprobs=logprobs, detokenize=False, ignore_eos=True)
        try:
            return SamplingParams(flat_logprobs=True, **kw)
        except TypeError:  # an older vLLM: per-position dicts
            return SamplingParams(**kw)

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        [params(i) for i in range(len(prompts))], use_tqdm=False)
    samples: list[Sample] = []
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        lp = comp.logprobs
        lps: list[float] = []
        heads: list[dict[int, float]] = []
        if hasattr(lp, "start_indices"):  # flat: entry a is the sampled token, a+1..b the top-K
            for a, b in zip(lp.start_indices, lp.end_indices):
                lps.append(lp.logprobs[a])
                heads.append({int(i): float(v) for i, v in zip(lp.token_ids[a + 1 : b], lp.logprobs[a + 1 : b])})
        else:  # dicts: the top-K plus the sampled token when it is not among them
            for t, d in enumerate(lp):
                lps.append(d[ids[t]].logprob)
                heads.append({int(i): float(v.logprob) for i, v in d.items()
                              if logprobs < 0 or len(d) <= logprobs or i != ids[t]})
        samples.append(Sample(prompt, ids, torch.tensor(lps, dtype=torch.float64), heads))
    return samples


@torch.no_grad()
def trainer_logits(model: Any, prompt: Sequence[int], completion: Sequence[int]) -> torch.Tensor:
    """float32 logits [L, V]: row t predicts completion token t (what an RL trainer scores)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    z: torch.Tensor = model(input_ids=ids).logits[0].float()
    return z[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def vllm_filter(z: torch.Tensor, *, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                min_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's sampling filters (v1 Sampler, PyTorch path) on logits [L, V] -> (z / T, kept mask).

    Temperature; min_p on probabilities (softmax(z/T) < min_p * max prob dropped); top_k (values below
    the k-th largest dropped: ties with it are KEPT); top_p over the ascending sort (cumulative
    probability <= 1 - top_p dropped, the largest token always kept). With top_p set, the row is sorted
    once and top_k cut in that order (apply_top_k_top_p): which of several tokens tied at the top_p
    boundary are dropped follows that sort's permutation of the whole row."""
    z = z.float() / temperature
    work = z.clone()
    vocab = z.shape[-1]
    if min_p > 0:
        probs = work.softmax(-1)
        work = work.masked_fill(probs < probs.amax(-1, keepdim=True) * min_p, NEG_INF)
    if top_p < 1.0:
        vals, idx = work.sort(dim=-1)
        if 0 < top_k < vocab:
            vals = vals.masked_fill(vals < vals[:, vocab - top_k : vocab - top_k + 1], NEG_INF)
        drop = vals.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        work = torch.empty_like(work).scatter_(1, idx, vals.masked_fill(drop, NEG_INF))
    elif 0 < top_k < vocab:
        kth = work.topk(top_k, dim=-1).values[:, -1:]
        work = work.masked_fill(work < kth, NEG_INF)
    return z, work > NEG_INF


def score(model: Any, s: Any, **filters: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
    b = logprob_bound(zs, y, kept, dtype="float32")
    return float((diff.double().abs() / b).max())


def seq_over_bound(pred_seq: torch.Tensor, meas_seq: torch.Tensor, zs_list: list[torch.Tensor], ys: list[torch.Tensor],
                   kepts: list[torch.Tensor]) -> float:
    """The same for sequence ratios e^sum: |e^a - e^b| <= e^max(a, b) * |a - b|."""
    b = torch.stack([logprob_bound(zs, y, k, dtype="float32").sum() for zs, y, k in zip(zs_list, ys, kepts)])
    return float(((pred_seq - meas_seq).abs() / (torch.maximum(pred_seq, meas_seq) * b.exp() * b)).max())


def kept_from_heads(heads: list[dict[int, float]], vocab: int) -> torch.Tensor:
    """S_q from captured heads: the tokens with a finite processed log-prob."""
    kept = torch.zeros(len(heads), vocab, dtype=torch.bool)
    for t, h in enumerate(heads):
        ids = [i for i, v in h.items() if v > NEG_INF]
        kept[t, ids] = True
    return kept


def with_token(kept: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return kept.clone().scatter_(1, y[:, None], True)


def seq_ratio(per_token: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Per-sequence importance ratios exp(sum over the sequence)."""
    return torch.stack([s.sum() for s in torch.split(per_token, lengths)]).exp()


# The table and the verdict every script prints; emitted scripts carry its source here.
from parity.repro.standalone_report import Outcome, report  # noqa: F401 (the emitted main calls report)  # @inline parity.repro.standalone_report


# ==================== section: top_p_bias ====================
def repro_top_p_bias(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """Under top_p < 1 the trainer's full-vocabulary log-prob is below vLLM's processed log-prob by exactly log S
    per token; the sequence IS ratio is the product of S; replay and recompute remove the bias."""
    model, llm, prompts = setup(cfg, args)
    rows = []
    for top_p in cfg["top_ps"]:
        filtered = top_p < 1.0
        # The whole vocabulary per position when filtered, so that replay knows S_q exactly.
        samples = sample(llm, prompts, top_p=top_p, tokens=args.tokens, logprobs=-1 if filtered else 0, seed=args.seed)
        cols: dict[str, list[torch.Tensor]] = {k: [] for k in ("full", "vllm", "log_s", "replay", "recompute")}
        zs_list: list[torch.Tensor] = []
        ys: list[torch.Tensor] = []
        kepts: list[torch.Tensor] = []
        for s in samples:
            y, zs, kept_p = score(model, s, top_p=top_p)
            everything = torch.ones_like(kept_p)
            kept_q = kept_from_heads(s.heads, zs.shape[-1]) if filtered else everything
            cols["full"].append(log_prob_over(zs, y, everything))
            cols["vllm"].append(s.logprobs)
            cols["log_s"].append(log_mass(zs, kept_p))  # predicted from trainer logits alone
            cols["replay"].append(log_prob_over(zs, y, kept_q))
            cols["recompute"].append(log_prob_over(zs, y, with_token(kept_p, y)))
            zs_list.append(zs)
            ys.append(y)
            kepts.append(kept_q)
        c = {k: torch.cat(v) for k, v in cols.items()}
        zs_all, y_all, kept_all = torch.cat(zs_list), torch.cat(ys), torch.cat(kepts)
        lengths = [len(s.completion) for s in samples]
        gap = c["full"] - c["vllm"]
        pred_seq, meas_seq = seq_ratio(c["log_s"], lengths), seq_ratio(gap, lengths)
        rows.append({
            "top_p": top_p, "mean_s": float(c["log_s"].exp().mean()),
            "pred": abs(float(c["log_s"].mean())), "meas": abs(float(gap.mean())),
            "err": abs(abs(float(c["log_s"].mean())) - abs(float(gap.mean()))),
            "gap": over_bound(gap - c["log_s"], zs_all, y_all, kept_all),
            "pred_seq": float(pred_seq.mean()), "meas_seq": float(meas_seq.mean()),
            "seq_err": seq_over_bound(pred_seq, meas_seq, zs_list, ys, kepts),
            "replay": float((c["replay"] - c["vllm"]).abs().max()),
            "recompute": float((c["recompute"] - c["vllm"]).abs().max()),
            "replay_h": over_bound(c["replay"] - c["vllm"], zs_all, y_all, kept_all),
            "recompute_h": over_bound(c["recompute"] - c["vllm"], zs_all, y_all, kept_all),
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
def repro_top_k_entropy(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """top_p keeps the surviving mass S near top_p whatever the entropy; top_k's S collapses on flat (uncertain)
    distributions and approaches 1 on peaked ones."""
    rows = []
    for scale in cfg["scales"]:
        model, llm, prompts = setup(cfg, args, logit_scale=scale)
        row = {"scale": scale, "gap": 0.0, "ratio": 0.0}
        entropies = []
        for label, kw in cfg["settings"]:
            samples = sample(llm, prompts, tokens=args.tokens, seed=args.seed, **kw)
            pred_seq: list[torch.Tensor] = []
            meas_seq: list[torch.Tensor] = []
            tols: list[torch.Tensor] = []
            for s in samples:
                y, zs, kept = score(model, s, **kw)
                tols.append(logprob_bound(zs, y, kept, dtype="float32"))
                pred_seq.append(log_mass(zs, kept))
                meas_seq.append(log_prob_over(zs, y, torch.ones_like(kept)) - s.logprobs)
                logp = zs.double().log_softmax(-1)
                entropies.append(-(logp.exp() * logp).sum(-1))
            pred, meas = torch.cat(pred_seq), torch.cat(meas_seq)
            row[label + " pred"] = float(pred.exp().mean())
            row[label + " meas"] = float(meas.exp().mean())
            row["gap"] = max(row["gap"], float((pred - meas).abs().max()))
            row["ratio"] = max(row["ratio"], float(((pred - meas).abs() / torch.cat(tols)).max()))
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
def repro_temperature(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """A trainer scoring log_softmax(z) while vLLM sampled from softmax(z / T) is biased by exactly
    log_softmax(z)[y] - log_softmax(z / T)[y] per token, non-zero for every T != 1; dividing by T removes it."""
    model, llm, prompts = setup(cfg, args)
    rows = []
    for temp in cfg["temperatures"]:
        samples = sample(llm, prompts, temperature=temp, tokens=args.tokens, seed=args.seed)
        right_seq: list[torch.Tensor] = []
        forgot_seq: list[torch.Tensor] = []
        pred_seq: list[torch.Tensor] = []
        vllm_seq: list[torch.Tensor] = []
        b_t_seq: list[torch.Tensor] = []
        b_1_seq: list[torch.Tensor] = []
        for s in samples:
            z = trainer_logits(model, s.prompt, s.completion)
            y = torch.tensor(s.completion)
            everything = torch.ones_like(z, dtype=torch.bool)
            right_seq.append(log_prob_over(z / temp, y, everything))
            forgot_seq.append(log_prob_over(z, y, everything))
            pred_seq.append(z.double().log_softmax(-1).gather(1, y[:, None]).squeeze(1)
                            - (z.double() / temp).log_softmax(-1).gather(1, y[:, None]).squeeze(1))
            vllm_seq.append(s.logprobs)
            b_t_seq.append(logprob_bound(z / temp, y, everything, dtype="float32"))
            b_1_seq.append(logprob_bound(z, y, everything, dtype="float32"))
        right, forgot, pred, vllm, b_t, b_1 = (torch.cat(v) for v in (right_seq, forgot_seq, pred_seq, vllm_seq,
                                                                     b_t_seq, b_1_seq))
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
def repro_recompute_boundary(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """With a bf16 trainer, recomputing the filters on its own logits moves the boundary: the sampled token
    sometimes falls outside the recomputed support and scores -inf; force-include removes every -inf and replay
    never produces one."""
    model, llm, prompts = setup(cfg, args)
    bf16 = build_model(cfg["vocab"], logit_scale=cfg["logit_scale"], seed=args.seed).to(torch.bfloat16)
    rows: list[dict[str, Any]] = []
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
def plant_ties(model: Any, prompts: list[list[int]], sizes: Sequence[int], rank_top: int = 4) -> list[list[int]]:
    """Make groups of lm_head rows identical, so those tokens' logits are bitwise equal everywhere. Each
    group copies the token most often among the rank_top largest logits (so ties sit where top_k
    boundaries fall) into size - 1 other tokens."""
    with torch.no_grad():
        z = torch.cat([model(input_ids=torch.tensor([p])).logits[0] for p in prompts])
        counts = torch.bincount(z.topk(rank_top, dim=-1).indices.flatten(), minlength=z.shape[-1])
        order = [int(i) for i in counts.argsort(descending=True, stable=True) if int(i) > 2]
        g = torch.Generator().manual_seed(1)
        used, groups = set(), []
        for size in sizes:
            source = next(i for i in order if i not in used)
            free = [i for i in range(3, z.shape[-1]) if i not in used and i != source]
            copies = [free[int(j)] for j in torch.randperm(len(free), generator=g)[: size - 1]]
            for c in copies:
                model.lm_head.weight[c] = model.lm_head.weight[source]
            used.update([source, *copies])
            groups.append([source, *copies])
    return groups


def repro_top_k_ties(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """vLLM keeps every token tied with the k-th logit, so len(S_q) > k at tie positions; a trainer that
    recomputes with a strict torch.topk disagrees on the support exactly there; replay and a tie-aware
    recompute agree."""
    model = build_model(cfg["vocab"], logit_scale=cfg["logit_scale"], seed=args.seed)
    prompts = random_prompts(args.prompts, cfg["vocab"], args.seed)
    groups = plant_ties(model, prompts, cfg["tie_sizes"])
    print(f"tie groups (token ids with identical lm_head rows): {groups}")
    llm = start_vllm(save(model), seed=args.seed)
    rows = []
    for k in cfg["top_ks"]:
        head = k + cfg["margin"]
        samples = sample(llm, prompts, top_k=k, tokens=args.tokens, logprobs=head, seed=args.seed)
        r = {"k": k, "tokens": 0, "over": 0, "max": 0, "pred": 0, "agree": 0, "strict": 0, "lost": 0,
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
def repro_capture_head(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """vLLM silently returns a top-K head smaller than the support when asked; replay over it mis-scores the
    positions whose support does not fit, and a completeness check (a head full of finite values) flags every
    one of them."""
    model, llm, prompts = setup(cfg, args)
    rows = []
    for head, kw in cfg["cases"]:
        samples = sample(llm, prompts, tokens=args.tokens, logprobs=head, seed=args.seed, **kw)
        r = {"setting": " ".join(f"{a}={b}" for a, b in kw.items()), "head": head, "tokens": 0, "pred": 0,
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


# ==================== section: batch_invariant_cpu ====================
from parity.repro.standalone_child import (  # @inline parity.repro.standalone_child
    frames,
    output_lines,
    run_child,
)

# The child starts vLLM on argv[1] (float32, eager) and asks one greedy request of two tokens for the prompt ids
# argv[2:]; it prints "STARTED" once the engine is up and "GENERATED <ids>" when the request got through.
BI_CHILD = r'''
import sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
          enable_prefix_caching=False)
print("STARTED", flush=True)
out = llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in sys.argv[2:]])],
                   SamplingParams(temperature=0, max_tokens=2, detokenize=False), use_tqdm=False)
print("GENERATED", list(out[0].outputs[0].token_ids), flush=True)
'''


def repro_batch_invariant_cpu(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """VLLM_BATCH_INVARIANT=1 crashes vLLM's CPU engine at the first forward with a TypeError raised in its
    batch_invariant.py (no Triton on CPU); without the knob the same request generates. Each run is a fresh
    process: the knob is read when vLLM is imported."""
    path = save(build_model(cfg["vocab"], seed=args.seed))
    rows: list[dict[str, Any]] = []
    for knob in ("0", "1"):
        p = run_child([sys.executable, "-c", BI_CHILD, path, "5", "6", "7"], dict(os.environ, VLLM_BATCH_INVARIANT=knob),
                      cfg["timeout_s"])
        where = [f"{os.path.basename(f['file'])}:{f['line']} in {f['func']}" for f in frames(output_lines(p.text))
                 if f["file"].endswith("batch_invariant.py")]
        rows.append({"knob": knob, "rc": p.rc, "generated": "GENERATED" in p.stdout, "error": p.error,
                     "where": where[-1] if where else ""})
    off, on = rows
    return ([("knob", "VLLM_BATCH_INVARIANT", ""), ("rc", "exit code", ""), ("generated", "generated", ""),
                    ("error", "last error", ""), ("where", "last batch_invariant.py frame", "")], rows, [
        ("without the knob the CPU engine generates", off["generated"]),
        ("with VLLM_BATCH_INVARIANT=1 it crashes with a TypeError", not on["generated"] and on["error"].startswith("TypeError")),
        ("raised inside vLLM's batch_invariant.py", bool(on["where"])),
    ])


# ==================== section: prefix_cache_logprobs ====================
def pc_logprobs(out: Any) -> list[float]:
    return [next(iter(d.values())).logprob for d in out.outputs[0].logprobs]


def pc_prompt_logprobs(out: Any) -> list[float]:
    return [next(iter(d.values())).logprob for d in out.prompt_logprobs[1:]]


def repro_prefix_cache_logprobs(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """Prefix caching on vLLM's CPU engine. vLLM #5543 (a cache hit recomputes the last block in another order)
    and #42019 (prompt log-probs depend on request order) need a cached prompt scored: vLLM 0.32 skips reading
    the cache for every request that asks prompt log-probs (SamplingParams.skip_reading_prefix_cache defaults to
    prompt_logprobs is not None), so prompt log-probs never see it. Completion log-probs with a cache hit are
    compared with a cold run and across request orders (measured). Forcing the cache read with prompt log-probs
    returns entries at the cached positions that are not the cold run's."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=save(build_model(cfg["vocab"], seed=args.seed)), skip_tokenizer_init=True, dtype="float32",
              seed=args.seed, max_model_len=1024, enforce_eager=True, enable_prefix_caching=True, max_logprobs=-1)
    shared = random_prompts(1, cfg["vocab"], args.seed, cfg["shared"])[0]
    a, b = (shared + p for p in random_prompts(2, cfg["vocab"], args.seed + 1, cfg["own"]))

    def gen(prompts: list[list[int]], **kw: Any) -> list[Any]:
        sp = SamplingParams(temperature=0.0, max_tokens=cfg["tokens"], logprobs=0, detokenize=False, **kw)
        out: list[Any] = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        return out

    def fresh(prompts: list[list[int]], **kw: Any) -> list[Any]:
        llm.reset_prefix_cache()
        return gen(prompts, **kw)

    rows = []
    cold, warm = fresh([a], prompt_logprobs=0)[0], gen([a], prompt_logprobs=0)[0]
    rows.append({"case": "prompt log-probs, asked again", "cached": warm.num_cached_tokens,
                 "max_diff": max(abs(x - y) for x, y in zip(pc_prompt_logprobs(cold), pc_prompt_logprobs(warm)))})
    cold, warm = fresh([a])[0], gen([a])[0]
    rows.append({"case": "completion log-probs, asked again", "cached": warm.num_cached_tokens,
                 "max_diff": max(abs(x - y) for x, y in zip(pc_logprobs(cold), pc_logprobs(warm)))})
    ab, ba = fresh([a, b]), fresh([b, a])
    rows.append({"case": "completion log-probs, order a,b vs b,a", "cached": ab[1].num_cached_tokens,
                 "max_diff": max(abs(x - y) for p, q in ((ab[0], ba[1]), (ab[1], ba[0]))
                                 for x, y in zip(pc_logprobs(p), pc_logprobs(q)))})
    cold = fresh([a], prompt_logprobs=0)[0]
    # An unrelated prompt's log-probs pass through the engine in between (b shares a's prefix, and so its values).
    gen(random_prompts(1, cfg["vocab"], args.seed + 2, len(a)), prompt_logprobs=0)
    forced = gen([a], prompt_logprobs=0, skip_reading_prefix_cache=False)[0]
    n = forced.num_cached_tokens
    gaps = [abs(x - y) for x, y in zip(pc_prompt_logprobs(cold), pc_prompt_logprobs(forced))]
    foreign = [next(iter(d)) != t for d, t in zip(forced.prompt_logprobs[1:], a[1:])]  # an entry for another token
    # Entry t scores prompt token t + 1 from position t's logits: the first n come from cached positions.
    for case, part in (("cached positions", slice(0, n)), ("the rest", slice(n, None))):
        rows.append({"case": f"prompt log-probs, cache read forced: {case}", "cached": n,
                     "max_diff": max(gaps[part], default=0.0), "foreign": sum(foreign[part])})
    for r in rows:
        r.setdefault("foreign", 0)
    return ([("case", "case", ""), ("cached", "cached tokens", ""), ("max_diff", "max |diff| vs a cold run", ".3g"),
             ("foreign", "entries not for the prompt's token", "")], rows, [
        ("a request with prompt log-probs reads no cached block (so #5543 and #42019 cannot arise)", rows[0]["cached"] == 0),
        ("completion log-probs after a cache hit were measured", rows[1]["cached"] > 0 and rows[2]["cached"] > 0),
        ("forcing the cache read returns prompt log-probs at cached positions that are not the cold run's",
         rows[3]["cached"] > 0 and rows[3]["max_diff"] > 1e-3),
        ("the positions computed in that request equal the cold run", rows[4]["max_diff"] == 0.0),
    ])


# ==================== section: cpu_capability_default ====================
from parity.repro.standalone_child import run_child  # @inline parity.repro.standalone_child

# The children print "ISA <inductor's vector ISA>" first and "GENERATED <ids>" when they got through.
CAP_ISA = "from torch._inductor import cpu_vec_isa\nprint('ISA', str(cpu_vec_isa.pick_vec_isa()), flush=True)\n"
CAP_TORCH = CAP_ISA + r"""
import torch
@torch.compile(dynamic=True)
def count_ge(x, v):
    return (x >= v).sum(-1)
print("GENERATED", count_ge(torch.arange(12.0).reshape(3, 4), torch.tensor([[1.0], [5.0], [20.0]])).tolist(), flush=True)
"""
CAP_VLLM = CAP_ISA + r"""
import sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, dtype=sys.argv[2], max_model_len=256, seed=0, enforce_eager=True,
          enable_prefix_caching=False)
out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])],
                   SamplingParams(temperature=0, max_tokens=2, logprobs=1, detokenize=False), use_tqdm=False)
print("GENERATED", list(out[0].outputs[0].token_ids), flush=True)
"""
# g++ quotes the name with typographic quotes under a UTF-8 locale, ASCII ones otherwise.
CAP_SYMPTOM = re.compile("[\u2018']at::vec[\u2019'] has not been declared")


def repro_cpu_capability_default(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """torch inductor's FX graph cache ignores ATEN_CPU_CAPABILITY: after a vectorised run fills the cache, a run
    under ATEN_CPU_CAPABILITY=default gets the vectorised graph back, g++ builds it against the scalar header and
    stops with 'at::vec' has not been declared; TORCHINDUCTOR_FX_GRAPH_CACHE=0 works around it. Shown on torch
    alone and on vLLM's CPU engine (log-probs on, so its sampler compiles a rank count), each in three processes
    over one fresh inductor cache."""
    path = save(build_model(cfg["vocab"], seed=args.seed))
    steps = (("control", None, None), ("stale cache", "default", None), ("FX graph cache off", "default", "0"))
    rows = []
    for case, code, argv in (("torch", CAP_TORCH, []), ("vllm", CAP_VLLM, [path, "bfloat16"])):
        if case not in cfg["cases"]:
            continue
        cache = tempfile.mkdtemp(prefix="repro-cache-")
        for step, knob, fx in steps:
            env = dict(os.environ, VLLM_CACHE_ROOT=os.path.join(cache, "vllm"), TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "ind"))
            for key, value in (("ATEN_CPU_CAPABILITY", knob), ("TORCHINDUCTOR_FX_GRAPH_CACHE", fx)):
                env.pop(key, None)
                if value:
                    env[key] = value
            p = run_child([sys.executable, "-c", code, *argv], env, cfg["timeout_s"])
            isa = [ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if ln.startswith("ISA ")]
            rows.append({"case": case, "step": step, "knob": knob or "unset", "isa": isa[0] if isa else "?",
                         "generated": any(ln.startswith("GENERATED ") for ln in p.stdout.splitlines()),
                         "symptom": bool(CAP_SYMPTOM.search(p.text))})
    pick = {s: [r for r in rows if r["step"] == s] for s, _, _ in steps}
    return ([("case", "case", ""), ("step", "step", ""), ("knob", "ATEN_CPU_CAPABILITY", ""),
                    ("isa", "inductor vector ISA", ""), ("generated", "generated", ""),
                    ("symptom", "'at::vec' has not been declared", "")], rows, [
        ("control: without the variable every case generates", all(r["generated"] for r in pick["control"])),
        ("the control compiled for a vectorised ISA (without one nothing can go stale)",
         all(r["isa"] not in ("INVALID_VEC_ISA", "?") for r in pick["control"])),
        ("ATEN_CPU_CAPABILITY=default over the same cache fails with 'at::vec' has not been declared",
         all(not r["generated"] and r["symptom"] for r in pick["stale cache"])),
        ("the same with TORCHINDUCTOR_FX_GRAPH_CACHE=0 generates", all(r["generated"] for r in pick["FX graph cache off"])),
    ])


# ==================== section: torch_cpu_log_softmax ====================
from parity.repro.standalone_child import run_child  # @inline parity.repro.standalone_child

# torch reads ATEN_CPU_CAPABILITY once, when it is imported: the second kernel path runs in a child process,
# which prints one "LSM_ROW<TAB>key=value<TAB>..." line per (V, sigma). The script is its own child (LSM_CHILD set).
LSM_CHILD = "REPRO_LOG_SOFTMAX_CHILD"
LSM_ROW = "LSM_ROW"
LSM_IN_PROCESS = "in-process"
LSM_DEFAULT = "ATEN_CPU_CAPABILITY=default"
LSM_MIN_POSITIVE = 0.95  # "(nearly) every row": this share of the rows has a positive offset
LSM_MIN_RATIO = 10.0  # log_softmax's mean offset over float32 logsumexp's mean |offset|
LSM_CHUNK = 16  # rows per batch of the float64 reference (memory)
LSM_COLUMNS = (("vocab", "V", ",d"), ("sigma", "σ", "g"), ("path", "kernel path", ""), ("capability", "torch capability", ""),
               ("rows", "rows", ""), ("ls_mean", "log_softmax mean offset", "+.2e"), ("ls_max", "max offset", "+.2e"),
               ("positive", "rows > 0", ".0%"), ("spread", "within-row spread", ".1e"),
               ("rounding", "float32 rounding spread", ".1e"), ("lse_mean", "logsumexp mean offset", "+.1e"),
               ("lse_abs", "logsumexp mean abs offset", ".1e"), ("written_mean", "max+exp+sum mean offset", "+.1e"))


def lsm_base_rows(vocab: int, rows: int, seed: int) -> torch.Tensor:
    """Standard normal rows [rows, vocab] in float32; the logits are sigma times these. Drawn in float64 and
    rounded: torch's float32 normal sampler gives other numbers on the other kernel path."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + vocab)
    return torch.randn(rows, vocab, generator=g, dtype=torch.float64).float()


def lsm_fingerprint(z: torch.Tensor) -> int:
    """An integer fingerprint of z's bits (exact integer sums, so both kernel paths agree on equal rows)."""
    bits = z.contiguous().view(torch.int32).long()
    weights = torch.arange(z.shape[-1]) % 1021 + 1  # per row |sum| < 2^31 * 1021 * V: no int64 overflow
    return int(sum(int(s) * (i + 1) for i, s in enumerate((bits * weights).sum(-1).tolist())) % (1 << 61))


def lsm_row_offsets(z: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per row of float32 logits z [R, V], each a float64 [R]: the offset (mean over the row's tokens of
    float32 result - float64 log_softmax) of torch.log_softmax, of z - torch.logsumexp(z) and of a written-out
    max + exp + sum; the within-row spread (std over tokens) of log_softmax's difference, and the spread of
    the float64 values rounded to float32 (what any float32 result has). A row biased by one constant has
    a mean far from 0 and a spread near that rounding spread."""
    exact = torch.log_softmax(z.double(), dim=-1)
    d = torch.log_softmax(z, dim=-1).double() - exact
    lse = (z - torch.logsumexp(z, dim=-1, keepdim=True)).double() - exact
    shifted = z - z.amax(dim=-1, keepdim=True)
    written = (shifted - shifted.exp().sum(dim=-1, keepdim=True).log()).double() - exact
    return {"log_softmax": d.mean(-1), "spread": d.std(-1), "rounding": (exact.float().double() - exact).std(-1),
            "logsumexp": lse.mean(-1), "written_out": written.mean(-1)}


def lsm_measure(vocabs: Iterable[int], scales: Iterable[float], rows: int, seed: int) -> list[dict[str, Any]]:
    """One table row per (V, sigma) on this process's kernel path: the per-row statistics over `rows` rows."""
    capability = torch.backends.cpu.get_cpu_capability()
    out = []
    for vocab in vocabs:
        base = lsm_base_rows(vocab, rows, seed)
        fingerprint = lsm_fingerprint(base)
        for sigma in scales:
            parts = [lsm_row_offsets(base[i : i + LSM_CHUNK] * sigma) for i in range(0, rows, LSM_CHUNK)]
            per = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
            ls = per["log_softmax"]
            out.append({"vocab": int(vocab), "sigma": float(sigma), "capability": capability, "rows": int(rows),
                        "ls_mean": float(ls.mean()), "ls_max": float(ls.max()), "ls_min": float(ls.min()),
                        "positive": float((ls > 0).double().mean()), "spread": float(per["spread"].mean()),
                        "rounding": float(per["rounding"].mean()), "lse_mean": float(per["logsumexp"].mean()),
                        "lse_abs": float(per["logsumexp"].abs().mean()),
                        "written_mean": float(per["written_out"].mean()), "fingerprint": fingerprint})
    return out


def lsm_print(rows: Iterable[Mapping[str, Any]]) -> None:
    """The child's output: one tab-separated line per table row."""
    for r in rows:
        print("\t".join([LSM_ROW] + [f"{k}={v!r}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()]),
              flush=True)


def lsm_value(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def lsm_parse(stdout: str) -> list[dict[str, Any]]:
    """The table rows a child printed (lsm_print's lines; other output is ignored)."""
    rows = []
    for line in stdout.splitlines():
        if line.startswith(LSM_ROW + "\t"):
            rows.append({k: lsm_value(v) for k, v in (item.split("=", 1) for item in line.split("\t")[1:])})
    return rows


def lsm_checks(rows: Sequence[Mapping[str, Any]], vocab: int, scale: float, child_error: str = "") -> list[tuple[str, bool, str]]:
    """The verdict's rule, as (statement, holds, detail): the default-path rows come from torch's DEFAULT
    kernels; then on each kernel path, at V = `vocab` and logit scale `scale`, log_softmax's row offset is
    positive on at least LSM_MIN_POSITIVE of the rows and its mean is positive and at least LSM_MIN_RATIO
    times float32 logsumexp's mean |offset| over the same rows. A row that was not measured fails."""
    child = [r for r in rows if r["path"] == LSM_DEFAULT]
    caps = sorted({r["capability"] for r in child})
    checks = [(f"the subprocess with {LSM_DEFAULT} ran torch's DEFAULT (non-vectorised) kernels",
               bool(child) and caps == ["DEFAULT"],
               f"capability {', '.join(caps)}" if child else f"no rows: {child_error or 'the subprocess printed none'}")]
    for path in (LSM_IN_PROCESS, LSM_DEFAULT):
        statement = (f"{path}, V={vocab:,}, sigma={scale:g}: log_softmax's offset is positive on >= "
                     f"{LSM_MIN_POSITIVE:.0%} of rows and its mean is >= {LSM_MIN_RATIO:g}x float32 logsumexp's mean |offset|")
        pick = [r for r in rows if r["path"] == path and r["vocab"] == vocab and r["sigma"] == scale]
        if not pick:
            checks.append((statement, False, "not measured"))
            continue
        r = pick[0]
        ratio = r["ls_mean"] / r["lse_abs"] if r["lse_abs"] > 0 else math.inf
        ok = r["positive"] >= LSM_MIN_POSITIVE and r["ls_mean"] > 0 and r["ls_mean"] >= LSM_MIN_RATIO * r["lse_abs"]
        checks.append((statement, ok, f"{r['capability']}: mean {r['ls_mean']:+.2e}, positive on {r['positive']:.0%} of "
                                      f"{r['rows']} rows; logsumexp mean |offset| {r['lse_abs']:.1e} (ratio {ratio:.1f})"))
    return checks


def repro_torch_cpu_log_softmax(cfg: dict[str, Any], args: argparse.Namespace) -> Outcome:
    """At the largest V on N(0, 4^2) logits, every float32 torch.log_softmax log-prob of a row is high by one
    constant on both CPU kernel paths (this process's native kernels, and this script again under
    ATEN_CPU_CAPABILITY=default): its sum of exponentials drops small terms. Per seeded row and (V, sigma): the
    offset (mean over the row's tokens of float32 - float64 log_softmax), its within-row spread beside float32
    rounding's, and the same offset for z - logsumexp(z) (the control) and a written-out max + exp + sum."""
    def measure() -> list[dict[str, Any]]:
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
