"""The nucleus (top_p) cut of vLLM's sort path without sorting the row: a histogram select on float bits.

vLLM's PyTorch top-p (``apply_top_k_top_p_pytorch`` in vllm/v1/sample/ops/topk_topp_sampler.py, mirrored
by :func:`parity.filters.top_k_top_p_sorted`) sorts the whole row ascending, takes the float32 softmax of
the sorted row, its cumulative sum, and drops the positions with ``cumsum <= 1 - p`` (the largest token
always kept). The kept set is therefore ``{z' >= v*}`` for one value v* per row, and finding v* is a
selection by probability mass, not a sort. :func:`nucleus_cut` finds it in a few passes over the row:

1. ``d = m - z'`` (m the row max) and ``e = exp(-d)`` in float32, the very argument and function the
   reference's softmax evaluates;
2. a histogram of the sortable bits of ``d`` (``d >= 0``, so its int32 view is monotone in d):
   ``MANTISSA_BITS`` mantissa bits per binade, counts and float32 masses per bucket, accumulated in
   ``CHUNKS`` slices of the row so that each float32 bucket sum has few terms;
3. from the histogram, per row, the range of buckets in which the cut can fall (every bucket above it
   certainly kept, every bucket below certainly dropped, with the error bounds below);
4. the tokens of those buckets (a few hundred) are the candidates: sorted by value, their exact
   cumulative mass is ``(mass below the range + float64 partial sums) / S``, and the cut is decided
   there, in float64, exactly as on the top_k path (:func:`parity.estimators._top_p_on_candidates`).

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
    vector path (:func:`softmax_lanes`); where it is not known, the any-order bound is used.
  - the absolute terms cover underflowed float32 terms and this module's float64 arithmetic.

  Our own evaluation adds the error of the histogram masses (float32 sums of ``n`` terms: ``(n - 1)u``
  relative, plus 2u for float32 exp), computed per bucket. A row whose C_j lies within the sum of both
  of ``1 - p`` at any candidate position could go either way in the reference: it falls back.
* **Tie split** (``tie_split``). When the cut falls between two equal values, which of them the
  reference drops is decided by ``torch.sort``'s permutation of the whole row: fall back.
* **Bracket** (``bracket``): the candidate range is wider than :data:`MAX_CANDIDATES` tokens (a flat
  row whose error bound spans many buckets): fall back rather than sort a large candidate list.
* **p = 1 rows** of a sort-path batch drop only tokens whose float32 probability underflows to 0: kept
  if ``x > -80``, dropped if ``x < -105`` (the bounds of :mod:`parity.estimators`), and the row falls
  back (``band``) if any token lies in between.

The log-mass of the kept set, ``log sum_{kept} exp(z' - m)``, comes from the same histogram (buckets
above the range) plus the candidates' float64 masses; where its certified relative error exceeds
:data:`LOG_MASS_REL_ERROR` (a flat row, where buckets hold many terms), the kept mass is summed again
over the row in blocks of :data:`BLOCK` (error ``(BLOCK + 1)u``).

CPU float32 only (the float32 kernels above are the CPU ones); other devices keep the reference sort.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from parity.filters import min_p_mask

U = 2.0**-24  # float32 unit roundoff
_SLACK = 1.0 + 2.0**-20  # second-order terms of the first-order error bounds
_ABS = 2.0**-40  # absolute slack: underflowed float32 terms, float64 evaluation

# Histogram over d = m - z' >= 0: bucket key = (float32 bits of d >> SHIFT) - BASE, clamped.
MANTISSA_BITS = 6  # buckets per binade: 2**6 (relative width of a bucket in d: 1/64)
SHIFT = 23 - MANTISSA_BITS
LOW_EXP, HIGH_EXP = -4, 7  # d in [2^-4, 2^7) is resolved; below: bucket 0; d >= 2^7 (exp underflows): last
BASE = (127 + LOW_EXP) << MANTISSA_BITS
NB = ((HIGH_EXP - LOW_EXP) << MANTISSA_BITS) + 1
CHUNKS = 4  # the row is histogrammed in this many slices, so each float32 bucket sum has fewer terms
MAX_CANDIDATES = 16384  # wider candidate ranges fall back (counted as bracket)
GROUP = 8  # exact masses: float32 sums of GROUP terms, then float64
# The kept mass and the masses around the cut carry float32 exp (2u) and a float32 sum of GROUP terms
# ((GROUP - 1)u) per term: a certified relative error, so also the error of log_mass in nats.
SUM_REL_ERROR = (GROUP + 1) * U * _SLACK + 2.0**-48
LOG_MASS_REL_ERROR = SUM_REL_ERROR

# p = 1 rows on the sort path: the bounds of parity.estimators (_UNDERFLOW_DROP, _UNDERFLOW_KEEP).
UNDERFLOW_DROP, UNDERFLOW_KEEP = 105.0, 80.0  # in d = -x


@dataclass
class NucleusResult:
    kept: torch.Tensor  # bool: ``out`` with the cut rows filled, or [R, V] (meaningless on fallback rows)
    log_mass: torch.Tensor  # float64 [R]: log sum_{kept} exp(z' - m), m the row max (NaN on fallback rows)
    row_max: torch.Tensor  # float32 [R, 1]: m
    band: torch.Tensor  # bool [R]: a decision fell inside the rounding band (or p = 1 underflow band)
    tie_split: torch.Tensor  # bool [R]: the cut fell inside a group of equal values
    bracket: torch.Tensor  # bool [R]: the candidate range held more than MAX_CANDIDATES tokens
    candidates: torch.Tensor  # long [R]: tokens in the candidate range (what was sorted)

    @property
    def fallback(self) -> torch.Tensor:
        """bool [R]: rows that must run the reference sort."""
        return self.band | self.tie_split | self.bracket

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


def supported(work: torch.Tensor) -> bool:
    """Whether :func:`nucleus_cut` applies: CPU float32 (the reference kernels modelled above)."""
    return work.device.type == "cpu" and work.dtype == torch.float32 and work.dim() == 2


def _edges(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Lower and upper d of each bucket (float64 [NB]); bucket 0 starts at 0, the last ends at +inf."""
    bits = ((torch.arange(NB + 1, dtype=torch.int64) + BASE) << SHIFT).to(torch.int32)
    edge = bits.view(torch.float32).double()
    lo, hi = edge[:-1].clone(), edge[1:].clone()
    lo[0] = 0.0
    hi[-1] = float("inf")
    return lo.to(device), hi.to(device)


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
    part = f.as_strided((b, GROUP, main // GROUP), (f.stride(0), main // GROUP, 1)).sum(dim=1).double().sum(dim=1)
    if main < v:
        part += f[:, main:].double().sum(dim=1)
    return part


def nucleus_cut(
    work: torch.Tensor,
    p: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lanes: int | None = -1,
) -> NucleusResult:
    """The kept set of vLLM's sort-path top_p cut for rows with no top_k, from a histogram select.

    ``work``: float32 ``[N, V]`` on CPU, the scaled logits (``-inf`` allowed, every row with a finite
    value); ``rows``: the rows to cut (default: all), R of them. ``p``: float32 ``[R]``, top_p per row
    (1.0: the row only drops float32-underflowed tokens, as vLLM's sort path does for rows without top_p).
    ``min_p``: float32 ``[R]`` or None: applied first with :func:`parity.filters.min_p_mask`, block of rows
    by block (the reference's own function; its result for a row does not depend on the other rows).
    ``out``: a bool ``[N, V]`` tensor whose ``rows`` receive the kept set (default: a new ``[R, V]``).
    ``lanes``: the softmax accumulator's lane count (default :func:`softmax_lanes`; None: any order).

    Rows go through in blocks of about :data:`BLOCK_ELEMS` values with buffers reused block after block
    (a fresh ``[R, V]`` buffer costs about as much as a pass over it, in page faults): only the kept mask
    is full size. Two passes over each block: the histogram, then (once every row's candidate range is
    known) the kept mask, the candidates and the exact masses.
    """
    if not supported(work):
        raise ValueError(f"nucleus_cut needs float32 [N, V] logits on CPU: got {work.dtype} {tuple(work.shape)} on {work.device}")
    n, v = work.shape
    dev = work.device
    whole = rows is None
    idx = torch.arange(n, device=dev) if whole else rows.to(device=dev, dtype=torch.long)
    r = idx.numel()
    if p.shape != (r,):
        raise ValueError(f"p has shape {tuple(p.shape)}: allowed [{r}] (one top_p per row cut)")
    if min_p is not None and min_p.shape != (r,):
        raise ValueError(f"min_p has shape {tuple(min_p.shape)}: allowed [{r}] (one min_p per row cut)")
    if out is None:
        out, dest = torch.empty(r, v, dtype=torch.bool, device=dev), None  # cut row i -> out[i]
    elif out.shape != (n, v) or out.dtype != torch.bool:
        raise ValueError(f"out has {out.dtype} {tuple(out.shape)}: allowed bool [{n}, {v}]")
    else:
        dest = None if whole else idx
    if lanes == -1:
        lanes = softmax_lanes(dev)
    block = max(1, min(r, BLOCK_ELEMS // max(v, 1)))
    spans = [(b0, min(r, b0 + block)) for b0 in range(0, r, block)]
    buf = _Buffers(block, v, dev)
    dropped = torch.empty(r, v, dtype=torch.bool, device=dev) if min_p is not None else None

    def block_rows(b0: int, b1: int) -> torch.Tensor:
        if whole:
            return work[b0:b1]
        return torch.index_select(work, 0, idx[b0:b1], out=buf.rows[: b1 - b0])

    # A. Per block: m, e = exp(z' - m), bucket keys, the histogram (counts, float32 masses).
    hist_n = torch.zeros(r * NB, device=dev)
    hist_m = torch.zeros(r * NB, device=dev)
    m = torch.empty(r, 1, device=dev)
    for b0, b1 in spans:
        w = block_rows(b0, b1)
        if dropped is not None:
            dropped[b0:b1] = min_p_mask(w, min_p[b0:b1])
        e, key = buf.exp_and_keys(w, m[b0:b1], None if dropped is None else dropped[b0:b1], fresh_max=True)
        key.add_(buf.off[: b1 - b0] + b0 * NB)
        hist_n.index_add_(0, key.view(-1), buf.ones[: key.numel()])
        hist_m.index_add_(0, key.view(-1), e.view(-1))

    # B. All rows: the candidate range [b_top, b_bot] of bucket keys, and the rows that fall back.
    rng = _ranges(hist_n.view(r, NB).double(), hist_m.view(r, NB).double(), (1 - p), v, lanes, buf)

    # C. Per block: kept mask (buckets above the range) into out, the candidates, the masses above and
    # below the range (float32 e, summed in blocks of GROUP: certified within (GROUP + 1)u of exact exps).
    b_top32, b_bot32 = rng.b_top.to(torch.int32).unsqueeze(1), rng.b_bot.to(torch.int32).unsqueeze(1)
    above_mass = torch.empty(r, dtype=torch.float64, device=dev)
    below_mass = torch.empty(r, dtype=torch.float64, device=dev)
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    for b0, b1 in spans:
        w = block_rows(b0, b1)
        e, key = buf.exp_and_keys(w, m[b0:b1], None if dropped is None else dropped[b0:b1], fresh_max=False)
        above = out[b0:b1] if dest is None else buf.above[: b1 - b0]
        torch.lt(key, b_top32[b0:b1], out=above)  # certainly kept
        cand = torch.le(key, b_bot32[b0:b1], out=buf.cand[: b1 - b0])
        below_mass[b0:b1] = _row_sums(torch.mul(e, cand.logical_not(), out=buf.f[: b1 - b0]))
        cand.logical_xor_(above)
        pos = cand.view(-1).nonzero().squeeze(1)
        found.append((pos + b0 * v, w.reshape(-1)[pos]))
        above_mass[b0:b1] = _row_sums(torch.mul(e, above, out=buf.f[: b1 - b0]))
        if dest is not None:
            out[dest[b0:b1]] = above

    # D. All rows: the exact cut on the candidates, sorted by value.
    pos = torch.cat([f[0] for f in found])
    res = _cut(pos, torch.cat([f[1] for f in found]), m, below_mass, above_mass, rng, 1 - p, v)
    keep_pos, log_mass, band, tie_split = res
    if keep_pos.numel():
        crow = torch.div(keep_pos, v, rounding_mode="floor")
        target = crow if dest is None else dest[crow]
        out.view(-1)[target * v + (keep_pos - crow * v)] = True
    return NucleusResult(out, log_mass, m, band, tie_split, rng.bracket, rng.n_cand)


BLOCK_ELEMS = 1 << 21  # values per row block (2 MB per float32 buffer)


class _Buffers:
    """Buffers of one row block, reused block after block, and the bucket edges."""

    def __init__(self, block: int, v: int, dev: torch.device) -> None:
        self.e = torch.empty(block, v, device=dev)
        self.f = torch.empty(block, v, device=dev)
        self.key = torch.empty(block, v, dtype=torch.int32, device=dev)
        self.above = torch.empty(block, v, dtype=torch.bool, device=dev)
        self.cand = torch.empty(block, v, dtype=torch.bool, device=dev)
        self.rows = torch.empty(block, v, device=dev)
        self.ones = torch.ones(1, device=dev).expand(block * v)
        self.off = (torch.arange(block, dtype=torch.int32, device=dev) * NB).unsqueeze(1)
        self.lo_d, self.hi_d = _edges(dev)

    def exp_and_keys(
        self, w: torch.Tensor, m: torch.Tensor, dropped: torch.Tensor | None, *, fresh_max: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """e = exp(z' - m) and the bucket keys of d = m - z' for a block (views of the buffers)."""
        b = w.shape[0]
        e, key = self.e[:b], self.key[:b]
        if fresh_max:
            torch.amax(w, dim=1, keepdim=True, out=m)
        torch.sub(m, w, out=e)  # d >= 0, +inf at -inf entries
        torch.bitwise_right_shift(e.view(torch.int32), SHIFT, out=key)
        key.sub_(BASE).clamp_(0, NB - 1)
        e.neg_().exp_()  # fl(z' - m) = -fl(m - z'): the argument the reference's softmax exponentiates
        if dropped is not None:  # min_p: the dropped tokens are -inf for every later step
            key.masked_fill_(dropped, NB - 1)
            e.masked_fill_(dropped, 0.0)
        return e, key


@dataclass
class _Ranges:
    b_top: torch.Tensor  # long [R]: first candidate bucket (every bucket before it is certainly kept)
    b_bot: torch.Tensor  # long [R]: last candidate bucket (every bucket after it is certainly dropped)
    n_cand: torch.Tensor  # long [R]: tokens in the range
    band: torch.Tensor  # bool [R]: no certain range (or p = 1 underflow band): fall back
    bracket: torch.Tensor  # bool [R]: range wider than MAX_CANDIDATES: fall back
    one: torch.Tensor  # bool [R]: p = 1
    a_all: torch.Tensor  # float64 [R]: A (upper bound), the denominator's argument/exp error
    e_sum: torch.Tensor  # float64 [R]: E, the denominator's summation error, relative
    a_below: torch.Tensor  # float64 [R]: A over the tokens below the range (upper bound), relative


def _ranges(nb: torch.Tensor, mb: torch.Tensor, thr32: torch.Tensor, v: int, lanes: int | None, buf: _Buffers) -> _Ranges:
    """Per row, from its histogram (counts ``nb``, float32 masses ``mb``, both [R, NB] float64)."""
    r = nb.shape[0]
    dev = nb.device
    # A float32 sum of n nonnegative terms is within (n - 1)u of the exact sum; float32 exp adds 2u.
    eb = (nb + 1) * mb * (U * _SLACK)
    m_hi = mb + eb
    s = mb.sum(dim=1)
    es = eb.sum(dim=1) + s * 2.0**-50
    s_lo = (s - es).clamp(min=1.0)  # the max contributes exp(0) = 1
    s_hi = s + es
    # B = sum over tokens of e * (tokens at or above it) <= sum_b mass_b * count(buckets <= b)
    b_bound = (m_hi * nb.cumsum(dim=1)).sum(dim=1) * (1 + 4 * U)
    anyorder = torch.full_like(s, float(v - 1))
    e_sum = anyorder if lanes is None else torch.minimum((b_bound / s_lo + (lanes - 1)) / lanes + (lanes - 1), anyorder)
    a_term = torch.where(m_hi > 0, m_hi * (buf.hi_d + 2), torch.zeros_like(m_hi))
    a_all = a_term.sum(dim=1) / s_lo
    zero = torch.zeros(r, 1, dtype=mb.dtype, device=dev)
    incl = mb.flip(1).cumsum(1).flip(1)  # [b]: mass of buckets >= b (at or below bucket b in value)
    e_incl = eb.flip(1).cumsum(1).flip(1)
    below = torch.cat([incl[:, 1:], zero], dim=1)  # [b]: mass strictly below bucket b
    e_below = torch.cat([e_incl[:, 1:], zero], dim=1)

    thr = thr32.double().unsqueeze(1)
    one = thr32 == 0
    k_ref = (3 + a_all + e_sum).unsqueeze(1)
    a1, es1, s_lo1 = a_all.unsqueeze(1), es.unsqueeze(1), s_lo.unsqueeze(1)

    def band_at(cm: torch.Tensor) -> torch.Tensor:  # reference band (A_j <= A) + the histogram's error
        return _margin(a1, cm, k_ref, v, es1 * (1 + cm) / s_lo1)

    # The range: the longest run of buckets from the bottom whose cumulative mass is certainly below
    # 1 - p (dropped), the longest from the top whose cumulative mass is certainly above (kept).
    c_below = (below + e_below) / s_lo1  # upper bound of the cumulative mass just below bucket b
    c_above = (incl - e_incl) / s_hi.unsqueeze(1)  # lower bound of the cumulative mass at bucket b's top
    certain_below = c_below < thr - band_at(torch.maximum(c_below, thr))
    certain_above = c_above > thr + band_at(torch.maximum(c_above, thr))
    n_below = certain_below.flip(1).to(torch.int8).cumprod(dim=1).sum(dim=1)  # run from the bottom
    n_above = certain_above.to(torch.int8).cumprod(dim=1).sum(dim=1)  # run from the top
    b_bot = NB - n_below
    b_top = (n_above - 1).clamp(min=0)
    band = (n_below == 0) | (n_above == 0)
    # p = 1 rows: keep d < 80, drop d > 105; any token in between: fall back.
    b_top = torch.where(one, torch.full_like(b_top, _KEEP_KEY), b_top)
    b_bot = torch.where(one, b_top - 1, b_bot)
    band = torch.where(one, nb[:, _KEEP_KEY : _DROP_KEY + 1].sum(dim=1) > 0, band)
    csum = torch.cat([zero, nb.cumsum(dim=1)], dim=1)
    end = (b_bot.clamp(max=NB - 1) + 1).unsqueeze(1)  # b_bot = NB: no certain bottom run (a band row)
    n_cand = (csum.gather(1, end) - csum.gather(1, b_top.unsqueeze(1))).squeeze(1).long()
    bracket = ~band & (n_cand > MAX_CANDIDATES)
    skip = band | bracket
    # Rows that fall back take no candidates and keep nothing here (the reference fills them).
    b_top = torch.where(skip, torch.zeros_like(b_top), b_top)
    b_bot = torch.where(skip, torch.full_like(b_bot, -1), b_bot)
    n_cand = torch.where(skip, torch.zeros_like(n_cand), n_cand)
    a_cum = torch.cat([a_term.flip(1).cumsum(1).flip(1)[:, 1:], zero], dim=1) / s_lo1
    a_below = a_cum.gather(1, b_bot.clamp(min=0).unsqueeze(1)).squeeze(1)
    return _Ranges(b_top, b_bot, n_cand, band, bracket, one, a_all, e_sum, a_below)


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
    pos: torch.Tensor,
    vals: torch.Tensor,
    m: torch.Tensor,
    low: torch.Tensor,
    above: torch.Tensor,
    rng: _Ranges,
    thr32: torch.Tensor,
    v: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The exact cut over the candidates (flat positions ``pos`` into the cut rows, grouped by row).

    ``low`` / ``above``: the float32 e's mass below / above the range (from :func:`_row_sums`); the
    candidates' masses are float64 exps. Returns (flat positions kept, log_mass [R], band [R], tie_split [R]).
    """
    r = m.shape[0]
    dev = m.device
    n_cand = rng.n_cand
    width = max(int(n_cand.max()) if r else 0, 1)
    crow = torch.div(pos, v, rounding_mode="floor")
    start = torch.cat([torch.zeros(1, dtype=torch.long, device=dev), n_cand.cumsum(0)[:-1]])
    slot = torch.arange(pos.numel(), device=dev) - start[crow]
    cvals = torch.full((r, width), float("inf"), device=dev)
    cpos = torch.full((r, width), -1, dtype=torch.long, device=dev)
    cvals[crow, slot] = vals
    cpos[crow, slot] = pos
    cvals, order = cvals.sort(dim=1)  # ascending; padding (+inf) last
    cpos = cpos.gather(1, order)
    valid = cpos >= 0
    x = (cvals - m).double().masked_fill(~valid, 0.0)  # fl(z' - m), as the reference computes it
    ec = torch.exp(x).masked_fill(~valid, 0.0)
    s = low + above + ec.sum(dim=1)  # the row's mass (exact exps up to SUM_REL_ERROR on low and above)
    e_low = SUM_REL_ERROR * low
    e_s = SUM_REL_ERROR * (low + above)
    s_lo = (s - e_s).unsqueeze(1)
    t = thr32.double().unsqueeze(1)
    c = (low.unsqueeze(1) + ec.cumsum(dim=1)) / s.unsqueeze(1)
    drop = (c <= t) & valid
    fin = ec > 0  # -inf candidates (min_p) have no mass and no argument error
    a_j = rng.a_below.unsqueeze(1) + torch.where(fin, ec * (2 - x), torch.zeros_like(ec)).cumsum(dim=1) / s_lo
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
    band = rng.band | (~skip & near.any(dim=1))
    keep_c = valid & ~drop
    kept_mass = above + (ec * keep_c).sum(dim=1)
    fb = band | tie_split | rng.bracket
    log_mass = torch.where(fb, torch.full_like(kept_mass, float("nan")), torch.log(kept_mass))
    keep_c &= ~fb.unsqueeze(1)
    return cpos[keep_c], log_mass, band, tie_split


def log_renormalised(zy: torch.Tensor, row_max: torch.Tensor, log_mass: torch.Tensor, forced: torch.Tensor) -> torch.Tensor:
    """``z'_y - log(sum_{kept} exp(z') [+ exp(z'_y) if forced])`` from :func:`nucleus_cut`'s kept mass.

    ``zy``: float32 ``[R]`` scaled logit of the sampled token; ``row_max`` float32 ``[R]`` and ``log_mass``
    ``[R]`` from the cut; ``forced``: y is outside the kept set and is added to it. The shift is the same
    float32 ``z'_y - m`` as :func:`parity.estimators._log_renormalised` (m, the row max, is kept); the
    sums are float64, so the result is within :data:`LOG_MASS_REL_ERROR` (plus float32 rounding of the
    result) of the float64 renormalisation over the same kept set.
    """
    x = (zy - row_max).double()
    lse = torch.where(forced, torch.logaddexp(log_mass, x), log_mass)
    return (x - lse).to(zy.dtype)
