"""Batch-invariant CPU kernels for a transformers causal LM's forward.

On CPU a row of torch's result depends on the rest of the batch (GEMM blocking by row count, attention
over the padded or packed row, vectorised functions whose scalar tail rounds differently). While
``enable`` is in force, each such operation (the keys of ``KERNELS``, and attention through
``ATTENTION_NAME``) is replaced by one whose result for a row depends only on that row: own reductions
and functions from exactly rounded arithmetic in a fixed order, or the same library call on the same
inputs in every layout. A ``TorchDispatchMode`` applies them around the given models' ``forward``
only, and counts replaced, exact and uncovered operations. What was measured, the two principles and
each kernel: docs/batch_invariance.md.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parity.errors import UsageError

ATTENTION_NAME = "parity_batch_invariant"
# Query and key chunk of the attention kernel: a sequence's keys are reduced from its first token in
# blocks of this many positions. A multiple of 16 keeps every chunk of a float32 buffer 64-byte aligned.
CHUNK = 64
ALIGN_BYTES = 64

aten = torch.ops.aten

# ==================================================================================================
# exact elementwise building blocks: float64 arithmetic in a fixed order
# ==================================================================================================

# Cody-Waite constants: the high parts have trailing zero bits, so n * HI is exact for the n that occur.
_INV_LN2 = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_TWO_OVER_PI = 6.36619772367581382433e-01
_PIO2_1 = 1.57079632673412561417e00
_PIO2_2 = 6.07710050630396597660e-11
_PIO2_2T = 2.02226624879595063154e-21
_SQRT_HALF = 0.7071067811865476
# Taylor coefficients: e^r on |r| <= ln2/2 to r^11 (truncation < 1e-14, far below a float32 ulp);
# log via the atanh series in s = (m-1)/(m+1), |s| <= 0.172, to s^23; sin/cos on |r| <= pi/4 to
# r^19 / r^20.
_EXP_C = [1.0 / math.factorial(k) for k in range(12)]
_LOG_C = [1.0 / (2 * k + 1) for k in range(12)]
_SIN_C = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(10)]
_COS_C = [(-1.0) ** k / math.factorial(2 * k) for k in range(11)]


def _horner(x: torch.Tensor, coeffs: Sequence[float]) -> torch.Tensor:
    """sum_k coeffs[k] * x^k, evaluated from the highest power down (a multiply, then an add)."""
    p = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = p * x + c
    return p


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2.0 ** k for int64 k in [-1022, 1023], built from the exponent bits (exact)."""
    return torch.bitwise_left_shift(k + 1023, 52).view(torch.float64)


def exp64(x: torch.Tensor) -> torch.Tensor:
    """e^x in float64 (relative error < 1e-14) from + - * only: x = n ln2 + r, e^x = 2^n e^r."""
    x = x.clamp(-746.0, 710.0)
    n = torch.round(x * _INV_LN2)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = _horner(r, _EXP_C)
    k = torch.nan_to_num(n, nan=0.0).to(torch.int64)
    half = torch.div(k, 2, rounding_mode="floor")
    # Two power-of-two factors, each a normal double: exact scaling down to the subnormal range.
    return (p * _pow2(half)) * _pow2(k - half)


def log64(x: torch.Tensor) -> torch.Tensor:
    """Natural log in float64 from frexp (exact) and + - * /: log x = e ln2 + 2 atanh((m-1)/(m+1))."""
    m, e = torch.frexp(x)
    low = m < _SQRT_HALF
    m = torch.where(low, m * 2.0, m)
    ef = e.to(torch.float64) - low.to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    logm = (s * _horner(s * s, _LOG_C)) * 2.0
    out = ef * _LN2_HI + (ef * _LN2_LO + logm)
    out = torch.where(x == 0, torch.full_like(out, -math.inf), out)
    out = torch.where(x < 0, torch.full_like(out, math.nan), out)
    return torch.where(x == math.inf, x, out)


