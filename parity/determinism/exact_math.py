"""Exactly rounded float64 building blocks of the batch-invariant CPU kernels.

exp, log, sin/cos, 1/sqrt and sqrt from + - * / and bit operations in a fixed order, a halving-tree sum
and 64-byte-aligned buffers: results that depend only on the inputs. Derivations: docs/batch_invariance.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ALIGN_BYTES = 64

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


def exp_to(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``exp64`` of ``z`` computed in float64, returned as ``dtype``."""
    return exp64(z.to(torch.float64)).to(dtype)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of a reduction: float64 stays, everything else is summed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def aligned_empty(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """A ``[rows, cols_p]`` contiguous buffer (``cols`` rounded up to 64 bytes), every row 64-byte aligned.

    The buffer is over-allocated and offset, so the alignment does not depend on the allocator.
    """
    per = max(1, ALIGN_BYTES // dtype.itemsize)
    cols_p = -(-cols // per) * per
    buf = torch.empty(rows * cols_p + per, dtype=dtype)
    off = (-buf.data_ptr() % ALIGN_BYTES) // dtype.itemsize
    return buf[off : off + rows * cols_p].view(rows, cols_p)
