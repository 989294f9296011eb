"""The nucleus (top_p) cut of vLLM's sort path without sorting the row: a histogram select on float bits.

vLLM's PyTorch top-p (``apply_top_k_top_p_pytorch`` in vllm/v1/sample/ops/topk_topp_sampler.py, mirrored
by :func:`parity.core.filters.top_k_top_p_sorted`) sorts the whole row ascending, takes the float32 softmax of
the sorted row, its cumulative sum, and drops the positions with ``cumsum <= 1 - p`` (the largest token
always kept). The kept set is therefore ``{z' >= v*}`` for one value v* per row, and finding v* is a
selection by probability mass, not a sort. :func:`nucleus_cut` finds it in a few passes over the row:

1. ``d = m - z'`` (m the row max) and ``e = exp(-d)`` in float32, the very argument and function the
   reference's softmax evaluates;
2. a histogram of the sortable bits of ``d`` (``d >= 0``, so its int32 view is monotone in d):
   ``MANTISSA_BITS`` mantissa bits per binade, counts and masses per bucket (float64 sums of the float32
   exps: ``bincount`` with float64 weights);
3. from the histogram, per row, the range of buckets in which the cut can fall (every bucket above it
   certainly kept, every bucket below certainly dropped, with the error bounds below), searched in a
   window of :data:`WINDOW` buckets either side of the bucket where the cumulative mass crosses 1 - p;
4. the masses above and below the range, prefix and suffix sums of the bucket masses; in one more
   pass, the kept mask of the buckets above the range and the tokens of the range: the candidates;
5. the candidates (a few hundred per row) sorted by value: their exact cumulative mass is
   ``(mass below the range + float64 partial sums) / S``, and the cut is decided there in float64,
   as on the top_k path (:func:`parity.core.estimators._top_p_on_candidates`).

Why it is exact, and when a row falls back to the reference sort instead (counted per reason):

* **Order.** Buckets are defined on ``d``'s bits, and ``d = fl(m - z')`` is monotone in z' (IEEE
  subtraction rounds monotonically), so a lower bucket holds only larger values: the partition agrees
  with the reference's sorted order. Tied values share a bucket, so a tie group is either wholly a
  candidate or wholly decided.
* **Rounding band** (``band``). The exact cumulative mass C_j is compared with the float32 ``1 - p``.
  The reference's float32 cumulative sum D_j differs from C_j by at most (u = 2^-24)::

      u * (A_j + C_j * (3 + A + E)) + j * 2^-53 + 2^-40

  - ``A_j = sum_{i<=j} q_i (|x_i| + 2)``: each float32 ``exp(x_i)`` carries the rounding of its argument
    (u|x_i|) and its own error (at most 1 ulp, 2u); ``A`` is the same over the row (the denominator);
  - ``3u``: the reciprocal of the sum, the product, and the float32 rounding of the cumulative sum's
    output (CPU ``cumsum`` accumulates float32 input in double, acc_type<float, false>, so the sum itself
    adds only ``j * 2^-53``: aten/src/ATen/native/cpu/ReduceOpsKernel.cpp, cumsum_cpu_kernel);
  - ``E``: the float32 softmax denominator. CPU softmax (aten/src/ATen/native/cpu/SoftMaxKernel.cpp,
    _vec_softmax_lastdim) sums the exps with ``vec::reduce_all`` (aten/src/ATen/cpu/vec/functional_base.h):
    one vector accumulator of L lanes walks the sorted row, lane l adding positions l, l + L, ... in
    ascending order, then the lanes are combined. Each lane's partial sum after position k is at most
    ``T_{k+L-1} / L`` (T_k the ascending prefix sum: the L values after position k are no smaller), so
    the error is at most ``u * ((B + (L - 1) S) / L + (L - 1) S)`` with ``B = sum_k T_k``, never more
    than the ``(n - 1) u S`` of any order. B is bounded from the histogram: a token in bucket b has at
    most as many tokens at or above it as the buckets <= b hold. L is the lane count of torch's CPU
    vector path (:func:`softmax_lanes`); where it is not known, the any-order bound is used. On LM-like
    rows at V = 152k the histogram's B is within a few percent of the exact B of the sorted row: the
    width of the band is the worst case of L lanes summing ~V / L ascending terms, not slack of the
    histogram, and a row inside it needs the reference's own rounding (a sort) or ``band_policy``.
  - the absolute terms cover underflowed float32 terms and this module's float64 arithmetic.

  Our own evaluation adds the error of its masses: float32 exp (2u) and float64 sums
  (:data:`HIST_REL_ERROR`) for the masses around the range and where the histogram decides a bucket. A row whose C_j lies within the sum of both of ``1 - p`` at any candidate position could go
  either way in the reference: it falls back.
* **Tie split** (``tie_split``). When the cut falls between two equal values, which of them the
  reference drops is decided by ``torch.sort``'s permutation of the whole row: the row is left to the
  caller's reference sort (``unresolved``).
* **Bracket** (``bracket``): the range does not fit the window, or holds more than
  :data:`MAX_CANDIDATES` tokens (a flat row whose error bound spans many buckets): cut from the
  sorted values rather than sort a large candidate list. A cost guard, not a correctness one.
* **Band policy.** ``band_policy="decide"`` (opt-in) keeps the exact float64 cut on the rows whose only
  uncertainty is a candidate inside the rounding band, instead of sorting them: such a row is the exact
  nucleus of its float32 probabilities, which may differ from the reference's float32 rounding of it by
  the token at the boundary. Those rows are counted (``decided``); every other row is cut as under the
  default ``"reference"`` policy.
* **p = 1 rows** of a sort-path batch drop only tokens whose float32 probability underflows to 0: kept
  if ``x > -80``, dropped if ``x < -105`` (the bounds of :mod:`parity.core.estimators`); if any token lies
  in between, the row falls back (``band``).

The log-mass of the kept set, ``log sum_{kept} exp(z' - m)``, is the mass above the range plus the
kept candidates' float64 masses: within :data:`LOG_MASS_REL_ERROR` of the float64 sum over the same
set. :func:`survivor_mass` gives the same for rows that are not cut at all (min_p alone, or no filter:
vLLM's top-k/top-p step is skipped when no row sets top_p or top_k).

CPU float32 only (the float32 kernels above are the CPU ones); other devices keep the reference sort.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import platform
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from parity.core import kernels, tolerances
from parity.core.filters import min_p_mask, min_p_thresholds

U = 2.0**-24  # float32 unit roundoff
_SLACK = 1.0 + 2.0**-20  # second-order terms of the first-order error bounds
_ABS = 2.0**-40  # absolute slack: underflowed float32 terms, float64 evaluation

# Histogram over d = m - z' >= 0: bucket key = (float32 bits of d >> SHIFT) - BASE, clamped.
MANTISSA_BITS = 6  # buckets per binade: 2**6 (relative width of a bucket in d: 1/64)
SHIFT = 23 - MANTISSA_BITS
LOW_EXP, HIGH_EXP = -4, 7  # d in [2^-4, 2^7) is resolved; below: bucket 0; d >= 2^7 (exp underflows): last
BASE = (127 + LOW_EXP) << MANTISSA_BITS
NB = ((HIGH_EXP - LOW_EXP) << MANTISSA_BITS) + 1
WINDOW = 8  # the candidate range is searched this many buckets either side of the crossing bucket
MAX_CANDIDATES = 16384  # wider candidate ranges fall back (counted as bracket)
# The exact cut runs on [rows, widest candidate list] tensors, in up to CUT_GROUPS groups of rows by
# candidate count, so a row pads to its group's widest, not the batch's. A group costs about as much as
# CUT_GROUP_COST more padded entries (its ~50 torch calls; measured at V = 32k and 152k).
CUT_GROUPS, CUT_GROUP_COST = 8, 20000
# Groups no wider than this are cut on one thread: their ~50 torch calls are small, and waking torch's
# other threads for each cost more than it saved (OMP_WAIT_POLICY=PASSIVE: 11.6 against 6.9 ms at
# 512 x 32k, 44 against 34 ms at 4096 x 32k); at V = 152k (~1600 wide) two threads were faster.
CUT_SERIAL_WIDTH = 512
# Values per row block (16 MB per float32 buffer). Smaller blocks stay in cache but multiply torch's
# parallel regions (about 20 per block); on a loaded machine each can stall on a descheduled thread.
BLOCK_ELEMS = 1 << 22
BAND_POLICIES = ("reference", "decide")  # nucleus_cut's band_policy
GROUP = 8  # _row_sums (survivor rows, rows cut from their sorted values): float32 sums of GROUP terms, then float64
# Those masses carry float32 exp (2u) and a float32 sum of GROUP terms ((GROUP - 1)u) per term: a
# certified relative error, so also the error of log_mass in nats.
SUM_REL_ERROR = (GROUP + 1) * U * _SLACK + 2.0**-48
# The masses around the cut come from the histogram: float64 sums (bincount with float64 weights) of
# float32 exps, so 2u per term (1 ulp of exp) and n 2^-53 for the float64 sums, n <= V < 2^25.
HIST_REL_ERROR = 2 * U * _SLACK + 2.0**-28  # + the prefix sums over NB buckets: NB 2^-53 < 2^-43
# The log-mass of a cut or survivor row: its masses are histogram sums (cut rows) or _row_sums (survivor
# rows and rows cut from their sorted values): the larger bound covers both.
LOG_MASS_REL_ERROR = max(SUM_REL_ERROR, HIST_REL_ERROR)

# p = 1 rows on the sort path: the underflow band on d = m - x (parity.core.tolerances).
UNDERFLOW_DROP, UNDERFLOW_KEEP = tolerances.UNDERFLOW_D_BAND


@dataclass
class NucleusResult:
    kept: torch.Tensor  # bool: ``out`` with the cut rows filled, or [R, V] (meaningless on unresolved rows)
    log_mass: torch.Tensor  # float64 [R]: log sum_{kept} exp(z' - m), m the row max (NaN: unresolved)
    row_max: torch.Tensor  # float32 [R, 1]: m
    band: torch.Tensor  # bool [R]: a decision fell inside the rounding band (or p = 1 underflow band)
    tie_split: torch.Tensor  # bool [R]: the cut fell inside a group of equal values
    bracket: torch.Tensor  # bool [R]: the range left the window or held more than MAX_CANDIDATES tokens
    candidates: torch.Tensor  # long [R]: tokens in the candidate range (what was sorted)
    # bool [R]: band_policy="decide" only: rows with a candidate inside the rounding band, cut by the exact
    # (float64) cumulative mass instead of the reference's float32 rounding (under "reference" they are
    # ``band`` rows, sorted); all False under "reference"
    decided: torch.Tensor | None = None

    @property
    def decided_count(self) -> int:
        return 0 if self.decided is None else int(self.decided.sum())

    @property
    def fallback(self) -> torch.Tensor:
        """bool [R]: rows the histogram select could not decide: cut from their sorted values instead
        (:func:`_values_cut`, the reference's own ops), or left to the caller (``unresolved``)."""
        return self.band | self.tie_split | self.bracket

    @property
    def unresolved(self) -> torch.Tensor:
        """bool [R]: rows whose kept set needs the reference's permutation (a split tie): run the
        reference sort on them (``kept`` and ``log_mass`` are not set there)."""
        return torch.isnan(self.log_mass)

    @property
    def fallback_count(self) -> int:
        return int(self.fallback.sum())


def softmax_lanes(device: torch.device) -> int | None:
    """Lanes of torch's CPU ``Vectorized<float>`` (the accumulator of the softmax sum), or None if unknown.

    AVX-512: 16; AVX2: 8; the non-vectorised x86 build (``ATEN_CPU_CAPABILITY=default``): 8 (32-byte
    generic vectors, lanes combined one by one). Other CPUs (ARM: NEON, SVE) are not modelled here.
    """
    if device.type != "cpu":
        return None
    cap = torch.backends.cpu.get_cpu_capability()
    if cap == "AVX512":
        return 16
    if cap == "AVX2":
        return 8
    if cap == "DEFAULT" and platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return 8
    return None


@dataclass(frozen=True)
class Scaled:
    """``z' = logits / temps[:, None]`` read where it is needed instead of materialised: the float32
    division the sampler runs (``parity.core.filters.apply_temperature``), row by row. IEEE division is
    correctly rounded, so every value read is the bit of the materialised z'; the compiled row passes
    divide as they read (a pass over ``[N, V]`` and its output saved), the torch ones on the rows they take.
    """

    logits: torch.Tensor  # float32 [N, V]
    temps: torch.Tensor  # float32 [N], > 0

    @property
    def shape(self) -> torch.Size:
        return self.logits.shape

    @property
    def device(self) -> torch.device:
        return self.logits.device

    @property
    def dtype(self) -> torch.dtype:
        return self.logits.dtype

    def dim(self) -> int:
        return self.logits.dim()

    def __getitem__(self, rows: torch.Tensor | slice) -> torch.Tensor:
        """z' of ``rows`` (a slice or a 1-D index tensor)."""
        return self.logits[rows] / self.temps[rows].unsqueeze(1)

    def gather(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        """``z'.gather(1, index)``: the values at ``index`` only."""
        if dim != 1:
            raise ValueError(f"Scaled.gather reads along dim 1 (the vocabulary): got dim={dim}")
        return self.logits.gather(1, index) / self.temps.unsqueeze(1)


Work = torch.Tensor | Scaled  # z' materialised, or read through Scaled


def supported(work: Work) -> bool:
    """Whether :func:`nucleus_cut` and :func:`survivor_mass` apply: CPU float32 ``[N, V]``."""
    return work.device.type == "cpu" and work.dtype == torch.float32 and work.dim() == 2


def _divisors(work: Work) -> np.ndarray:
    """The kernels' per-row divisor of what they read: the temperatures, or 1 (x / 1 is x)."""
    if isinstance(work, Scaled):
        return work.temps.contiguous().numpy()
    return np.ones(work.shape[0], dtype=np.float32)


def _edges() -> torch.Tensor:
    """Upper d of each bucket plus 2 (float64 [NB]: the A-term weight); the last bucket's mass is 0."""
    bits = ((torch.arange(1, NB + 1, dtype=torch.int64) + BASE) << SHIFT).to(torch.int32)
    hi = bits.view(torch.float32).double()
    hi[-1] = 2.0**HIGH_EXP * 2  # d >= 2^7 there: float32 exp(-d) is 0, so the weight multiplies 0
    return hi + 2


def _key_of(d: float) -> int:
    """The bucket key of one value of d."""
    bits = int(torch.tensor([d], dtype=torch.float32).view(torch.int32))
    return min(max((bits >> SHIFT) - BASE, 0), NB - 1)


_KEEP_KEY = _key_of(UNDERFLOW_KEEP)  # 80 = 1.25 * 2^6 is a bucket edge: key < _KEEP_KEY <=> d < 80
_DROP_KEY = _key_of(UNDERFLOW_DROP)  # the bucket holding d = 105


def _row_sums(f: torch.Tensor) -> torch.Tensor:
    """Row sums of nonnegative float32 ``[b, V]`` in float64: float32 sums of GROUP terms, then float64.

    Any order of GROUP nonnegative float32 terms is within (GROUP - 1)u of their exact sum; the float64
    sum of the partial sums adds ~V 2^-53.
    """
    b, v = f.shape
    main = v - v % GROUP
    part = f.as_strided((b, GROUP, main // GROUP), (f.stride(0), main // GROUP, 1)).sum(dim=1).sum(dim=1, dtype=torch.float64)
    if main < v:
        part += f[:, main:].double().sum(dim=1)
    return part


def _check(
    work: Work, rows: torch.Tensor | None, min_p: torch.Tensor | None, out: torch.Tensor | None
) -> tuple[int, int, torch.Tensor | None, int]:
    if not supported(work):
        raise ValueError(f"work must be float32 [N, V] logits on CPU: got {work.dtype} {tuple(work.shape)} on {work.device}")
    n, v = work.shape
    idx = None if rows is None else rows.to(device=work.device, dtype=torch.long)
    r = n if idx is None else idx.numel()
    if min_p is not None and (min_p.shape != (r,) or min_p.dtype != torch.float32):
        raise ValueError(f"min_p has {min_p.dtype} {tuple(min_p.shape)}: allowed float32 [{r}] (one min_p per row, as the reference)")
    if out is not None and (out.shape != (n, v) or out.dtype != torch.bool):
        raise ValueError(f"out has {out.dtype} {tuple(out.shape)}: allowed bool [{n}, {v}]")
    return n, v, idx, r


class _Blocks:
    """Row blocks of about BLOCK_ELEMS values and the buffers reused block after block.

    A fresh ``[R, V]`` buffer costs about as much as a pass over it (page faults): only the kept mask
    is full size.
    """

    def __init__(self, work: Work, idx: torch.Tensor | None, r: int, min_p: torch.Tensor | None) -> None:
        v = work.shape[1]
        dev = work.device
        self.work, self.idx, self.min_p = work, idx, min_p
        self.size = max(1, min(r, BLOCK_ELEMS // max(v, 1)))
        self.spans = [(b0, min(r, b0 + self.size)) for b0 in range(0, r, self.size)]
        self.e = torch.empty(self.size, v, device=dev)
        self.f = torch.empty(self.size, v, device=dev)
        self.e64 = torch.empty(self.size, v, dtype=torch.float64, device=dev)  # bincount weights
        self.key = torch.empty(self.size, v, dtype=torch.int32, device=dev)
        self.mask = torch.empty(self.size, v, dtype=torch.bool, device=dev)
        self.cand = torch.empty(self.size, v, dtype=torch.bool, device=dev)
        self.rows = torch.empty(self.size, v, device=dev) if idx is not None else None
        self.zero = torch.zeros((), device=dev)

    def block(self, b0: int, b1: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(z' rows, m [b, 1], min_p drop mask or None); e = exp(z' - m) in ``self.e`` (0 where dropped)."""
        if self.idx is None:
            w = self.work[b0:b1]
        else:
            assert self.rows is not None  # allocated whenever idx is given
            raw = self.work.logits if isinstance(self.work, Scaled) else self.work
            w = torch.index_select(raw, 0, self.idx[b0:b1], out=self.rows[: b1 - b0])
            if isinstance(self.work, Scaled):
                w.div_(self.work.temps[self.idx[b0:b1]].unsqueeze(1))  # z' of those rows, in place
        dropped = None if self.min_p is None else min_p_mask(w, self.min_p[b0:b1])
        m = w.amax(dim=1, keepdim=True)
        e = self.e[: b1 - b0]
        torch.sub(w, m, out=e).exp_()  # fl(z' - m): the argument the reference's softmax exponentiates
        if dropped is not None:
            e.masked_fill_(dropped, 0.0)
        return w, m, dropped

    def keys(self, w: torch.Tensor, m: torch.Tensor, dropped: torch.Tensor | None, offset: torch.Tensor) -> torch.Tensor:
        """Bucket keys of d = m - z', plus ``offset`` per row (``self.f`` is scratch); dropped: last bucket.

        d is clamped to [2^LOW_EXP, 2^HIGH_EXP] first (+inf at -inf entries, so the last bucket), so its
        bits shifted right are BASE .. BASE + NB - 1; ``offset`` (row * NB - BASE) makes them indices
        into the block's [b * NB] histogram in the same pass.
        """
        b = w.shape[0]
        d, key = self.f[:b], self.key[:b]
        torch.sub(m, w, out=d).clamp_(2.0**LOW_EXP, 2.0**HIGH_EXP)  # d = -fl(z' - m) exactly, before the clamp
        torch.bitwise_right_shift(d.view(torch.int32), SHIFT, out=key)
        if dropped is not None:
            key.masked_fill_(dropped, BASE + NB - 1)
        return key.add_(offset)


def survivor_mass(
    work: Work,
    *,
    rows: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> NucleusResult:
    """Rows that are not cut: the kept set is the finite z' left by min_p (:func:`parity.core.filters.min_p_mask`,
    if given), and its log-mass as in :func:`nucleus_cut`.

    These are the rows without top_k in a batch where no row sets top_p: vLLM then skips its top-p step
    (``apply_top_k_top_p`` returns the logits when k and p are None; with top_k on other rows,
    ``apply_top_k_only`` keeps every value >= the V-th largest of such a row: all of them).

    Arguments as for :func:`nucleus_cut`; no row falls back.
    """
    n, v, idx, r = _check(work, rows, min_p, out)
    dev = work.device
    if out is None:
        out, dest = torch.empty(r, v, dtype=torch.bool, device=dev), None
    else:
        dest = idx
    log_mass = torch.empty(r, dtype=torch.float64, device=dev)
    m_all = torch.empty(r, 1, device=dev)
    todo = torch.arange(r, device=dev)
    if kernels.backend() == "numba" and r:
        todo = _survivor_kernel(work, idx, min_p, out, dest, log_mass, m_all)
    if todo.numel():  # the torch passes (or the kernel's min_p band rows: the reference's min_p_mask)
        sub_idx = todo if idx is None else idx[todo]
        sub_dest = None if dest is None and todo.numel() == r else (todo if dest is None else dest[todo])
        blocks = _Blocks(work, sub_idx if todo.numel() < n or idx is not None else None, todo.numel(), None if min_p is None else min_p[todo])
        for b0, b1 in blocks.spans:
            w, m, dropped = blocks.block(b0, b1)
            m_all[todo[b0:b1]] = m
            log_mass[todo[b0:b1]] = torch.log(_row_sums(blocks.e[: b1 - b0]))
            kept = out[b0:b1] if sub_dest is None else blocks.mask[: b1 - b0]
            torch.gt(w, float("-inf"), out=kept)
            if dropped is not None:
                kept &= ~dropped
            if sub_dest is not None:
                out[sub_dest[b0:b1]] = kept
    no = torch.zeros(r, dtype=torch.bool, device=dev)
    return NucleusResult(out, log_mass, m_all, no, no.clone(), no.clone(), torch.zeros(r, dtype=torch.long, device=dev), no.clone())


def _rows_np(work: Work, idx: torch.Tensor | None, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy views for the kernels: what they read (contiguous), the row of each of the R rows, and the
    divisor of each row read (:func:`_divisors`)."""
    raw = work.logits if isinstance(work, Scaled) else work
    z = raw.contiguous().numpy()
    rows = np.arange(r, dtype=np.int64) if idx is None else idx.contiguous().numpy()
    return z, rows, _divisors(work)


def _row_max(work: Work, idx: torch.Tensor | None) -> torch.Tensor:
    """float32 [R, 1]: the max of each cut row (torch's amax: vectorised, threaded). Through :class:`Scaled`,
    the max of the logits divided by T: division by T > 0 rounds monotonically, so it is the max of z'."""
    raw = work.logits if isinstance(work, Scaled) else work
    if idx is None or (idx.numel() == work.shape[0] and bool((idx == torch.arange(idx.numel(), device=idx.device)).all())):
        m = raw.amax(dim=1, keepdim=True)
        return m / work.temps.unsqueeze(1) if isinstance(work, Scaled) else m
    parts = []
    for b0 in range(0, idx.numel(), 4096):
        at = idx[b0 : b0 + 4096]
        m = raw[at].amax(dim=1, keepdim=True)
        parts.append(m / work.temps[at].unsqueeze(1) if isinstance(work, Scaled) else m)
    return torch.cat(parts)


def _thresholds(m: torch.Tensor, min_p: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """min_p's float32 band per row for the kernels (lo, hi, redo), and whether anything is dropped."""
    r = m.shape[0]
    if min_p is None:
        none = np.full(r, -np.inf, dtype=np.float32)
        return none, none, np.zeros(r, dtype=bool), False
    lo, hi, redo = min_p_thresholds(m.squeeze(1), min_p)
    return lo.numpy(), hi.numpy(), redo.numpy(), True


def _run(fn: object, r: int, *args: object) -> None:
    """Run a row kernel over rows [0, r), split over torch's intra-op thread count."""
    spans = kernels.split(r, torch.get_num_threads())
    if len(spans) == 1:
        fn(*args[:2], *spans[0], *args[2:])  # type: ignore[operator]
        return
    list(_pool().map(lambda sp: fn(*args[:2], *sp, *args[2:]), spans))  # type: ignore[operator]


def min_p_survivors(
    work: Work, rows: torch.Tensor, min_p: torch.Tensor, cap: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """min_p's survivors of ``rows`` through :func:`parity.core.kernels.list_rows` (numba; CPU float32):
    (count [R], values [R, cap] in column order, -inf past them, ids [R, cap], 0 past them, redo [R]).

    A survivor is a value at or above the row's :func:`parity.core.filters.min_p_thresholds` ``lo``; the
    rows flagged ``redo`` have a value inside min_p's rounding band (or a min_p below MIN_P_FAST_MIN):
    only the reference's ``min_p_mask`` decides them, and their lists are meaningless.
    """
    r = rows.numel()
    z, rows_np, t = _rows_np(work, rows, r)
    lo, hi, redo, _ = _thresholds(_row_max(work, rows), min_p)
    vals = np.full((r, max(cap, 1)), -np.inf, dtype=np.float32)
    ids = np.zeros((r, max(cap, 1)), dtype=np.int64)
    count = np.zeros(r, dtype=np.int64)
    near = np.zeros(r, dtype=bool)
    _run(kernels.list_rows, r, z, rows_np, t, lo, hi, vals, ids, count, near)
    return torch.from_numpy(count), torch.from_numpy(vals), torch.from_numpy(ids), torch.from_numpy(near | redo)


def _survivor_kernel(
    work: Work, idx: torch.Tensor | None, min_p: torch.Tensor | None, out: torch.Tensor, dest: torch.Tensor | None,
    log_mass: torch.Tensor, m_all: torch.Tensor,
) -> torch.Tensor:
    """survivor_mass through :func:`parity.core.kernels.survivor_rows`; returns the rows left to the torch
    passes (min_p's rounding band: the reference's min_p_mask decides them)."""
    r = m_all.shape[0]
    z, rows, t = _rows_np(work, idx, r)
    m = _row_max(work, idx)
    lo, hi, redo, drop = _thresholds(m, min_p)
    dest_np = np.arange(r, dtype=np.int64) if dest is None else dest.contiguous().numpy()
    sums = np.empty(r, dtype=np.float64)
    near = np.zeros(r, dtype=bool)
    _run(kernels.survivor_rows, r, z, rows, t, m.squeeze(1).numpy(), lo, hi, drop, out.numpy(), dest_np, sums, near)
    m_all.copy_(m)
    log_mass.copy_(torch.log(torch.from_numpy(sums)))
    return torch.from_numpy(near | redo).nonzero().squeeze(1)


@dataclass
class Selection:
    """The nucleus select up to its candidates (:func:`select`); :func:`nucleus_cut` cuts them."""

    kept: torch.Tensor  # bool: the kept mask above each row's range (``out``, or a new [R, V])
    row_max: torch.Tensor  # float32 [R, 1]
    ranges: _Ranges  # per row: the candidate range, its fallbacks, the masses around it
    pos: torch.Tensor  # long: the candidates' flat positions (row i * V + column), grouped by row
    vals: torch.Tensor  # float32: their z' (-inf for min_p's drops)
    thr32: torch.Tensor  # float32 [R]: 1 - p
    idx: torch.Tensor | None  # the rows read (None: all)
    dest: torch.Tensor | None  # the rows of ``kept`` written (None: row i -> kept[i])

    @property
    def candidates(self) -> int:
        return self.pos.numel()


def select(
    work: Work,
    p: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lanes: int | None = -1,
) -> Selection:
    """Steps 1-4 of the module docstring for :func:`nucleus_cut` (same arguments): the row max, the
    histogram, each row's range, the kept mask above it and the candidates in it. Through the compiled row
    passes (:mod:`parity.core.kernels`) or the torch ones; rows with a value in min_p's rounding band go
    through the torch passes (the reference's min_p_mask). The cut itself is :func:`nucleus_cut`'s."""
    n, v, idx, r = _check(work, rows, min_p, out)
    if p.shape != (r,) or p.dtype != torch.float32:
        raise ValueError(f"p has {p.dtype} {tuple(p.shape)}: allowed float32 [{r}] (one top_p per row cut; 1 - p in float32)")
    dev = work.device
    if out is None:
        out, dest = torch.empty(r, v, dtype=torch.bool, device=dev), None  # cut row i -> out[i]
    else:
        dest = idx
    if lanes == -1:
        lanes = softmax_lanes(dev)
    hd2 = _edges().to(dev)
    thr32 = 1 - p  # float32, as the reference computes it
    todo = torch.arange(r, device=dev)
    kernel: tuple[torch.Tensor, _Ranges, torch.Tensor, torch.Tensor] | None = None
    if kernels.backend() == "numba" and r:
        kernel, todo = _select_kernel(work, idx, thr32, min_p, out, dest, lanes, hd2)
    torch_part = None
    if todo.numel():  # the torch passes (or the kernel's min_p band rows: the reference's min_p_mask)
        whole = todo.numel() == r and kernel is None
        torch_part = _select_torch(work, idx, None if whole else todo, thr32, min_p, out, dest, lanes, hd2)
    if kernel is None:
        assert torch_part is not None  # every row went through the torch passes
        m_all, rng, pos, vals = torch_part
    else:
        m_all, rng, pos, vals = kernel
        if torch_part is not None:
            m_all[todo] = torch_part[0]
            rng.assign(todo, torch_part[1])
            pos, order = torch.cat([pos, torch_part[2]]).sort(stable=True)  # grouped by row again, columns in order
            vals = torch.cat([vals, torch_part[3]])[order]
    return Selection(out, m_all, rng, pos, vals, thr32, idx, dest)


def nucleus_cut(
    work: Work,
    p: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lanes: int | None = -1,
    band_policy: str = "reference",
) -> NucleusResult:
    """The kept set of vLLM's sort-path top_p cut for rows with no top_k, from a histogram select.

    ``work``: float32 ``[N, V]`` on CPU, the scaled logits, or a :class:`Scaled` that reads them from the logits (``-inf`` allowed, every row with a finite
    value); ``rows``: the rows to cut (default: all), R of them. ``p``: float32 ``[R]``, top_p per row
    (1.0: the row only drops float32-underflowed tokens, as vLLM's sort path does for rows without top_p).
    ``min_p``: float32 ``[R]`` or None: applied first with :func:`parity.core.filters.min_p_mask`, block of rows
    by block (the reference's own function; its result for a row does not depend on the other rows).
    ``out``: a bool ``[N, V]`` tensor whose ``rows`` receive the kept set (default: a new ``[R, V]``).
    ``lanes``: the softmax accumulator's lane count (default :func:`softmax_lanes`; None: any order).
    ``band_policy``: what a row does when a candidate's exact cumulative mass lies inside the rounding
    band. ``"reference"`` (default): the row is cut from its sorted values by the reference's own float32
    ops (``band``), so the kept set is the reference's, bit for bit. ``"decide"``: the row keeps the cut
    of the exact float64 cumulative mass, which may differ from the reference's float32 one on those rows
    only; they are counted in ``decided`` (never silently). Rows whose whole range is uncertain (no
    candidates: ``band`` from the histogram), split ties and brackets fall back under either policy.

    One pass over each block of rows: e and the bucket keys, the histogram, the range, the kept mask
    above the range, the masses around it and the candidates; then the exact cut over all candidates.
    """
    if band_policy not in BAND_POLICIES:
        raise ValueError(f"band_policy is {band_policy!r}: allowed one of {', '.join(map(repr, BAND_POLICIES))}")
    sel = select(work, p, rows=rows, min_p=min_p, out=out, lanes=lanes)
    v, idx, dev = work.shape[1], sel.idx, work.device
    out, dest, m_all, rng, thr32 = sel.kept, sel.dest, sel.row_max, sel.ranges, sel.thr32
    keep_pos, log_mass, band, tie_split, decided = _cut(sel.pos, sel.vals, m_all, rng, thr32, v, decide=band_policy == "decide")
    if keep_pos.numel():
        crow = torch.div(keep_pos, v, rounding_mode="floor")
        target = crow if dest is None else dest[crow]
        out.view(-1)[target * v + (keep_pos - crow * v)] = True
    # Rows in the band or off the window: the reference's own float32 cut on the row's sorted values.
    late = ((band | rng.bracket) & ~tie_split).nonzero().squeeze(1)
    if late.numel():
        src = late if idx is None else idx[late]
        w = work[src]
        if min_p is not None:
            w = w.masked_fill(min_p_mask(w, min_p[late]), float("-inf"))
        v_star, split = _values_cut(w, thr32[late])
        ok = ~split
        to = late if dest is None else dest[late]
        if kernels.backend() == "numba":  # kept = {z' >= v*} and its mass in one compiled pass, into out
            okr = ok.nonzero().squeeze(1)
            k = okr.numel()
            sums, near, none = np.empty(k), np.zeros(k, dtype=bool), np.full(k, -np.inf, dtype=np.float32)
            m_ok = m_all[late][okr].squeeze(1).contiguous().numpy()
            ones = np.ones(w.shape[0], dtype=np.float32)  # w holds z' already
            args = (w.contiguous().numpy(), okr.numpy(), ones, m_ok, v_star[okr].contiguous().numpy(), none, True)
            _run(kernels.survivor_rows, k, *args, out.numpy(), to[okr].contiguous().numpy(), sums, near)
            log_mass[late[okr]] = torch.log(torch.from_numpy(sums))
        else:
            kept = w >= v_star.unsqueeze(1)
            mass = _row_sums(torch.where(kept, torch.exp(w - m_all[late]), torch.zeros((), device=dev)))
            out[to[ok]] = kept[ok]
            log_mass[late[ok]] = torch.log(mass[ok])
        tie_split[late[split]] = True
        band[late[split]] = False
        rng.bracket[late[split]] = False
    return NucleusResult(out, log_mass, m_all, band, tie_split, rng.bracket, rng.n_cand, decided)


def _select_torch(
    work: Work, idx: torch.Tensor | None, todo: torch.Tensor | None, thr32: torch.Tensor, min_p: torch.Tensor | None,
    out: torch.Tensor, dest: torch.Tensor | None, lanes: int | None, hd2: torch.Tensor,
) -> tuple[torch.Tensor, _Ranges, torch.Tensor, torch.Tensor]:
    """The torch passes of :func:`nucleus_cut` over its rows (or the subset ``todo`` of them), block by
    block: (row max [k, 1], ranges, candidate positions (flat, in the cut rows' numbering, grouped by
    row), candidate values). The kept mask above each range goes to ``out``."""
    dev, v = work.device, work.shape[1]
    if todo is not None:  # a subset: read rows through idx, write out rows through dest
        r_all = thr32.shape[0]
        dest = (torch.arange(r_all, device=dev) if dest is None else dest)[todo]
        idx = todo if idx is None else idx[todo]
        thr32 = thr32[todo]
        min_p = None if min_p is None else min_p[todo]
    r = thr32.shape[0]
    blocks = _Blocks(work, idx, r, min_p)
    m_all = torch.empty(r, 1, device=dev)
    parts: list[_Ranges] = []
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    for b0, b1 in blocks.spans:
        b = b1 - b0
        w, m, dropped = blocks.block(b0, b1)
        e = blocks.e[:b]
        offset = torch.arange(0, b * NB, NB, dtype=torch.int32, device=dev).unsqueeze(1)
        key = blocks.keys(w, m, dropped, offset - BASE)  # row r's bucket k is index r * NB + k
        m_all[b0:b1] = m
        # Histogram: counts and masses (float64 sums of the float32 exps) per (row, bucket).
        flat = key.view(-1)
        # bincount is one thread each: the counts run beside the masses when torch has two threads or more.
        pool = _pool() if torch.get_num_threads() > 1 else None
        counted = pool.submit(torch.bincount, flat, None, b * NB) if pool is not None else None
        e64 = blocks.e64[:b]
        e64.copy_(e)
        mb = torch.bincount(flat, weights=e64.view(-1), minlength=b * NB).view(b, NB)  # float64 sums
        counts = counted.result() if counted is not None else torch.bincount(flat, minlength=b * NB)
        nb = counts.view(b, NB).double()
        rng = _ranges(nb, mb, thr32[b0:b1], v, lanes, hd2)  # with the masses above and below the range
        # The kept mask above the range and the candidates.
        above = out[b0:b1] if dest is None else blocks.mask[:b]
        torch.lt(key, rng.b_top.to(torch.int32).unsqueeze(1) + offset, out=above)
        cand = torch.le(key, rng.b_bot.to(torch.int32).unsqueeze(1) + offset, out=blocks.cand[:b])
        cand.logical_xor_(above)
        pos = cand.view(-1).nonzero().squeeze(1)
        vals = w.reshape(-1)[pos]
        if dropped is not None:  # min_p's drops are -inf in the reference's z'
            vals = vals.masked_fill(dropped.reshape(-1)[pos], float("-inf"))
        found.append((pos + b0 * v, vals))
        if dest is not None:
            out[dest[b0:b1]] = above
        parts.append(rng)
    pos = torch.cat([f[0] for f in found])
    if todo is not None:  # back to the numbering of all cut rows
        row = torch.div(pos, v, rounding_mode="floor")
        pos = todo[row] * v + (pos - row * v)
    return m_all, _Ranges.cat(parts), pos, torch.cat([f[1] for f in found])


def _select_kernel(
    work: Work, idx: torch.Tensor | None, thr32: torch.Tensor, min_p: torch.Tensor | None,
    out: torch.Tensor, dest: torch.Tensor | None, lanes: int | None, hd2: torch.Tensor,
) -> tuple[tuple[torch.Tensor, _Ranges, torch.Tensor, torch.Tensor], torch.Tensor]:
    """The same as :func:`_select_torch` through the compiled row passes of :mod:`parity.core.kernels`:
    one pass for the histogram, the ranges from it (:func:`_ranges`, shared), one pass for the kept
    mask and the candidates. Returns that and the rows left to the torch passes: rows with a value in
    min_p's rounding band (the reference's min_p_mask decides them); those get no candidates here."""
    r, v = thr32.shape[0], work.shape[1]
    z, rows, t = _rows_np(work, idx, r)
    m = _row_max(work, idx)
    lo, hi, redo, drop = _thresholds(m, min_p)
    m_np = m.squeeze(1).numpy()
    counts = np.zeros((r, NB), dtype=np.int64)
    masses = np.zeros((r, NB), dtype=np.float64)
    near = np.zeros(r, dtype=bool)
    geometry = (SHIFT, BASE, NB - 1, np.float32(2.0**LOW_EXP), np.float32(2.0**HIGH_EXP))
    _run(kernels.hist_rows, r, z, rows, t, m_np, lo, hi, drop, counts, masses, near, *geometry)
    rng = _ranges(torch.from_numpy(counts).double(), torch.from_numpy(masses), thr32, v, lanes, hd2, _prefix_kernel(counts, masses, hd2))
    todo = torch.from_numpy(near | redo)
    if bool(todo.any()):  # no candidates and no kept tokens from the kernel on these rows
        rng.b_top[todo] = 0
        rng.b_bot[todo] = -1
        rng.n_cand[todo] = 0
    start = torch.cat([torch.zeros(1, dtype=torch.long), rng.n_cand.cumsum(0)])
    cand_pos = np.empty(int(start[-1]), dtype=np.int64)
    cand_val = np.empty(int(start[-1]), dtype=np.float32)
    dest_np = np.arange(r, dtype=np.int64) if dest is None else dest.contiguous().numpy()
    _run(
        kernels.mark_rows, r, z, rows, t, m_np, lo, drop, rng.b_top.numpy(), rng.b_bot.numpy(), out.numpy(), dest_np,
        start.numpy(), cand_pos, cand_val, *geometry,
    )
    return (m, rng, torch.from_numpy(cand_pos), torch.from_numpy(cand_val)), todo.nonzero().squeeze(1)


_POOL: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    """Worker threads for the single-threaded steps (numpy's sort, bincount), as many as torch's threads."""
    global _POOL
    threads = max(torch.get_num_threads(), 2)
    if _POOL is None or _POOL._max_workers < threads:
        _POOL = concurrent.futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="parity-nucleus")
    return _POOL


def _sorted_rows(a: np.ndarray) -> np.ndarray:
    """``np.sort(a, axis=1)``, the rows split over torch's intra-op thread count (numpy's sort releases
    the GIL; one thread each, as torch's own kernels use them); with the compiled kernels, their radix
    sort (:func:`parity.core.kernels.sort_rows`: the same values, -0.0 before 0.0)."""
    if kernels.backend() == "numba" and a.dtype == np.float32 and a.size:
        a = np.ascontiguousarray(a)
        out = np.empty_like(a)
        _run(kernels.sort_rows, a.shape[0], a, out)  # radix sort: about 4x numpy's on these rows
        return out
    threads = min(torch.get_num_threads(), a.shape[0])
    if threads <= 1:
        return np.sort(a, axis=1)
    out = np.empty_like(a)
    bounds = np.linspace(0, a.shape[0], threads + 1).astype(int)

    def one(i: int) -> None:
        out[bounds[i] : bounds[i + 1]] = np.sort(a[bounds[i] : bounds[i + 1]], axis=1)

    list(_pool().map(one, range(threads)))
    return out


def _values_cut(w: torch.Tensor, thr32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's top_p cut value of each row, from its sorted values alone (no permutation).

    The reference (:func:`parity.core.filters.top_k_top_p_sorted`) takes the float32 softmax and cumulative
    sum of the row sorted ascending; those depend on the sorted *values* only, so running the same ops
    on the same values gives its bits. CPU tensors. Returns
    (v* [k]: the first kept value, split [k]: the value before it is equal, so which of the tied tokens
    are kept depends on the reference's permutation, which this does not know).
    """
    # numpy's sort of the values alone (no permutation): on one thread, about a quarter of the CPU time of
    # torch.sort's values and indices on two. The sorted values are the same whatever sorts them (0.0 and
    # -0.0 may swap: equal, with the same exp and the same comparisons).
    vals = torch.from_numpy(_sorted_rows(w.contiguous().numpy()))
    cum = torch.cumsum(vals.softmax(dim=-1), dim=-1)
    # The drops (cum <= 1 - p) are a prefix: the cumulative sum only grows (CPU cumsum accumulates the
    # nonnegative float32 terms in double and rounds each output, both monotone), so their number is a
    # binary search; the largest token is always kept.
    first = torch.searchsorted(cum, thr32.unsqueeze(1), right=True).clamp(max=vals.shape[1] - 1)
    v_star = vals.gather(1, first).squeeze(1)
    split = (first.squeeze(1) > 0) & (vals.gather(1, (first - 1).clamp(min=0)).squeeze(1) == v_star)
    return v_star, split


@dataclass
class _Ranges:
    b_top: torch.Tensor  # long [R]: first candidate bucket (every bucket before it is certainly kept)
    b_bot: torch.Tensor  # long [R]: last candidate bucket (every bucket after it is certainly dropped)
    n_cand: torch.Tensor  # long [R]: tokens in the range
    band: torch.Tensor  # bool [R]: no certain range (or p = 1 underflow band): fall back
    bracket: torch.Tensor  # bool [R]: range outside the window or wider than MAX_CANDIDATES: fall back
    a_all: torch.Tensor  # float64 [R]: A (upper bound), the denominator's argument/exp error
    e_sum: torch.Tensor  # float64 [R]: E, the denominator's summation error, relative
    a_below: torch.Tensor  # float64 [R]: A over the tokens below the range (upper bound, unnormalised)
    above: torch.Tensor | None = None  # float64 [R]: float32 e's mass above the range (histogram)
    below: torch.Tensor | None = None  # float64 [R]: the same below the range

    @staticmethod
    def cat(parts: list[_Ranges]) -> _Ranges:
        return _Ranges(*(torch.cat([getattr(pt, f) for pt in parts]) for f in _Ranges.__dataclass_fields__))

    def assign(self, rows: torch.Tensor, other: _Ranges) -> None:
        """Rows ``rows`` of every field from ``other`` (one row of it per entry of ``rows``)."""
        for f in _Ranges.__dataclass_fields__:
            getattr(self, f)[rows] = getattr(other, f)


@dataclass
class _Prefix:
    """A histogram's prefix sums (each [b, NB] float64, ``suffix`` [b, NB + 1]) and B's bound [b]."""

    cum: torch.Tensor  # masses of buckets <= k
    ecum: torch.Tensor  # their error bounds (``_bucket_error``)
    ncum: torch.Tensor  # counts of buckets <= k
    acum: torch.Tensor  # sum of (mass + error) * (upper d + 2): the A term
    suffix: torch.Tensor  # masses of buckets >= k (0 past the last)
    b_sum: torch.Tensor  # sum_k (mass + error)_k * ncum_k (B's bound before its rounding factor)


def _bucket_error(mb: torch.Tensor, nb: torch.Tensor) -> torch.Tensor:
    """Each float32 exp is within 1 ulp (2u); the float64 sum of n of them adds at most n 2^-53."""
    return mb * ((2 * U + nb * 2.0**-53) * _SLACK)


def _prefix(nb: torch.Tensor, mb: torch.Tensor, hd2: torch.Tensor) -> _Prefix:
    """The prefix sums of :class:`_Prefix` in torch ops (the compiled pass: :func:`parity.core.kernels.prefix_rows`)."""
    eb = _bucket_error(mb, nb)
    m_hi = mb + eb
    ncum = nb.cumsum(dim=1)
    suffix = torch.nn.functional.pad(mb.flip(1).cumsum(dim=1).flip(1), (0, 1))  # suffix[k]: buckets >= k
    return _Prefix(mb.cumsum(dim=1), eb.cumsum(dim=1), ncum, (m_hi * hd2).cumsum(dim=1), suffix, (m_hi * ncum).sum(dim=1))


def _prefix_kernel(counts: np.ndarray, masses: np.ndarray, hd2: torch.Tensor) -> _Prefix:
    """:func:`_prefix` through :func:`parity.core.kernels.prefix_rows`: one pass over each row's buckets
    in place of about fifteen torch ops over [R, NB] (70 ms at 4096 x 32k, two thirds of full's time)."""
    r, nbk = masses.shape
    cum, ecum, ncum, acum = (np.empty((r, nbk)) for _ in range(4))
    suffix, b_sum = np.empty((r, nbk + 1)), np.empty(r)
    _run(kernels.prefix_rows, r, counts, masses, hd2.numpy(), 2 * U * _SLACK, 2.0**-53 * _SLACK, cum, ecum, ncum, acum, suffix, b_sum)
    return _Prefix(*(torch.from_numpy(a) for a in (cum, ecum, ncum, acum, suffix, b_sum)))


def _ranges(
    nb: torch.Tensor, mb: torch.Tensor, thr32: torch.Tensor, v: int, lanes: int | None, hd2: torch.Tensor, pre: _Prefix | None = None
) -> _Ranges:
    """Per row, from its histogram (counts ``nb``, masses ``mb``: float64 sums of float32 exps; both [b, NB] float64)
    and its prefix sums (``pre``; default :func:`_prefix`)."""
    dev = nb.device
    if pre is None:
        pre = _prefix(nb, mb, hd2)
    cum, ecum, ncum, acum = pre.cum, pre.ecum, pre.ncum, pre.acum
    s, es0 = cum[:, -1], ecum[:, -1]
    es = es0 + s * 2.0**-50
    s_lo = (s - es).clamp(min=1.0)  # the max contributes exp(0) = 1
    s_hi = s + es
    # B = sum over tokens of e * (tokens at or above it) <= sum_b mass_b * count(buckets <= b)
    b_bound = pre.b_sum * (1 + 4 * U)
    anyorder = torch.full_like(s, float(v - 1))
    e_sum = anyorder if lanes is None else torch.minimum((b_bound / s_lo + (lanes - 1)) / lanes + (lanes - 1), anyorder)
    a_all = acum[:, -1] / s_lo
    thr = thr32.double()
    one = thr32 == 0

    # The crossing bucket: the first whose mass strictly below, s - cum, is at most (1 - p) s.
    star = torch.searchsorted(cum, (s * (1 - thr)).unsqueeze(1)).squeeze(1).clamp(max=NB - 1)
    offs = torch.arange(-WINDOW, WINDOW + 1, device=dev)
    win = (star.unsqueeze(1) + offs).clamp(0, NB - 1)  # [b, 2W + 1]
    cum_w, ecum_w, mb_w = cum.gather(1, win), ecum.gather(1, win), mb.gather(1, win)
    eb_w = _bucket_error(mb_w, nb.gather(1, win))
    below = s.unsqueeze(1) - cum_w  # mass strictly below bucket b
    e_below = es0.unsqueeze(1) - ecum_w
    incl, e_incl = below + mb_w, e_below + eb_w
    t = thr.unsqueeze(1)
    k_ref = (3 + a_all + e_sum).unsqueeze(1)
    a1, es1, s_lo1 = a_all.unsqueeze(1), es.unsqueeze(1), s_lo.unsqueeze(1)

    def band_at(cm: torch.Tensor) -> torch.Tensor:  # reference band (A_j <= A) + the histogram's error
        return _margin(a1, cm, k_ref, v, es1 * (1 + cm) / s_lo1)

    # Certainly dropped: every bucket after b (cumulative mass below b certainly under 1 - p); certainly
    # kept: every bucket before b (cumulative mass at b's top certainly over). Both monotone in b.
    c_below = (below + e_below) / s_lo1
    c_above = (incl - e_incl) / s_hi.unsqueeze(1)
    cb = c_below < t - band_at(torch.maximum(c_below, t))
    ca = c_above > t + band_at(torch.maximum(c_above, t))
    first_cb = cb.shape[1] - cb.flip(1).to(torch.int8).cumprod(dim=1).sum(dim=1)  # the run of True at the end
    last_ca = ca.to(torch.int8).cumprod(dim=1).sum(dim=1) - 1  # the run of True at the start
    b_bot = win.gather(1, first_cb.clamp(max=cb.shape[1] - 1).unsqueeze(1)).squeeze(1)
    b_top = win.gather(1, last_ca.clamp(min=0).unsqueeze(1)).squeeze(1)
    no_bottom = ~cb[:, -1]
    no_top = ~ca[:, 0]
    band = (no_bottom & (win[:, -1] == NB - 1)) | (no_top & (win[:, 0] == 0))  # the row's ends reached
    bracket = ~band & (no_bottom | no_top)  # the run leaves the window
    # p = 1 rows: keep d < 80, drop d > 105; any token in between: fall back.
    b_top = torch.where(one, torch.full_like(b_top, _KEEP_KEY), b_top)
    b_bot = torch.where(one, b_top - 1, b_bot)
    gap = ncum[:, _DROP_KEY] - ncum[:, _KEEP_KEY - 1]
    band = torch.where(one, gap > 0, band)
    bracket &= ~one
    n_cand = (ncum.gather(1, b_bot.clamp(min=0).unsqueeze(1)).squeeze(1) - torch.where(
        b_top > 0, ncum.gather(1, (b_top - 1).clamp(min=0).unsqueeze(1)).squeeze(1), torch.zeros_like(s)
    )).long().clamp(min=0)
    bracket |= ~band & (n_cand > MAX_CANDIDATES)
    skip = band | bracket
    # Rows that fall back take no candidates and keep nothing here (the reference fills them).
    b_top = torch.where(skip, torch.zeros_like(b_top), b_top)
    b_bot = torch.where(skip, torch.full_like(b_bot, -1), b_bot)
    n_cand = torch.where(skip, torch.zeros_like(n_cand), n_cand)
    a_below = acum[:, -1] - acum.gather(1, b_bot.clamp(min=0).unsqueeze(1)).squeeze(1)
    # The masses above and below the range: prefix sums of the buckets' float64 masses (HIST_REL_ERROR).
    zero = torch.zeros_like(s)
    m_above = torch.where(b_top > 0, cum.gather(1, (b_top - 1).clamp(min=0).unsqueeze(1)).squeeze(1), zero)
    m_below = pre.suffix.gather(1, (b_bot + 1).unsqueeze(1)).squeeze(1)  # a sum, not s - cum: no cancellation
    return _Ranges(b_top, b_bot, n_cand, band, bracket, a_all, e_sum, a_below, m_above, m_below)


def _margin(a_j: torch.Tensor, cmax: torch.Tensor, k_ref: torch.Tensor, v: int, ours: torch.Tensor) -> torch.Tensor:
    """Half-width around ``1 - p`` (cumulative mass units) inside which a decision is not certain.

    ``u (A_j + C (3 + A + E)) + V 2^-53 + 2^-40`` bounds the reference's float32 cumulative sum against
    the exact one (module docstring; ``k_ref = 3 + A + E``, C = ``cmax`` = max(C_j, 1 - p)); ``ours`` is
    this module's own error at that position.
    """
    return U * _SLACK * (a_j + cmax * k_ref) + v * 2.0**-53 + _ABS + ours


def _tied(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The last dropped and the first kept candidate have the same value: the cut splits a tie."""
    return lo == hi


def _cut(
    pos: torch.Tensor, vals: torch.Tensor, m: torch.Tensor, rng: _Ranges, thr32: torch.Tensor, v: int, *, decide: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact cut over the candidates (flat positions ``pos`` into the cut rows, grouped by row).

    The masses above and below the range are float32 e summed in float64 by the histogram (``rng``); the
    candidates' are float64 exps. Returns (flat positions kept, log_mass [R], band [R], tie_split [R],
    decided [R]); with ``decide``, rows whose only uncertainty is a candidate inside the band keep the
    float64 cut and are ``decided`` instead of ``band``.

    The rows are cut in groups of similar candidate counts (:data:`CUT_GROUPS`), each padded to its own
    widest row: every row's arithmetic is its own; a row's padding (no mass, never kept) is all that changes.
    """
    r = m.shape[0]
    dev = m.device
    start = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), rng.n_cand.cumsum(0)[:-1]])
    log_mass = torch.empty(r, dtype=torch.float64, device=dev)
    band = torch.empty(r, dtype=torch.bool, device=dev)
    tie_split, decided = torch.empty_like(band), torch.empty_like(band)
    kept: list[torch.Tensor] = []
    by_width = rng.n_cand.argsort(stable=True)
    size = _group_size(rng.n_cand[by_width])
    for g0 in range(0, r, size):
        rows = by_width[g0 : g0 + size]
        narrow = int(rng.n_cand[rows[-1]]) <= CUT_SERIAL_WIDTH  # rows sorted by width: the last is the widest
        with _one_thread() if narrow else contextlib.nullcontext():
            keep_pos, log_mass[rows], band[rows], tie_split[rows], decided[rows] = _cut_rows(
                rows, start[rows], pos, vals, m, rng, thr32, v, decide
            )
        kept.append(keep_pos)
    return (torch.cat(kept) if kept else pos[:0]), log_mass, band, tie_split, decided


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """torch's intra-op parallelism off within the block (this thread's setting; restored after)."""
    before = torch.get_num_threads()
    if before == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _group_size(widths: torch.Tensor) -> int:
    """Rows per group of :func:`_cut` for candidate counts ``widths`` (ascending): of 1, 2, 4, ...
    CUT_GROUPS groups, the one with the least padded area plus CUT_GROUP_COST per group."""
    r = widths.numel()
    best, best_size = None, max(r, 1)
    g = 1
    while g <= CUT_GROUPS:
        size = max(-(-r // g), 1)
        tops = widths[size - 1 :: size].tolist() + ([int(widths[-1])] if r % size else [])
        cost = sum(size * max(int(w), 1) for w in tops) + len(tops) * CUT_GROUP_COST
        if best is None or cost < best:
            best, best_size = cost, size
        g *= 2
    return best_size


def _cut_rows(
    rows: torch.Tensor, start: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor, m_all: torch.Tensor, rng_all: _Ranges,
    thr_all: torch.Tensor, v: int, decide: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_cut` on the cut rows ``rows`` (their candidates from ``start`` on in ``pos`` / ``vals``)."""
    dev = m_all.device
    m, thr32 = m_all[rows], thr_all[rows]
    rng = _Ranges(*(getattr(rng_all, f)[rows] for f in _Ranges.__dataclass_fields__))
    n_cand = rng.n_cand
    width = max(int(n_cand.max()) if rows.numel() else 0, 1)
    col = torch.arange(width, device=dev)
    valid = col.unsqueeze(0) < n_cand.unsqueeze(1)
    at = (start.unsqueeze(1) + col).clamp(max=max(pos.numel() - 1, 0))
    if pos.numel():
        cvals = torch.where(valid, vals[at], torch.full((), float("inf"), device=dev))
        cpos = torch.where(valid, pos[at], torch.full((), -1, dtype=torch.long, device=dev))
    else:
        cvals = torch.full(valid.shape, float("inf"), device=dev)
        cpos = torch.full(valid.shape, -1, dtype=torch.long, device=dev)
    cvals, order = cvals.sort(dim=1)  # ascending; padding (+inf) last
    cpos = cpos.gather(1, order)
    valid = cpos >= 0
    x = (cvals - m).double().masked_fill(~valid, 0.0)  # fl(z' - m), as the reference computes it
    ec = torch.exp(x).masked_fill(~valid, 0.0)
    low, above = rng.below, rng.above
    assert low is not None and above is not None, "nucleus_cut fills the masses around the range first"
    s = low + above + ec.sum(dim=1)  # the row's mass (exact exps up to HIST_REL_ERROR on low and above)
    e_low = HIST_REL_ERROR * low
    e_s = HIST_REL_ERROR * (low + above)
    s_lo = (s - e_s).clamp(min=1.0).unsqueeze(1)
    t = thr32.double().unsqueeze(1)
    c = (low.unsqueeze(1) + ec.cumsum(dim=1)) / s.unsqueeze(1)
    drop = (c <= t) & valid
    fin = ec > 0  # -inf candidates (min_p) have no mass and no argument error
    a_j = (rng.a_below.unsqueeze(1) + torch.where(fin, ec * (2 - x), torch.zeros_like(ec)).cumsum(dim=1)) / s_lo
    cmax = torch.maximum(c, t)
    j = torch.arange(1, width + 1, device=dev, dtype=torch.float64).unsqueeze(0)
    ours_j = (e_low.unsqueeze(1) + cmax * e_s.unsqueeze(1)) / s_lo + cmax * 2.0**-48 + j * 2.0**-52
    near = ((c - t).abs() <= _margin(a_j, cmax, (3 + rng.a_all + rng.e_sum).unsqueeze(1), v, ours_j)) & valid
    # The largest token is always kept: it is a candidate when the range starts at bucket 0.
    last = (n_cand - 1).clamp(min=0)
    has_max = (rng.b_top == 0) & (n_cand > 0)
    top = torch.zeros_like(drop).scatter_(1, last.unsqueeze(1), has_max.unsqueeze(1))
    drop &= ~top
    near &= ~top
    first_kept = drop.sum(dim=1)
    split = (first_kept > 0) & (first_kept < n_cand)
    lo_v = cvals.gather(1, (first_kept - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
    hi_v = cvals.gather(1, first_kept.clamp(max=width - 1).unsqueeze(1)).squeeze(1)
    skip = rng.band | rng.bracket
    tie_split = ~skip & split & _tied(lo_v, hi_v)
    in_band = ~skip & near.any(dim=1)
    decided = in_band & ~tie_split if decide else torch.zeros_like(in_band)
    band = rng.band | (in_band & ~decided)
    keep_c = valid & ~drop
    kept_mass = above + (ec * keep_c).sum(dim=1)
    fb = band | tie_split | rng.bracket
    log_mass = torch.where(fb, torch.full_like(kept_mass, float("nan")), torch.log(kept_mass))
    keep_c &= ~fb.unsqueeze(1)
    return cpos[keep_c], log_mass, band, tie_split, decided


def log_renormalised(zy: torch.Tensor, row_max: torch.Tensor, log_mass: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """``z'_y - log(sum_{kept} exp(z') [+ exp(z'_y) if forced])`` from :func:`nucleus_cut`'s kept mass.

    ``zy``: float32 ``[R]`` scaled logit of the sampled token; ``row_max`` float32 ``[R]`` and ``log_mass``
    ``[R]`` from the cut; ``forced``: y is outside the kept set and is added to it. The shift is the same
    float32 ``z'_y - m`` as :func:`parity.core.estimators._log_renormalised` (m, the row max, is kept); the
    sums are float64, so the result is within :data:`LOG_MASS_REL_ERROR` (plus float32 rounding of the
    result) of the float64 renormalisation over the same kept set.
    """
    x = (zy - row_max).double()
    lse = torch.where(forced, torch.logaddexp(log_mass, x), log_mass)
    return (x - lse).to(zy.dtype)
