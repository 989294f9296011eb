"""Vocabulary-parallel trainer estimators over ``torch.distributed`` (Megatron-style sharded lm_head).

Each rank of a process group holds one contiguous vocabulary shard ``[N, V_r]`` of the float32
logits (rank r owns global ids ``[offset_r, offset_r + V_r)``; uneven splits allowed, every shard
non-empty). No rank ever holds, or is sent, a whole row except in the counted exact fallback of
``recompute`` described below. Every replicated output (log-probs, flags) is the same on all ranks;
the recompute kept mask stays sharded ``[N, V_r]``.

What each estimator communicates (``Comm`` counts it; see ``bytes_per_token`` in the driver):

* ``full``: all-reduce MAX of the shard maxima ``[N]``, then one all-reduce SUM ``[N, 2]`` float64
  (shifted sum-exp partials and ``z'_y - M`` from the rank that owns y).
* ``replay``: one all-reduce SUM of ``[N, K + 1]`` float32: each rank writes the logits of the kept ids
  it owns (and y) and zeros elsewhere, so the sum *is* the gathered value, bit for bit. O(K), never V.
* ``predicted_log_s``: the replay gather plus the two small ``full`` collectives.
* ``recompute``: the reference kept set of :func:`parity.core.filters.reference_filter`, built from shards:
  min_p from the global max (all-reduce MAX); top_k from per-rank top-k candidates (all-gather of
  ``[N, k]`` values; the k-th value is global, and every rank then keeps *its own* tokens tied with it,
  so ties straddling shard boundaries are kept wherever they live); top_p over the global candidate set
  (all-gather of the survivors in descending (value, id) order, widened until the nucleus boundary is
  provably inside what was gathered); then force-include the sampled token on its owner and
  renormalise (all-reduce MAX + SUM).

Exactness, decision by decision (the reference is float32; the shards cannot reproduce its reduction
order, so every *rounding-sensitive* decision is made in exact-enough float64 with a certified margin):

* temperature, top_k, ties at the k-th value: exact (pure comparisons of the same float32 values).
* min_p: the reference drops ``p_i < p_max * min_p`` in float32. Here ``z'_i - M < log(min_p)`` in
  float64; it equals the reference unless ``|z'_i - M - log(min_p)| <= (|log min_p| + 16) * 2^-20``
  (16x the float32 error of subtraction, exp, two products; min_p < 1e-30 is always ambiguous).
* top_p: the reference drops ascending-sorted positions with ``cumsum(softmax) <= 1 - p``. Here the
  exact cumulative mass ``C_j`` is compared with the same float32 ``1 - p``; the decision is certain
  unless ``|C_j - (1 - p)| <= max(C_j, 1-p) * u * (2c + 16) + 2u * min(max(C_j, 1-p) * D, 0.37c) +
  c * 2^-50 + 2^-40`` (u = 2^-24, c survivors, D their value span: float32 sum/exp/argument rounding of
  the reference softmax). Rows whose p is 1 in a batch where another row sets top_p still drop tokens
  whose float32 probability underflows to 0: certain outside ``log q in [-120, -80]``
  (:data:`parity.core.tolerances.UNDERFLOW_BAND`, the same band the single-device recompute uses).
* **Tie order at the top_p boundary is not reproducible from shards.** When the nucleus cut falls
  inside a group of equal values, *which* tied tokens the reference drops is decided by
  ``torch.sort`` (not stable on CPU for rows longer than 16, measured in the tests), and a comparison
  sort's permutation of equal keys depends on the order pattern of the *entire* row, including tokens
  no shard would ever send. Resolution (``tie_policy``): ``"gather"`` (default) detects such rows
  (``tie_split``) and recomputes them exactly from the full row (below); ``"index"`` keeps the
  stable-sort answer (lower ids dropped first) with no O(V) traffic, flags the row, and may differ
  from the reference there.
* Exact fallback: rows with an ambiguous decision (or a split tie under ``"gather"``) all-gather their
  full rows and run :func:`parity.core.filters.reference_filter` itself on them (with a context row that
  keeps the batch-level path choice). This is the only O(V) traffic; it is counted in the bytes and the
  rows are reported in ``fallback``. With top_k set (c <= k + ties) generic logits almost never need
  it. With top_p alone over a large vocabulary they often do: the certified band grows with the
  survivor count c (worst-case float32 summation error (c - 1)u of the *reference's* softmax sum, whose
  order no shard can reproduce) and exceeds the mass of the tail tokens near the cut (22 of 32 rows at
  V = 32000 in the benchmark). ``band_policy="flag"`` keeps the exact-arithmetic decision instead (no
  O(V) traffic), flags the row ``ambiguous``, and may then differ from the float32 reference there.

Log-prob tolerance against the unsharded estimators (proved in ``logprob_bounds``):

* ``replay``: bit-identical. The K gathered values are the same float32 numbers and the single-device
  :func:`parity.core.estimators.replay` is run on them.
* ``recompute`` and ``predicted_log_s``: ``2u|x| + c * 2^-50``. The float32 shift by the (exactly
  reproduced) max mirrors the reference, so the only difference is the order of a float64 sum of
  identical terms (relative error < c * 2^-52), plus at most one float32 rounding step of the result.
  This mirrors the single-device arithmetic of ``estimators._log_renormalised`` / ``predicted_log_s``
  (float32 shift, float64 sum and log); if that arithmetic changes, the parity tests fail and say so.
  On rows without top_k the single-device recompute takes the kept mass of :mod:`parity.core.nucleus`
  (float32 exp; float64 histogram sums or float32 sums of 8 terms): ``nucleus.LOG_MASS_REL_ERROR`` is added there.
* ``full``: ``u (2c + 2|z'_y - M| + 3|x| + 16)``: the reference is float32 ``log_softmax``, whose own
  float32 sum over c terms may be off by (c - 1)u in the worst case in *any* order; the sharded value is
  float64-accurate. Observed differences are a few float32 ulps (see the benchmark's ``max_abs_diff``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from parity.core import estimators as _est
from parity.core import nucleus as _nucleus
from parity.core.filters import apply_temperature, check_logits, reference_filter
from parity.core.metrics import abs_difference
from parity.core.spec import SamplingSpec, per_row
from parity.core.tolerances import U32 as U
from parity.core.tolerances import top_p_band, underflow_decision

NEG_INF = float("-inf")
ESTIMATORS = ("full", "replay", "recompute", "predicted_log_s")
TIE_POLICIES = ("gather", "index")
BAND_POLICIES = ("gather", "flag")


# ---------------------------------------------------------------------------------------------
# Shards and faults
# ---------------------------------------------------------------------------------------------


def split_vocab(vocab: int, shards: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Shard sizes: ``sizes`` validated, or an even split with the remainder on the first ranks."""
    if shards < 1:
        raise ValueError(f"shards={shards}: allowed >= 1")
    if sizes is None:
        if vocab < shards:
            raise ValueError(f"vocabulary of {vocab} cannot be split into {shards} non-empty shards")
        base, rem = divmod(vocab, shards)
        return [base + (1 if r < rem else 0) for r in range(shards)]
    sizes = [int(s) for s in sizes]
    if len(sizes) != shards or any(s < 1 for s in sizes) or sum(sizes) != vocab:
        raise ValueError(
            f"split {sizes} is invalid: allowed {shards} positive sizes summing to the vocabulary ({vocab})"
        )
    return sizes


