"""The aten operations the batch-invariant CPU kernels replace, and their table ``KERNELS``.

Each replacement gives a row a result that depends only on that row: matrix products as one
``torch.mv`` per aligned row, reductions as halving trees, nonlinearities from exact_math's float64
functions. Returning ``NotImplemented`` hands a call back to torch. See docs/batch_invariance.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import NotImplementedType

import torch
from torch._ops import OpOverload

from parity.determinism.exact_math import (
    ALIGN_BYTES,
    acc_dtype,
    aligned_empty,
    exp64,
    exp_to,
    log64,
    rsqrt64,
    sincos64,
    sqrt64,
    tree_sum,
)

aten = torch.ops.aten

Scalar = float | int | bool  # an aten Scalar argument (alpha, beta, an exponent)
# A kernel's result: its tensor, or NotImplemented to hand the call back to torch.
Result = torch.Tensor | NotImplementedType
# NotImplemented typed as a Result: outside binary dunders mypy (warn_return_any) flags a bare `return NotImplemented`.
DECLINE: Result = NotImplemented


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
    out = aligned_empty(m, width, x.dtype)
    out[:, k:].zero_()
    out[:, :k].copy_(x)
    return out[:, :width] if out.shape[1] != width else out


def rowwise_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``x`` [M, K] and ``w`` [N, K]: row m is ``torch.mv(w, x[m])`` on a 64-byte-aligned row.

    torch's GEMM picks its blocking by M and a row's place in a micro-tile; one matrix-vector product per row is
    the same call whatever M is (docs/batch_invariance.md, section 3).
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
    out = aligned_empty(m, n, torch.promote_types(x.dtype, w.dtype))
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


def _scaled_sum(product: torch.Tensor, bias: torch.Tensor, beta: Scalar, alpha: Scalar) -> torch.Tensor:
    """``beta * bias + alpha * product`` as separate rounded operations (no fused multiply-add)."""
    if alpha != 1:
        product = product * alpha
    if beta == 0:
        return product
    return product + (bias if beta == 1 else bias * beta)


def _plus_bias(product: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    def kernel(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: Scalar = 1,
               alpha: Scalar = 1) -> torch.Tensor:
        return _scaled_sum(product(a, b), bias, beta, alpha)

    return kernel


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched ``a @ b``: every batch item row by row (the same calls as ``mm``)."""
    if a.shape[0] == 0:
        return a.new_zeros(0, a.shape[1], b.shape[2])
    return torch.stack([mm(a[i], b[i]) for i in range(a.shape[0])])


addmm = _plus_bias(mm)
baddbmm = _plus_bias(bmm)


def mv(a: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``a @ v`` ([M, K] x [K]): every row of ``a`` is its own dot product (a gemv blocks rows)."""
    return rowwise_linear(a, v[None])[:, 0]


# -- reductions and nonlinearities ----------------------------------------------------------------

Dims = int | Sequence[int] | None  # aten's dim argument: one, several, or None / [] for all


def _reduce(x: torch.Tensor, dims: Dims, keepdim: bool, dtype: torch.dtype | None, mean: bool) -> torch.Tensor:
    """Sum (or mean) over ``dims`` with a halving tree over the reduced elements of each output."""
    nd = x.dim()
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = list(range(nd))
    listed = [dims] if isinstance(dims, int) else dims
    red = sorted({d % nd for d in listed}) if nd else []
    kept = [d for d in range(nd) if d not in red]
    acc = dtype if dtype is not None else acc_dtype(x.dtype)
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


def _reduction(mean: bool) -> Callable[..., Result]:
    def kernel(x: torch.Tensor, dim: Dims, keepdim: bool = False, *,
               dtype: torch.dtype | None = None) -> Result:
        if x.dim() == 0 or not (x.is_floating_point() or (dtype is not None and dtype.is_floating_point)):
            return DECLINE  # integer sums are exact in any order; a 0-d sum adds nothing
        return _reduce(x, dim, keepdim, dtype, mean=mean)

    return kernel


sum_dim = _reduction(mean=False)
mean_dim = _reduction(mean=True)


def _softmax_parts(
    x: torch.Tensor, dim: int, half_to_float: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype, int]:
    out_dtype = torch.float32 if half_to_float else x.dtype
    acc = acc_dtype(x.dtype)
    d = dim % max(x.dim(), 1)
    xt = x.to(acc).movedim(d, -1) if x.dim() else x.to(acc).reshape(1)
    z = xt - xt.amax(-1, keepdim=True)  # the max is exact in any order
    return z, tree_sum(exp_to(z, acc), keepdim=True), out_dtype, d


def softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """Row-wise softmax: exact max, own exp, halving-tree sum, one division."""
    z, s, out_dtype, d = _softmax_parts(x, dim, half_to_float)
    out = exp_to(z, z.dtype) / s
    return (out.movedim(-1, d) if x.dim() else out.reshape(())).to(out_dtype)


def log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """Row-wise log-softmax: ``z - log(sum exp z)`` with ``z = x - max``, own exp and log."""
    z, s, out_dtype, d = _softmax_parts(x, dim, half_to_float)
    out = z - log64(s.to(torch.float64)).to(z.dtype)
    return (out.movedim(-1, d) if x.dim() else out.reshape(())).to(out_dtype)


def _float64_unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], Result]:
    def kernel(x: torch.Tensor) -> Result:
        if not x.is_floating_point():
            return DECLINE
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
_POW: dict[float, Callable[[torch.Tensor], torch.Tensor]] = {
    1: lambda x: x.clone(),
    2: lambda x: x * x,
    3: lambda x: (x * x) * x,
    0.5: sqrt64,
    -1: lambda x: 1.0 / x,
    -0.5: rsqrt64,
}


def pow_scalar(x: torch.Tensor, exponent: Scalar) -> Result:
    fn = _POW.get(exponent) if not isinstance(exponent, bool) else None
    if fn is None or not x.is_floating_point():
        return DECLINE
    if exponent in (1, 2, 3):
        return fn(x)
    return fn(x.to(torch.float64)).to(x.dtype)


def _add_alpha(sign: int) -> Callable[..., Result]:
    def kernel(a: torch.Tensor, b: torch.Tensor, *, alpha: Scalar = 1) -> Result:
        if alpha == 1:
            return DECLINE
        scaled = b * alpha
        return a + scaled if sign > 0 else a - scaled

    return kernel


# Each kernel takes its aten operation's arguments (signatures differ from one operation to the next).
KERNELS: dict[OpOverload, tuple[Callable[..., Result], str]] = {
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
    aten.pow.Tensor_Scalar: (pow_scalar,
                             "exponents 1, 2, 3 by products; 0.5, -0.5 by own sqrt; -1 by division"),
    aten.add.Tensor: (_add_alpha(1), "alpha != 1 only: multiply, then add (no fused multiply-add)"),
    aten.sub.Tensor: (_add_alpha(-1), "alpha != 1 only: multiply, then subtract"),
}
