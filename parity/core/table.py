"""Per-token comparison of the sampler's records against trainer logits (engine-free).

The sampler side contributes its processed log-prob of each sampled token and the captured S_q; the
trainer side contributes raw logits. Every estimator is evaluated at every position and laid out in
one flat :class:`TokenTable` with locators (prompt, position, token) so a gate can name exactly where
it failed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from parity.core import estimators
from parity.core.capture import support_mass
from parity.core.metrics import diff_stats, is_ratios, kl_tv_over_support, support_equal
from parity.core.spec import SamplingSpec
from parity.records.sequence import SequenceRecord

# Float32 sums of up to V probabilities: 1e-4 is far above rounding, far below one missing token of
# any mass the filters would keep.
SUPPORT_MASS_TOL = 1e-4


@dataclass
class TokenTable:
    prompt_index: torch.Tensor  # long [T]
    position: torch.Tensor  # long [T]
    token: torch.Tensor  # long [T]
    vllm: torch.Tensor  # float64 [T]: the sampler's processed log-prob
    full: torch.Tensor  # float64 [T]: trainer full-vocabulary log-prob (naive)
    replay: torch.Tensor  # float64 [T]
    recompute: torch.Tensor  # float64 [T]
    log_s: torch.Tensor  # float64 [T]: predicted log S from trainer logits over S_q (0 when unfiltered)
    forced: torch.Tensor  # bool [T]: recompute had to force-include the sampled token
    captured: torch.Tensor  # bool [T]: S_q was captured (False: unfiltered, support = vocabulary)
    incomplete: torch.Tensor  # bool [T]: the captured head may not hold the whole support
    sampled_outside: torch.Tensor  # bool [T]: the sampled token is not in S_q (engine or capture fault)
    replay_support_ok: torch.Tensor  # bool [T]: S_q complete, holds y, sampler mass sums to 1
    recompute_support_equal: torch.Tensor  # bool [T]: recomputed S_p == S_q
    support_size: torch.Tensor  # long [T]: |S_q| (V when not captured)
    kl: torch.Tensor  # float64 [T]: KL(sampler || trainer replay) over S_q (0 when not captured)
    tv: torch.Tensor  # float64 [T]: total variation over S_q
    seq_lengths: list[int]
    user: torch.Tensor | None = None  # float64 [T]: a trainer under test's log-probs (parity.engines.trainer_under_test)
    user_name: str | None = None
    user_diagnosis: str | None = None

    @property
    def tokens(self) -> int:
        return int(self.token.numel())

    def locate(self, i: int) -> str:
        return f"prompt {int(self.prompt_index[i])}, position {int(self.position[i])}, token {int(self.token[i])}"

    def select(self, mask: torch.Tensor) -> TokenTable:
        """Rows where ``mask`` holds (sequence lengths are recomputed per prompt)."""
        kw: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = v[mask] if isinstance(v, torch.Tensor) else v
        counts = torch.bincount(kw["prompt_index"]) if mask.any() else torch.zeros(0, dtype=torch.long)
        kw["seq_lengths"] = [int(c) for c in counts if int(c) > 0]
        return TokenTable(**kw)


@dataclass(frozen=True)
class TrainerFaults:
    """Planted faults on the trainer side, for proving that gates fail."""

    perturb_logits: float = 0.0  # add this to one logit of the sampled token at one position per sequence
    forget_temperature: bool = False  # score with T = 1 whatever the sampler used
    swap_token: bool = False  # the trainer scores a different token at one position per sequence
    drop_kept: bool = False  # drop one non-sampled token from S_q at one position per sequence


def _plant(
    records: Sequence[SequenceRecord], logits: list[torch.Tensor], faults: TrainerFaults, vocab: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Apply planted faults at position L // 2 of each sequence; returns (tokens, logits, kept) per record."""
    out = []
    for r, z in zip(records, logits, strict=True):
        y = torch.tensor(r.completion_ids, dtype=torch.long)
        kept = r.kept_ids
        t = r.length // 2
        if r.length and faults.perturb_logits:
            z = z.clone()
            z[t, y[t]] += faults.perturb_logits
        if r.length and faults.swap_token:
            y = y.clone()
            y[t] = (y[t] + 1) % vocab
        if r.length and faults.drop_kept and kept is not None:
            kept = kept.clone()
            row = kept[t]
            victims = ((row >= 0) & (row != int(r.completion_ids[t]))).nonzero()
            if victims.numel():
                row[int(victims[0])] = -1
        out.append((y, z, kept))
    return out


