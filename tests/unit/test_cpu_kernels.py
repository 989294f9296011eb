"""The CPU kernel set (parity.determinism.kernels) piece by piece: accuracy, row invariance, the attention
kernel's mask handling, installing and restoring, and the operation report.

Row invariance is what the kernels guarantee: a row's result is bitwise the same alone and inside a
batch of any size, at any position, whatever the memory layout of the batch. torch's own kernels on
the same draws are measured and reported, not asserted (their blocking depends on the CPU).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.determinism import attention_kernel, exact_math, op_kernels
from parity.determinism import kernels as ck


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One torch thread: the kernels' many small per-row calls stall on a shared 2-core machine under
    OpenMP (the property itself was also checked with 2 threads); restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


aten = torch.ops.aten


def ulps(a: torch.Tensor, truth: torch.Tensor) -> float:
    """Largest distance of float32 ``a`` from float64 ``truth`` in units of the float32 spacing at truth."""
    t32 = truth.to(torch.float32)
    spacing = (torch.nextafter(t32.abs(), torch.tensor(math.inf)) - t32.abs()).double()
    err = (a.double() - truth).abs()
    ok = torch.isfinite(truth)
    return float((err[ok] / spacing[ok]).max())


# -- exact building blocks ---------------------------------------------------------------------------


def test_exp_log_sin_cos_match_torch_in_float64() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(20000, generator=g, dtype=torch.float64) * 30,
            torch.linspace(-700, 700, 5001, dtype=torch.float64),
        ]
    )
    assert float(((exact_math.exp64(x) - torch.exp(x)) / torch.exp(x)).abs().max()) < 1e-13
    pos = torch.cat(
        [
            torch.rand(20000, generator=g, dtype=torch.float64) * 1e6,
            torch.tensor([1e-310, 5e-324, 1.0, 2.0], dtype=torch.float64),
        ]
    )
    assert float((exact_math.log64(pos) - torch.log(pos)).abs().max()) < 1e-12
    ang = torch.rand(20000, generator=g, dtype=torch.float64) * 2e4 - 1e4
    s, c = exact_math.sincos64(ang)
    assert float((s - torch.sin(ang)).abs().max()) < 1e-13 and float((c - torch.cos(ang)).abs().max()) < 1e-13


def test_special_values() -> None:
    inf, nan = math.inf, math.nan
    e = exact_math.exp64(torch.tensor([-inf, inf, nan, 0.0, -800.0, 800.0], dtype=torch.float64))
    assert e[0] == 0 and e[1] == inf and math.isnan(e[2]) and e[3] == 1 and e[4] == 0 and e[5] == inf
    lg = exact_math.log64(torch.tensor([0.0, -1.0, inf, nan, 1.0], dtype=torch.float64))
    assert lg[0] == -inf and math.isnan(lg[1]) and lg[2] == inf and math.isnan(lg[3]) and lg[4] == 0
    s, c = exact_math.sincos64(torch.tensor([inf, nan, 0.0], dtype=torch.float64))
    assert math.isnan(s[0]) and math.isnan(c[1]) and s[2] == 0 and c[2] == 1


@pytest.mark.parametrize(
    ("kernel", "truth", "scale"),
    [
        (op_kernels.exp, torch.exp, 20.0),
        (op_kernels.silu, lambda x: x / (1 + torch.exp(-x)), 12.0),
        (op_kernels.sigmoid, torch.sigmoid, 12.0),
        (op_kernels.cos, torch.cos, 1000.0),
        (op_kernels.sin, torch.sin, 1000.0),
    ],
)
def test_float32_unary_kernels_are_within_one_ulp(kernel, truth, scale) -> None:
    x = torch.randn(50000, generator=torch.Generator().manual_seed(1)) * scale
    assert ulps(kernel(x), truth(x.double())) <= 1.0


def test_rsqrt_pow_softmax_log_softmax_and_reductions_agree_with_torch() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, 300, generator=g)
    pos = x.abs() + 0.1
    assert ulps(op_kernels.rsqrt(pos), 1 / torch.sqrt(pos.double())) <= 1.0
    assert torch.equal(op_kernels.pow_scalar(x, 2), x * x)
    assert ulps(op_kernels.pow_scalar(pos, 0.5), torch.sqrt(pos.double())) <= 0.5  # correctly rounded here
    assert ulps(op_kernels.sqrt(pos), torch.sqrt(pos.double())) <= 0.5
    assert op_kernels.pow_scalar(x, 1.7) is NotImplemented  # left to torch, and reported as an other op
    torch.testing.assert_close(op_kernels.softmax(x, -1, False), torch.softmax(x, -1), rtol=3e-6, atol=1e-9)
    torch.testing.assert_close(op_kernels.log_softmax(x, 0, False), torch.log_softmax(x, 0), rtol=3e-6, atol=3e-6)
    torch.testing.assert_close(op_kernels.mean_dim(x, [-1], True), x.mean(-1, keepdim=True), rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(op_kernels.sum_dim(x, [0, 1]), x.sum(), rtol=1e-5, atol=1e-5)
    assert op_kernels.sum_dim(torch.arange(6).view(2, 3), [1]) is NotImplemented  # integer sums are exact
    half = x.to(torch.bfloat16)
    assert op_kernels.mean_dim(half, [1]).dtype == torch.bfloat16 and op_kernels.softmax(half, 1, True).dtype == torch.float32


def test_tree_sum_is_accurate_and_handles_lengths() -> None:
    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 3, 17, 64, 1000, 4097):
        x = torch.randn(n, generator=g, dtype=torch.float64)
        assert abs(float(exact_math.tree_sum(x)) - math.fsum(x.tolist())) <= 1e-13 * n
    assert exact_math.tree_sum(torch.zeros(3, 0)).shape == (3,) and exact_math.tree_sum(
        torch.zeros(3, 0), keepdim=True
    ).shape == (3, 1)


# -- row invariance --------------------------------------------------------------------------------

KS = st.sampled_from([1, 2, 16, 37, 64, 128, 900])


@settings(max_examples=40)
@given(
    k=KS, n=st.sampled_from([1, 5, 64, 400]), m=st.integers(1, 70), pos=st.data(), seed=st.integers(0, 2**16)
)
def test_matrix_products_give_a_row_the_same_bits_in_any_batch(k, n, m, pos, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    row = torch.randn(1, k, generator=g)
    p = pos.draw(st.integers(0, m - 1))
    batch = torch.randn(m + 1, k + 3, generator=g)[1:, 2 : 2 + k]  # an offset, strided view
    batch[p] = row[0]
    assert torch.equal(op_kernels.mm(batch, w.t())[p], op_kernels.mm(row, w.t())[0])
    assert torch.equal(op_kernels.addmm(bias, batch, w.t())[p], op_kernels.addmm(bias, row, w.t())[0])
    b3 = torch.stack([batch, batch.flip(0)])
    assert torch.equal(op_kernels.bmm(b3, torch.stack([w.t(), w.t()]))[0, p], op_kernels.mm(row, w.t())[0])
    assert torch.equal(op_kernels.mv(batch, w[0])[p], op_kernels.mv(row, w[0])[0])


@settings(max_examples=40)
@given(r=st.integers(1, 300), m=st.integers(1, 40), pos=st.data(), seed=st.integers(0, 2**16))
def test_row_reductions_and_nonlinearities_give_a_row_the_same_bits_in_any_batch(r, m, pos, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    row = torch.randn(1, r, generator=g) * 5
    p = pos.draw(st.integers(0, m - 1))
    batch = torch.randn(r, m, generator=g).t()  # column-major: rows are strided
    batch[p] = row[0]
    for name, fn in [
        ("mean", lambda t: op_kernels.mean_dim(t, [-1], False)),
        ("sum", lambda t: op_kernels.sum_dim(t, [1], True)),
        ("softmax", lambda t: op_kernels.softmax(t, -1, False)),
        ("log_softmax", lambda t: op_kernels.log_softmax(t, 1, False)),
        ("silu", op_kernels.silu),
        ("sigmoid", op_kernels.sigmoid),
        ("exp", op_kernels.exp),
        ("cos", op_kernels.cos),
        ("rsqrt", lambda t: op_kernels.rsqrt(t.abs() + 1)),
    ]:
        assert torch.equal(fn(batch)[p], fn(row)[0]), name


def test_torch_kernels_on_the_same_rows_are_measured_and_reported(record_property) -> None:
    """Negative control: torch's own mm and silu on the row-invariance draws. Reported, not asserted."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(256, 128, generator=g)
    row = torch.randn(1, 128, generator=g)
    ref = row @ w.t()
    differ = {"mm": 0, "silu": 0}
    sizes = list(range(1, 40))
    for m in sizes:
        batch = torch.randn(m, 128, generator=g)
        batch[m - 1] = row[0]
        differ["mm"] += not torch.equal((batch @ w.t())[m - 1], ref[0])
        x = torch.randn(m * 37, generator=g) * 8
        one = torch.nn.functional.silu(x[-1:])
        differ["silu"] += not torch.equal(torch.nn.functional.silu(x)[-1:], one)
        assert torch.equal(op_kernels.mm(batch, w.t())[m - 1], op_kernels.mm(row, w.t())[0])
        assert torch.equal(op_kernels.silu(x)[-1:], op_kernels.silu(x[-1:]))
    record_property("torch_rows_not_bitwise", str(differ))
    print(f"[measured] torch kernels, {len(sizes)} batch sizes: rows not bitwise {differ}")


