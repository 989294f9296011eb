"""The trainer's MoE routers (transformers 5): their top-k per layer and token, and routing replay (R3):
router hooks force the recorded experts and recompute the gate weights, and a pre-hook on ``experts``
checks what ran. docs/routing.md, section 3."""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from parity.core import routing as core_routing
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.core.token_table import TokenTable, build_table
from parity.core.violation import Position
from parity.engines.routed_experts import ROUTED
from parity.errors import UsageError
from parity.report.blocks import JsonObject, ReplayDrift, Routing

if TYPE_CHECKING:
    from parity.engines.session import Trainer


def routers(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module, torch.nn.Module]]:
    """(decoder layer, router, experts) of every MoE layer, in layer order."""
    mods = dict(model.named_modules())
    out = []
    for name, mod in mods.items():
        hit = re.search(r"layers\.(\d+)\.mlp\.gate$", name)
        experts = mods.get(name.removesuffix(".gate") + ".experts")
        if hit and experts is not None and hasattr(mod, "top_k") and getattr(mod, "weight", None) is not None:
            out.append((int(hit.group(1)), mod, experts))
    return sorted(out, key=lambda t: t[0])


@dataclass
class RouterTrace:
    """Per forward call and MoE layer: ||h||, router logits, and the experts the expert MLPs ran with."""

    layers: list[int]
    w_rms: np.ndarray  # [layers, E]
    calls: dict[int, list[dict[str, np.ndarray]]] = field(default_factory=dict)

    def per_record(self, records: Sequence[SequenceRecord], batch_size: int) -> list[dict[str, np.ndarray]]:
        """The trace cut back to each record's routed rows (positions 0 .. P + L - 2), right-padded batches undone."""
        out = []
        for i, r in enumerate(records):
            b, j = divmod(i, batch_size)
            chunk = records[b * batch_size : (b + 1) * batch_size]
            width = max(len(c.prompt_ids) + c.length for c in chunk)
            rows = slice(j * width, j * width + len(r.prompt_ids) + r.length - 1)
            out.append({key: np.stack([self.calls[lyr][b][key][rows] for lyr in self.layers], 1)
                        for key in ("h_norm", "logits", "ids")})
        return out


def _forced(records: Sequence[SequenceRecord], batch_size: int, layer: int, k: int) -> list[torch.Tensor]:
    """The recorded experts of ``layer`` laid out as each forward call's flat rows (-1: the trainer's own)."""
    out = []
    for b in range(0, len(records), batch_size):
        chunk = records[b : b + batch_size]
        width = max(len(c.prompt_ids) + c.length for c in chunk)
        flat = torch.full((len(chunk) * width, k), -1, dtype=torch.long)
        for j, r in enumerate(chunk):
            ids = r.extras.get(ROUTED)
            if ids is None:
                raise UsageError(f"routing replay: prompt {r.prompt_index} has no recorded experts: allowed records "
                                 f"sampled from a MoE engine with routed-expert capture on")
            flat[j * width : j * width + ids.shape[0]] = ids[:, layer]
        out.append(flat)
    return out


def _top_k(router: torch.nn.Module) -> int:
    k = router.top_k
    assert isinstance(k, int)  # the router's config.num_experts_per_tok
    return k


def _regate(module: torch.nn.Module, logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Gate weights for ``idx`` from the router's own logits, as its forward computes them for its top-k."""
    probs = torch.softmax(logits.float(), dim=-1)
    scores = probs.gather(1, idx)
    if getattr(module, "norm_topk_prob", True):
        scores = scores / scores.sum(dim=-1, keepdim=True)
    return scores.to(logits.dtype) if hasattr(module, "norm_topk_prob") else scores


@contextmanager
def trace_routers(model: torch.nn.Module, records: Sequence[SequenceRecord] | None = None,
                  batch_size: int = 8) -> Iterator[RouterTrace]:
    """Record every MoE layer's routing over the forwards inside; with ``records``, replay their experts."""
    found = routers(model)
    if not found:
        raise UsageError(f"{type(model).__name__} has no MoE router (layers.N.mlp.gate with experts): allowed a "
                         f"Qwen3-MoE or Mixtral model of transformers")
    weights: list[torch.Tensor] = [m.weight for _, m, _ in found]  # type: ignore[misc]  # [E, H] Parameters
    w_rms = np.stack([w.detach().float().pow(2).mean(1).sqrt().cpu().numpy() for w in weights])
    trace = RouterTrace([lyr for lyr, _, _ in found], w_rms)
    handles = []
    for j, (lyr, router, experts) in enumerate(found):
        calls = trace.calls.setdefault(lyr, [])
        forced = _forced(records, batch_size, j, _top_k(router)) if records is not None else None

        def after(mod: torch.nn.Module, args: tuple[torch.Tensor, ...], out: tuple[torch.Tensor, ...],
                  calls: list[dict[str, np.ndarray]] = calls, forced: list[torch.Tensor] | None = forced,
                  ) -> tuple[torch.Tensor, ...] | None:
            h = args[0].reshape(-1, args[0].shape[-1])
            calls.append({"h_norm": h.float().norm(dim=-1).cpu().numpy(), "logits": out[0].float().cpu().numpy()})
            if forced is None:
                return None
            want = forced[len(calls) - 1].to(out[2].device)
            idx = torch.where(want >= 0, want, out[2])
            return out[0], _regate(mod, out[0], idx), idx

        def used(mod: torch.nn.Module, args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor], calls: list[dict[str, np.ndarray]] = calls) -> None:
            top = kwargs["top_k_index"] if "top_k_index" in kwargs else args[1]
            calls[-1]["ids"] = top.detach().cpu().numpy().astype(np.int32)

        handles.append(router.register_forward_hook(after))
        handles.append(experts.register_forward_pre_hook(used, with_kwargs=True))
    try:
        yield trace
    finally:
        for hd in handles:
            hd.remove()