def build_table(
    records: Sequence[SequenceRecord],
    logits: Sequence[torch.Tensor],
    spec: SamplingSpec,
    *,
    faults: TrainerFaults | None = None,
) -> TokenTable:
    """Evaluate full / replay / recompute / log S for every sampled token."""
    if len(records) != len(logits):
        raise ValueError(f"{len(records)} sampler records but {len(logits)} trainer logit tensors")
    faults = faults or TrainerFaults()
    vocab = int(logits[0].shape[-1]) if logits else 0
    trainer_spec = SamplingSpec(1.0, spec.top_k, spec.top_p, spec.min_p) if faults.forget_temperature and not spec.greedy else spec
    cols: dict[str, list[torch.Tensor]] = {
        f.name: [] for f in fields(TokenTable) if f.name not in ("seq_lengths", "user", "user_name", "user_diagnosis")
    }
    lengths = []
    for r, (y, z, kept) in zip(records, _plant(records, list(logits), faults, vocab), strict=True):
        n = r.length
        if z.shape != (n, vocab):
            raise ValueError(f"trainer logits for prompt {r.prompt_index} have shape {tuple(z.shape)}, allowed ({n}, {vocab})")
        lengths.append(n)
        cols["prompt_index"].append(torch.full((n,), r.prompt_index, dtype=torch.long))
        cols["position"].append(torch.arange(n))
        cols["token"].append(y)
        cols["vllm"].append(r.logprobs.double())
        full = estimators.full(z, y, trainer_spec).double()
        cols["full"].append(full)
        rec = estimators.recompute(z, y, trainer_spec)
        cols["recompute"].append(rec.logprobs.double())
        cols["forced"].append(rec.forced)
        if kept is None:
            # Unfiltered: S_q is the whole vocabulary, replay is the full log-softmax, log S = 0.
            cols["replay"].append(full)
            cols["log_s"].append(torch.zeros(n, dtype=torch.float64))
            cols["captured"].append(torch.zeros(n, dtype=torch.bool))
            cols["incomplete"].append(torch.zeros(n, dtype=torch.bool))
            cols["sampled_outside"].append(torch.zeros(n, dtype=torch.bool))
            cols["replay_support_ok"].append(torch.ones(n, dtype=torch.bool))
            cols["recompute_support_equal"].append(rec.kept.all(dim=-1))
            cols["support_size"].append(torch.full((n,), vocab, dtype=torch.long))
            cols["kl"].append(torch.zeros(n, dtype=torch.float64))
            cols["tv"].append(torch.zeros(n, dtype=torch.float64))
            continue
        rep = estimators.replay(z, y, kept, trainer_spec)
        cols["replay"].append(rep.logprobs.double())
        cols["log_s"].append(estimators.predicted_log_s(z, kept, trainer_spec).double())
        incomplete = r.incomplete if r.incomplete is not None else torch.zeros(n, dtype=torch.bool)
        cols["captured"].append(torch.ones(n, dtype=torch.bool))
        cols["incomplete"].append(incomplete)
        # Outside a complete capture only: beyond a full head the sampled token may simply be unlisted.
        cols["sampled_outside"].append(rep.outside & ~incomplete)
        # Sampler mass over the captured ids; a dropped token leaves it short of 1.
        sampler_lp = _sampler_lp_of(r, kept)
        mass_ok = (support_mass(sampler_lp) - 1.0).abs() <= SUPPORT_MASS_TOL
        cols["replay_support_ok"].append(~incomplete & ~rep.outside & mass_ok)
        cols["support_size"].append((kept >= 0).sum(dim=-1))
        q_mask = estimators.ids_to_mask(kept, vocab)
        cols["recompute_support_equal"].append(support_equal(rec.kept, q_mask))
        # KL / TV between the sampler's processed distribution and the trainer's replayed one, on S_q.
        zs = estimators.scale(z, trainer_spec)
        vals = zs.gather(1, kept.clamp(min=0)).masked_fill(kept < 0, float("-inf")).double()
        t_lp = vals - torch.logsumexp(vals, dim=-1, keepdim=True)
        kl, tv = kl_tv_over_support(sampler_lp, t_lp)
        cols["kl"].append(kl)
        cols["tv"].append(tv)
    if not lengths:
        empty: dict[str, Any] = {k: torch.zeros(0) for k in cols}
        return TokenTable(**empty, seq_lengths=[])
    joined: dict[str, Any] = {k: torch.cat(v) for k, v in cols.items()}
    return TokenTable(**joined, seq_lengths=lengths)


