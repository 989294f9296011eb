"""The map step of the records analysis: one validated batch of records in, its mergeable
:class:`~parity.records.accumulators.Summary` out. No torch at import: records without ``--model`` are
summarised with numpy alone; the gates and report entries are computed from the merged summary by
:mod:`parity.records.verdict`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# No torch at import: records without --model are judged with numpy alone. torch is imported where a
# rule's one home computes on tensors (the top_p bracket, replay from kept logits).
from parity.core.error_model import (
    SUPPORT_MASS_TOL,
    UNIT_ROUNDOFF,
    unit_roundoff,
)
from parity.core.gates import Thresholds
from parity.core.spec import SAMPLING_EPS, SamplingSpec
from parity.core.violation import Position
from parity.records.accumulators import (
    INPUTS,
    ScenarioAcc,
    Summary,
)
from parity.records.arrays import RecordsBatch
from parity.records.steps import (
    COMPARISONS,
    StepAcc,
    grouped_headroom,
    grouped_streams,
)
from parity.records.streams import ViewMatch, _finite_pair
from parity.records.validate import validate_batch

# Trainer logits held at once when computing from kept logits (floats): bounds memory on big heads.
LOGIT_BUDGET = 1 << 26

@dataclass
class Options:
    model: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    n_listed: int = Thresholds().max_violations_listed
    batch_rows: int = 1024


# ==================================================================================================
# per-token columns of one batch
# ==================================================================================================


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
    systematic: np.ndarray  # per-token systematic bound (trainer_systematic, else the float32 storage term alone)
    s_lo: np.ndarray  # NaN where no sampler-side log S
    s_hi: np.ndarray
    s_source: list[str | None]  # per row
    logit_drift: np.ndarray  # NaN where unknown
    # Reference views for the trainer-under-test diagnosis, by bug set ("" = correct); NaN = unknown there.
    views: dict[frozenset[str], np.ndarray] = field(default_factory=dict)


def _segments(kto: np.ndarray) -> np.ndarray:
    """Token index of every kept entry, from token -> entry offsets."""
    return np.repeat(np.arange(kto.size - 1, dtype=np.int64), np.diff(kto))


# The float32 screen of a kept mass (exp and sum in float32) lies within (n + 8) * 2**-23 of the float64 sum
# relative to max(mass, 1) for n entries: a few ulps per exp, (n - 1) ulps for the sum, doubled.
_SCREEN_ULPS = 2.0**-23


def _kept_mass(klp: np.ndarray, kto: np.ndarray, counts: np.ndarray, nonempty: np.ndarray) -> np.ndarray:
    """Per position, the mass of its kept set: the sum of exp(kept log-prob), 0 for none.

    Exact (float64 exp, summed in entry order) where the mass may be judged off 1 (``|mass - 1| >
    SUPPORT_MASS_TOL``: the only way a mass enters a result); elsewhere a float32 screen, which
    proves ``|mass - 1| <= SUPPORT_MASS_TOL`` without the float64 pass over every entry.
    """
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


def _row_float(batch: RecordsBatch, name: str) -> tuple[np.ndarray, np.ndarray] | None:
    rag = batch.trainer.get(name)
    if rag is None:
        return None
    if bool(rag.valid.all()):  # every row has the column: its values are the token column
        return rag.values.astype(np.float64), np.ones(batch.tokens, dtype=bool)
    have = np.repeat(rag.valid, batch.completion.lengths)
    vals = np.zeros(batch.tokens, dtype=np.float64)
    vals[have] = rag.values.astype(np.float64)
    return vals, have


def _row_bool(batch: RecordsBatch, name: str) -> tuple[np.ndarray, np.ndarray]:
    T = batch.tokens
    rag = batch.trainer.get(name)
    if rag is None:
        return np.zeros(T, dtype=bool), np.zeros(T, dtype=bool)
    have = np.repeat(rag.valid, batch.completion.lengths)
    vals = np.zeros(T, dtype=bool)
    vals[have] = rag.values.astype(bool)
    return vals, have


def token_columns(batch: RecordsBatch, *, vocab_size: int | None = None) -> TokenColumns:
    """Sampler-side flags and the trainer's values read (or derived) from the records themselves.

    ``vocab_size`` (records metadata, or the re-scoring model) lets the top_p bracket be derived.
    Per kept entry, only what every batch needs is computed (the sampled token's membership, the
    kept mass); the smallest kept log-prob only where the top_p bracket may apply.
    """
    T = batch.tokens
    row = batch.row_of_token()
    lengths = batch.completion.lengths
    position = np.arange(T, dtype=np.int64) - np.repeat(batch.token_offsets[:-1], lengths)
    y = batch.completion.values.astype(np.int64)
    filtered_spec = np.array([s.effective().filtered for s in batch.specs], dtype=bool)
    filtered = filtered_spec[batch.spec_index][row] if T else np.zeros(0, dtype=bool)
    zeros = np.zeros(T, dtype=np.float64)
    false = np.zeros(T, dtype=bool)
    captured = batch.kept_rows()[row] if T else false.copy()
    incomplete = batch.kept_incomplete.copy() if batch.kept_incomplete is not None else false.copy()
    incomplete &= captured
    mass = np.ones(T, dtype=np.float64)
    contains = false.copy()
    support_size = np.zeros(T, dtype=np.int64)
    kl, tv = zeros.copy(), zeros.copy()
    have_kl = false.copy()
    replay_derived = np.full(T, np.nan)
    have_replay_derived = false.copy()
    logit_drift = np.full(T, np.nan)
    kto = batch.kept_token_offsets
    if batch.kept is not None and T:
        assert kto is not None and batch.kept_logprobs is not None  # set together with kept (RecordsBatch)
        support_size = np.diff(kto)
        nonempty = np.flatnonzero(support_size > 0)
        match = batch.kept.values == np.repeat(batch.completion.values, support_size)
        if nonempty.size:  # whether the sampled token is among the position's kept ids
            contains[nonempty] = np.logical_or.reduceat(match, kto[nonempty])
        mass = np.where(captured, _kept_mass(batch.kept_logprobs, kto, support_size, nonempty), 1.0)
        if batch.trainer_kept_logits is not None:
            seg = _segments(kto)
            p = np.exp(batch.kept_logprobs, dtype=np.float64)
            klp = batch.kept_logprobs.astype(np.float64)
            kl, tv, replay_derived, with_logits, logit_drift = _from_kept_logits(batch, seg, match, p, klp, row)
            have_kl = with_logits
            have_replay_derived = with_logits

    def min_kept_lp() -> np.ndarray:
        """The smallest finite kept processed log-prob per position (inf: none finite; NaN: no kept ids)."""
        out = np.full(T, np.nan)
        if batch.kept is not None and T:
            assert kto is not None and batch.kept_logprobs is not None
            nonempty = np.flatnonzero(support_size > 0)
            if nonempty.size:
                klp32 = batch.kept_logprobs  # the minimum of float32 values is exact in either width
                finite_lp = np.where(np.isfinite(klp32), klp32, np.float32(np.inf))
                out[nonempty] = np.minimum.reduceat(finite_lp, kto[nonempty])
        return out

    mass_ok = np.abs(mass - 1.0) <= SUPPORT_MASS_TOL
    sampled_outside = captured & ~contains & ~incomplete
    replay_support_ok = np.where(captured, ~incomplete & contains & mass_ok, True)
    have: dict[str, np.ndarray] = {"kept": captured | ~filtered}

    full = _row_float(batch, "trainer_full_logprobs")
    full_v, have_full = full if full is not None else (zeros.copy(), false.copy())
    have["full"] = have_full
    rep = _row_float(batch, "trainer_replay_logprobs")
    replay_v, have_rep = rep if rep is not None else (zeros.copy(), false.copy())
    # Derived replay: over S_q from the trainer's kept logits; unfiltered without a kept set: the full value.
    use_derived = ~have_rep & have_replay_derived
    replay_v = np.where(use_derived, replay_derived, replay_v)
    unfilt = ~captured & ~filtered
    use_full = ~have_rep & ~use_derived & unfilt & have_full
    replay_v = np.where(use_full, full_v, replay_v)
    have["replay"] = have_rep | use_derived | use_full
    rec = _row_float(batch, "trainer_recompute_logprobs")
    recompute_v, have["recompute"] = rec if rec is not None else (zeros.copy(), false.copy())
    ls = _row_float(batch, "trainer_log_s")
    log_s_v, have_ls = ls if ls is not None else (zeros.copy(), false.copy())
    # log S = 0 when nothing is filtered; from the kept logits, log S = full - replay (the trainer's mass on S_q).
    zero_ls = ~have_ls & unfilt
    derive_ls = ~have_ls & captured & have_full & use_derived
    log_s_v = np.where(zero_ls, 0.0, np.where(derive_ls, full_v - replay_v, log_s_v))
    have["log_s"] = have_ls | zero_ls | derive_ls
    user = _row_float(batch, "trainer_logprobs")
    user_v, have["user"] = user if user is not None else (zeros.copy(), false.copy())
    forced, have["forced"] = _row_bool(batch, "trainer_recompute_forced")
    rec_eq, have["recompute_support"] = _row_bool(batch, "trainer_recompute_support_equal")
    have["kl"] = have_kl | (unfilt & ~captured)
    bound = _row_float(batch, "trainer_bound")
    bound_v, have["bound"] = bound if bound is not None else (zeros.copy(), false.copy())
    bound_full = _row_float(batch, "trainer_bound_full")
    bound_full_v, have["bound_full"] = bound_full if bound_full is not None else (zeros.copy(), false.copy())
    # Without trainer_systematic only the last float32 operations are known to point one way (2 u32 |lp|);
    # a float32 kernel's normalisation offset needs the trainer's logits (parity run --records writes it).
    sys_col = _row_float(batch, "trainer_systematic")
    vllm = batch.sampler_logprobs.astype(np.float64)
    v_abs = np.abs(vllm)
    storage = 2.0 * UNIT_ROUNDOFF["float32"] * np.where(np.isfinite(v_abs), v_abs, 0.0)
    systematic_v = np.where(sys_col[1], sys_col[0], storage) if sys_col is not None else storage
    s_lo, s_hi, have["sampler_log_s"], s_source = _sampler_log_s(batch, row, filtered, captured, incomplete, min_kept_lp,
                                                                   vocab_size)
    tt = batch.trainer.get("trainer_token_ids")
    trainer_token = y.copy()
    if tt is not None:
        has_tt = np.repeat(tt.valid, lengths)
        trainer_token[has_tt] = tt.values.astype(np.int64)
    views: dict[frozenset[str], np.ndarray] = {frozenset(): vllm}  # read only, like every column here
    if bool((captured & have_full).any()):
        views[frozenset({"full_vocabulary"})] = np.where(captured & have_full, full_v, np.nan)
    return TokenColumns(
        n_rows=batch.n_rows,
        row=row,
        position=position,
        token=y,
        vllm=vllm,
        have=have,
        full=full_v,
        replay=replay_v,
        recompute=recompute_v,
        log_s=log_s_v,
        user=user_v,
        forced=forced,
        recompute_support_equal=rec_eq,
        captured=captured,
        incomplete=incomplete,
        sampled_outside=sampled_outside,
        replay_support_ok=replay_support_ok,
        support_size=support_size,
        mass=mass,
        kl=kl,
        tv=tv,
        bound=bound_v,
        bound_full=bound_full_v,
        systematic=systematic_v,
        s_lo=s_lo,
        s_hi=s_hi,
        s_source=s_source,
        logit_drift=logit_drift,
        trainer_token=trainer_token,
        views=views,
    )


def _sampler_log_s(
    batch: RecordsBatch, row: np.ndarray, filtered: np.ndarray, captured: np.ndarray, incomplete: np.ndarray,
    min_kept_lp: Callable[[], np.ndarray], vocab_size: int | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str | None]]:
    """``(lo, hi, have, source per row)``: the sampler-side log S, as :func:`parity.core.token_table.build_table` takes it.

    The records' interval where given; 0 where nothing is filtered; else the top_p bracket
    (:func:`parity.core.log_s.top_p_bracket`) from the smallest kept processed log-prob
    (``min_kept_lp()``, computed only here), when top_p is the only filter, the row's kept set is
    complete and the vocabulary size is known.
    """
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


def _from_kept_logits(
    batch: RecordsBatch, seg: np.ndarray, match: np.ndarray, p: np.ndarray, klp: np.ndarray, row: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """KL/TV over S_q, replay and the logit drift, from the trainer's raw logits at the kept ids.

    Mirrors :func:`parity.core.token_table.build_table`: the logits are scaled by the temperature in float32
    (``estimators.scale``), the trainer's distribution over S_q is ``vals - logsumexp(vals)`` in float64,
    KL(sampler || trainer) and TV are summed over S_q; replay is ``estimators.replay`` itself, on the
    gathered logits. A sampled token outside S_q has no logit here: its replay is -inf.
    """
    import torch

    from parity.core import estimators

    T = batch.tokens
    tk = batch.trainer_kept_logits
    assert tk is not None and batch.kept_token_offsets is not None and batch.kept is not None
    with_logits = np.repeat(tk.valid, batch.completion.lengths) & batch.kept_rows()[row]
    # Entries of rows that carry logits, in the same order as kept.values (rows without a kept set add none).
    entry_has = np.repeat(tk.valid[batch.kept.valid], batch.kept.lengths[batch.kept.valid])
    logits = np.zeros(seg.size, dtype=np.float32)
    logits[entry_has] = tk.values.astype(np.float32)
    temps = np.array([_temperature(s) for s in batch.specs], dtype=np.float32)[batch.spec_index][row]
    vals = (logits / temps[seg]).astype(np.float64)
    counts = np.diff(batch.kept_token_offsets)
    big = np.full(T, -np.inf)
    nonempty = np.flatnonzero(counts > 0)
    if nonempty.size:
        big[nonempty] = np.maximum.reduceat(vals, batch.kept_token_offsets[nonempty])
    m = np.where(np.isfinite(big), big, 0.0)
    s = np.bincount(seg, weights=np.exp(vals - m[seg]), minlength=T)
    with np.errstate(divide="ignore"):
        lse = m + np.log(s)
    t_lp = vals - lse[seg]
    kl = np.bincount(seg, weights=np.where(p > 0, p * (klp - t_lp), 0.0), minlength=T)
    tv = 0.5 * np.bincount(seg, weights=np.abs(p - np.exp(t_lp)), minlength=T)
    kl = np.where(with_logits, kl, 0.0)
    tv = np.where(with_logits, tv, 0.0)
    # Logit drift (parity.core.token_table._logit_drift): the spread over S_q of (sampler lp - trainer lp).
    e = klp - t_lp
    fin = np.isfinite(e)
    drift = np.full(T, np.nan)
    if nonempty.size:
        hi = np.maximum.reduceat(np.where(fin, e, -np.inf), batch.kept_token_offsets[nonempty])
        lo = np.minimum.reduceat(np.where(fin, e, np.inf), batch.kept_token_offsets[nonempty])
        anyf = np.bincount(seg[fin], minlength=T)[nonempty] > 0
        drift[nonempty] = np.where(anyf, hi - lo, 0.0)
    drift = np.where(with_logits, drift, np.nan)
    # Replay through the estimator itself, per spec, on [tokens, K] blocks of the kept logits.
    replay = np.full(T, -np.inf)
    y_col = np.full(T, -1, dtype=np.int64)
    ent = np.flatnonzero(match)
    y_col[seg[ent]] = ent - batch.kept_token_offsets[seg[ent]]
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
            starts = batch.kept_token_offsets[part]
            e_idx = np.arange(int(c.sum())) - np.repeat(np.cumsum(c) - c, c) + np.repeat(starts, c)
            k_idx = e_idx - np.repeat(starts, c)
            dense[r_idx, k_idx] = logits[e_idx]
            col[r_idx, k_idx] = k_idx
            lp = estimators.replay(torch.from_numpy(dense), torch.from_numpy(y_col[part]), torch.from_numpy(col), spec).logprobs
            replay[part] = lp.double().numpy()
    return kl, tv, replay, with_logits, drift




# ==================================================================================================
# the map step
# ==================================================================================================


def _row_groups(batch: RecordsBatch) -> list[tuple[str, tuple[str, tuple[float, int, float, float]], np.ndarray]]:
    """The batch's scenarios: ``(name, (label, spec values), rows)``, rows ascending, in the order of each
    scenario's first row. A row's label is its ``scenario``, else its spec's label."""
    n, n_specs = batch.n_rows, max(len(batch.specs), 1)
    names: dict[str, int] = {}
    code = np.zeros(n, dtype=np.int64)  # 0: no scenario name
    if any(batch.scenario):
        for i, name in enumerate(batch.scenario):
            if name:
                code[i] = names.setdefault(str(name), len(names) + 1)
    label_of: list[str] = ["", *names]  # code 0: no scenario name (the spec's label stands for it)
    pair = code * n_specs + batch.spec_index
    uniq, first, inverse = np.unique(pair, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    groups: dict[str, tuple[tuple[str, tuple[float, int, float, float]], list[np.ndarray]]] = {}
    for u in np.argsort(first, kind="stable"):
        c, j = divmod(int(uniq[u]), n_specs)
        spec = batch.specs[j]
        key = (label_of[c] if c else spec.label(), (spec.temperature, spec.top_k, spec.top_p, spec.min_p))
        groups.setdefault(_key_name(key), (key, []))[1].append(np.flatnonzero(inverse == u))
    return [(g, key, parts[0] if len(parts) == 1 else np.sort(np.concatenate(parts)))
            for g, (key, parts) in groups.items()]


def _key_name(key: tuple[str, tuple[float, int, float, float]]) -> str:
    return f"{key[0]}\x1f{json.dumps(key[1])}"


def summarize_batch(
    batch: Any,
    *,
    file_index: int = 0,
    options: Options | None = None,
    source: str = "batch",
    first_row: int = 0,
    dtypes: tuple[str, str] = ("float32", "float32"),
    vocab_size: int | None = None,
    columns: Callable[[RecordsBatch], TokenColumns] | None = None,
    stated_dtypes: tuple[str, str] | None = None,
) -> Summary:
    """The map step: one batch of records (a ``pyarrow.RecordBatch``/``Table`` or a validated
    :class:`~parity.records.arrays.RecordsBatch`) → its :class:`Summary`.

    Raw pyarrow batches are validated here (``source``/``first_row`` name them in errors), so the step
    runs as-is on Ray Data (``map_batches(..., batch_format="pyarrow")``) or Spark (``mapInArrow``).
    ``dtypes``: the sampler's and the trainer's dtype (the mean-bias limit uses the looser roundoff);
    ``columns``: how the per-token values are obtained (default :func:`token_columns`; re-scoring with
    a model passes its own, see :mod:`parity.analyze`); ``stated_dtypes``: the dtypes the records state
    ("" where they do not; default ``dtypes``), for the two-column mean-bias gate's stated facts.
    """
    opts = options or Options()
    rb = batch if isinstance(batch, RecordsBatch) else validate_batch(batch, source=source, first_row=first_row)
    out = Summary()
    out.rows = rb.n_rows
    out.tokens = rb.tokens
    out.columns = set(rb.columns)
    out.ignored_columns = set(rb.ignored_columns)
    out.casts = {f"{rb.source}\x1f{k}": note for k, note in rb.casts.items()}
    if rb.n_rows == 0:
        return out
    cols = columns(rb) if columns is not None else token_columns(rb, vocab_size=vocab_size)
    u = unit_roundoff(dtypes)
    for gname, (label, spec), rows in _row_groups(rb):
        acc = ScenarioAcc(
            name=label,
            spec=SamplingSpec(spec[0], int(spec[1]), spec[2], spec[3]).to_dict(),
            first_order=(file_index, rb.first_row + int(rows[0]), 0),
            n_listed=opts.n_listed,
            roundoff=u,
            vocab_size=int(vocab_size or 0),
            dtypes=list(stated_dtypes if stated_dtypes is not None else dtypes),
        )
        _accumulate(acc, rb, cols, rows.astype(np.int64, copy=False), file_index)
        out.groups[gname] = acc
    return out


def _same_inf_zero(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        d = np.abs(a - b)
    return np.where(np.isinf(a) & np.isinf(b) & (np.sign(a) == np.sign(b)), 0.0, d)


def _accumulate(acc: ScenarioAcc, rb: RecordsBatch, c: TokenColumns, rows: np.ndarray, file_index: int) -> None:
    if rows.size == rb.n_rows:  # the batch is one scenario
        g = np.ones(c.row.size, dtype=bool)
    else:
        in_rows = np.zeros(rb.n_rows, dtype=bool)
        in_rows[rows] = True
        g = in_rows[c.row] if c.row.size else np.zeros(0, dtype=bool)
    acc.sequences += int(rows.size)
    acc.tokens += int(g.sum())
    # Sequences lacking each input (a row lacks it when any of its tokens does): tokens are in row order,
    # so the rows are the runs of equal row numbers.
    for k in INPUTS:
        lack = c.row[g & ~c.have[k]]
        acc.lacking[k] += int(np.count_nonzero(lack[1:] != lack[:-1])) + 1 if lack.size else 0
    usable = g & ~c.incomplete  # incomplete positions are counted, never compared
    acc.compared += int(usable.sum())
    row_in_file = rb.first_row + c.row
    if rb.prompt_index is not None:
        prompt = np.where(rb.prompt_index >= 0, rb.prompt_index, rb.first_row + np.arange(rb.n_rows))
        note = ""
    else:
        prompt = rb.first_row + np.arange(rb.n_rows)
        note = f"{rb.source}: prompt = row"

    def order(idx: np.ndarray) -> Callable[[int], tuple[int, int, int]]:
        return lambda i: (file_index, int(row_in_file[idx[i]]), int(c.position[idx[i]]))

    def position(j: int, values: Mapping[str, np.ndarray] | None = None, gap: np.ndarray | None = None,
                 bound: np.ndarray | None = None, extra: str = "") -> Position:
        return Position(
            prompt=int(prompt[c.row[j]]), position=int(c.position[j]), token=int(c.trainer_token[j]),
            values={k: float(v[j]) for k, v in (values or {}).items()},
            gap=None if gap is None else float(gap[j]), bound=None if bound is None else float(bound[j]),
            note=extra or note,
        )

    def at(idx: np.ndarray, **kw: Any) -> Callable[[int], Position]:
        return lambda i: position(int(idx[i]), **kw)

    h = c.have
    full_minus = c.full - c.vllm
    diffs: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # per comparison: tokens and differences (the per-step view)
    heads: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # per comparison: tokens with a bound and their headroom
    for name, sel, a, b in (
        ("naive", usable & h["full"], c.full, c.vllm),
        ("gap", usable & h["full"] & h["log_s"], full_minus, c.log_s),
        ("replay", usable & h["replay"], c.replay, c.vllm),
        ("recompute", usable & h["recompute"], c.recompute, c.vllm),
        ("user", usable & h["user"], c.user, c.vllm),
        ("user_gap", usable & h["user"] & h["log_s"], c.user - c.vllm, c.log_s),
    ):
        idx = np.flatnonzero(sel)
        diffs[name] = (idx, _finite_pair(a[idx], b[idx]))
        acc.streams[name].add(diffs[name][1])

    # The two log-prob columns' mean-bias gate, and the sampled tokens outside the trainer's support.
    idx = np.flatnonzero(usable & h["user"])
    outside, other = acc.ratio.add(c.user[idx], c.vllm[idx], c.row[idx], acc.facts()["allowance"])
    bad = idx[outside | other]
    acc.first["trainer_support"].offer(np.ones(bad.size, dtype=bool), order(bad),
                                       at(bad, values={"vllm": c.vllm, "trainer_under_test": c.user}))

    # The gated comparisons against the per-token bound (evaluate_summary).
    bsel = usable & h["bound"]
    for name, est, side in (("replay", c.replay, "trainer_replay"), ("recompute", c.recompute, "trainer_recompute"),
                            ("user", c.user, "trainer_under_test")):
        idx = np.flatnonzero(bsel & h[name])
        with np.errstate(invalid="ignore"):
            d = est - c.vllm
        s = acc.bounds[name]
        key = s.add(d[idx], c.bound[idx], c.systematic[idx],
                    c.log_s[idx] if name == "user" and bool(h["log_s"][idx].all()) else None)
        heads[name] = (idx, key)
        s.worst.offer(key, order(idx), at(idx, values={"vllm": c.vllm, side: est}, gap=d,
                                          bound=c.bound * 1.0))
    nsel = usable & h["full"] & h["bound"] & h["bound_full"] & h["sampler_log_s"]
    idx = np.flatnonzero(nsel)
    if idx.size:
        v = full_minus[idx]
        gap = np.clip(c.s_lo[idx] - v, 0.0, None) + np.clip(v - c.s_hi[idx], 0.0, None)  # the distance outside [s_lo, s_hi]
        nb = c.bound_full[idx] + c.bound[idx]
        s = acc.bounds["naive"]
        key = s.add(gap, nb)
        gap_all = np.zeros(c.row.size)
        gap_all[idx] = gap
        nb_all = np.zeros(c.row.size)
        nb_all[idx] = nb
        s.worst.offer(key, order(idx), at(idx, values={"vllm": c.vllm, "trainer_full": c.full, "sampler_log_s_lo": c.s_lo,
                                                       "sampler_log_s_hi": c.s_hi}, gap=gap_all, bound=nb_all))
        acc.s_n += int(idx.size)
        acc.s_lo_sum += float(c.s_lo[idx].sum())
        acc.s_hi_sum += float(c.s_hi[idx].sum())
        acc.naive_gap_max = max(acc.naive_gap_max, float(gap.max()))
    acc.s_sources = sorted(set(acc.s_sources) | {c.s_source[i] or "none" for i in rows})
    if bsel.any():
        acc.bound_n += int(bsel.sum())
        acc.bound_sum += float(c.bound[bsel].sum())
        acc.bound_max = max(acc.bound_max, float(c.bound[bsel].max()))
    # The diagnosis of a trainer under test: which reference view it matches within the bound.
    usel = usable & h["user"] & h["bound"]
    if usel.any():
        for bugs, view in c.views.items():
            known = usel & ~np.isnan(view)
            d = _same_inf_zero(c.user[known], view[known])
            m = acc.views.setdefault("+".join(sorted(bugs)), ViewMatch())
            m.known += int(known.sum())
            m.over += int((~(d <= c.bound[known])).sum())
            with np.errstate(invalid="ignore"):
                diff = c.user[known] - view[known]
            m.diff_sum += float(np.where(np.isfinite(diff), diff, 0.0).sum())
    dsel = usable & c.captured & ~np.isnan(c.logit_drift) & h["replay"]
    if dsel.any():
        acc.drift_n += int(dsel.sum())
        acc.drift_sum += float(c.logit_drift[dsel].sum())
        acc.drift_max = max(acc.drift_max, float(c.logit_drift[dsel].max()))
        acc.drift_replay_max = max(acc.drift_replay_max, float(np.abs(c.replay[dsel] - c.vllm[dsel]).max()))

    ls_sel = usable & h["log_s"]
    if ls_sel.any():
        v = c.log_s[ls_sel]
        acc.log_s_n += int(v.size)
        acc.log_s_sum += float(v.sum())
        acc.log_s_min = min(acc.log_s_min, float(v.min()))
        acc.log_s_sum_exp += float(np.exp(v).sum())
    sup = usable & h["kept"]
    acc.replay_ok += int(c.replay_support_ok[sup].sum())
    acc.replay_n += int(sup.sum())
    idx = np.flatnonzero(sup)
    acc.first["replay_support"].offer(~c.replay_support_ok[idx], order(idx), at(idx))
    req = usable & h["recompute_support"]
    acc.recompute_eq += int(c.recompute_support_equal[req].sum())
    acc.recompute_n += int(req.sum())
    idx = np.flatnonzero(req)
    acc.first["recompute_support"].offer(~c.recompute_support_equal[idx], order(idx), at(idx))
    acc.forced += int(c.forced[usable & h["forced"]].sum())
    _accumulate_steps(acc, rb, c, rows, g, usable, diffs, heads)

    # IS ratios: per token, and per sequence over its compared tokens.
    def ratios(name: str, est: np.ndarray, inp: str, identity: bool = False) -> None:
        sel = usable & h[inp]
        d = est[sel] - c.vllm[sel]
        r = c.row[sel]
        n_r = np.bincount(r, minlength=rb.n_rows)
        seq = np.bincount(r, weights=d, minlength=rb.n_rows)
        keep = n_r > 0
        seq_ls = None
        if identity and bool((sel & ~h["log_s"]).sum() == 0):
            seq_ls = np.bincount(r, weights=c.log_s[sel], minlength=rb.n_rows)[keep]
        acc.ratios[name].add(d, seq[keep], seq_ls)

    ratios("naive", c.full, "full", identity=True)
    ratios("replay", c.replay, "replay")
    ratios("recompute", c.recompute, "recompute")
    ratios("user", c.user, "user")

    kls = usable & c.captured & h["kl"]
    if kls.any():
        acc.kl_n += int(kls.sum())
        acc.kl_sum += float(c.kl[kls].sum())
        acc.kl_max = max(acc.kl_max, float(c.kl[kls].max()))
        acc.tv_sum += float(c.tv[kls].sum())
        acc.tv_max = max(acc.tv_max, float(c.tv[kls].max()))

    gi = np.flatnonzero(g)
    acc.incomplete += int(c.incomplete[g].sum())
    acc.first["incomplete"].offer(c.incomplete[gi], order(gi), at(gi))
    acc.sampled_outside += int(c.sampled_outside[g].sum())
    acc.first["sampled_outside"].offer(c.sampled_outside[gi], order(gi), at(gi))
    mism = c.trainer_token != c.token
    acc.token_mismatch += int(mism[g].sum())
    for j in gi[mism[gi]][: acc.n_listed]:
        acc.first["token_mismatch"].items.append(((file_index, int(row_in_file[j]), int(c.position[j])),
                                                  position(int(j), extra=f"sampled {int(c.token[j])}")))
    acc.first["token_mismatch"].merge(type(acc.first["token_mismatch"])(acc.n_listed))
    cap = g & c.captured
    acc.captured += int(cap.sum())
    if cap.any():
        acc.support_sum += int(c.support_size[cap].sum())
        acc.support_max = max(acc.support_max, int(c.support_size[cap].max()))
    off = cap & ~c.incomplete & (np.abs(c.mass - 1.0) > SUPPORT_MASS_TOL)
    if off.any():
        acc.mass_off += int(off.sum())
        worst = c.mass[off][int(np.argmax(np.abs(c.mass[off] - 1.0)))]
        if abs(worst - 1.0) > abs(acc.mass_off_worst - 1.0):
            acc.mass_off_worst = float(worst)


def _accumulate_steps(
    acc: ScenarioAcc, rb: RecordsBatch, c: TokenColumns, rows: np.ndarray, g: np.ndarray, usable: np.ndarray,
    diffs: Mapping[str, tuple[np.ndarray, np.ndarray]], heads: Mapping[str, tuple[np.ndarray, np.ndarray]],
) -> None:
    """The training-log view of one scenario's rows: per step (``rb.step``), the comparisons' sums and
    headroom over the same tokens as the scenario's streams, and the support counts."""
    step_of_row = rb.step if rb.step is not None else np.full(rb.n_rows, -1, dtype=np.int64)
    stepped = rows[step_of_row[rows] >= 0]  # a null step reads as -1; a negative step is no step
    acc.unstepped += int(rows.size - stepped.size)
    if not stepped.size:
        return
    steps, row_slot = np.unique(step_of_row[stepped], return_inverse=True)
    ns = int(steps.size)
    slot_of_row = np.full(rb.n_rows, -1, dtype=np.int64)
    slot_of_row[stepped] = row_slot.reshape(-1)
    tok_slot = slot_of_row[c.row] if c.row.size else np.zeros(0, dtype=np.int64)

    def slots(idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        sl = tok_slot[idx]
        keep = sl >= 0
        return sl[keep], keep

    seqs = np.bincount(row_slot.reshape(-1), minlength=ns)
    toks = np.bincount(tok_slot[g & (tok_slot >= 0)], minlength=ns)
    parts = [StepAcc(sequences=int(seqs[i]), tokens=int(toks[i])) for i in range(ns)]
    for name in COMPARISONS:
        idx, d = diffs[name]
        sl, keep = slots(idx)
        for i, s in enumerate(grouped_streams(sl, ns, d[keep])):
            parts[i].streams[name] = s
        hidx, key = heads[name]
        sl, keep = slots(hidx)
        count, top = grouped_headroom(sl, ns, key[keep])
        for i in range(ns):
            parts[i].streams[name].head_n, parts[i].streams[name].headroom = int(count[i]), float(top[i])
    for sel, flag, ok_field, n_field in ((usable & c.have["kept"], c.replay_support_ok, "replay_ok", "replay_n"),
                                         (usable & c.have["recompute_support"], c.recompute_support_equal,
                                          "recompute_eq", "recompute_n")):
        idx = np.flatnonzero(sel)
        sl, keep = slots(idx)
        ok = np.bincount(sl, weights=flag[idx][keep].astype(np.float64), minlength=ns)
        n = np.bincount(sl, minlength=ns)
        for i in range(ns):
            setattr(parts[i], ok_field, int(round(ok[i])))
            setattr(parts[i], n_field, int(n[i]))
    for i, step in enumerate(steps):
        acc.steps.setdefault(int(step), StepAcc()).merge(parts[i])