def _rows(per: list[dict[str, np.ndarray]], key: str) -> np.ndarray:
    return np.concatenate([p[key] for p in per]) if per else np.zeros(0)


def routing_report(
    records: Sequence[SequenceRecord], table: TokenTable, trainer: Trainer, spec: SamplingSpec, dtypes: Sequence[str],
    *, scenario: str, n_listed: int = 5, own: RouterTrace | None = None,
) -> Routing:
    """One scenario's routing section: agreement of the sampler's experts with the trainer's router, then the
    trainer again under replay of the sampler's experts, with the positions each routing gate would name (the
    gate table's routing entries judge it). ``own``: the trace of the trainer's scoring pass, where the caller
    traced it (else traced here)."""
    bs = int(getattr(trainer, "batch_size", 8))
    if own is None:
        with trace_routers(trainer.model, batch_size=bs) as own:
            trainer.logits(records)
    mine = own.per_record(records, bs)
    with trace_routers(trainer.model, records, bs) as forced:
        logits_r3 = trainer.logits(records)
    replayed = forced.per_record(records, bs)
    recorded = np.concatenate([r.extras[ROUTED].numpy() for r in records]).astype(np.int32)
    prompt = np.concatenate([np.full(len(r.prompt_ids) + r.length - 1, r.prompt_index) for r in records])
    position = np.concatenate([np.arange(len(r.prompt_ids) + r.length - 1) for r in records])
    covered = (recorded >= 0).all(axis=(1, 2))
    experts = int(own.w_rms.shape[1])
    bad = recorded[covered] >= experts
    if bad.any():
        raise UsageError(f"routed experts of scenario {scenario!r}: expert id {int(recorded[covered][bad].max())} "
                         f"from the sampler: allowed ids < {experts} (the trainer's experts per layer)")
    logits, ids, h_norm = (_rows(mine, k)[covered] for k in ("logits", "ids", "h_norm"))
    args = (prompt[covered], position[covered])
    agreement, flips = core_routing.routing_agreement(recorded[covered], ids, logits, h_norm, own.w_rms, dtypes, *args,
                                                      n_listed=n_listed)
    check, unforced = core_routing.replay_forced(recorded[covered], _rows(replayed, "ids")[covered], *args,
                                                 n_listed=n_listed)
    table_r3 = build_table(records, logits_r3, spec, dtype=list(dtypes))
    seq = table.prompt_index.numpy()
    without, with_r3 = (core_routing.drift_stats(t.vllm.numpy(), t.replay.numpy(), t.bound.numpy(), seq)
                        for t in (table, table_r3))
    head = (table_r3.replay - table_r3.vllm).abs() / table_r3.bound.clamp(min=1e-300)
    i = int(head.argmax()) if head.numel() else 0
    worst = Position(int(table_r3.prompt_index[i]), int(table_r3.position[i]), int(table_r3.token[i]),
                     {"vllm": float(table_r3.vllm[i]), "trainer_replay_r3": float(table_r3.replay[i])},
                     float((table_r3.replay[i] - table_r3.vllm[i]).abs()), float(table_r3.bound[i])) if head.numel() else None
    drifted: core_routing.Listed = ((worst,) if worst else (), f"without replay {without['headroom']:.3g}")
    listed: dict[str, JsonObject] = {gate: {"worst": [p.to_dict() for p in where], "detail": detail}
              for gate, (where, detail) in ((core_routing.AGREEMENT_GATE, flips), (core_routing.FORCED_GATE, unforced),
                                            (core_routing.DRIFT_GATE, drifted)) if where}
    # The agreement's keys are the section's first keys; "capture" (not required) is added by the caller.
    return Routing(
        **agreement, uncovered_rows=int((~covered).sum()),  # type: ignore[typeddict-item]
        replay={"rows": check.rows, "forced_frac": check.forced_frac, "mismatched": check.mismatched,
                "drift": {"without_replay": cast(ReplayDrift, without),  # drift_stats' keys, tokens an int
                          "with_replay": cast(ReplayDrift, with_r3)}},
        listed=listed,
    )

