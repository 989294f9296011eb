"""Compiled CPU row passes for :mod:`parity.core.nucleus` (numba, optional): one pass where torch takes ten.

The nucleus select and the survivor mass are a handful of elementwise steps and a histogram per row.
Written as torch ops, each step is a pass over the whole ``[R, V]`` block with its own output buffer
(keys, exps, float64 copies, two ``bincount`` calls, masks, ``nonzero``): about ten passes, where the
full log-softmax they are compared with makes three. These kernels fuse them: for each row, in chunks
that stay in the first-level cache, the bucket keys and the masses are computed in a loop the compiler
vectorises and accumulated in a second, scalar loop; a prefix pass over each row's buckets gives the
running sums the ranges are read from; a second pass over the row writes the kept mask and lists the
candidates (from the 8-value flag words that hold one: a serial compaction over whole chunks took most
of that pass). The row max comes from torch (``amax``, vectorised and threaded), so do the min_p
thresholds (:func:`parity.core.filters.min_p_thresholds`). Rows are split over torch's intra-op thread
count; the kernels release the GIL.

Every row pass reads ``z[rows[i]] / t[rows[i]]``: ``t`` is each row's temperature when the caller hands
the logits unscaled (:class:`parity.core.nucleus.Scaled`), else 1. A float32 division is correctly
rounded (no reciprocal: fastmath has no ``arcp``), so the value read is the bit of the materialised
``z / T`` (``parity.core.filters.apply_temperature``), and a pass over ``[N, V]`` and its output is saved.

Two things decide their speed, both measured: the element loops index zero-based views of each chunk
(``row[c0:c0 + n][j]``, not ``row[c0 + j]``, which numba's index wrap-around kept scalar: 1.8 against
0.27 ns per value for the mark pass), and they have no branches (a predicate is summed or selected, not
tested). Multiply-adds may be fused (fastmath ``contract`` only: no reassociation, no assumptions about
NaN or infinities), which only removes roundings from the error analysis below.

They compute what the torch passes of :mod:`parity.core.nucleus` compute, with one difference: the
masses are float64 exps of the same float32 arguments ``fl(z' - m)`` (:func:`_exp_neg`, within
:data:`EXP_REL_ERROR` of the exact exp), where the torch path sums float32 exps (1 ulp). Both lie within
the module's ``HIST_REL_ERROR`` of the exact masses, so every decision of the select is certified the
same way on both; the bucket counts, keys, kept masks and candidate lists are the same bits.

numba is optional (``pip install parity[fast]``; vLLM's CPU build brings it): without it, or with
``PARITY_KERNELS=torch``, the torch passes run. :func:`backend` names the one in use.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

try:  # numba is an optional dependency: the torch passes of parity.core.nucleus serve without it
    import numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None


def _plain_dict_for_llvmlite() -> None:
    """Give llvmlite's library handle an empty ``__dict__``.

    ``llvmlite.binding.ffi.lib`` answers every attribute lookup, ``__dict__`` included, with a C function
    wrapper. vLLM's CPU platform scans every loaded module's attributes when it registers its Triton
    kernel overrides (``vllm/triton_utils/dispatcher.py``, ``_rebind_kernels``: ``vars(value).get(...)``),
    and that scan fails on this object once numba is loaded, so an engine started after this import
    would not start. The handle's class becomes a subclass whose ``__dict__`` is a property returning
    ``{}``; every C function is still looked up as before (none is named ``__dict__``).
    """
    try:
        from llvmlite.binding import ffi
    except ImportError:  # pragma: no cover
        return
    lib = getattr(ffi, "lib", None)
    base = type(lib)
    if lib is None or base.__module__ != ffi.__name__ or "__dict__" in vars(base):
        return

    class _Handle(base):  # type: ignore[misc,valid-type]
        __slots__ = ()
        __dict__ = property(lambda self: {})

    lib.__class__ = _Handle  # same layout (no new slots): every holder of ffi.lib sees it


if numba is not None:
    _plain_dict_for_llvmlite()

BACKENDS = ("numba", "torch")
ENV = "PARITY_KERNELS"  # "numba", "torch" or "auto" (the default: numba when it imports)

# The histogram's geometry (shift, base, last bucket, clamp of d) is passed in by parity.core.nucleus.
LANES = 8  # survivor_rows sums its masses in this many independent float64 accumulators
CHUNK = 1024  # values per chunk: keys (int32) and masses (float64) of a chunk, 12 KB, stay in L1

# _exp_neg: exp(x) for float64 x in (-128, 0] from exp(x) = 2^n exp(r), |r| <= ln2 / 2:
LOG2E = 1.4426950408889634
LN2_HI = 6.93147180369123816490e-01  # fdlibm's split of ln 2: n * LN2_HI is exact for |n| < 2^20
LN2_LO = 1.90821492927058770002e-10
ROUND = 6755399441055744.0  # 1.5 * 2^52: t = y + ROUND rounds y to an integer held in t's low bits
ROUND_BITS = 0x4338000000000000  # the bits of ROUND
# Error: the Taylor remainder of degree 7 at |r| <= ln2 / 2 is exp(xi) r^8 / 8! for xi between 0 and r,
# so relative to exp(r) at most exp(|r|) |r|^8 / 8! <= sqrt(2) 0.3466^8 / 40320 < 7.4e-9 < 2^-27;
# r = (x - n LN2_HI) - n LN2_LO is exact in its first step (Sterbenz) and within 2^-53 |r| after the
# second; Horner's 7 steps add about 7 * 2^-53 (fewer where they are fused into multiply-adds); the
# scaling by 2^n is exact. Fused or not, t - ROUND is the integer n (t is ROUND + n). The masses need
# no more: their bounds (parity.core.nucleus HIST_REL_ERROR, SUM_REL_ERROR) allow 2u = 2^-23 for the
# exp, the error of the float32 exp on the torch path; degree 10 (2^-36) cost about 30 % more per value.
EXP_REL_ERROR = 2.0**-26
UNDERFLOW_X = -128.0  # x <= this: the mass is taken as 0 (float32 exp underflows below -103.97)


_FORCED: list[str] = []  # forced(): innermost last


@contextlib.contextmanager
def forced(name: str) -> Iterator[None]:
    """Within the block, :func:`backend` answers ``name`` (a row the kernels hand back runs the torch passes)."""
    if name not in BACKENDS:
        raise ValueError(f"backend is {name!r}: allowed {', '.join(BACKENDS)}")
    _FORCED.append(name)
    try:
        yield
    finally:
        _FORCED.pop()


def backend() -> str:
    """The row passes in use: ``"numba"`` (compiled) or ``"torch"`` (``PARITY_KERNELS``, default auto)."""
    if _FORCED:
        return _FORCED[-1]
    want = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", *BACKENDS):
        raise ValueError(f"{ENV} is {want!r}: allowed auto, numba or torch")
    if want == "torch" or numba is None:
        if want == "numba":
            raise ValueError(f"{ENV}=numba but numba is not installed (pip install parity[fast])")
        return "torch"
    return "numba"


F = TypeVar("F", bound=Callable[..., Any])


def _jit(**kw: Any) -> Callable[[F], F]:
    """numba.njit with the GIL released; the identity without numba (the functions are then unused)."""
    if numba is None:  # pragma: no cover
        return lambda f: f
    jit: Callable[[F], F] = numba.njit(nogil=True, cache=True, fastmath={"contract"}, **kw)
    return jit


@_jit(inline="always")
def _exp_neg(x: float) -> float:
    """exp(x) for float64 ``x`` in (-128, 0], within EXP_REL_ERROR; exactly 1 at 0. Vectorisable."""
    t = x * LOG2E + ROUND
    n = t - ROUND
    r = (x - n * LN2_HI) - n * LN2_LO
    p = 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    scale = (np.float64(t).view(np.int64) - ROUND_BITS + 1023) << 52
    return p * np.int64(scale).view(np.float64)


@_jit()
def exp_neg_array(x: np.ndarray, out: np.ndarray) -> None:
    """:func:`_exp_neg` over float64 ``x`` (for tests of its error)."""
    for i in range(x.size):
        out[i] = _exp_neg(x[i])


@_jit(inline="always")
def _key(z: np.float32, m: np.float32, lo: np.float32, shift: int, base: int, last: int, lo_d: np.float32, hi_d: np.float32) -> Any:
    """The bucket key of one value, as parity.core.nucleus's ``keys``: min_p's drops (``z < lo``) go to the last bucket."""
    d = min(max(m - z, lo_d), hi_d)  # fl(m - z') = -fl(z' - m), clamped
    key = (np.float32(d).view(np.int32) >> shift) - base
    return last if z < lo else key


@_jit(inline="always")
def _mass(z: np.float32, m: np.float32, lo: np.float32) -> float:
    """The float64 mass of one value: exp of the float32 argument ``fl(z' - m)``, 0 when min_p drops it."""
    xd = max(np.float64(z - m), UNDERFLOW_X)
    return _exp_neg(xd) * ((xd > UNDERFLOW_X) & (z >= lo))


@_jit()
def hist_rows(
    z: np.ndarray, rows: np.ndarray, r0: int, r1: int, t: np.ndarray, m: np.ndarray, lo: np.ndarray, hi: np.ndarray, drop: bool,
    counts: np.ndarray, masses: np.ndarray, near: np.ndarray, shift: int, base: int, last: int, lo_d: np.float32, hi_d: np.float32,
) -> None:
    """Counts and float64 masses per bucket of rows ``r0:r1`` (``z[rows[i]] / t[rows[i]]``, row max ``m[i]``).

    With ``drop``, values below ``lo[i]`` are min_p's drops (last bucket, no mass) and a value in
    ``[lo[i], hi[i])`` sets ``near[i]`` (min_p's rounding band: the reference decides that row).
    """
    v = z.shape[1]
    keys = np.empty(CHUNK, np.int32)
    mass = np.empty(CHUNK, np.float64)
    neg_inf = np.float32(-np.inf)
    for i in range(r0, r1):
        row = z[rows[i]]
        ti = t[rows[i]]
        mi = m[i]
        loi = lo[i] if drop else neg_inf  # -inf: nothing dropped, nothing near
        hii = hi[i] if drop else neg_inf
        c_row, m_row = counts[i], masses[i]
        hits = 0
        for c0 in range(0, v, CHUNK):
            n = min(v - c0, CHUNK)
            seg, kseg, mseg = row[c0 : c0 + n], keys[:n], mass[:n]  # zero-based views: vectorised loop
            for j in range(n):  # no branch either
                zj = seg[j] / ti
                kseg[j] = _key(zj, mi, loi, shift, base, last, lo_d, hi_d)
                mseg[j] = _mass(zj, mi, loi)
                hits += (zj >= loi) & (zj < hii)
            for j in range(n):
                k = keys[j]
                m_row[k] += mass[j]
                c_row[k] += 1
        near[i] = hits > 0


@_jit()
def mark_rows(
    z: np.ndarray, rows: np.ndarray, r0: int, r1: int, t: np.ndarray, m: np.ndarray, lo: np.ndarray, drop: bool,
    b_top: np.ndarray, b_bot: np.ndarray, out: np.ndarray, dest: np.ndarray, start: np.ndarray,
    cand_pos: np.ndarray, cand_val: np.ndarray, shift: int, base: int, last: int, lo_d: np.float32, hi_d: np.float32,
) -> None:
    """The kept mask above each row's range into ``out[dest[i]]``, and the range's tokens (candidates).

    Row i's candidates go to ``cand_pos`` / ``cand_val`` from ``start[i]`` on, in column order:
    position ``i * V + column`` and the value (``z / t`` as hist_rows reads it; -inf for min_p's drops,
    as the reference's z').
    """
    v = z.shape[1]
    neg_inf = np.float32(-np.inf)
    flags = np.zeros(CHUNK, np.uint8)  # 1 where the value is a candidate
    words = flags.view(np.uint64)  # the same flags, 8 at a time
    found = np.empty(CHUNK + 1, np.int64)
    for i in range(r0, r1):
        row = z[rows[i]]
        ti = t[rows[i]]
        o = out[dest[i]]
        mi, top, bot = m[i], b_top[i], b_bot[i]
        loi = lo[i] if drop else neg_inf
        at = start[i]
        for c0 in range(0, v, CHUNK):
            n = min(v - c0, CHUNK)
            inside = 0
            seg, oseg, fseg = row[c0 : c0 + n], o[c0 : c0 + n], flags[:n]  # zero-based views: vectorised
            for j in range(n):  # no branch either
                k = _key(seg[j] / ti, mi, loi, shift, base, last, lo_d, hi_d)
                oseg[j] = k < top
                f = (k >= top) & (k <= bot)
                fseg[j] = f
                inside += f
            if inside:  # the range's tokens (a few per row), in column order
                flags[n:] = 0  # a short last chunk: no stale flags past it
                c = 0
                for w in range((n + 7) // 8):  # only the words of flags that hold one
                    if words[w]:
                        for j in range(8 * w, 8 * w + 8):
                            found[c] = j
                            c += flags[j]
                for q in range(c):
                    j = found[q]
                    zj = row[c0 + j] / ti
                    cand_pos[at + q] = i * v + c0 + j
                    cand_val[at + q] = neg_inf if zj < loi else zj
                at += c


@_jit()
def survivor_rows(
    z: np.ndarray, rows: np.ndarray, r0: int, r1: int, t: np.ndarray, m: np.ndarray, lo: np.ndarray, hi: np.ndarray, drop: bool,
    out: np.ndarray, dest: np.ndarray, sums: np.ndarray, near: np.ndarray,
) -> None:
    """Rows that are not cut (``z[rows[i]] / t[rows[i]]``): kept = finite and not dropped by min_p; float64
    sum of their exps.

    Branch-free in the element loop (the masses of a chunk are summed after it), so the compiler
    vectorises it; ``lo`` is -inf where nothing is dropped, which makes ``drop`` a no-op there too.
    """
    v = z.shape[1]
    neg_inf = np.float32(-np.inf)
    mass = np.empty(CHUNK + LANES, np.float64)
    for i in range(r0, r1):
        row = z[rows[i]]
        ti = t[rows[i]]
        o = out[dest[i]]
        mi = m[i]
        loi = lo[i] if drop else neg_inf
        hii = hi[i] if drop else neg_inf
        acc = np.zeros(LANES)
        hits = 0
        for c0 in range(0, v, CHUNK):
            n = min(v - c0, CHUNK)
            seg, oseg, mseg = row[c0 : c0 + n], o[c0 : c0 + n], mass[:n]  # zero-based views: vectorised
            for j in range(n):
                zj = seg[j] / ti
                oseg[j] = (zj > neg_inf) & (zj >= loi)
                mseg[j] = _mass(zj, mi, loi)  # 0 at -inf too
                hits += (zj >= loi) & (zj < hii)
            mass[n : n + (-n) % LANES] = 0.0  # pad the last chunk to whole lanes
            for j in range(0, n, LANES):  # LANES independent float64 sums, not one serial chain
                for lane in range(LANES):
                    acc[lane] += mass[j + lane]
        sums[i] = acc.sum()
        near[i] = hits > 0


@_jit()
def prefix_rows(
    counts: np.ndarray, masses: np.ndarray, r0: int, r1: int, hd2: np.ndarray, k_exp: float, k_sum: float,
    cum: np.ndarray, ecum: np.ndarray, ncum: np.ndarray, acum: np.ndarray, suffix: np.ndarray, b_sum: np.ndarray,
) -> None:
    """The prefix sums of parity.core.nucleus's ``_prefix`` for rows ``r0:r1`` of a histogram, in float64:
    with e_k = mass_k (k_exp + count_k k_sum) (the bucket's error bound) and h_k = mass_k + e_k, the running
    sums of mass, e, count and h (upper d + 2) into ``cum``, ``ecum``, ``ncum``, ``acum``; the suffix sums of
    the masses into ``suffix`` (0 past the last bucket); and sum_k h_k ncum_k into ``b_sum``. Sequential
    sums, as torch's CPU cumsum of float64 runs; a fused multiply-add may replace a product and a sum
    (one rounding fewer: these are bounds with slack for far more)."""
    nbk = masses.shape[1]
    for i in range(r0, r1):
        c, e, n, a, b = 0.0, 0.0, 0.0, 0.0, 0.0
        for k in range(nbk):
            mb = masses[i, k]
            nb = np.float64(counts[i, k])
            eb = mb * (k_exp + nb * k_sum)
            hi = mb + eb
            c += mb
            e += eb
            n += nb
            a += hi * hd2[k]
            cum[i, k] = c
            ecum[i, k] = e
            ncum[i, k] = n
            acum[i, k] = a
            b += hi * n
        b_sum[i] = b
        t = 0.0
        suffix[i, nbk] = 0.0
        for k in range(nbk - 1, -1, -1):
            t += masses[i, k]
            suffix[i, k] = t


@_jit()
def list_rows(
    z: np.ndarray, rows: np.ndarray, r0: int, r1: int, t: np.ndarray, lo: np.ndarray, hi: np.ndarray,
    vals: np.ndarray, ids: np.ndarray, count: np.ndarray, near: np.ndarray,
) -> None:
    """min_p's survivors (``z / t >= lo[i]``, row ``rows[i]``) of each row, in column order: the first
    ``vals.shape[1]`` of them into ``vals`` / ``ids`` (left as they are past that), their number into
    ``count``; ``near`` as above. Flags per chunk in a branch-free loop, then the survivors listed from
    the flag words that hold one, as in mark_rows (a branch per value kept the loop scalar)."""
    v = z.shape[1]
    cap = vals.shape[1]
    flags = np.zeros(CHUNK, np.uint8)
    words = flags.view(np.uint64)
    for i in range(r0, r1):
        row = z[rows[i]]
        ti = t[rows[i]]
        loi, hii = lo[i], hi[i]
        c = 0
        hits = 0
        for c0 in range(0, v, CHUNK):
            n = min(v - c0, CHUNK)
            seg, fseg = row[c0 : c0 + n], flags[:n]  # zero-based views: vectorised
            inside = 0
            for j in range(n):
                zj = seg[j] / ti
                f = zj >= loi
                fseg[j] = f
                inside += f
                hits += f & (zj < hii)
            if inside:
                flags[n:] = 0  # a short last chunk: no stale flags past it
                for w in range((n + 7) // 8):
                    if words[w]:
                        for j in range(8 * w, 8 * w + 8):
                            if flags[j]:
                                if c < cap:
                                    vals[i, c] = row[c0 + j] / ti
                                    ids[i, c] = c0 + j
                                c += 1
        count[i] = c
        near[i] = hits > 0


@_jit()
def sort_rows(a: np.ndarray, out: np.ndarray, r0: int, r1: int) -> None:
    """Rows ``r0:r1`` of float32 ``a`` sorted ascending into ``out`` (values only): an LSD radix sort on the
    order-preserving integer keys of the float bits (negative: all bits flipped; positive: the sign bit),
    three passes of 11 bits. -0.0 sorts before 0.0 (equal values, as for numpy's sort, which may put
    either first); no NaN (the inputs are checked logits)."""
    v = a.shape[1]
    k0 = np.empty(v, np.uint32)
    k1 = np.empty(v, np.uint32)
    h = np.zeros((3, 2048), np.int64)
    top = np.uint32(31)
    low = np.uint32(2047)
    for i in range(r0, r1):
        bits = a[i].view(np.uint32)
        h[:] = 0
        for j in range(v):
            u = np.uint32(bits[j])
            u = u ^ (np.uint32(0xFFFFFFFF) if (u >> top) else np.uint32(0x80000000))
            k0[j] = u
            h[0, u & low] += 1
            h[1, (u >> np.uint32(11)) & low] += 1
            h[2, u >> np.uint32(22)] += 1
        for p in range(3):  # bucket offsets: exclusive prefix sums
            t = 0
            for b in range(2048):
                c = h[p, b]
                h[p, b] = t
                t += c
        src, dst = k0, k1
        for p in range(3):
            shift = np.uint32(11 * p)
            off = h[p]
            for j in range(v):
                u = src[j]
                b = (u >> shift) & low
                dst[off[b]] = u
                off[b] += 1
            src, dst = dst, src
        o = out[i].view(np.uint32)
        for j in range(v):
            u = src[j]
            o[j] = u ^ (np.uint32(0x80000000) if (u >> top) else np.uint32(0xFFFFFFFF))


def exp_neg(x: np.ndarray) -> np.ndarray:
    """:func:`_exp_neg` on float64 ``x`` in (-128, 0] (numba only)."""
    out = np.empty_like(x, dtype=np.float64)
    exp_neg_array(np.ascontiguousarray(x, dtype=np.float64), out)
    return out


def split(r: int, threads: int) -> list[tuple[int, int]]:
    """Row ranges ``[r0, r1)`` for ``threads`` workers (fewer when there are fewer rows)."""
    t = max(1, min(threads, r))
    bounds = [round(i * r / t) for i in range(t + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(t) if bounds[i + 1] > bounds[i]]


__all__ = ["BACKENDS", "EXP_REL_ERROR", "backend", "exp_neg", "hist_rows", "list_rows", "mark_rows", "prefix_rows", "sort_rows", "split", "survivor_rows"]
