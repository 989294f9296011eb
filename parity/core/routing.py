"""MoE routing parity (engine-free): the sampler's experts against the trainer's router, and routing replay.
Arrays in (``ids`` ``[N, layers, top_k]`` per (sequence, position) a forward ran), a typed result and the
positions a failing gate would name (:data:`Listed`) out; the gates decide in :mod:`parity.judge.gate_table`.
A flip is allowed within :func:`margin_bound` (docs/routing.md, section 2)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, TypedDict

import numpy as np

from parity.core.error_model import LOGIT_ULPS, unit_roundoff
from parity.core.violation import Position
from parity.errors import UsageError

if TYPE_CHECKING:
    from parity.core.error_model import Dtypes

AGREEMENT_GATE = "routing_agreement"
FORCED_GATE = "routing_replay_forced"
DRIFT_GATE = "routing_replay_drift"

# The worst positions a routing gate names where it fails, and a line of detail.
Listed = tuple[tuple[Position, ...], str]


def margin_bound(h_norm: np.ndarray, w_rms: np.ndarray, pair: np.ndarray, dtypes: Dtypes) -> np.ndarray:
    """Bound on |margin_sampler - margin_trainer| per row and layer (docs/routing.md, section 2). ``h_norm``
    [N, layers]: ||h||_2 of the router's input; ``w_rms`` [layers, E]: each expert row's RMS; ``pair``
    [N, layers, 2]: the trainer's k-th and (k+1)-th experts."""
    u = unit_roundoff(dtypes)
    layer = np.arange(w_rms.shape[0])[None, :, None]
    w = w_rms[layer, pair].sum(-1)
    return np.asarray(2.0 * LOGIT_ULPS * u * h_norm * w, dtype=np.float64)