# -- the attention kernel ------------------------------------------------------------------------


def eager(query, key, value, allowed, scaling):
    """Plain masked attention in float64, the numerical reference."""
    rep = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(rep, 1).double()
    v = value.repeat_interleave(rep, 1).double()
    s = (query.double() @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~allowed[:, None], -math.inf)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def qkv(b, h, hkv, t, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(b, h, t, d, generator=g),
        torch.randn(b, hkv, t, d, generator=g),
        torch.randn(b, hkv, t, d, generator=g),
    )


def causal_padded(lengths, width, left=False):
    allowed = torch.zeros(len(lengths), width, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        o = width - n if left else 0
        allowed[i, o : o + n, o : o + n] = torch.ones(n, n, dtype=torch.bool).tril()
    return allowed


MODULE = torch.nn.Module().eval()


def test_attention_matches_plain_attention_with_grouped_heads() -> None:
    q, k, v = qkv(2, 4, 2, 150)
    allowed = causal_padded([150, 97], 150)
    out, weights = attention_kernel.attention_forward(MODULE, q, k, v, allowed[:, None], scaling=0.25)
    assert weights is None and out.shape == (2, 150, 4, 16)
    ref = eager(q, k, v, allowed, 0.25)
    torch.testing.assert_close(out[0].double(), ref[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out[1, :97].double(), ref[1, :97], rtol=1e-5, atol=1e-6)


def test_attention_gives_a_sequence_the_same_bits_in_every_layout() -> None:
    q, k, v = qkv(1, 2, 1, 200, seed=5)
    n = 130
    alone, _ = attention_kernel.attention_forward(MODULE, q[:, :, :n], k[:, :, :n], v[:, :, :n], None, scaling=0.3)
    # packed at offset 70 behind another sequence, boolean block-diagonal mask
    seg = torch.cat([torch.zeros(70), torch.ones(n)]).long()
    block = (seg[:, None] == seg[None, :]) & torch.ones(200, 200, dtype=torch.bool).tril()
    qp, kp, vp = (torch.cat([x[:, :, n:], x[:, :, :n]], 2) for x in (q, k, v))
    packed, _ = attention_kernel.attention_forward(MODULE, qp, kp, vp, block[None, None], scaling=0.3)
    assert torch.equal(packed[0, 70:], alone[0])
    # the same as an additive mask, and right/left padded from a 2D mask
    additive = torch.zeros(200, 200).masked_fill(~block, torch.finfo(torch.float32).min)
    assert torch.equal(
        attention_kernel.attention_forward(MODULE, qp, kp, vp, additive[None, None], scaling=0.3)[0][0, 70:], alone[0]
    )
    pad2d = torch.zeros(1, 200, dtype=torch.long)
    pad2d[0, :n] = 1
    assert torch.equal(attention_kernel.attention_forward(MODULE, q, k, v, pad2d, scaling=0.3)[0][0, :n], alone[0])
    left = causal_padded([n], 200, left=True)
    ql, kl, vl = (torch.cat([x[:, :, n:], x[:, :, :n]], 2) for x in (q, k, v))
    out_left, _ = attention_kernel.attention_forward(MODULE, ql, kl, vl, left[:, None], scaling=0.3)
    assert torch.equal(out_left[0, 70:], alone[0])
    assert torch.equal(out_left[0, :70], torch.zeros(70, 2, 16))  # queries without keys


def _tril(heads: int = 1) -> torch.Tensor:
    return torch.ones(1, heads, 8, 8, dtype=torch.bool).tril()


def _gap() -> torch.Tensor:
    m = _tril()
    m[0, 0, 5, 2] = False  # query 5 reads keys 0, 1, 3, 4, 5
    return m


def _per_head() -> torch.Tensor:
    m = _tril(2)
    m[0, 1, 7, 0] = False
    return m


@pytest.mark.parametrize(
    ("mask", "kwargs", "match"),
    [
        (_gap(), {}, r"query 5\) is not one contiguous range"),
        (torch.full((1, 1, 8, 8), -1.5), {}, "additive value -1.5"),
        (_per_head(), {}, "differs between heads"),
        (torch.ones(1, 1, 8, 9, dtype=torch.bool), {}, "allowed \\[1 or 1, 1 or heads, 8, 8\\]"),
        (None, {"sliding_window": 4}, "sliding_window=4"),
        (None, {"softcap": 30.0}, "softcap=30.0"),
    ],
)
def test_attention_refuses_what_it_cannot_make_invariant(mask, kwargs, match) -> None:
    q, k, v = qkv(1, 2, 1, 8)
    with pytest.raises(ValueError, match=match):
        attention_kernel.attention_forward(MODULE, q, k, v, mask, scaling=0.5, **kwargs)


def test_attention_refuses_dropout_in_training() -> None:
    q, k, v = qkv(1, 2, 1, 8)
    mod = torch.nn.Module().train()
    with pytest.raises(ValueError, match="dropout=0.1 in training mode"):
        attention_kernel.attention_forward(mod, q, k, v, None, scaling=0.5, dropout=0.1)


# -- installing, restoring, reporting -------------------------------------------------------------


@pytest.fixture
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(cfg).eval()


def registry() -> tuple[bool, bool]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    return (
        attention_kernel.ATTENTION_NAME in AttentionInterface._global_mapping,
        attention_kernel.ATTENTION_NAME in AttentionMaskInterface._global_mapping,
    )


def test_enable_installs_and_restore_puts_everything_back(model) -> None:
    prev = model.config._attn_implementation
    assert registry() == (False, False)
    handle = ck.enable([model])
    assert registry() == (True, True) and ck.is_enabled(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    calls = dict(handle.report["calls"])
    assert calls["attention"] == 1 and calls["mm.default"] >= 7 and calls["mean.dim"] == 3
    assert handle.report["other_ops"] == {} and handle.report["exact_ops"] > 0
    torch.mm(torch.ones(2, 2), torch.ones(2, 2))  # outside the model's forward: torch's own kernel
    assert handle.report["calls"] == calls
    handle.restore()
    assert registry() == (False, False) and not ck.is_enabled(model)
    assert model.config._attn_implementation == prev and "forward" not in model.__dict__


def test_restore_after_a_forward_that_raised_and_nested_handles(model) -> None:
    outer = ck.enable([model])
    inner = ck.enable([model])
    with pytest.raises(IndexError):
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 99]]))  # token id outside the vocabulary
    assert attention_kernel.TLS.active is None  # the forward's kernel scope ended with the exception
    inner.restore()
    assert ck.is_enabled(model) and registry() == (True, True)
    outer.restore()
    assert not ck.is_enabled(model) and registry() == (False, False)


def test_operations_no_kernel_covers_are_counted(model) -> None:
    class Tanh(torch.nn.Module):
        def forward(self, x):
            return torch.tanh(x) * 2

    model.model.layers[0].mlp.act_fn = Tanh()
    handle = ck.enable([model])
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
    finally:
        handle.restore()
    assert handle.report["other_ops"] == {"tanh.default": 1}


def test_unsupported_models_are_refused_with_the_reason() -> None:
    with pytest.raises(ck.UnsupportedModel, match="is not a torch.nn.Module"):
        ck.enable([object()])
    with pytest.raises(ck.UnsupportedModel, match="no transformers config"):
        ck.enable([torch.nn.Linear(2, 2)])
