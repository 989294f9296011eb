"""The sampler's own kept sets, read where a top-K head cannot prove them: a hook on vLLM 0.32's
``Sampler.sample`` in the in-process engine keeps those rows' finite ids and values as tensors; a row proves
a position only when it matches it bitwise (docs/capture_plan.md, section 9)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from parity.core.capture import Heads

ATTR = "_parity_sampler_rows"  # the stash on the worker's sampler: request id -> per-step rows
ARMED = "_parity_rows_armed"  # rows are kept only between arm() and take()


@dataclass(frozen=True)
class Row:
    """One sampling step of one request: the sampled token, its processed log-prob, |S_q| and, when the
    head could not prove it (and it is below the cap), S_q itself."""

    token: int
    logprob: float
    count: int
    ids: torch.Tensor | None = None  # long [count]: kept ids, value descending then id
    values: torch.Tensor | None = None  # float32 [count]


def _install(worker: Any, cap: int | None) -> str:
    runner = getattr(worker, "model_runner", None)
    sampler = getattr(runner, "sampler", None)
    if sampler is None or not hasattr(sampler, "sample") or not hasattr(runner, "input_batch"):
        return "the worker has no V1 model runner sampler"
    if getattr(sampler, ATTR, None) is not None:
        sampler._parity_rows_cap = cap
        return ""
    # Weak references only: the wrapper lives on the sampler, and a cycle through it would keep a closed
    # engine alive until a garbage collection, whose teardown of vLLM's process groups would then break
    # the next engine of the process.
    original = type(sampler).sample
    sampler_ref, runner_ref = weakref.ref(sampler), weakref.ref(runner)
    store: dict[str, list[Row]] = {}

    def sample(logits: Any, metadata: Any, *args: Any, **kwargs: Any) -> Any:
        me, run = sampler_ref(), runner_ref()
        out = original(me, logits, metadata, *args, **kwargs)
        sampled, processed = out
        if processed is None or run is None or not getattr(me, ARMED, False):
            return out  # only parity's own generate calls are read: other calls leave nothing behind
        batch = run.input_batch
        limit = getattr(me, "_parity_rows_cap", None)
        finite = torch.isfinite(processed)
        counts = finite.sum(dim=1).tolist()
        tokens = sampled.long().view(-1)
        values = processed.gather(1, tokens.view(-1, 1)).view(-1).tolist()
        for r, rid in enumerate(list(batch.req_ids)[: processed.shape[0]]):
            k = batch.num_logprobs.get(rid)
            if k is None or k <= 0:  # no head asked, or the whole vocabulary: nothing to prove here
                continue
            row = Row(int(tokens[r]), float(values[r]), int(counts[r]))
            if row.count >= k and (limit is None or row.count < limit):
                idx = finite[r].nonzero().view(-1)
                vals = processed[r, idx].float()
                order = torch.sort(vals, descending=True, stable=True).indices  # ties: id ascending
                row = Row(row.token, row.logprob, row.count, idx[order].clone(), vals[order].clone())
            store.setdefault(rid, []).append(row)
        return out

    sampler.sample = sample
    setattr(sampler, ATTR, store)
    sampler._parity_rows_cap = cap
    return ""


def _arm(worker: Any) -> None:
    setattr(worker.model_runner.sampler, ARMED, True)


def _take(worker: Any) -> dict[str, list[Row]]:
    sampler = worker.model_runner.sampler
    setattr(sampler, ARMED, False)
    store = getattr(sampler, ATTR, None)
    if store is None:
        return {}
    out = dict(store)
    store.clear()
    return out


class SamplerRows:
    """The hook on one ``vllm.LLM``: :meth:`install` once, :meth:`attach` after each ``generate``. ``cap``
    (``--max-capture-head``): a kept set of ``cap`` or more tokens is not kept and its position stays unproven
    (None: no cap)."""

    def __init__(self, llm: Any, *, cap: int | None = None, timeout_s: float = 60.0) -> None:
        self.llm, self.cap, self.timeout_s = llm, cap, timeout_s
        self.reason = ""
        self.active = False

    def install(self) -> bool:
        """Wrap the worker's sampler; False (with :attr:`reason`) where the engine does not allow it."""
        try:
            answers = self.llm.collective_rpc(_install, timeout=self.timeout_s, args=(self.cap,))
        except Exception as exc:  # noqa: BLE001 - any refusal leaves the head route, and is said
            self.reason = f"the sampler hook could not be installed: {type(exc).__name__}: {exc}"
            return False
        problems = [a for a in answers if a]
        self.reason = "; ".join(problems)
        self.active = not problems and len(answers) == 1
        if len(answers) != 1:
            self.reason = f"the engine has {len(answers)} workers: the hook reads one"
        return self.active

    def describe(self) -> str:
        """report.json's ``capture_plan.sampler_rows``: where the kept sets the head did not prove came from."""
        if not self.active:
            return f"not read: {self.reason}" if self.reason else ""
        cap = "no cap" if self.cap is None else f"kept sets below {self.cap} tokens"
        return f"vLLM Sampler.sample hook (vllm 0.32, in-process V1 runner), {cap}"

    def arm(self) -> None:
        """Keep rows from now until the next :meth:`take` (one parity generate call)."""
        if self.active:
            self.llm.collective_rpc(_arm, timeout=self.timeout_s)

    def take(self) -> dict[str, list[Row]]:
        """What the hook kept since :meth:`arm`, by the caller's request id (cleared there, and disarmed)."""
        if not self.active:
            return {}
        [got] = self.llm.collective_rpc(_take, timeout=self.timeout_s)
        out: dict[str, list[Row]] = {}
        for rid, rows in got.items():
            out.setdefault(rid.rsplit("-", 1)[0], []).extend(rows)
        return out

    @staticmethod
    def attach(heads: Sequence[Heads], request_ids: Sequence[str], rows: dict[str, list[Row]]) -> int:
        """Put each kept row on its position (``Heads.rows``); returns the count of wide rows that did not match.
        A completion's rows are the last ``len(completion)`` of its request's sampling steps (docs/capture_plan.md, section 9)."""
        mismatched = 0
        for h, rid in zip(heads, request_ids, strict=True):
            steps = rows.get(rid, [])
            n = len(h.completion_ids)
            tail = steps[-n:] if n and len(steps) >= n else []
            for t, row in enumerate(tail):
                if row.ids is None or row.values is None:
                    continue
                if row.token == int(h.completion_ids[t]) and row.logprob == float(h.sampled_logprobs[t]):
                    h.rows[t] = (row.ids, row.values)
                else:
                    mismatched += 1
            if len(steps) < n:
                mismatched += sum(r.ids is not None for r in steps)
        return mismatched
