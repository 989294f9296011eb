"""Per-token comparison of the sampler's records against trainer logits (engine-free): every estimator at
every position, in one flat :class:`TokenTable` with locators (prompt, position, token) for the gates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from parity.core import estimators
from parity.core.error_model import logprob_bound, systematic_bound, unit_roundoff
from parity.core.log_s import top_p_bracket, top_p_bracket_applies
from parity.core.metrics import boundary_only, support_equal, top_k_count_differs
from parity.core.penalties import penalise_sequence
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.errors import UsageError


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
    incomplete: torch.Tensor  # bool [T]: the captured head may not hold the whole support
    recompute_support_equal: torch.Tensor  # bool [T]: recomputed S_p == S_q (or differs only at the cutoff)
    recompute_support_size: torch.Tensor  # long [T]: |S_p ∪ {y}|, the tokens recompute normalised over
    # float64 [T]: where S_p differs from S_q only at the cutoff, how far that moves recompute: |logsumexp over
    # S_q - logsumexp over S_p with the sampled token| (0 where the sets are equal); recompute's drift bound adds it
    recompute_boundary: torch.Tensor
    bound: torch.Tensor  # float64 [T]: rounding bound on |trainer - sampler| over S_q (parity.core.error_model)
    bound_full: torch.Tensor  # float64 [T]: the same over the whole vocabulary (the naive estimator's)
    systematic: torch.Tensor  # float64 [T]: what of |trainer - sampler| can point one way (error_model.systematic_bound)
    sampled: torch.Tensor  # long [T]: the token the sampler drew (``token`` is what the trainer scored)
    s_lo: torch.Tensor  # float64 [T]: sampler-side log S lies in [s_lo, s_hi]; NaN where no source has it
    s_hi: torch.Tensor  # float64 [T]
    # float64 [T]: full(penalised z)[y] - full(z)[y], the penalties' part of a naive trainer's bias (0 unpenalised):
    # a trainer that ignores the penalties and the filters reads vllm + log S - penalty (docs/penalties.md)
    penalty: torch.Tensor
    seq_lengths: list[int]
    roundoff: float = 2.0**-24  # unit roundoff of the looser side
    s_source: str = "none"  # where s_lo/s_hi come from: unfiltered, raw_logits, top_p_bracket, none
    user: torch.Tensor | None = None  # float64 [T]: a trainer under test's log-probs (parity.engines.trainer_under_test)
    user_name: str | None = None
    # Per sequence, the kept ids [L, K] (-1 padded) as the (possibly planted) trainer saw them and its logits at those
    # ids, float32 [L, K]; (None, None) where the record has no kept set. From plant_faults, the one place faults are
    # applied: the records take their kept columns from here. A selection holds none.
    kept_seen: tuple[tuple[torch.Tensor | None, torch.Tensor | None], ...] = ()

    @property
    def tokens(self) -> int:
        return int(self.token.numel())

    def select(self, mask: torch.Tensor) -> TokenTable:
        """Rows where ``mask`` holds (sequence lengths are recomputed per prompt)."""
        kw = {f.name: v[mask] for f in fields(self) if isinstance(v := getattr(self, f.name), torch.Tensor)}
        counts = torch.bincount(kw["prompt_index"]) if mask.any() else torch.zeros(0, dtype=torch.long)
        return TokenTable(**kw, seq_lengths=[int(c) for c in counts if int(c) > 0], roundoff=self.roundoff,
                          s_source=self.s_source, user_name=self.user_name, kept_seen=())


@dataclass(frozen=True)
class TrainerFaults:
    """Planted faults on the trainer side, for proving that gates fail."""

    perturb_logits: float = 0.0  # add this to one logit of the sampled token at one position per sequence
    forget_temperature: bool = False  # score with T = 1 whatever the sampler used
    swap_token: bool = False  # the trainer scores a different token at one position per sequence
    drop_kept: bool = False  # drop one non-sampled token from S_q at one position per sequence
    # Faults sized against the gates' own limits (tests plant them at a few times and a tenth of a limit):
    shift_bounds: float = 0.0  # the trainer's log-probs off by this many rounding bounds at position L // 2
    bias_logprob: float = 0.0  # every trainer log-prob shifted by this many nats (a systematic bias)
    move_boundary_every: int = 0  # every N-th position: the best token outside S_q rises to the max logit
    drop_kept_mass: float = 0.0  # drop the kept token whose sampler probability is nearest this, at L // 2
    ignore_penalty: bool = False  # score the raw logits: the sampler's repetition/presence/frequency penalties left out


def plant_faults(
    records: Sequence[SequenceRecord], logits: list[torch.Tensor], faults: TrainerFaults, vocab: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Apply planted faults at position L // 2 of each sequence; returns (tokens, logits, kept) per record."""
    out = []
    seen = 0  # positions before this record (move_boundary_every counts across the batch)
    for r, z in zip(records, logits, strict=True):
        y = torch.tensor(r.completion_ids, dtype=torch.long)
        kept = r.kept_ids
        t = r.length // 2
        if faults.move_boundary_every and kept is not None:
            z = z.clone()
            q = estimators.ids_to_mask(kept, vocab)
            for pos in range(r.length):
                if (seen + pos) % faults.move_boundary_every == 0 and not bool(q[pos].all()):
                    outside = z[pos].masked_fill(q[pos], float("-inf"))
                    z[pos, int(outside.argmax())] = z[pos].max()
        seen += r.length
        if r.length and faults.perturb_logits:
            z = z.clone()
            z[t, y[t]] += faults.perturb_logits
        if r.length and faults.swap_token:
            y = y.clone()
            y[t] = (y[t] + 1) % vocab
        if r.length and faults.drop_kept_mass and kept is not None and r.kept_logprobs is not None:
            kept = kept.clone()
            p = r.kept_logprobs[t].double().exp()
            p[(kept[t] < 0) | (kept[t] == int(r.completion_ids[t]))] = math.inf
            kept[t, int((p - faults.drop_kept_mass).abs().argmin())] = -1
        if r.length and faults.drop_kept and kept is not None:
            kept = kept.clone()
            row = kept[t]
            victims = ((row >= 0) & (row != int(r.completion_ids[t]))).nonzero()
            if victims.numel():
                row[int(victims[0])] = -1
        out.append((y, z, kept))
    return out


