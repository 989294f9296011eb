"""The per-token values of one batch (``TokenColumns``) and what is derived from its kept sets: the kept
mass, the sampler-side log S (given, unfiltered, or the top_p bracket) and, from the trainer's logits at
the kept ids, KL/TV over S_q, replay and the logit drift. No torch at import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from parity.core.error_model import SUPPORT_MASS_TOL
from parity.core.spec import SAMPLING_EPS, SamplingSpec
from parity.records.arrays import RecordsBatch

# Trainer logits held at once when computing from kept logits (floats): bounds memory on big heads.
LOGIT_BUDGET = 1 << 26


@dataclass
class TokenColumns:
    """Flat per-token values of one batch; ``have[input]`` says where each input exists."""

    n_rows: int
    row: np.ndarray  # int64 [T]
    position: np.ndarray
    token: np.ndarray  # the sampled token
    trainer_token: np.ndarray  # the token the trainer scored
    vllm: np.ndarray  # float64
    have: dict[str, np.ndarray]
    full: np.ndarray
    replay: np.ndarray
    recompute: np.ndarray
    log_s: np.ndarray
    user: np.ndarray
    forced: np.ndarray  # bool
    recompute_support_equal: np.ndarray
    recompute_support_size: np.ndarray  # int64: |S_p ∪ {y}| (trainer_recompute_support_size), -1 where unknown
    captured: np.ndarray
    incomplete: np.ndarray
    sampled_outside: np.ndarray
    replay_support_ok: np.ndarray
    support_size: np.ndarray
    mass: np.ndarray  # float64 (1 where not captured); exact where it may be off 1, else a float32 screen (_kept_mass)
    kl: np.ndarray
    tv: np.ndarray
    bound: np.ndarray
    bound_full: np.ndarray
    recompute_boundary: np.ndarray  # >= 0: the boundary tokens' shift of recompute (0 where S_p == S_q)
    systematic: np.ndarray  # per-token systematic bound (trainer_systematic, else the float32 storage term alone)
    s_lo: np.ndarray  # NaN where no sampler-side log S
    s_hi: np.ndarray
    s_source: list[str | None]  # per row
    logit_drift: np.ndarray  # NaN where unknown
    penalty: np.ndarray  # trainer_penalty_term where recorded (have["penalty"])
    # Reference views for the trainer-under-test diagnosis, by bug set ("" = correct); NaN = unknown there.
    views: dict[frozenset[str], np.ndarray] = field(default_factory=dict)


def segments(kto: np.ndarray) -> np.ndarray:
    """Token index of every kept entry, from token -> entry offsets."""
    return np.repeat(np.arange(kto.size - 1, dtype=np.int64), np.diff(kto))


# The float32 screen of a kept mass (exp and sum in float32) lies within (n + 8) * 2**-23 of the float64 sum
# relative to max(mass, 1) for n entries: a few ulps per exp, (n - 1) ulps for the sum, doubled.
_SCREEN_ULPS = 2.0**-23


def kept_mass(klp: np.ndarray, kto: np.ndarray, counts: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
    """Per position, the mass of its kept set: the sum of exp(kept log-prob), 0 for none; exact where it may be
    judged off 1, a float32 screen elsewhere (docs/records.md, section 5)."""
    mass = np.zeros(counts.size, dtype=np.float64)
    if not nonempty.size:
        return mass
    with np.errstate(over="ignore"):
        screen = np.add.reduceat(np.exp(klp), kto[nonempty]).astype(np.float64)
        margin = (counts[nonempty] + 8) * _SCREEN_ULPS * np.maximum(screen, 1.0)
    mass[nonempty] = screen
    exact = nonempty[~(np.abs(screen - 1.0) <= SUPPORT_MASS_TOL - margin)]
    if exact.size:
        c = counts[exact]
        local = np.cumsum(c) - c  # where each position's entries start among the gathered ones
        entries = np.repeat(kto[exact] - local, c) + np.arange(int(c.sum()))
        p = np.exp(klp[entries], dtype=np.float64)
        mass[exact] = np.bincount(np.repeat(np.arange(exact.size), c), weights=p, minlength=exact.size)
    return mass


def _temperature(spec: SamplingSpec) -> float:
    # Greedy rows divide by 1 (parity.core.filters.apply_temperature, after vLLM's Sampler.apply_temperature).
    t = spec.effective_temperature
    return 1.0 if t < SAMPLING_EPS else t


def min_kept_logprob(batch: RecordsBatch, support_size: np.ndarray) -> np.ndarray:
    """The smallest finite kept processed log-prob per position (inf: none finite; NaN: no kept ids)."""
    out = np.full(batch.tokens, np.nan)
    kto = batch.kept_token_offsets
    if batch.kept is not None and batch.tokens:
        assert kto is not None and batch.kept_logprobs is not None
        nonempty = np.flatnonzero(support_size > 0)
        if nonempty.size:
            klp32 = batch.kept_logprobs  # the minimum of float32 values is exact in either width
            finite_lp = np.where(np.isfinite(klp32), klp32, np.float32(np.inf))
            out[nonempty] = np.minimum.reduceat(finite_lp, kto[nonempty])
    return out


def sampler_log_s(
    batch: RecordsBatch, row: np.ndarray, filtered: np.ndarray, captured: np.ndarray, incomplete: np.ndarray,
    min_kept_lp: Callable[[], np.ndarray], vocab_size: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
    """``(lo, hi, have, source per row)``: the sampler-side log S, as ``build_table`` takes it; the top_p bracket
    comes from ``min_kept_lp()`` (the rules: README, "What records can be judged on")."""
    T = batch.tokens
    n = batch.n_rows
    lengths = batch.completion.lengths
    lo, hi = np.full(T, np.nan), np.full(T, np.nan)
    source = np.full(n, None, dtype=object)
    have_given = np.zeros(n, dtype=bool)
    if "sampler_log_s_lo" in batch.trainer:
        rlo, rhi = batch.trainer["sampler_log_s_lo"], batch.trainer["sampler_log_s_hi"]
        tok = np.repeat(rlo.valid, lengths)
        lo[tok], hi[tok] = rlo.values.astype(np.float64), rhi.values.astype(np.float64)
        have_given = rlo.valid.copy()
        given_src = batch.sampler_log_s_source or [None] * n
        for i in np.flatnonzero(have_given):
            source[i] = given_src[i] or "recorded"
    spec_filtered = np.array([s.effective().filtered for s in batch.specs], dtype=bool)
    unfiltered = ~have_given & ~spec_filtered[batch.spec_index]
    tok = np.repeat(unfiltered, lengths)
    lo[tok], hi[tok] = 0.0, 0.0
    source[unfiltered] = "unfiltered"
    bracket_specs = [j for j, s in enumerate(batch.specs)
                     if vocab_size and spec_filtered[j] and _top_p_bracket_applies(s, vocab_size)]
    if bracket_specs:
        inc_rows = np.bincount(row[incomplete], minlength=n) > 0 if T else np.zeros(n, dtype=bool)
        rows = np.flatnonzero(~have_given & np.isin(batch.spec_index, bracket_specs) & batch.kept_rows() & ~inc_rows)
        if rows.size:
            import torch

            from parity.core.log_s import top_p_bracket

            assert vocab_size
            mk = min_kept_lp()
            starts = batch.token_offsets
            for i in rows:
                a, b = int(starts[i]), int(starts[i + 1])
                if not bool(np.isfinite(mk[a:b]).all()):
                    continue
                # One call per row, as parity.core.token_table calls it per sequence: the same tensors, the same bits.
                r_lo, r_hi = top_p_bracket(torch.from_numpy(mk[a:b].reshape(-1, 1)), batch.spec_of(int(i)).top_p, vocab_size)
                lo[a:b], hi[a:b] = r_lo.numpy(), r_hi.numpy()
                source[i] = "top_p_bracket"
    out: list[str | None] = source.tolist()
    have_rows = np.array([x is not None for x in out], dtype=bool)
    return lo, hi, np.repeat(have_rows, lengths), out


def _top_p_bracket_applies(spec: SamplingSpec, vocab: int) -> bool:
    if spec.top_p >= 1.0:  # a condition of the rule itself: no torch for specs it cannot apply to
        return False
    from parity.core.log_s import top_p_bracket_applies

    return top_p_bracket_applies(spec, vocab)


def entry_logits(batch: RecordsBatch, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(logits, with_logits)``: the trainer's raw logits at the kept entries (float32, in the order of
    ``kept.values``; 0 where a row has none) from ``trainer_kept_logits``, and per token whether they are held."""
    tk = batch.trainer_kept_logits
    assert tk is not None and batch.kept is not None
    with_logits = np.repeat(tk.valid, batch.completion.lengths) & batch.kept_rows()[row]
    # Entries of rows that carry logits, in the same order as kept.values (rows without a kept set add none).
    entry_has = np.repeat(tk.valid[batch.kept.valid], batch.kept.lengths[batch.kept.valid])
    logits = np.zeros(batch.kept.values.size, dtype=np.float32)
    logits[entry_has] = tk.values.astype(np.float32)
    return logits, with_logits