@dataclass(frozen=True)
class VocabShard:
    """Which contiguous slice of the vocabulary this rank holds."""

    rank: int
    sizes: tuple[int, ...]

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def offset(self) -> int:
        return sum(self.sizes[: self.rank])

    @property
    def size(self) -> int:
        return self.sizes[self.rank]

    @property
    def vocab(self) -> int:
        return sum(self.sizes)

    def owns(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mask of global ids in this shard, local index clamped into range)."""
        ids = ids.long()
        mine = (ids >= self.offset) & (ids < self.offset + self.size)
        return mine, (ids - self.offset).clamp(0, self.size - 1)


@dataclass(frozen=True)
class ParallelFaults:
    """Deliberate bugs, only for planted-fault tests (each must make a parity check fail)."""

    lse_without_max_shift: bool = False  # sum exp(z) per shard in float32 with no max shift
    drop_kth_ties_rank: int = -1  # this rank drops its tokens tied with the global k-th value
    die_rank: int = -1  # this rank exits abruptly when a job arrives


# ---------------------------------------------------------------------------------------------
# Collectives with byte accounting
# ---------------------------------------------------------------------------------------------


class Comm:
    """``torch.distributed`` collectives that record bytes per section.

    ``payload``: bytes of the tensor this rank contributes. ``wire``: bytes this rank sends under the
    ring algorithms (all-reduce ``2 (R-1)/R * B``, all-gather ``(R-1) * B``); 0 with one rank. Without
    an initialised process group, a one-rank identity.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group
        if dist.is_available() and dist.is_initialized():
            self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        else:
            self.world, self.rank = 1, 0
        self.log: dict[str, dict[str, float]] = {}
        self._section = "other"

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        prev, self._section = self._section, name
        try:
            yield
        finally:
            self._section = prev

    def _record(self, kind: str, t: torch.Tensor) -> None:
        b = t.numel() * t.element_size()
        w = self.world
        wire = 0.0 if w == 1 else (2.0 * (w - 1) / w * b if kind == "all_reduce" else float((w - 1) * b))
        entry = self.log.setdefault(self._section, {"payload": 0.0, "wire": 0.0, "collectives": 0})
        entry["payload"] += b
        entry["wire"] += wire
        entry["collectives"] += 1

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        t = t.contiguous().clone()
        self._record("all_reduce", t)
        if self.world > 1:
            dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op], group=self.group)
        return t

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[world, *t.shape]``; every rank must pass the same shape."""
        t = t.contiguous()
        self._record("all_gather", t)
        if self.world == 1:
            return t.unsqueeze(0).clone()
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        return torch.stack(out)



def _check_sampled(sampled: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    if sampled.dim() != 1 or sampled.shape[0] != n:
        raise ValueError(f"sampled has shape {tuple(sampled.shape)}: allowed a 1-D tensor of {n} token ids")
    if sampled.numel() and (int(sampled.min()) < 0 or int(sampled.max()) >= vocab):
        raise ValueError(f"sampled ids must lie in [0, {vocab})")
    return sampled.long()


def _check_shard(logits: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    if logits.dim() != 2 or logits.shape[1] != shard.size:
        raise ValueError(
            f"shard logits have shape {tuple(logits.shape)}: allowed [N, {shard.size}] on rank {shard.rank}"
        )
    z = logits.to(torch.float32)
    if torch.isnan(z).any() or torch.isposinf(z).any():
        raise ValueError(
            f"shard logits on rank {shard.rank} contain NaN or +inf: allowed finite values or -inf"
        )
    return z


def _global_max(vals: torch.Tensor, comm: Comm) -> torch.Tensor:
    """Row max over all shards (float32, exact); rows with no finite value anywhere → 0 (as _row_max)."""
    m = comm.all_reduce(vals.amax(dim=-1), "max")
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _take(z: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return z.gather(1, idx.unsqueeze(1)).squeeze(1)


def _renormalised(
    scaled: torch.Tensor,
    support: torch.Tensor,
    shard: VocabShard,
    y: torch.Tensor,
    comm: Comm,
    faults: ParallelFaults,
    extra: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``z'_y - logsumexp(z' over support)`` with the support sharded; mirrors
    ``estimators._log_renormalised``: shift by the (global, exact) support max in float32, sum and log
    in float64. ``extra`` ``[N]`` float64 is summed over ranks in the same all-reduce."""
    own, loc = shard.owns(y)
    vals = scaled.masked_fill(~support, NEG_INF)
    cols = [] if extra is None else [extra.double()]
    if faults.lse_without_max_shift:  # planted fault: no shift, float32 partial sums
        zy = torch.where(own, _take(scaled, loc), torch.zeros_like(y, dtype=torch.float32))
        part = torch.stack([torch.exp(vals).sum(dim=-1), zy, *[c.float() for c in cols]], dim=-1)
        agg = comm.all_reduce(part, "sum")
        lp = agg[:, 1] - torch.log(agg[:, 0])
        return lp.to(torch.float32), (agg[:, 2].double() if extra is not None else None)
    m = _global_max(vals, comm)
    zy = torch.where(
        own, _take(scaled, loc) - m, torch.zeros_like(m)
    )  # float32 subtraction, as the reference
    s = torch.exp((vals - m.unsqueeze(1)).double()).sum(dim=-1)
    agg = comm.all_reduce(torch.stack([s, zy.double(), *cols], dim=-1), "sum")
    lp = (agg[:, 1] - torch.log(agg[:, 0])).to(torch.float32)
    return lp, (agg[:, 2] if extra is not None else None)