def topk_margin(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k-th minus the (k+1)-th largest logit, and those two experts, per row and layer."""
    order = np.argsort(-logits, axis=-1, kind="stable")[..., : k + 1]
    top = np.take_along_axis(logits, order, -1)
    return top[..., k - 1] - top[..., k], order[..., k - 1 : k + 1]


class RoutingLayer(TypedDict):
    """One layer of :class:`Agreement`: the fraction of rows whose expert sets agree, the flips, those above the
    margin bound, and the median margin and bound."""

    layer: int
    agreement: float
    flips: int
    flips_above_bound: int
    median_margin: float
    median_bound: float


class Agreement(TypedDict):
    """The sampler's expert sets against the trainer's router: per layer, and over every (row, layer); the
    first keys of a report's routing section (:class:`parity.report.blocks.RoutingSection`)."""

    rows: int
    layers: int
    top_k: int
    num_experts: int
    per_layer: list[RoutingLayer]
    agreement: float  # over every (row, layer)
    rows_any_layer_differs: float  # Megatron's figure: rows with >= 1 layer whose set differs
    flips: int
    flips_within_bound: int
    flips_above_bound: int
    worst_margin_over_bound: float | None  # the largest margin / bound among flips (None: no flip)


def _margins(sampler_ids: np.ndarray, trainer_ids: np.ndarray, z: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per row and layer: whether the sets differ, the trainer's margin that a flip must overcome and its two
    experts. No flip: the k-th against the (k+1)-th. A flip: the best trainer-only expert against the worst
    sampler-only one (every such pair must have swapped, so the widest pair decides)."""
    experts = np.arange(z.shape[-1])
    in_t = (trainer_ids[..., None] == experts).any(-2)
    in_s = (sampler_ids[..., None] == experts).any(-2)
    only_t, only_s = in_t & ~in_s, in_s & ~in_t
    flip = only_t.any(-1)
    e_t = np.where(only_t, z, -np.inf).argmax(-1)
    e_s = np.where(only_s, z, np.inf).argmin(-1)
    swap = np.take_along_axis(z, e_t[..., None], -1)[..., 0] - np.take_along_axis(z, e_s[..., None], -1)[..., 0]
    margin, pair = topk_margin(z, sampler_ids.shape[-1])
    return (flip, np.where(flip, swap, margin), np.where(flip[..., None], np.stack([e_t, e_s], -1), pair))


def routing_agreement(
    sampler_ids: np.ndarray, trainer_ids: np.ndarray, trainer_logits: np.ndarray, h_norm: np.ndarray,
    w_rms: np.ndarray, dtypes: Dtypes, prompt: np.ndarray, position: np.ndarray, *, n_listed: int = 5,
) -> tuple[Agreement, Listed]:
    """The expert sets of both sides per row and layer, and the flips whose trainer margin exceeds its bound
    (widest first; none listed where there are none). ``trainer_logits`` [N, layers, E]: the trainer's router
    logits; ``h_norm``, ``w_rms``, ``dtypes`` as :func:`margin_bound`; ``prompt``/``position`` [N] name each row."""
    if sampler_ids.shape != trainer_ids.shape or sampler_ids.ndim != 3:
        raise UsageError(f"routed experts: sampler {sampler_ids.shape} vs trainer {trainer_ids.shape}: allowed the "
                         f"same [rows, layers, top_k] on both sides")
    n, layers, k = sampler_ids.shape
    experts = int(trainer_logits.shape[-1])
    flip, margin, pair = _margins(sampler_ids, trainer_ids, trainer_logits)
    agree = ~flip
    bound = margin_bound(h_norm, w_rms, pair, dtypes)
    ratio = np.where(bound > 0, margin / np.maximum(bound, 1e-300), np.inf)
    above = flip & (margin > bound)
    per_layer = [RoutingLayer(layer=j, agreement=float(agree[:, j].mean()) if n else 1.0, flips=int(flip[:, j].sum()),
                              flips_above_bound=int(above[:, j].sum()),
                              median_margin=float(np.median(margin[:, j])) if n else 0.0,
                              median_bound=float(np.median(bound[:, j])) if n else 0.0) for j in range(layers)]
    result = Agreement(
        rows=n, layers=layers, top_k=k, num_experts=experts, per_layer=per_layer,
        agreement=float(agree.mean()) if n else 1.0, rows_any_layer_differs=float(flip.any(1).mean()) if n else 0.0,
        flips=int(flip.sum()), flips_within_bound=int((flip & ~above).sum()), flips_above_bound=int(above.sum()),
        worst_margin_over_bound=float(ratio[flip].max()) if flip.any() else None,
    )
    if not above.any():
        return result, ((), "")
    rows, cols = np.nonzero(above)
    worst = np.argsort(-ratio[rows, cols], kind="stable")[:n_listed]
    where = tuple(
        Position(prompt=int(prompt[rows[i]]), position=int(position[rows[i]]), gap=float(margin[rows[i], cols[i]]),
                 bound=float(bound[rows[i], cols[i]]),
                 note=f"layer {cols[i]}: sampler experts {sorted(sampler_ids[rows[i], cols[i]].tolist())}, trainer "
                      f"{sorted(trainer_ids[rows[i], cols[i]].tolist())}, margin {margin[rows[i], cols[i]]:.3g}")
        for i in worst)
    return result, (where, f"{int(above.sum())} of {int(flip.sum())} flips over {n} tokens x {layers} layers "
                           f"(positions count from the prompt's first token)")


@dataclass(frozen=True)
class ReplayCheck:
    """Routing replay: how many (row, layer) sets the trainer used equal the recorded ones, and the drift."""

    rows: int
    forced_frac: float
    mismatched: int
    drift: dict[str, dict[str, float]] = field(default_factory=dict)  # with and without replay: |diff|, headroom, IS ratio

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def replay_forced(
    recorded: np.ndarray, used: np.ndarray, prompt: np.ndarray, position: np.ndarray, *, n_listed: int = 5
) -> tuple[ReplayCheck, Listed]:
    """How many (row, layer) sets the trainer ran under replay equal the recorded ones, and the first that do not."""
    if recorded.shape != used.shape:
        raise UsageError(f"routing replay: recorded {recorded.shape} vs used {used.shape}: allowed equal shapes")
    same = (np.sort(recorded, -1) == np.sort(used, -1)).all(-1)
    bad_rows, bad_layers = np.nonzero(~same)
    check = ReplayCheck(rows=int(recorded.shape[0]), forced_frac=float(same.mean()) if same.size else 1.0,
                        mismatched=int((~same).sum()))
    if not check.mismatched:
        return check, ((), "")
    where = tuple(Position(prompt=int(prompt[r]), position=int(position[r]),
                           note=f"layer {c}: recorded {sorted(recorded[r, c].tolist())}, used {sorted(used[r, c].tolist())}")
                  for r, c in list(zip(bad_rows, bad_layers, strict=True))[:n_listed])
    return check, (where, f"{check.mismatched} of {same.size} sets differ from the recorded ones")


def drift_stats(sampler: np.ndarray, trainer: np.ndarray, bound: np.ndarray, seq: np.ndarray) -> dict[str, float]:
    """|trainer - sampler| against its per-token bound, and the IS ratio exp(trainer - sampler), token and sequence."""
    d = trainer - sampler
    head = np.abs(d) / np.maximum(bound, 1e-300)
    seq_sum = np.bincount(seq, weights=d) if d.size else np.zeros(0)
    return {"tokens": int(d.size), "max_abs_diff": float(np.abs(d).max()) if d.size else 0.0,
            "mean_abs_diff": float(np.abs(d).mean()) if d.size else 0.0, "mean_diff": float(d.mean()) if d.size else 0.0,
            "headroom": float(head.max()) if d.size else 0.0,
            "is_ratio_token_mean": float(np.exp(d).mean()) if d.size else 1.0,
            "is_ratio_token_max": float(np.exp(d).max()) if d.size else 1.0,
            "is_ratio_seq_min": float(np.exp(seq_sum).min()) if seq_sum.size else 1.0,
            "is_ratio_seq_max": float(np.exp(seq_sum).max()) if seq_sum.size else 1.0}