def sincos64(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sin x, cos x) in float64: x = k pi/2 + r (three-part pi/2, exact products for |k| < 2^20),
    polynomials on |r| <= pi/4, then the quadrant k mod 4. Accurate to ~1e-16 for |x| < 1e6."""
    k = torch.round(x * _TWO_OVER_PI)
    r = ((x - k * _PIO2_1) - k * _PIO2_2) - k * _PIO2_2T
    r2 = r * r
    s = r * _horner(r2, _SIN_C)
    c = _horner(r2, _COS_C)
    q = torch.remainder(torch.nan_to_num(k, nan=0.0, posinf=0.0, neginf=0.0).to(torch.int64), 4)
    sin = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cos = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sin, cos


# 1/sqrt by Newton's iteration from the exponent-halving guess (relative error <= 3.5 %): five
# steps reach the float64 rounding level. torch.sqrt is not used: its float32 and float64 results
# are not the correctly rounded ones (measured: 16 % and 1 % of random inputs differ from IEEE sqrt).
_RSQRT_GUESS = 0x5FE6EB50C7B537A9
_RSQRT_STEPS = 5


def rsqrt64(x: torch.Tensor) -> torch.Tensor:
    """1/sqrt(x) in float64 from + - * and bit operations only."""
    tiny = x < 2.0**-1000  # scale subnormal and tiny inputs up by 2^128 (exact), the result by 2^64
    xs = torch.where(tiny, x * 2.0**128, x)
    y = (_RSQRT_GUESS - torch.bitwise_right_shift(xs.view(torch.int64), 1)).view(torch.float64)
    half = xs * 0.5
    for _ in range(_RSQRT_STEPS):
        y = y * (1.5 - (half * y) * y)
    y = torch.where(tiny, y * 2.0**64, y)
    y = torch.where(x == 0, torch.full_like(y, math.inf), y)
    y = torch.where(x == math.inf, torch.zeros_like(y), y)
    return torch.where((x < 0) | torch.isnan(x), torch.full_like(y, math.nan), y)


def sqrt64(x: torch.Tensor) -> torch.Tensor:
    """sqrt(x) in float64: x * rsqrt(x) and one Newton correction, from + - * only."""
    y = rsqrt64(x)
    s = x * y
    s = s + (x - s * s) * (y * 0.5)
    s = torch.where(x == 0, x, s)
    return torch.where(x == math.inf, x, s)


def tree_sum(x: torch.Tensor, keepdim: bool = False) -> torch.Tensor:
    """Sum over the last dim: zero-pad to the next power of two, then add the halves until one is left.

    Element i is paired with i + n/2 at every level, so the order depends only on the length.
    """
    n = x.shape[-1]
    if n == 0:
        out = x.new_zeros(x.shape[:-1] + (1,))
        return out if keepdim else out.squeeze(-1)
    width = 1 << (n - 1).bit_length()
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x if keepdim else x.squeeze(-1)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of a reduction: float64 stays, everything else is summed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ==================================================================================================
# matrix products: one torch.mv per output row, on a 64-byte-aligned copy of the row
# ==================================================================================================


def _aligned_empty(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, cols_p]`` contiguous buffer whose rows all start on a 64-byte boundary.

    ``cols_p`` is ``cols`` rounded up to 64 bytes; the buffer is over-allocated and offset, so the
    alignment does not depend on the allocator.
    """
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    cols_p = -(-cols // per) * per
    buf = torch.empty(rows * cols_p + per, dtype=dtype)
    off = (-buf.data_ptr() % ALIGN_BYTES) // dtype.itemsize
    return buf[off : off + rows * cols_p].view(rows, cols_p)


def _aligned_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` ([M, K]) as a ``[M, width]`` tensor (zero columns after K) with 64-byte-aligned rows."""
    m, k = x.shape
    stride_ok = (
        (width * x.element_size()) % ALIGN_BYTES == 0
        and x.stride(1) == 1
        and (m == 1 or x.stride(0) == width)
    )
    if width == k and stride_ok and x.data_ptr() % ALIGN_BYTES == 0:
        return x
    out = _aligned_empty(m, width, x.dtype)
    out[:, k:].zero_()
    out[:, :k].copy_(x)
    return out[:, :width] if out.shape[1] != width else out


def rowwise_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [M, K] and ``w`` [N, K]: row m is ``torch.mv(w, x[m])``.

    Why per row: torch's GEMM (MKL here) chooses its kernel and blocking by M and by a row's place in
    its micro-tile, so a row's bits change with the batch (measured). One matrix-vector product per
    row is the same call — shape ``[N, K] x [K]``, the same ``w``, a 64-byte-aligned row (K is padded
    with zero columns when a row is not a multiple of 64 bytes, decided by K alone), a 64-byte-aligned
    output row — whatever M is and wherever the row sits.
    """
    m, k = x.shape
    n = w.shape[0]
    per = max(1, ALIGN_BYTES // x.element_size())
    kp = -(-k // per) * per
    xa = _aligned_rows(x, kp)
    if kp != k or w.stride() != (k, 1):
        # Exactly row-major [N, kp]: is_contiguous() also accepts other strides on size-1 dims, and
        # torch.mv picks a different kernel (another reduction order) for those.
        wa = torch.zeros(n, kp, dtype=w.dtype)
        wa[:, :k].copy_(w)
    else:
        wa = w
    out = _aligned_empty(m, n, torch.promote_types(x.dtype, w.dtype))
    outs = out.unbind(0) if out.shape[1] == n else out[:, :n].unbind(0)
    for row, dst in zip(xa.unbind(0), outs, strict=True):
        torch.mv(wa, row, out=dst)
    return out if out.shape[1] == n else out[:, :n].contiguous()


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` ([M, K] x [K, N]) row by row. K == 1 is one rounded product per element: exact."""
    if a.shape[1] == 0:
        return a.new_zeros(a.shape[0], b.shape[1])
    if a.shape[1] == 1:
        return a * b
    return rowwise_linear(a, b.t())


def _scaled_sum(
    product: torch.Tensor, bias: torch.Tensor, beta: float | int | bool, alpha: float | int | bool
) -> torch.Tensor:
    """``beta * bias + alpha * product`` as separate rounded operations (no fused multiply-add)."""
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (bias if beta == 1 else bias * beta)


def addmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    return _scaled_sum(mm(a, b), bias, beta, alpha)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b``: every batch item row by row (the same calls as ``mm``)."""
    if a.shape[0] == 0:
        return a.new_zeros(0, a.shape[1], b.shape[2])
    return torch.stack([mm(a[i], b[i]) for i in range(a.shape[0])])


def baddbmm(
    bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
) -> torch.Tensor:
    return _scaled_sum(bmm(a, b), bias, beta, alpha)


def mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``a @ v`` ([M, K] x [K]): every row of ``a`` is its own dot product (a gemv blocks rows)."""
    return rowwise_linear(a, v[None])[:, 0]


# ==================================================================================================
# reductions and nonlinearities
# ==================================================================================================


def _reduce(x: torch.Tensor, dims: Any, keepdim: bool, dtype: torch.dtype | None, mean: bool) -> torch.Tensor:
    """Sum (or mean) over ``dims`` with a halving tree over the reduced elements of each output."""
    nd = x.dim()
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(nd))
    if isinstance(dims, int):
        dims = [dims]
    red = sorted({d % nd for d in dims}) if nd else []
    kept = [d for d in range(nd) if d not in red]
    acc = dtype if dtype is not None else _acc_dtype(x.dtype)
    count = 1
    for d in red:
        count *= x.shape[d]
    y = x.to(acc).permute(*kept, *red).reshape(*[x.shape[d] for d in kept], count)
    s = tree_sum(y)
    if mean:
        s = s / count
    if keepdim:
        s = s.reshape([1 if d in red else x.shape[d] for d in range(nd)])
    return s.to(dtype if dtype is not None else x.dtype)


def sum_dim(x: torch.Tensor, dim: Any, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
    if x.dim() == 0 or not (x.is_floating_point() or (dtype is not None and dtype.is_floating_point)):
        return NotImplemented  # integer sums are exact in any order; a 0-d sum adds nothing
    return _reduce(x, dim, keepdim, dtype, mean=False)


def mean_dim(x: torch.Tensor, dim: Any, keepdim: bool = False, *, dtype: torch.dtype | None = None) -> Any:
    if x.dim() == 0 or not (x.is_floating_point() or (dtype is not None and dtype.is_floating_point)):
        return NotImplemented
    return _reduce(x, dim, keepdim, dtype, mean=True)


def _exp_to(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return exp64(z.to(torch.float64)).to(dtype)


def _softmax_parts(
    x: torch.Tensor, dim: int, half_to_float: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype, int]:
    out_dtype = torch.float32 if half_to_float else x.dtype
    acc = _acc_dtype(x.dtype)
    d = dim % max(x.dim(), 1)
    xt = x.to(acc).movedim(d, -1) if x.dim() else x.to(acc).reshape(1)
    z = xt - xt.amax(-1, keepdim=True)  # the max is exact in any order
    return z, tree_sum(_exp_to(z, acc), keepdim=True), out_dtype, d


def softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """Row-wise softmax: exact max, own exp, halving-tree sum, one division."""
    z, s, out_dtype, d = _softmax_parts(x, dim, half_to_float)
    out = _exp_to(z, z.dtype) / s
    return (out.movedim(-1, d) if x.dim() else out.reshape(())).to(out_dtype)


def log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """Row-wise log-softmax: ``z - log(sum exp z)`` with ``z = x - max``, own exp and log."""
    z, s, out_dtype, d = _softmax_parts(x, dim, half_to_float)
    out = z - log64(s.to(torch.float64)).to(z.dtype)
    return (out.movedim(-1, d) if x.dim() else out.reshape(())).to(out_dtype)


def _float64_unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Any]:
    def kernel(x: torch.Tensor) -> Any:
        if not x.is_floating_point():
            return NotImplemented
        return fn(x.to(torch.float64)).to(x.dtype)

    kernel.__name__ = fn.__name__
    return kernel


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (exp64(-x) + 1.0)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    return 1.0 / (exp64(-x) + 1.0)


def _sin(x: torch.Tensor) -> torch.Tensor:
    return sincos64(x)[0]


def _cos(x: torch.Tensor) -> torch.Tensor:
    return sincos64(x)[1]


silu = _float64_unary(_silu)
sigmoid = _float64_unary(_sigmoid)
exp = _float64_unary(exp64)
rsqrt = _float64_unary(rsqrt64)
sqrt = _float64_unary(sqrt64)
sin = _float64_unary(_sin)
cos = _float64_unary(_cos)

# Exponents with an exact or correctly rounded form; any other exponent is left to torch (reported).
_POW = {
    1: lambda x: x.clone(),
    2: lambda x: x * x,
    3: lambda x: (x * x) * x,
    0.5: sqrt64,
    -1: lambda x: 1.0 / x,
    -0.5: rsqrt64,
}


def pow_scalar(x: torch.Tensor, exponent: Any) -> Any:
    fn = _POW.get(exponent) if not isinstance(exponent, bool) else None
    if fn is None or not x.is_floating_point():
        return NotImplemented
    if exponent in (1, 2, 3):
        return fn(x)
    return fn(x.to(torch.float64)).to(x.dtype)


def _add_alpha(sign: int) -> Callable[..., Any]:
    def kernel(a: Any, b: Any, *, alpha: Any = 1) -> Any:
        if alpha == 1:
            return NotImplemented
        scaled = b * alpha
        return a + scaled if sign > 0 else a - scaled

    return kernel


# ==================================================================================================
# attention: per sequence, over its own keys from its first token, in fixed chunks
# ==================================================================================================


def _allowed(mask: torch.Tensor | None, b: int, q: int, kv: int) -> torch.Tensor:
    """The mask as booleans ``[B, Q, KV]`` (True = query may read key)."""
    if mask is None:
        pos = torch.arange(q)[:, None] + (kv - q)
        return (torch.arange(kv)[None, :] <= pos).expand(b, q, kv)
    if mask.dim() == 2:  # a padding mask no mask function turned into 4D: causal + padding
        causal = _allowed(None, b, q, kv)
        return causal & mask.to(torch.bool)[:, None, -kv:]
    if mask.dim() != 4:
        raise UsageError(
            f"attention_mask has shape {tuple(mask.shape)}: allowed None, a 2D padding mask or a 4D mask "
            "[batch, 1 or heads, queries, keys]"
        )
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((allowed | blocked).all()):
            bad = float(mask[~(allowed | blocked)].flatten()[0])
            raise UsageError(
                f"attention_mask holds additive value {bad!r}: allowed a boolean mask or an additive mask of "
                "0 (attend) and the dtype's minimum or -inf (blocked); attention biases are not supported"
            )
    if allowed.shape[-2:] != (q, kv) or allowed.shape[0] not in (1, b):
        raise UsageError(
            f"attention_mask has shape {tuple(mask.shape)}: allowed [{b} or 1, 1 or heads, {q}, {kv}] "
            "for these queries and keys"
        )
    if allowed.shape[1] > 1 and not bool((allowed == allowed[:, :1]).all()):
        raise UsageError("attention_mask differs between heads: allowed one mask shared by all heads")
    return allowed[:, 0].expand(b, q, kv)


def _key_ranges(allowed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the first allowed key ``lo`` and the count; every row must be one contiguous range."""
    count = allowed.sum(-1)
    lo = allowed.to(torch.int8).argmax(-1)
    j = torch.arange(allowed.shape[-1])
    expect = (j >= lo[..., None]) & (j < (lo + count)[..., None])
    if not torch.equal(allowed, expect):
        bi, qi = (allowed != expect).any(-1).nonzero()[0].tolist()
        raise UsageError(
            f"attention_mask row (batch {bi}, query {qi}) is not one contiguous range of keys: allowed causal "
            "masks with padding and block-diagonal (packed) masks"
        )
    return lo, count


def _chunked(
    qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, lim: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of the query rows of ``qb`` ([R, H, D] chunk-major as [nQ, H, C, D]) over the key
    rows ``[0, lim[r])`` of ``kb``/``vb`` ([nK, H, C, D]), one query chunk at a time.

    For query chunk c the keys read are chunks ``0 .. k-1``, ``k`` = enough chunks for the chunk's
    largest range: for a sequence's own queries that is a function of c alone. Scores are one
    ``torch.matmul`` of the chunk's queries [H, C, D] with those keys [H, D, k*C] (copied contiguous),
    then the exact row max, e = exp(s - max) with the own exp (keys outside the range exactly 0), the
    denominator as a halving-tree sum over the k*C keys, the numerator as one ``torch.matmul`` of e
    [H, C, k*C] with the values [H, k*C, D], and one division. Every call has a shape fixed by
    (c, k) and inputs that are the sequence's own values, so it repeats bit for bit in any layout.
    Returns [nQ, H, C, Dv] in the accumulation dtype.
    """
    acc = _acc_dtype(qb.dtype)
    n_k, h, _, d = kb.shape
    dv = vb.shape[-1]
    out = torch.zeros(qb.shape[0], h, CHUNK, dv, dtype=acc)
    keys_all = kb.transpose(0, 1).reshape(h, n_k * CHUNK, d)
    values_all = vb.transpose(0, 1).reshape(h, n_k * CHUNK, dv)
    for qc in range(qb.shape[0]):
        lim_c = lim[qc * CHUNK : (qc + 1) * CHUNK]
        top = int(lim_c.max())
        if top == 0:
            continue
        width = -(-top // CHUNK) * CHUNK
        keys = keys_all[:, :width].contiguous()
        values = values_all[:, :width].contiguous()
        keep = torch.arange(width)[None, :] < lim_c[:, None]  # [C, width]
        s = (torch.matmul(qb[qc], keys.transpose(-1, -2)).to(acc) * scale).masked_fill(~keep, -math.inf)
        top_score = s.amax(-1, keepdim=True)  # exact in any order
        top_score = torch.where(torch.isinf(top_score), torch.zeros_like(top_score), top_score)
        e = torch.where(keep, _exp_to(s - top_score, acc), torch.zeros((), dtype=acc))
        den = tree_sum(e, keepdim=True)
        num = torch.matmul(e.to(vb.dtype), values).to(acc)
        out[qc] = torch.where(den > 0, num / den, torch.zeros((), dtype=acc))
    return out


def _chunk_buffer(rows: int, h: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros ``[ceil(rows / C), h, C, d]``, 64-byte aligned (every chunk too: C * d elements each)."""
    n = max(1, -(-rows // CHUNK))
    size = n * h * CHUNK * d
    return _aligned_empty(1, size, dtype)[0, :size].zero_().view(n, h, CHUNK, d)


def _fill_keys(buf: torch.Tensor, keys: torch.Tensor) -> None:
    """Copy ``keys`` [H, n, D] into the chunk-major ``buf`` [nK, H, C, D] (positions 0..n-1)."""
    h, n, d = keys.shape
    padded = torch.zeros(h, buf.shape[0] * CHUNK, d, dtype=keys.dtype)
    padded[:, :n] = keys
    buf.copy_(padded.view(h, buf.shape[0], CHUNK, d).transpose(0, 1))


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (the ``AttentionInterface`` signature of
    ``eager_attention_forward`` in transformers' modeling files): query ``[B, H, Q, D]``, key and
    value ``[B, Hkv, KV, D]``, returns ``([B, Q, H, D], None)``.

    The mask (boolean or additive 0/min, 4D, or None for plain causal) gives each query one contiguous
    range of keys ``[lo, hi)``. A query whose range ends at itself is *causal*: causal queries with the
    same ``lo`` in a row are one sequence, whatever else shares the row (padding, other packed
    sequences). The sequence's queries, keys and values are copied into zeroed, aligned buffers at
    their position relative to ``lo`` and reduced by ``_chunked``: its result is the same in every
    layout. Other queries with keys (e.g. right-padding positions, which read the whole sequence) are
    computed the same way in a separate call, without that guarantee; queries without keys get zeros.
    """
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise UsageError(
                f"{name}={kwargs[name]!r}: the batch-invariant attention supports full causal attention only "
                f"(allowed {name}=None)"
            )
    if dropout and module.training:
        raise UsageError(
            f"dropout={dropout!r} in training mode: the batch-invariant attention allows dropout=0"
        )
    with _bypass():
        out = _attention(query, key, value, attention_mask, scaling)
    kernels = _current_kernels()
    if kernels is not None:
        kernels.count_call("attention")
    return out, None


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor:
    b, h, q, d = query.shape
    hkv, kv, dv = key.shape[1], key.shape[2], value.shape[-1]
    if h % hkv:
        raise UsageError(f"query has {h} heads and key {hkv}: allowed a multiple (grouped-query attention)")
    scale = float(scaling) if scaling is not None else d**-0.5
    heads = torch.arange(h) // (h // hkv)  # query head -> key/value head, as transformers' repeat_kv
    lo, count = _key_ranges(_allowed(mask, b, q, kv))
    self_pos = torch.arange(q) + (kv - q)
    causal = (count > 0) & (lo + count == self_pos + 1)
    out = torch.zeros(b, q, h, dv, dtype=_acc_dtype(query.dtype))
    for bi in range(b):
        # A causal query's key range ends at itself: the causal queries with the same first key are one
        # sequence, each at its own position in it. Other queries with keys (e.g. right padding, which
        # reads the whole sequence) are grouped by their range and stacked without a position.
        seqs: dict[tuple[bool, int, int], list[int]] = {}
        rows = zip(causal[bi].tolist(), lo[bi].tolist(), count[bi].tolist(), strict=True)
        for qi, (is_causal, start, n) in enumerate(rows):
            if n:
                seqs.setdefault((is_causal, start, -1 if is_causal else start + n), []).append(qi)
        for (is_causal, start, _), qs in seqs.items():
            idx = torch.tensor(qs)
            if is_causal:
                rel = self_pos[idx] - start
                lim_q = rel + 1
            else:  # other queries with keys (e.g. right padding): stacked in order, no position
                rel = torch.arange(len(idx))
                lim_q = count[bi, idx]
            nkeys = int(lim_q.max())
            rows_n = int(rel.max()) + 1
            qb = _chunk_buffer(rows_n, h, d, query.dtype)
            kb = _chunk_buffer(nkeys, h, d, key.dtype)
            vb = _chunk_buffer(nkeys, h, dv, value.dtype)
            qb[rel // CHUNK, :, rel % CHUNK] = query[bi][:, idx].transpose(0, 1)
            _fill_keys(kb, key[bi, heads, start : start + nkeys])
            _fill_keys(vb, value[bi, heads, start : start + nkeys])
            lim = torch.zeros(qb.shape[0] * CHUNK, dtype=torch.long)
            lim[rel] = lim_q
            res = _chunked(qb, kb, vb, lim, scale)
            out[bi, idx] = res[rel // CHUNK, :, rel % CHUNK]
    return out.to(query.dtype)


# ==================================================================================================
# the dispatch mode, scoped to the models' forward
# ==================================================================================================

KERNELS: dict[Any, tuple[Callable[..., Any], str]] = {
    aten.mm.default: (mm, "one torch.mv per output row on an aligned row copy"),
    aten.addmm.default: (addmm, "mm per row, then bias added as a separate rounding"),
    aten.bmm.default: (bmm, "mm per batch item, one torch.mv per row"),
    aten.baddbmm.default: (baddbmm, "bmm, then bias added as a separate rounding"),
    aten.mv.default: (mv, "one dot product per row (a [1, K] x [K] torch.mv)"),
    aten.mean.dim: (mean_dim, "halving-tree sum over the reduced elements, one division"),
    aten.sum.dim_IntList: (sum_dim, "halving-tree sum over the reduced elements"),
    aten._softmax.default: (softmax, "exact row max, own float64 exp, halving-tree sum"),
    aten._log_softmax.default: (log_softmax, "exact row max, own float64 exp and log, halving-tree sum"),
    aten.silu.default: (silu, "x / (1 + exp(-x)) in float64 with own exp"),
    aten.sigmoid.default: (sigmoid, "1 / (1 + exp(-x)) in float64 with own exp"),
    aten.exp.default: (exp, "own float64 exp"),
    aten.cos.default: (cos, "own float64 cos"),
    aten.sin.default: (sin, "own float64 sin"),
    aten.rsqrt.default: (rsqrt, "own float64 1/sqrt (Newton iteration)"),
    aten.sqrt.default: (sqrt, "own float64 sqrt (Newton iteration)"),
    aten.pow.Tensor_Scalar: (
        pow_scalar,
        "exponents 1, 2, 3 by products; 0.5, -0.5 by own sqrt; -1 by division",
    ),
    aten.add.Tensor: (_add_alpha(1), "alpha != 1 only: multiply, then add (no fused multiply-add)"),
    aten.sub.Tensor: (_add_alpha(-1), "alpha != 1 only: multiply, then subtract"),
}
ATTENTION_KERNEL = (
    f"transformers attention '{ATTENTION_NAME}': per sequence (from the mask), keys from the sequence's "
    f"first token, one fixed-shape query chunk of {CHUNK} at a time, exact max, own exp, tree sums"
)

# Floating-point operations whose result is exact (data movement, comparisons, IEEE + - * /,
# max/min, rounding casts) and so cannot depend on the layout; sqrt is not among them (see rsqrt64).
# Any other floating-point operation seen in a forward is counted in ``other_ops``.
EXACT_OPS = frozenset(
    """
    view _unsafe_view reshape t transpose permute expand unsqueeze squeeze slice select index index_select
    gather embedding cat stack clone _to_copy copy_ alias detach lift_fresh new_ones new_zeros new_empty
    new_full zeros ones full empty empty_strided empty_like zeros_like ones_like full_like arange
    scalar_tensor where masked_fill masked_fill_ bitwise_and bitwise_or bitwise_not bitwise_xor eq ne lt
    le gt ge logical_and logical_or logical_not logical_xor add sub mul div neg abs maximum minimum clamp
    clamp_min clamp_max reciprocal amax amin max min argmax argmin any all isnan isinf isfinite
    constant_pad_nd fill fill_ zero_ split split_with_sizes chunk unbind sort topk _local_scalar_dense
    flip roll repeat repeat_interleave nonzero masked_select round floor ceil trunc sign nan_to_num frexp
    bitwise_left_shift bitwise_right_shift diff unfold narrow as_strided contiguous _assert_tensor_metadata
    """.split()
)


class _State(threading.local):
    def __init__(self) -> None:
        self.active: CpuKernels | None = None
        self.bypass = 0


_TLS = _State()


class _bypass:
    """Inside the attention kernel: its chunk products and sums are its own; do not re-route them."""

    def __enter__(self) -> None:
        _TLS.bypass += 1

    def __exit__(self, *exc: Any) -> None:
        _TLS.bypass -= 1


def _current_kernels() -> CpuKernels | None:
    return _TLS.active


def _has_float(args: Any) -> bool:
    stack = list(args)
    while stack:
        a = stack.pop()
        if isinstance(a, torch.Tensor):
            if a.is_floating_point() or a.is_complex():
                return True
        elif isinstance(a, (list, tuple)):
            stack.extend(a)
    return False


def _all_cpu(args: Any) -> bool:
    return all(a.device.type == "cpu" for a in args if isinstance(a, torch.Tensor))


class _KernelMode(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch leaves __init_subclass__ unannotated
    """Routes the operations in ``KERNELS`` to this module's kernels and counts every operation."""

    def __init__(self, kernels: CpuKernels) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch leaves TorchDispatchMode.__init__ unannotated
        self.kernels = kernels

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if _TLS.bypass:
            return func(*args, **kwargs)
        entry = KERNELS.get(func)
        if entry is not None and _all_cpu(args):
            out = entry[0](*args, **kwargs)
            if out is not NotImplemented:
                self.kernels.count_call(str(func.overloadpacket.__name__ + "." + func._overloadname))
                return out
        self.kernels.count_op(func, args)
        return func(*args, **kwargs)


class CpuKernels:
    """The kernel set installed on some models: what was replaced and what the forwards ran.

    ``report`` is a live dict (the ``batch_invariant_mode`` state holds it): ``replaced`` names each
    kernel and how it computes; ``calls`` counts replaced calls; ``exact_ops`` counts exact operations;
    ``other_ops`` counts floating-point operations neither replaced nor exact, by name.
    """

    def __init__(self, models: Sequence[Any]) -> None:
        self.models = list(models)
        self.calls: Counter[str] = Counter()
        self.other: Counter[str] = Counter()
        self.exact = 0
        self.report: dict[str, Any] = {
            "replaced": {
                f"{op.overloadpacket.__name__}.{op._overloadname}": how for op, (_, how) in KERNELS.items()
            }
            | {"attention": ATTENTION_KERNEL},
            "attention_implementation": ATTENTION_NAME,
            "attention_chunk": CHUNK,
            "models": [type(m).__name__ for m in self.models],
            "calls": {},
            "exact_ops": 0,
            "other_ops": {},
        }
        self._undo: list[Callable[[], None]] = []

    def count_call(self, name: str) -> None:
        self.calls[name] += 1
        self.report["calls"][name] = self.calls[name]

    def count_op(self, func: Any, args: Any) -> None:
        name = func.overloadpacket.__name__
        if name in EXACT_OPS or not _has_float(args):
            self.exact += 1
            self.report["exact_ops"] = self.exact
            return
        key = f"{name}.{func._overloadname}"
        self.other[key] += 1
        self.report["other_ops"][key] = self.other[key]

    # -- install / restore -------------------------------------------------------------------------

    def _wrap_forward(self, model: torch.nn.Module) -> None:
        own = model.__dict__.get("forward")
        inner = model.forward
        kernels = self

        def forward(*args: Any, **kwargs: Any) -> Any:
            if _TLS.active is not None:  # already inside a model under the kernels (a nested call)
                return inner(*args, **kwargs)
            _TLS.active = kernels
            try:
                with _KernelMode(kernels):
                    return inner(*args, **kwargs)
            finally:
                _TLS.active = None

        model.forward = forward

        def restore() -> None:
            if own is None:
                del model.forward
            else:
                model.forward = own

        self._undo.append(restore)

    def _switch_attention(self, model: Any) -> None:
        prev = model.config._attn_implementation
        if prev != ATTENTION_NAME:
            model.set_attn_implementation(ATTENTION_NAME)
            self._undo.append(lambda: model.set_attn_implementation(prev))

    def enable(self) -> CpuKernels:
        try:
            _register()
            self._undo.append(_unregister)
            for m in self.models:
                self._switch_attention(m)
                self._wrap_forward(m)
        except BaseException:
            self.restore()
            raise
        return self

    def restore(self) -> None:
        errors = []
        while self._undo:
            try:
                self._undo.pop()()
            except Exception as exc:  # noqa: BLE001 - every restore runs; collected below
                errors.append(exc)
        if errors:
            raise RuntimeError(f"cpu kernels: {len(errors)} restore step(s) failed: {errors}")


# One registration of the attention and mask functions per process while any kernel set is enabled.
_REGISTERED = {"count": 0, "added": False}
_LOCK = threading.Lock()


def _mask_function(**kwargs: Any) -> Any:
    """Boolean 4D masks (transformers' ``sdpa_mask``), always materialised: the kernel reads each
    query's key range from the mask, so a plain causal batch must not come as None plus is_causal."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(**kwargs)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _LOCK:
        if _REGISTERED["count"] == 0:
            present = ATTENTION_NAME in AttentionInterface._global_mapping
            if not present:
                AttentionInterface.register(ATTENTION_NAME, attention_forward)
                AttentionMaskInterface.register(ATTENTION_NAME, _mask_function)
            _REGISTERED["added"] = not present
        _REGISTERED["count"] += 1


def _unregister() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    with _LOCK:
        _REGISTERED["count"] -= 1
        if _REGISTERED["count"] == 0 and _REGISTERED["added"]:
            AttentionInterface._global_mapping.pop(ATTENTION_NAME, None)
            AttentionMaskInterface._global_mapping.pop(ATTENTION_NAME, None)
            _REGISTERED["added"] = False


class UnsupportedModel(UsageError):
    """A model the kernel set cannot be installed on (the reason names what is missing)."""


def check_model(model: Any) -> None:
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedModel(
            f"{type(model).__name__} is not a torch.nn.Module: allowed a transformers model"
        )
    config = getattr(model, "config", None)
    if (
        config is None
        or not hasattr(model, "set_attn_implementation")
        or not hasattr(config, "_attn_implementation")
    ):
        raise UnsupportedModel(
            f"{type(model).__name__} has no transformers config with an attention implementation "
            "(set_attn_implementation): allowed a transformers PreTrainedModel"
        )
    dev = {p.device.type for p in model.parameters()}
    if dev - {"cpu"}:
        raise UnsupportedModel(
            f"{type(model).__name__} has parameters on {sorted(dev)}: the CPU kernels allow 'cpu'"
        )


def enable(models: Sequence[Any]) -> CpuKernels:
    """Install the kernel set on ``models`` (checked first); ``restore()`` on the result undoes it."""
    for m in models:
        check_model(m)
    return CpuKernels(models).enable()


def is_enabled(model: Any) -> bool:
    """Whether ``model`` currently runs under a kernel set (its attention is this module's)."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "_attn_implementation", None) == ATTENTION_NAME and "forward" in getattr(
        model, "__dict__", {}
    )