# ---------------------------------------------------------------------------------------------
# full, replay, predicted log S
# ---------------------------------------------------------------------------------------------


def _scaled(logits: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec], shard: VocabShard) -> torch.Tensor:
    """This rank's logits, checked against its shard, divided by each row's temperature."""
    z = _check_shard(logits, shard)
    return apply_temperature(z, per_row(specs, z.shape[0]))


def sharded_full(
    logits: torch.Tensor, sampled: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec],
    shard: VocabShard, comm: Comm, faults: ParallelFaults | None = None,
) -> torch.Tensor:
    """``log_softmax(z / T)[y]`` from shards: max all-reduce, then one ``[N, 2]`` float64 sum."""
    scaled = _scaled(logits, specs, shard)
    support = torch.ones_like(scaled, dtype=torch.bool)
    lp, _ = _renormalised(scaled, support, shard, sampled.long(), comm, faults or ParallelFaults())
    return lp


def _gather_kept_values(
    scaled: torch.Tensor, ids: torch.Tensor, shard: VocabShard, comm: Comm
) -> torch.Tensor:
    """The logits at global ``ids`` ``[N, W]`` (-1 = padding → 0): owners write, others write 0, one sum."""
    mine, loc = shard.owns(ids)
    vals = torch.where(mine, scaled.gather(1, loc), torch.zeros((), dtype=scaled.dtype))
    return comm.all_reduce(vals, "sum")  # x + 0 + ... + 0 == x exactly: the gathered values are bitwise