def penalised_logits(records: Sequence[SequenceRecord], logits: Sequence[torch.Tensor], spec: SamplingSpec) -> list[torch.Tensor]:
    """Each sequence's logits as the sampler saw them: position t penalised from the prompt and the tokens
    before it (:func:`parity.core.penalties.penalise_sequence`); unchanged when ``spec`` sets no penalty."""
    if not spec.penalised:
        return list(logits)
    return [penalise_sequence(z, spec, r.prompt_ids, r.completion_ids) if z.dim() == 2 and z.shape[0] == r.length else z
            for r, z in zip(records, logits, strict=True)]


def build_table(
    records: Sequence[SequenceRecord],
    logits: Sequence[torch.Tensor],
    spec: SamplingSpec,
    *,
    faults: TrainerFaults | None = None,
    dtype: str | Sequence[str] = "float32",
    recompute_dtype: str | None = None,
) -> TokenTable:
    """Evaluate full / replay / recompute / log S for every sampled token. ``dtype``: the two sides' dtypes
    (the rounding bound uses the looser); ``recompute_dtype``: recompute chooses its kept set on the logits
    rounded to it (the sampler's dtype reproduces its ties)."""
    if len(records) != len(logits):
        raise UsageError(f"{len(records)} sampler records but {len(logits)} trainer logit tensors")
    faults = faults or TrainerFaults()
    vocab = int(logits[0].shape[-1]) if logits else 0
    trainer_spec = replace(spec, temperature=1.0) if faults.forget_temperature and not spec.greedy else spec
    raw = list(logits)
    penalised = penalised_logits(records, raw, spec)
    scalar = ("seq_lengths", "user", "user_name", "roundoff", "s_source", "kept_seen")
    cols: dict[str, list[torch.Tensor]] = {f.name: [] for f in fields(TokenTable) if f.name not in scalar}
    sources: set[str] = set()
    lengths = []
    scored = raw if faults.ignore_penalty else penalised  # a trainer planted to ignore the penalties scores the raw logits
    kept_seen: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
    for r, (y, z, kept), z_raw, z_pen in zip(records, plant_faults(records, scored, faults, vocab), raw, penalised,
                                             strict=True):
        n = r.length
        if z.shape != (n, vocab):
            raise UsageError(f"trainer logits for prompt {r.prompt_index} have shape {tuple(z.shape)}, allowed ({n}, {vocab})")
        lengths.append(n)
        kept_seen.append((kept, None if kept is None else z.gather(1, kept.clamp(min=0)).float()))
        cols["prompt_index"].append(torch.full((n,), r.prompt_index, dtype=torch.long))
        cols["position"].append(torch.arange(n))
        cols["token"].append(y)
        cols["sampled"].append(torch.tensor(r.completion_ids, dtype=torch.long))
        cols["vllm"].append(r.logprobs.double())
        zs = estimators.scale(z, trainer_spec)
        support = None if kept is None else estimators.ids_to_mask(kept, vocab)
        bound = logprob_bound(zs, y, support, dtype=dtype)
        bound_full = bound if kept is None else logprob_bound(zs, y, None, dtype=dtype)
        cols["bound"].append(bound)
        cols["bound_full"].append(bound_full)
        cols["systematic"].append(systematic_bound(zs, y, support, dtype=dtype))
        # Planted trainer faults that shift what the trainer reports (not its logits), each estimator by
        # a multiple of its own gate's bound (the naive one is gated with the full-vocabulary bound added).
        shift = torch.full((n,), faults.bias_logprob, dtype=torch.float64)
        shift_full = shift.clone()
        if n and faults.shift_bounds:
            shift[n // 2] += faults.shift_bounds * float(bound[n // 2])
            naive_bound = bound if kept is None else bound + bound_full
            shift_full[n // 2] += faults.shift_bounds * float(naive_bound[n // 2])
        full = estimators.full(z, y, trainer_spec).double() + shift_full
        cols["full"].append(full)
        cols["penalty"].append(estimators.penalty_term(z_raw, z_pen, y, trainer_spec) if spec.penalised
                               else torch.zeros(n, dtype=torch.float64))
        rec = estimators.recompute(z, y, trainer_spec, select_dtype=recompute_dtype)
        cols["recompute"].append(rec.logprobs.double() + shift)
        cols["forced"].append(rec.forced)
        cols["recompute_support_size"].append(rec.kept.sum(dim=-1) + rec.forced.long())
        lo, hi, source = _sampler_log_s(r, kept, spec, vocab)
        cols["s_lo"].append(lo)
        cols["s_hi"].append(hi)
        sources.add(source)
        if kept is None:  # S_q is the whole vocabulary: replay is the full log-softmax, log S = 0
            cols["replay"].append(full - shift_full + shift)
            cols["log_s"].append(torch.zeros(n, dtype=torch.float64))
            cols["incomplete"].append(torch.zeros(n, dtype=torch.bool))
            cols["recompute_support_equal"].append(rec.kept.all(dim=-1))
            cols["recompute_boundary"].append(torch.zeros(n, dtype=torch.float64))
        else:
            _add_captured(cols, r, z, y, zs, kept, rec.kept, shift, trainer_spec, bound)
    u = unit_roundoff(dtype)
    source = sources.pop() if len(sources) == 1 else ("mixed" if sources else "none")
    joined = {k: torch.cat(v) if v else torch.zeros(0) for k, v in cols.items()}
    return TokenTable(**joined, seq_lengths=lengths, roundoff=u, s_source=source, user_name=None,
                      kept_seen=tuple(kept_seen))


Columns = dict[str, list[torch.Tensor]]


def _add_captured(cols: Columns, r: SequenceRecord, z: torch.Tensor, y: torch.Tensor, zs: torch.Tensor,
                  kept: torch.Tensor, rec_kept: torch.Tensor, shift: torch.Tensor, trainer_spec: SamplingSpec,
                  bound: torch.Tensor) -> None:
    """A captured S_q: replay over it, predicted log S and recompute's support check. What the kept set alone gives
    (its size and mass, KL / TV, the logit drift) the records path derives from ``kept_seen``
    (:mod:`parity.judge.token_values`)."""
    n, vocab = r.length, int(z.shape[-1])
    rep = estimators.replay(z, y, kept, trainer_spec)
    cols["replay"].append(rep.logprobs.double() + shift)
    cols["log_s"].append(estimators.predicted_log_s(z, kept, trainer_spec).double())
    cols["incomplete"].append(r.incomplete if r.incomplete is not None else torch.zeros(n, dtype=torch.bool))
    q_mask = estimators.ids_to_mask(kept, vocab)
    exact = support_equal(rec_kept, q_mask)
    equal = exact.clone()
    if not bool(equal.all()):
        # A set that differs only at the cutoff, within drift, is the same filter; one keeping ties at the
        # k-th value that the other does not (a coarser precision ties more tokens there) is a different one.
        k = trainer_spec.top_k_for_vocab(vocab) if trainer_spec.effective().uses_top_k else 0
        equal |= boundary_only(rec_kept, q_mask, zs, bound) & ~top_k_count_differs(rec_kept, q_mask, k)
    cols["recompute_support_equal"].append(equal)
    cols["recompute_boundary"].append(boundary_shift(zs, y, q_mask, rec_kept, equal & ~exact))


def boundary_shift(zs: torch.Tensor, y: torch.Tensor, q_mask: torch.Tensor, rec_kept: torch.Tensor,
                   straddle: torch.Tensor) -> torch.Tensor:
    """Per position (float64): where ``straddle`` holds (the recomputed set differs from S_q only at the cutoff),
    ``|logsumexp(z' over S_q) - logsumexp(z' over S_p and y)|``, the exact amount by which the boundary tokens'
    mass moves recompute off the sampler's renormalisation; 0 elsewhere (docs/error_model.md, section 1)."""
    out = torch.zeros(zs.shape[0], dtype=torch.float64)
    if not bool(straddle.any()):
        return out
    z = zs[straddle].double()
    sp = rec_kept[straddle].clone()
    sp.scatter_(1, y[straddle].long().unsqueeze(1), True)  # recompute force-includes the sampled token
    neg = torch.full_like(z, -math.inf)
    lse_q = torch.logsumexp(torch.where(q_mask[straddle], z, neg), dim=-1)
    lse_p = torch.logsumexp(torch.where(sp, z, neg), dim=-1)
    out[straddle] = (lse_q - lse_p).abs()
    return out


def _sampler_log_s(
    r: SequenceRecord, kept: torch.Tensor | None, spec: SamplingSpec, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, str]:
    """[lo, hi] per position for log S from the sampler's side only (see :mod:`parity.core.log_s`)."""
    n = r.length
    if not spec.effective().filtered:
        zero = torch.zeros(n, dtype=torch.float64)  # the sampler normalised over the whole vocabulary
        return zero, zero, "unfiltered"
    given = r.extras.get("sampler_log_s") if r.extras else None
    if given is not None:  # from the engine's raw logits (a second pass with the same seeds)
        v = given.double()
        return v, v, "raw_logits"
    if kept is not None and r.kept_logprobs is not None and top_p_bracket_applies(spec, vocab):
        complete = r.incomplete is None or not bool(r.incomplete.any())
        if complete and bool(torch.isfinite(r.kept_logprobs).any(dim=-1).all()):
            lo, hi = top_p_bracket(r.kept_logprobs, spec.top_p, vocab)
            return lo, hi, "top_p_bracket"
    nan = torch.full((n,), float("nan"), dtype=torch.float64)
    return nan, nan, "none"


