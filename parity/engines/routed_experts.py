"""The experts vLLM's MoE routers chose (vLLM 0.32): top-k ids per layer for every (request, position) a
forward ran, natively (Model Runner V2) or through vLLM's ``bind_routed_experts_capturer`` on the
in-process V1 runner. docs/routing.md, section 1."""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.worker_base import WorkerBase

    from parity.core.sequence import SequenceRecord

ATTR = "_parity_routes"
ROUTED = "routed_experts"  # SequenceRecord.extras key: long [P + L - 1, layers, top_k], -1 where no forward ran
NATIVE = "vLLM enable_return_routed_experts (CompletionOutput.routed_experts, Model Runner V2)"
BINDER = "vLLM bind_routed_experts_capturer on the in-process V1 runner (vllm 0.32)"
Steps = dict[str, list[tuple[np.ndarray, dict[int, np.ndarray]]]]  # request id -> (positions, ids per layer) per forward


def moe_shape(checkpoint: str | Path) -> tuple[int, int, int] | None:
    """(MoE layers, top_k, experts) from a checkpoint's config.json; None for a dense model."""
    cfg = json.loads((Path(checkpoint) / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts or not cfg.get("num_experts_per_tok"):
        return None
    n = int(cfg["num_hidden_layers"])
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step") or 1)
    layers = sum(1 for i in range(n) if i not in dense and (i + 1) % step == 0)
    return layers, int(cfg["num_experts_per_tok"]), int(experts)


class _Recorder:
    """What ``bind_routed_experts_capturer`` calls: ``capture(layer_id, topk_ids)`` once per MoE layer and forward."""

    def __init__(self) -> None:
        self.armed = False
        self.schedule: dict[str, int] | None = None
        self.layers: dict[int, np.ndarray] = {}
        self.store: Steps = {}

    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        if self.armed and self.schedule is not None:
            self.layers[int(layer_id)] = topk_ids.detach().to("cpu").numpy().astype(np.int32, copy=True)

    def flush(self, req_ids: list[str], positions: np.ndarray) -> None:
        sched, self.schedule = self.schedule, None
        layers, self.layers = self.layers, {}
        if sched is None or not layers:
            return
        start = 0
        for rid in req_ids:
            n = int(sched.get(rid, 0))
            if n:
                rows = {lid: ids[start : start + n] for lid, ids in layers.items()}
                self.store.setdefault(rid, []).append((positions[start : start + n].copy(), rows))
            start += n


def _install(worker: WorkerBase) -> str:
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    runner = getattr(worker, "model_runner", None)
    if runner is None or not hasattr(runner, "input_batch") or not hasattr(runner, "_model_forward"):
        return "the worker has no V1 model runner"
    if getattr(runner, ATTR, None) is not None:
        return ""
    rec = _Recorder()
    bind_routed_experts_capturer(runner.get_model(), rec)  # duck-typed: capture(layer_id, topk_ids) only
    ref = weakref.ref(runner)  # no cycle through the wrappers: the engine must be collectable on close
    execute, forward = runner.execute_model, runner._model_forward

    def execute_model(scheduler_output: SchedulerOutput, *args: object, **kwargs: object) -> object:
        rec.schedule = dict(scheduler_output.num_scheduled_tokens) if rec.armed else None
        return execute(scheduler_output, *args, **kwargs)

    def model_forward(*args: object, **kwargs: object) -> object:
        out = forward(*args, **kwargs)
        run, positions = ref(), kwargs.get("positions")
        if run is not None and rec.schedule is not None and isinstance(positions, torch.Tensor):
            rec.flush(list(run.input_batch.req_ids), positions.detach().to("cpu").numpy())
        return out

    runner.execute_model, runner._model_forward = execute_model, model_forward
    setattr(runner, ATTR, rec)
    return ""


def _arm(worker: WorkerBase, on: bool) -> Steps:
    rec: _Recorder = getattr(worker.model_runner, ATTR)
    rec.armed, out = on, dict(rec.store)
    rec.store.clear()
    return out


def assemble(steps: list[tuple[np.ndarray, dict[int, np.ndarray]]], length: int) -> tuple[np.ndarray, int]:
    """One request's steps as ``[length, layers, top_k]`` by position (later forwards of a position win);
    with the count of positions no forward covered (their ids stay -1)."""
    lids = sorted({lid for _, layers in steps for lid in layers})
    k = next(iter(steps[0][1].values())).shape[1] if steps else 1
    out = np.full((length, len(lids), k), -1, dtype=np.int32)
    for pos, layers in steps:
        keep = pos < length
        for j, lid in enumerate(lids):
            out[pos[keep], j] = layers[lid][keep]
    return out, int((out[:, 0, 0] < 0).sum()) if len(lids) else length


class RoutedExperts:
    """The binder on one ``vllm.LLM``: :meth:`install` once; :meth:`arm`, generate, :meth:`take`."""

    def __init__(self, llm: LLM, *, timeout_s: float = 60.0) -> None:
        self.llm, self.timeout_s, self.reason, self.active = llm, timeout_s, "", False

    def install(self) -> bool:
        try:
            answers = self.llm.collective_rpc(_install, timeout=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - a refusal is reported, never hidden
            self.reason = f"bind_routed_experts_capturer failed: {type(exc).__name__}: {exc}"
            return False
        self.reason = "; ".join(a for a in answers if a) or (
            "" if len(answers) == 1 else f"{len(answers)} workers")
        self.active = not self.reason
        return self.active

    def arm(self) -> None:
        if self.active:
            self.llm.collective_rpc(_arm, timeout=self.timeout_s, args=(True,))

    def take(self) -> Steps:
        """The steps recorded since :meth:`arm`, by the caller's request id (vLLM appends ``-`` and 8 characters)."""
        if not self.active:
            return {}
        [got] = self.llm.collective_rpc(_arm, timeout=self.timeout_s, args=(False,))
        out: Steps = {}
        for rid, steps in got.items():
            out.setdefault(rid.rsplit("-", 1)[0], []).extend(steps)
        return out


def attach_routes(records: Sequence[SequenceRecord], outputs: Sequence[RequestOutput], steps: Steps | None,
                  experts: int) -> dict[str, object]:
    """Put each record's routed experts in ``extras[ROUTED]``: the native ``routed_experts`` of its output, or the
    binder's ``steps`` (by request id). Positions no forward covered (a prefix-cache hit) stay -1, counted."""
    uncovered, rows = 0, 0
    for r, out in zip(records, outputs, strict=True):
        length = len(r.prompt_ids) + r.length - 1
        if steps is None:
            arr = np.asarray(out.outputs[0].routed_experts, dtype=np.int32)[:length]
            miss = length - arr.shape[0]
            arr = np.concatenate([arr, np.full((miss, *arr.shape[1:]), -1, np.int32)]) if miss else arr
        else:
            arr, miss = assemble(steps.get(str(out.request_id), []), length)
        r.extras[ROUTED] = torch.from_numpy(arr.astype(np.int64))
        r.extras["routed_num_experts"] = torch.tensor(experts)
        uncovered, rows = uncovered + miss, rows + length
    import vllm

    route = NATIVE if steps is None else BINDER
    return {"route": route, "vllm": getattr(vllm, "__version__", None), "rows": rows, "uncovered_rows": uncovered}