def divergence_over_kept(
    batch: RecordsBatch, seg: np.ndarray, klp: np.ndarray, logits: np.ndarray, with_logits: np.ndarray, row: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(kl, tv, drift)`` per token over S_q: KL(sampler || trainer), TV, and max - min of (sampler lp - trainer lp),
    from the sampler's ``klp`` (float64 per kept entry) and the trainer's raw ``logits`` there (float32, over T),
    renormalised over S_q; 0, 0, NaN where ``with_logits`` is False (docs/records.md, section 5)."""
    T = batch.tokens
    kto = batch.kept_token_offsets
    assert kto is not None
    temps = np.array([_temperature(s) for s in batch.specs], dtype=np.float32)[batch.spec_index][row]
    vals = (logits / temps[seg]).astype(np.float64)
    counts = np.diff(kto)
    nonempty = np.flatnonzero(counts > 0)
    big = np.full(T, -np.inf)
    if nonempty.size:
        big[nonempty] = np.maximum.reduceat(vals, kto[nonempty])
    m = np.where(np.isfinite(big), big, 0.0)
    s = np.bincount(seg, weights=np.exp(vals - m[seg]), minlength=T)
    with np.errstate(divide="ignore"):
        lse = m + np.log(s)
    t_lp = vals - lse[seg]
    p = np.exp(klp)
    with np.errstate(invalid="ignore"):
        kl = np.bincount(seg, weights=np.where(p > 0, p * (klp - t_lp), 0.0), minlength=T)
    tv = 0.5 * np.bincount(seg, weights=np.abs(p - np.exp(t_lp)), minlength=T)
    e = klp - t_lp
    fin = np.isfinite(e)
    drift = np.full(T, np.nan)
    if nonempty.size:
        hi = np.maximum.reduceat(np.where(fin, e, -np.inf), kto[nonempty])
        lo = np.minimum.reduceat(np.where(fin, e, np.inf), kto[nonempty])
        anyf = np.bincount(seg[fin], minlength=T)[nonempty] > 0
        drift[nonempty] = np.where(anyf, hi - lo, 0.0)
    return np.where(with_logits, kl, 0.0), np.where(with_logits, tv, 0.0), np.where(with_logits, drift, np.nan)


def replay_over_kept(
    batch: RecordsBatch, seg: np.ndarray, match: np.ndarray, logits: np.ndarray, with_logits: np.ndarray, row: np.ndarray
) -> np.ndarray:
    """Replay from the trainer's raw logits at the kept entries, through the estimator itself
    (:func:`parity.core.estimators.replay`), per spec, on ``[tokens, K]`` blocks; -inf where the sampled token is
    not kept, NaN-free."""
    import torch

    from parity.core import estimators

    T = batch.tokens
    kto = batch.kept_token_offsets
    assert kto is not None
    counts = np.diff(kto)
    replay = np.full(T, -np.inf)
    y_col = np.full(T, -1, dtype=np.int64)
    ent = np.flatnonzero(match)
    y_col[seg[ent]] = ent - kto[seg[ent]]
    spec_of_tok = batch.spec_index[row]
    toks = np.flatnonzero(with_logits & (y_col >= 0))
    width = max(int(counts.max()) if counts.size else 1, 1)
    step = max(1, LOGIT_BUDGET // (width + 1))
    for j, spec in enumerate(batch.specs):
        sel = toks[spec_of_tok[toks] == j]
        for a in range(0, sel.size, step):
            part = sel[a : a + step]
            c = counts[part]
            dense = np.zeros((part.size, width), dtype=np.float32)
            col = np.full((part.size, width), -1, dtype=np.int64)
            r_idx = np.repeat(np.arange(part.size), c)
            k_idx = np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c)
            e_idx = k_idx + np.repeat(kto[part], c)
            dense[r_idx, k_idx] = logits[e_idx]
            col[r_idx, k_idx] = k_idx
            lp = estimators.replay(torch.from_numpy(dense), torch.from_numpy(y_col[part]), torch.from_numpy(col), spec).logprobs
            replay[part] = lp.double().numpy()
    return replay


@dataclass
class KeptValues:
    """Per position, what the kept set gives: its size and mass, whether it holds the sampled token, and
    (``with_logits``: where the trainer's kept logits are recorded) KL, TV, replay and the logit drift."""

    support_size: np.ndarray
    mass: np.ndarray
    contains: np.ndarray
    kl: np.ndarray
    tv: np.ndarray
    replay: np.ndarray
    with_logits: np.ndarray
    drift: np.ndarray


def kept_values(batch: RecordsBatch, row: np.ndarray, captured: np.ndarray) -> KeptValues:
    """Per kept entry only what every batch needs: the sampled token's membership and the kept mass."""
    T = batch.tokens
    false = np.zeros(T, dtype=bool)
    out = KeptValues(np.zeros(T, dtype=np.int64), np.ones(T, dtype=np.float64), false.copy(), np.zeros(T),
                     np.zeros(T), np.full(T, np.nan), false.copy(), np.full(T, np.nan))
    kto = batch.kept_token_offsets
    if batch.kept is None or not T:
        return out
    assert kto is not None and batch.kept_logprobs is not None  # set together with kept (RecordsBatch)
    out.support_size = np.diff(kto)
    nonempty = np.flatnonzero(out.support_size > 0)
    match = batch.kept.values == np.repeat(batch.completion.values, out.support_size)
    if nonempty.size:  # whether the sampled token is among the position's kept ids
        out.contains[nonempty] = np.logical_or.reduceat(match, kto[nonempty])
    out.mass = np.where(captured, kept_mass(batch.kept_logprobs, kto, out.support_size, nonempty), 1.0)
    if batch.trainer_kept_logits is not None:
        seg = segments(kto)
        logits, out.with_logits = entry_logits(batch, row)
        klp = batch.kept_logprobs.astype(np.float64)
        out.kl, out.tv, out.drift = divergence_over_kept(batch, seg, klp, logits, out.with_logits, row)
        out.replay = replay_over_kept(batch, seg, match, logits, out.with_logits, row)
    return out