def _sampler_lp_of(r: SequenceRecord, kept: torch.Tensor) -> torch.Tensor:
    """The sampler's processed log-probs of ``kept`` (which may have had ids planted away)."""
    assert r.kept_ids is not None and r.kept_logprobs is not None
    lp = r.kept_logprobs.double()
    if kept is r.kept_ids:
        return lp
    return lp.masked_fill(kept < 0, float("-inf"))


def summarize(table: TokenTable) -> dict[str, Any]:
    """The per-scenario numbers of the report contract (schema_version 1), computed from the table."""
    usable = ~table.incomplete  # incomplete positions are counted, never guessed
    t = table.select(usable)
    naive = diff_stats(t.full, t.vllm)
    gap = diff_stats(t.full - t.vllm, t.log_s)
    rep = diff_stats(t.replay, t.vllm)
    rec = diff_stats(t.recompute, t.vllm)
    captured = t.captured
    kl = t.kl[captured]
    tv = t.tv[captured]

    def frac(mask: torch.Tensor) -> float:
        return float(mask.double().mean()) if mask.numel() else 1.0

    naive_ratio = is_ratios(t.full, t.vllm, t.seq_lengths, log_s=t.log_s)
    replay_ratio = is_ratios(t.replay, t.vllm, t.seq_lengths)
    recompute_ratio = is_ratios(t.recompute, t.vllm, t.seq_lengths)
    return {
        "tokens": table.tokens,
        "compared_tokens": t.tokens,
        "sequences": len(table.seq_lengths),
        "log_s": {
            "mean": float(t.log_s.mean()) if t.tokens else 0.0,
            "min": float(t.log_s.min()) if t.tokens else 0.0,
            "mean_s": float(t.log_s.exp().mean()) if t.tokens else 1.0,
        },
        "naive": {
            "bias_mean": naive.mean_diff,
            "max_abs_diff": naive.max_abs_diff,
            "max_abs_gap_to_log_s": gap.max_abs_diff,
            "mean_gap_to_log_s": gap.mean_diff,
        },
        "replay": {**rep.to_dict(), "support_equal_frac": frac(t.replay_support_ok)},
        "recompute": {
            **rec.to_dict(),
            "support_equal_frac": frac(t.recompute_support_equal),
            "forced_includes": int(t.forced.sum()),
        },
        "is_ratio": {
            "naive": {
                "token": {"mean": naive_ratio.token_mean, "min": naive_ratio.token_min, "max": naive_ratio.token_max},
                "sequence": {"mean": naive_ratio.seq_mean, "min": naive_ratio.seq_min, "max": naive_ratio.seq_max},
                "sequence_identity_max_rel_err": naive_ratio.seq_identity_max_rel_err,
            },
            "replay": {
                "token": {"mean": replay_ratio.token_mean, "min": replay_ratio.token_min, "max": replay_ratio.token_max},
                "sequence": {"mean": replay_ratio.seq_mean, "min": replay_ratio.seq_min, "max": replay_ratio.seq_max},
            },
            "recompute": {
                "token": {"mean": recompute_ratio.token_mean, "min": recompute_ratio.token_min, "max": recompute_ratio.token_max},
                "sequence": {"mean": recompute_ratio.seq_mean, "min": recompute_ratio.seq_min, "max": recompute_ratio.seq_max},
            },
        },
        "kl_over_support": {"mean": float(kl.mean()) if kl.numel() else 0.0, "max": float(kl.max()) if kl.numel() else 0.0},
        "tv_over_support": {"mean": float(tv.mean()) if tv.numel() else 0.0, "max": float(tv.max()) if tv.numel() else 0.0},
        "incomplete_positions": int(table.incomplete.sum()),
        "sampled_outside_support": int(table.sampled_outside.sum()),
        **({"trainer_under_test": _user_summary(t)} if t.user is not None else {}),
        "captured_positions": int(table.captured.sum()),
        "max_support_size": int(table.support_size[table.captured].max()) if bool(table.captured.any()) else None,
        "mean_support_size": float(table.support_size[table.captured].double().mean()) if bool(table.captured.any()) else None,
    }


def _user_summary(t: TokenTable) -> dict[str, Any]:
    assert t.user is not None
    d = diff_stats(t.user, t.vllm)
    gap = diff_stats(t.user - t.vllm, t.log_s)
    return {
        "name": t.user_name,
        **d.to_dict(),
        "max_abs_gap_to_log_s": gap.max_abs_diff,
        "diagnosis": t.user_diagnosis,
    }
