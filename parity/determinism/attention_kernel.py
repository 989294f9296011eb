"""The batch-invariant attention: per sequence, over its own keys from its first token, in fixed chunks.

Registered with transformers as ``ATTENTION_NAME`` while a kernel set is enabled (parity.determinism.kernels).
Why each step is layout-free: docs/batch_invariance.md.
"""

from __future__ import annotations

import math
import threading
from typing import Protocol, runtime_checkable

import torch

from parity.determinism.exact_math import acc_dtype, aligned_empty, exp_to, tree_sum
from parity.errors import UsageError

ATTENTION_NAME = "parity_batch_invariant"
# Query and key chunk of the attention kernel: a sequence's keys are reduced from its first token in
# blocks of this many positions. A multiple of 16 keeps every chunk of a float32 buffer 64-byte aligned.
CHUNK = 64
ATTENTION_KERNEL = (
    f"transformers attention '{ATTENTION_NAME}': per sequence (from the mask), keys from the sequence's "
    f"first token, one fixed-shape query chunk of {CHUNK} at a time, exact max, own exp, tree sums"
)


class _Counts(Protocol):
    def count_call(self, name: str) -> None: ...


class _State(threading.local):
    def __init__(self) -> None:
        self.active: _Counts | None = None  # the kernels.CpuKernels whose forward is running
        self.bypass = 0


TLS = _State()


class _AttentionConfig(Protocol):
    _attn_implementation: str | None


@runtime_checkable
class SwitchesAttention(Protocol):
    """A model whose attention implementation can be switched: a transformers ``PreTrainedModel``, as read here
    (its config's implementation, and the setter, which also puts a previous value back)."""

    config: _AttentionConfig

    def set_attn_implementation(self, attn_implementation: str | None) -> object: ...


def implementation(config: object, attr: str = "_attn_implementation") -> str | None:
    """A transformers config's implementation name (``_attn_implementation``, ``_experts_implementation``);
    None where ``config`` has none (or is None)."""
    value: object = getattr(config, attr, None)
    return value if isinstance(value, str) else None


class bypass:
    """Inside the attention kernel: its chunk products and sums are its own; do not re-route them."""

    def __enter__(self) -> None:
        TLS.bypass += 1

    def __exit__(self, *exc: object) -> None:
        TLS.bypass -= 1


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
    """Attention of the query rows of ``qb`` ([nQ, H, C, D], chunk-major) over the key rows ``[0, lim[r])``
    of ``kb``/``vb`` ([nK, H, C, D]), one query chunk at a time: every call has a shape fixed by the chunk
    and the sequence's own inputs (docs/batch_invariance.md, "Attention"). Returns [nQ, H, C, Dv]."""
    acc = acc_dtype(qb.dtype)
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
        e = torch.where(keep, exp_to(s - top_score, acc), torch.zeros((), dtype=acc))
        den = tree_sum(e, keepdim=True)
        num = torch.matmul(e.to(vb.dtype), values).to(acc)
        out[qc] = torch.where(den > 0, num / den, torch.zeros((), dtype=acc))
    return out


def _chunk_buffer(rows: int, h: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros ``[ceil(rows / C), h, C, d]``, 64-byte aligned (every chunk too: C * d elements each)."""
    n = max(1, -(-rows // CHUNK))
    size = n * h * CHUNK * d
    return aligned_empty(1, size, dtype)[0, :size].zero_().view(n, h, CHUNK, d)


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
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """transformers attention function (the ``AttentionInterface`` signature of ``eager_attention_forward``):
    query ``[B, H, Q, D]``, key and value ``[B, Hkv, KV, D]``, returns ``([B, Q, H, D], None)``. Each causal
    sequence, cut out of its row by the mask, is reduced over its own keys (docs/batch_invariance.md)."""
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
    with bypass():
        out = _attention(query, key, value, attention_mask, scaling)
    kernels = TLS.active
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
    out = torch.zeros(b, q, h, dv, dtype=acc_dtype(query.dtype))
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