def _check_kept_ids(kept_ids: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    if kept_ids.dim() != 2 or kept_ids.shape[0] != n:
        raise ValueError(f"kept ids have shape {tuple(kept_ids.shape)}: allowed [{n}, K] (-1 = padding)")
    if kept_ids.numel() and (int(kept_ids.max()) >= vocab or int(kept_ids.min()) < -1):
        raise ValueError(f"kept ids must lie in [0, {vocab}) or be -1 padding")
    return kept_ids.long()


def _scaled_kept(
    logits: torch.Tensor, kept_ids: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec], shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_scaled`, and the kept ids ``[N, K]`` checked against the logits' rows and the vocabulary."""
    z = _check_shard(logits, shard)
    ids = _check_kept_ids(kept_ids, z.shape[0], shard.vocab)
    return apply_temperature(z, per_row(specs, z.shape[0])), ids


@dataclass
class ShardedReplay:
    logprobs: torch.Tensor  # [N]
    outside: torch.Tensor  # bool [N]: y not in S_q


def sharded_replay(
    logits: torch.Tensor, sampled: torch.Tensor, kept_ids: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec],
    shard: VocabShard, comm: Comm, faults: ParallelFaults | None = None,
) -> ShardedReplay:
    """``z'_y - logsumexp(z'_{S_q})`` with one all-reduce of ``[N, K + 1]`` values.

    The gathered K + 1 values are the same float32 numbers the unsharded replay reads, so the
    single-device :func:`parity.core.estimators.replay` run on them is bit-identical to it.
    """
    scaled, ids = _scaled_kept(logits, kept_ids, specs, shard)
    n = scaled.shape[0]
    y = sampled.long()
    k = ids.shape[1]
    got = _gather_kept_values(scaled, torch.cat([ids, y.unsqueeze(1)], dim=1), shard, comm)
    kv = got[:, :k].masked_fill(ids < 0, NEG_INF)
    # [kept values | z'_y | 0]: the trailing 0 only keeps check_logits happy when a row has no finite
    # kept value and z'_y = -inf; replay reads the K kept columns and column K, nothing else.
    mini = torch.cat([kv, got[:, k:], torch.zeros_like(got[:, :1])], dim=1).contiguous()
    local = torch.where(ids >= 0, torch.arange(k, device=ids.device).expand_as(ids), torch.full_like(ids, -1))
    ref = _est.replay(
        mini, torch.full((n,), k, dtype=torch.long, device=ids.device), local, SamplingSpec(1.0)
    )
    return ShardedReplay(ref.logprobs, ~(ids == y.unsqueeze(1)).any(dim=-1))


def sharded_predicted_log_s(
    logits: torch.Tensor, kept_ids: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec],
    shard: VocabShard, comm: Comm, faults: ParallelFaults | None = None,
) -> torch.Tensor:
    """``logsumexp(z'_{S_q}) - logsumexp(z')``, both shifted by the global row max as the reference."""
    faults = faults or ParallelFaults()
    scaled, ids = _scaled_kept(logits, kept_ids, specs, shard)
    kv = _gather_kept_values(scaled, ids, shard, comm).masked_fill(ids < 0, NEG_INF)
    if faults.lse_without_max_shift:  # planted fault
        tot = comm.all_reduce(torch.exp(scaled).sum(dim=-1), "sum")
        return (torch.log(torch.exp(kv).sum(dim=-1)) - torch.log(tot)).to(torch.float32)
    m = _global_max(scaled, comm).unsqueeze(1)
    part = torch.exp((scaled - m).double()).sum(dim=-1)
    tot = comm.all_reduce(part, "sum")
    kept_lse = torch.log(torch.exp((kv - m).double()).sum(dim=-1))
    return (kept_lse - torch.log(tot)).to(torch.float32)


# ---------------------------------------------------------------------------------------------
# recompute
# ---------------------------------------------------------------------------------------------


@dataclass
class ShardedRecompute:
    logprobs: torch.Tensor  # [N]: z'_y - logsumexp over S_p ∪ {y}
    kept: torch.Tensor  # bool [N, V_r]: this rank's slice of S_p (before force-include)
    forced: torch.Tensor  # bool [N]: y was outside S_p
    fallback: torch.Tensor  # bool [N]: row recomputed from its gathered full row (O(V) bytes)
    ambiguous: torch.Tensor  # bool [N]: a min_p / top_p / underflow decision fell inside its rounding band
    tie_split: torch.Tensor  # bool [N]: the top_p cut fell inside a group of equal values


def _lex_max(v: torch.Tensor, i: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Max of (value, id) pairs along ``dim`` (id -1 = absent)."""
    v = torch.where(i >= 0, v, torch.full_like(v, NEG_INF))
    best_v = v.amax(dim=dim, keepdim=True)
    best_i = torch.where((v == best_v) & (i >= 0), i, torch.full_like(i, -1)).amax(dim=dim, keepdim=True)
    return best_v.squeeze(dim), best_i.squeeze(dim)


def _top_p_cut(
    vals: torch.Tensor,
    shard: VocabShard,
    thr: torch.Tensor,
    lse: torch.Tensor,
    count: torch.Tensor,
    span: torch.Tensor,
    max_count: int,
    start: int,
    comm: Comm,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For rows with ``1 - p > 0``: the smallest kept (value, id) of the nucleus, plus flags.

    ``vals`` ``[n, V_r]`` holds the top_k/min_p survivors (-inf elsewhere). Each round every rank sends
    its ``m`` largest survivors in (value, id) order and its largest unsent one; everything above the
    largest unsent anywhere (``G``) is then known on every rank. If the mass outside ``G`` is certainly
    below ``1 - p`` the cut lies in ``G``; otherwise ``m`` grows 4x (at worst until all are sent).
    Returns (cut value f64, cut id, ambiguous, tie_split), each ``[n]``.
    """
    n, vr = vals.shape
    dev = vals.device
    # Local order: descending (value, id). A stable descending sort of the flipped row puts equal
    # values in descending id order.
    sv, si = torch.sort(vals.flip(-1), dim=-1, descending=True, stable=True)
    sid = shard.offset + (vr - 1 - si)
    sid = torch.where(sv > NEG_INF, sid, torch.full_like(sid, -1))
    cut_v = torch.full((n,), NEG_INF, dtype=torch.float64, device=dev)
    cut_i = torch.full((n,), -1, dtype=torch.long, device=dev)
    amb = torch.zeros(n, dtype=torch.bool, device=dev)
    tie = torch.zeros(n, dtype=torch.bool, device=dev)
    active = torch.arange(n, device=dev)
    m = max(1, min(max_count, start))
    while active.numel():
        pad = max(0, m + 1 - vr)
        av = torch.nn.functional.pad(sv[active], (0, pad), value=NEG_INF)[:, : m + 1]
        ai = torch.nn.functional.pad(sid[active], (0, pad), value=-1)[:, : m + 1]
        packed = torch.stack([av.contiguous().view(torch.int32), ai.to(torch.int32)], dim=-1)
        g = comm.all_gather(packed)  # [R, a, m + 1, 2] int32: 8 bytes per candidate
        gv = g[..., 0].contiguous().view(torch.float32).double().permute(1, 0, 2)  # [a, R, m + 1]
        gi = g[..., 1].long().permute(1, 0, 2)
        uv, ui = _lex_max(gv[:, :, m], gi[:, :, m], dim=1)  # largest unsent over ranks
        unsent = ui >= 0
        v = gv[:, :, :m].reshape(len(active), -1)
        i = gi[:, :, :m].reshape(len(active), -1)
        above = (v > uv.unsqueeze(1)) | ((v == uv.unsqueeze(1)) & (i > ui.unsqueeze(1)))
        in_g = (i >= 0) & (~unsent.unsqueeze(1) | above)
        v = torch.where(in_g, v, torch.full_like(v, NEG_INF))
        i = torch.where(in_g, i, torch.full_like(i, -1))
        o = torch.sort(i, dim=-1, stable=True).indices  # ascending (value, id): id first, then value
        v, i = v.gather(1, o), i.gather(1, o)
        o = torch.sort(v, dim=-1, stable=True).indices
        v, i = v.gather(1, o), i.gather(1, o)
        a_thr, a_lse, a_c, a_span = thr[active], lse[active], count[active], span[active]
        q = torch.exp(v - a_lse.unsqueeze(1))
        after = q.flip(-1).cumsum(-1).flip(-1) - q  # mass strictly after each position
        cum = 1.0 - after  # exact-math cumsum of the reference at this position
        known = i >= 0
        drop = known & (cum <= a_thr.unsqueeze(1))
        drop[:, -1] = False  # the largest token is always kept
        keep = known & ~drop
        first = keep.to(torch.int8).argmax(dim=-1)
        band = top_p_band(torch.maximum(cum, a_thr.unsqueeze(1)), a_c.unsqueeze(1), a_span.unsqueeze(1))
        near = known & ((cum - a_thr.unsqueeze(1)).abs() <= band)
        near[:, -1] = False
        outside_mass = 1.0 - q.sum(dim=-1)
        complete = ~unsent | (outside_mass <= a_thr - top_p_band(a_thr, a_c, a_span))
        # Every rank decided from identical gathered data; the MAX makes the loop provably agree.
        complete = comm.all_reduce((~complete).to(torch.int32), "max") == 0
        pidx = (first - 1).clamp(min=0)
        has_prev_g = (first > 0) & _take(known.to(torch.int8), pidx).bool()
        prev_v = torch.where(
            has_prev_g, _take(v, pidx), torch.where(unsent, uv, torch.full_like(uv, NEG_INF))
        )
        fv = _take(v, first)
        split = (has_prev_g | unsent) & (prev_v == fv)
        done = active[complete]
        cut_v[done] = fv[complete]
        cut_i[done] = _take(i, first)[complete]
        amb[done] = near.any(dim=-1)[complete]
        tie[done] = split[complete]
        active = active[~complete]
        if m >= max_count:  # everything was sent: complete by construction
            if active.numel():
                raise RuntimeError("top_p candidate search did not converge with every survivor gathered")
            break
        m = min(max_count, 4 * m)
    return cut_v, cut_i, amb, tie


def _fallback_kept(
    raw: torch.Tensor,
    row_specs: list[SamplingSpec],
    shard: VocabShard,
    comm: Comm,
    any_p: bool,
) -> torch.Tensor:
    """Exact: gather the full rows ``[n, V]`` and run the reference filter on them; return our slice.

    A context row keeps the batch-level path choice of the whole batch (sort path iff some row of the
    batch sets top_p; never the all-greedy path, since the batch that needed this was not all greedy).
    """
    width = max(shard.sizes)
    padded = torch.nn.functional.pad(raw, (0, width - raw.shape[1]))
    g = comm.all_gather(padded)
    rows = torch.cat([g[r, :, : shard.sizes[r]] for r in range(shard.world)], dim=1)
    ctx = SamplingSpec(temperature=1.0, top_p=0.5) if any_p else SamplingSpec(temperature=1.0)
    full_rows = torch.cat([rows, torch.zeros(1, rows.shape[1], dtype=rows.dtype, device=rows.device)])
    res = reference_filter(full_rows, [*row_specs, ctx])
    return res.kept[:-1, shard.offset : shard.offset + shard.size]


def sharded_kept(
    logits: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec], shard: VocabShard, comm: Comm, *,
    tie_policy: str = "gather", band_policy: str = "gather", faults: ParallelFaults | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's slice of ``reference_filter(logits, specs).kept``.

    Returns (kept ``[N, V_r]``, scaled ``[N, V_r]``, fallback, ambiguous, tie_split ``[N]``).
    """
    if tie_policy not in TIE_POLICIES or band_policy not in BAND_POLICIES:
        raise ValueError(
            f"tie_policy={tie_policy!r}, band_policy={band_policy!r}: allowed {TIE_POLICIES}, {BAND_POLICIES}"
        )
    faults = faults or ParallelFaults()
    raw = _check_shard(logits, shard)
    n, vr = raw.shape
    dev = raw.device
    vocab = shard.vocab
    row_specs = per_row(specs, n)
    none = torch.zeros(n, dtype=torch.bool, device=dev)
    if all(s.greedy for s in row_specs):  # Sampler.sample's all-greedy batch: log_softmax(z), no filters
        return torch.isfinite(raw), raw, none, none.clone(), none.clone()
    scaled = apply_temperature(raw, row_specs)
    ok = torch.isfinite(scaled)  # the reference keeps ``work > -inf``
    amb = none.clone()
    tie = none.clone()
    near = torch.zeros_like(ok)

    # min_p (MinPLogitsProcessor): p_i < p_max * min_p  <=>  z'_i - M < log(min_p), decided in float64.
    if any(s.uses_min_p for s in row_specs):
        mp = torch.tensor(
            [s.min_p if s.uses_min_p else 0.0 for s in row_specs], dtype=torch.float32, device=dev
        )
        use = mp > 0
        m = comm.all_reduce(scaled.amax(dim=-1), "max").double()
        log_mp = torch.log(mp.double()).unsqueeze(1)
        d = scaled.double() - m.unsqueeze(1)
        band = (log_mp.abs() + 16.0) * 2.0**-20
        near = ok & use.unsqueeze(1) & ((d - log_mp).abs() <= band)
        amb |= use & (mp < 1e-30)
        ok &= (d >= log_mp) | ~use.unsqueeze(1)

    # top_k: global k-th value from per-rank top-k candidates; each rank keeps its own ties.
    k = torch.tensor([s.top_k_for_vocab(vocab) for s in row_specs], dtype=torch.long, device=dev)
    cut = k < vocab
    kmax = int(k[cut].max()) if bool(cut.any()) else 0
    if kmax:
        work = scaled.masked_fill(~ok, NEG_INF)
        loc = work.topk(min(kmax, vr), dim=1).values
        loc = torch.nn.functional.pad(loc, (0, kmax - loc.shape[1]), value=NEG_INF)
        g = comm.all_gather(loc)  # [R, N, kmax]
        merged = g.permute(1, 0, 2).reshape(n, -1).topk(kmax, dim=1).values
        kth = merged.gather(1, (k.clamp(max=kmax) - 1).unsqueeze(1))
        kth = torch.where(cut.unsqueeze(1), kth, torch.full_like(kth, NEG_INF))
        if faults.drop_kth_ties_rank == shard.rank:  # planted fault: this shard drops its ties
            ok &= work > kth
        else:
            ok &= work >= kth
        # A min_p decision in its band cannot matter below a finite k-th value: adding or removing a
        # smaller element leaves the k-th largest unchanged, and top_p only sees top_k survivors.
        near &= ~(torch.isfinite(kth) & (scaled < kth))
    amb |= near.any(dim=-1)

    # top_p: the sort + cumsum path runs for every row once any row of the batch sets top_p.
    any_p = any(s.uses_top_p for s in row_specs)
    if any_p:
        p = torch.tensor(
            [s.top_p if s.uses_top_p else 1.0 for s in row_specs], dtype=torch.float32, device=dev
        )
        thr = (1 - p).double()  # the reference's float32 ``1 - p``, exactly
        v = scaled.masked_fill(~ok, NEG_INF)
        lo = scaled.masked_fill(~ok, float("inf")).amin(dim=-1)
        st = comm.all_reduce(
            torch.stack([v.amax(dim=-1).double(), -lo.double(), ok.sum(dim=-1).double()], dim=-1), "max"
        )
        vmax, span, max_count = st[:, 0], st[:, 0] + st[:, 1], st[:, 2]
        s = torch.exp(v.double() - vmax.unsqueeze(1)).sum(dim=-1)
        agg = comm.all_reduce(torch.stack([s, ok.sum(dim=-1).double()], dim=-1), "sum")
        lse, count = vmax + torch.log(agg[:, 0]), agg[:, 1]
        # p == 1 rows: cumsum <= 0 drops the tokens whose float32 probability is exactly 0.
        zero = thr == 0
        if bool(zero.any()):
            logq = v.double() - lse.unsqueeze(1)
            z_ok = zero.unsqueeze(1)
            zero_prob, in_band = underflow_decision(logq)
            amb |= (z_ok & ok & in_band).any(dim=-1)
            ok &= ~z_ok | ~zero_prob
        rows = (~zero).nonzero().squeeze(1)
        if rows.numel():
            start = max(64, kmax)
            cv, ci, a, t = _top_p_cut(
                v[rows],
                shard,
                thr[rows],
                lse[rows],
                count[rows],
                span[rows],
                int(max_count[rows].max()),
                start,
                comm,
            )
            amb[rows] |= a
            tie[rows] |= t
            gid = shard.offset + torch.arange(vr, device=dev).unsqueeze(0)
            vr_rows = v[rows].double()
            keep = (vr_rows > cv.unsqueeze(1)) | ((vr_rows == cv.unsqueeze(1)) & (gid >= ci.unsqueeze(1)))
            ok[rows] &= keep

    need = (amb if band_policy == "gather" else none) | (tie if tie_policy == "gather" else none)
    flags = comm.all_reduce(torch.stack([need, amb, tie], dim=-1).to(torch.int32), "max").bool()
    need, amb, tie = flags[:, 0], flags[:, 1], flags[:, 2]
    if bool(need.any()):
        idx = need.nonzero().squeeze(1)
        with comm.section(comm._section + "/fallback"):
            ok[idx] = _fallback_kept(raw[idx], [row_specs[int(r)] for r in idx], shard, comm, any_p)
    return ok, scaled, need, amb, tie


def sharded_recompute(
    logits: torch.Tensor, sampled: torch.Tensor, specs: SamplingSpec | Sequence[SamplingSpec],
    shard: VocabShard, comm: Comm, *,
    tie_policy: str = "gather", band_policy: str = "gather", faults: ParallelFaults | None = None,
) -> ShardedRecompute:
    """Reference kept set from shards, force-include y on its owner, renormalise over S_p ∪ {y}."""
    faults = faults or ParallelFaults()
    y = _check_sampled(sampled, logits.shape[0], shard.vocab)
    kept, scaled, fb, amb, tie = sharded_kept(
        logits, specs, shard, comm, tie_policy=tie_policy, band_policy=band_policy, faults=faults
    )
    own, loc = shard.owns(y)
    forced_here = own & ~_take(kept, loc)
    support = kept.clone()
    rows = own.nonzero().squeeze(1)
    support[rows, loc[rows]] = True
    lp, forced = _renormalised(scaled, support, shard, y, comm, faults, extra=forced_here.double())
    assert forced is not None
    return ShardedRecompute(lp, kept, forced > 0.5, fb, amb, tie)


# ---------------------------------------------------------------------------------------------
# Tolerances and the parity check against the unsharded estimators
# ---------------------------------------------------------------------------------------------


def logprob_bounds(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
    support: torch.Tensor,
    reference: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Per-token bounds on |sharded - unsharded| (see the module docstring for the proofs).

    ``support``: the recompute support S_p ∪ {y} (bool [N, V]); ``reference``: unsharded values of
    ``full``, ``recompute``, ``predicted_log_s``.
    """
    z = _est.scale(logits, specs).double()
    y = sampled.long().unsqueeze(1)
    finite = torch.isfinite(z)
    c_all = finite.sum(dim=-1).double()
    c_sup = (support & finite).sum(dim=-1).double()
    m = torch.where(finite, z, torch.full_like(z, NEG_INF)).amax(dim=-1)
    zy = z.gather(1, y).squeeze(1)

    def mag(x: torch.Tensor) -> torch.Tensor:
        x = x.double().abs()
        return torch.where(torch.isfinite(x), x, torch.zeros_like(x))

    # Rows without top_k: the unsharded recompute takes the kept mass of parity.core.nucleus (CPU), certified
    # within nucleus.LOG_MASS_REL_ERROR of the float64 sum (float32 exp; float64 histogram sums or float32 sums of 8 terms).
    vocab = logits.shape[1]
    free = torch.tensor([s.top_k_for_vocab(vocab) >= vocab for s in per_row(specs, logits.shape[0])], device=z.device)
    mass_err = torch.where(free, _nucleus.LOG_MASS_REL_ERROR if _nucleus.supported(logits) else 0.0, 0.0).double()
    out = {
        "full": U * (2 * c_all + 2 * mag(zy - m) + 3 * mag(reference["full"]) + 16),
        "recompute": 2 * U * mag(reference["recompute"]) + (c_sup + 1) * 2.0**-50 + mass_err,
        "replay": torch.zeros_like(c_all),
    }
    if "predicted_log_s" in reference:
        out["predicted_log_s"] = 2 * U * mag(reference["predicted_log_s"]) + (c_all + 1) * 2.0**-50
    return out


@dataclass
class ParityReport:
    violations: list[str]
    max_abs_diff: dict[str, float]
    max_bound: dict[str, float]
    support_equal_frac: float
    fallback_rows: int
    exempt_rows: int = 0

    @property
    def passed(self) -> bool:
        return not self.violations


def check_parity(
    result: dict[str, Any],
    logits: torch.Tensor,
    sampled: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
    kept_ids: torch.Tensor | None = None,
) -> ParityReport:
    """Compare a :func:`run_vocab_parallel` result with the unsharded estimators.

    Kept sets must be identical (rows flagged ``tie_split`` under ``tie_policy="index"``, or
    ``ambiguous`` under ``band_policy="flag"``, are exempt from the kept-set, forced and recompute
    log-prob checks and counted in ``exempt_rows``), ``forced`` identical, replay bit-identical, the other log-probs within
    :func:`logprob_bounds`, and every rank must have returned the same replicated values.
    """
    logits = check_logits(logits).to(torch.float32)
    y = sampled.long()
    violations: list[str] = []
    rec = _est.recompute(logits, y, specs)
    ref: dict[str, torch.Tensor] = {"full": _est.full(logits, y, specs), "recompute": rec.logprobs}
    if kept_ids is not None and "replay" in result:
        rp = _est.replay(logits, y, kept_ids, specs)
        ref["replay"], ref["replay_outside"] = rp.logprobs, rp.outside
    if kept_ids is not None and "predicted_log_s" in result:
        ref["predicted_log_s"] = _est.predicted_log_s(logits, kept_ids, specs)
    support = rec.kept.scatter(1, y.unsqueeze(1), True)
    bounds = logprob_bounds(logits, y, specs, support, ref)
    max_diff: dict[str, float] = {}
    max_bound: dict[str, float] = {}
    if not result.get("ranks_agree", True):
        violations.append(f"ranks returned different replicated values: {result.get('ranks_disagree')}")
    equal_frac = 1.0
    fb = 0
    exempt = torch.zeros(logits.shape[0], dtype=torch.bool)
    if "recompute" in result:
        kept = result["recompute_kept"]
        row_eq = (kept == rec.kept).all(dim=-1)
        if result.get("tie_policy") == "index":
            exempt |= result["recompute_tie_split"].bool()
        if result.get("band_policy") == "flag":
            exempt |= result["recompute_ambiguous"].bool()
        bad = (~row_eq & ~exempt).nonzero().squeeze(1).tolist()
        equal_frac = float(row_eq.double().mean()) if row_eq.numel() else 1.0
        fb = int(result["recompute_fallback"].sum())
        if bad:
            r = bad[0]
            extra = (kept[r] & ~rec.kept[r]).nonzero().squeeze(1).tolist()
            missing = (rec.kept[r] & ~kept[r]).nonzero().squeeze(1).tolist()
            violations.append(
                f"recompute kept set differs from the unsharded reference on {len(bad)} row(s); row {r}: "
                f"extra ids {extra[:8]}, missing ids {missing[:8]}"
            )
        if not torch.equal(result["recompute_forced"][~exempt], rec.forced[~exempt]):
            violations.append("recompute forced-include flags differ from the unsharded reference")
    if "replay_outside" in ref and not torch.equal(result["replay_outside"], ref["replay_outside"]):
        violations.append("replay 'sampled token outside S_q' flags differ from the unsharded replay")
    for name in ("full", "recompute", "replay", "predicted_log_s"):
        if name not in result or name not in ref:
            continue
        d = abs_difference(result[name], ref[name])
        if name == "recompute":  # a row deliberately judged on another support (exempt above)
            d = d.masked_fill(exempt, 0.0)
        b = bounds[name]
        max_diff[name] = float(d.max()) if d.numel() else 0.0
        max_bound[name] = float(b.max()) if b.numel() else 0.0
        over = (d > b).nonzero().squeeze(1).tolist()
        if over:
            r = over[0]
            violations.append(
                f"{name}: {len(over)} token(s) beyond the proven bound; token {r}: sharded "
                f"{float(result[name][r]):.9g} vs unsharded {float(ref[name][r]):.9g} "
                f"(|diff| {float(d[r]):.3g} > bound {float(b[r]):.3g})"
            )
    return ParityReport(violations, max_diff, max_bound, equal_frac, fb, int(exempt.sum()))


__all__ = [
    "ESTIMATORS",
    "Comm",
    "ParallelFaults",
    "ParityReport",
    "ShardedRecompute",
    "ShardedReplay",
    "VocabShard",
    "check_parity",
    "logprob_bounds",
    "sharded_full",
    "sharded_kept",
    "sharded_predicted_log_s",
    "sharded_recompute",
    "sharded_replay",
    "split_vocab",
]
