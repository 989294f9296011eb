"""The process pool that runs the vocabulary-parallel estimators (:mod:`parity.distributed.sharded`).

:class:`VocabParallelPool` starts one process per vocabulary shard in a ``torch.distributed`` group
(gloo on CPU), sends each job over a queue, collects every rank's answer with a deadline and closes
the group when a rank dies, raises or times out (:class:`RankFailure`). :func:`run_vocab_parallel` is
the driver: shard the logits, run the estimators on the pool, assemble the replicated outputs.
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from parity.core.filters import check_logits
from parity.core.spec import SamplingSpec, per_row
from parity.distributed.sharded import (
    BAND_POLICIES,
    ESTIMATORS,
    TIE_POLICIES,
    Comm,
    ParallelFaults,
    VocabShard,
    _check_kept_ids,
    _check_sampled,
    sharded_full,
    sharded_predicted_log_s,
    sharded_recompute,
    sharded_replay,
    split_vocab,
)


class RankFailure(RuntimeError):
    """A rank died, raised, or timed out; the pool is closed when this is raised."""


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _run_job(
    job: dict[str, Any], rank: int, device: torch.device, groups: dict[int, Any]
) -> dict[str, Any] | None:
    faults = ParallelFaults(**job["faults"])
    if faults.die_rank == rank:
        os._exit(13)
    shards = len(job["split"])
    if rank >= shards:
        return None  # not part of this job's group
    shard = VocabShard(rank, tuple(job["split"]))
    specs = [SamplingSpec.from_dict(s) for s in job["specs"]]
    z = job["logits"].to(device)
    y = job["sampled"].to(device)
    ids = job["kept_ids"].to(device) if job["kept_ids"] is not None else None
    comm = Comm(groups.get(shards))
    out: dict[str, Any] = {}
    timing: dict[str, float] = {}
    for name in job["estimators"]:
        t0 = time.perf_counter()
        with comm.section(name):
            if name == "full":
                out["full"] = sharded_full(z, y, specs, shard, comm, faults)
            elif name == "replay" and ids is not None:
                rp = sharded_replay(z, y, ids, specs, shard, comm, faults)
                out["replay"], out["replay_outside"] = rp.logprobs, rp.outside
            elif name == "predicted_log_s" and ids is not None:
                out["predicted_log_s"] = sharded_predicted_log_s(z, ids, specs, shard, comm, faults)
            elif name == "recompute":
                r = sharded_recompute(
                    z,
                    y,
                    specs,
                    shard,
                    comm,
                    tie_policy=job["tie_policy"],
                    band_policy=job["band_policy"],
                    faults=faults,
                )
                out["recompute"], out["recompute_kept"], out["recompute_forced"] = (
                    r.logprobs,
                    r.kept,
                    r.forced,
                )
                out["recompute_fallback"], out["recompute_ambiguous"] = r.fallback, r.ambiguous
                out["recompute_tie_split"] = r.tie_split
        timing[name] = time.perf_counter() - t0
    out = {k: v.cpu() for k, v in out.items()}
    out["bytes"] = comm.log
    out["seconds"] = timing
    return out


def _worker(
    rank: int,
    world: int,
    backend: str,
    rendezvous: str,
    inbox: Any,
    outbox: Any,
    timeout_s: float,
    parent_pid: int,
) -> None:
    torch.set_num_threads(1)
    device = torch.device("cpu")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
            device = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group(
            backend,
            init_method=f"file://{rendezvous}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        # Jobs on fewer shards run on the first ranks, in a subgroup created up front by every rank.
        groups: dict[int, Any] = {world: None}
        for size in range(1, world):
            groups[size] = dist.new_group(list(range(size)), timeout=timedelta(seconds=timeout_s))
        outbox.put((rank, -1, "ready", b""))
    except Exception:
        outbox.put((rank, -1, "error", traceback.format_exc().encode()))
        return
    try:
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if os.getppid() != parent_pid:  # orphaned: the parent is gone
                    return
                continue
            if msg is None:
                return
            seq, data = msg
            try:
                res = _run_job(_loads(data), rank, device, groups)
                outbox.put((rank, seq, "ok", b"" if res is None else _dumps(res)))
            except Exception:
                outbox.put((rank, seq, "error", traceback.format_exc().encode()))
    finally:
        dist.destroy_process_group()


class VocabParallelPool:
    """``shards`` spawned processes in one process group, reused across many jobs.

    Every wait has a deadline: a rank that dies, raises or stalls ends :meth:`run` with
    :class:`RankFailure` (and closes the pool) instead of hanging. Use as a context manager, or call
    :meth:`close`; ``exitcodes`` then holds each process's exit status.
    """

    def __init__(self, shards: int, backend: str = "gloo", *, timeout_s: float = 60.0) -> None:
        if shards < 1:
            raise ValueError(f"shards={shards}: allowed >= 1")
        import torch.multiprocessing as tmp

        self.shards, self.backend, self.timeout_s = shards, backend, timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="parity-vp-")
        ctx = tmp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(shards)]
        self._outbox = ctx.Queue()
        rdzv = os.path.join(self._tmp.name, "rendezvous")
        self.procs = [
            ctx.Process(
                target=_worker,
                args=(r, shards, backend, rdzv, self._inboxes[r], self._outbox, timeout_s, os.getpid()),
                daemon=True,
            )
            for r in range(shards)
        ]
        self.exitcodes: list[int | None] = []
        self.closed = False
        self._seq = 0
        for p in self.procs:
            p.start()
        try:
            self._collect(-1, deadline=time.monotonic() + max(timeout_s, 120.0))
        except RankFailure:
            self.close(force=True)
            raise

    def __enter__(self) -> VocabParallelPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _collect(self, seq: int, deadline: float) -> list[bytes]:
        got: dict[int, bytes] = {}
        while len(got) < self.shards:
            try:
                rank, s, status, data = self._outbox.get(timeout=0.05)
            except queue.Empty:
                dead = [
                    (r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive() and r not in got
                ]
                if dead:
                    raise RankFailure(
                        f"rank {dead[0][0]} died with exit code {dead[0][1]} (pool closed)"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(self.shards)) - set(got))
                    raise RankFailure(
                        f"ranks {missing} gave no answer within the deadline (pool closed)"
                    ) from None
                continue
            if s != seq:
                continue  # a late answer to an earlier, failed job
            if status == "error":
                # A peer that died makes the others fail in their collectives first: report the death
                # (the cause) when there is one.
                grace = time.monotonic() + 2.0
                while time.monotonic() < grace:
                    dead = [(r, p.exitcode) for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead:
                        raise RankFailure(
                            f"rank {dead[0][0]} died with exit code {dead[0][1]} (pool closed); "
                            f"rank {rank} then raised:\n{data.decode()}"
                        )
                    time.sleep(0.05)
                raise RankFailure(f"rank {rank} raised:\n{data.decode()}")
            got[rank] = data
        return [got[r] for r in range(self.shards)]

    def run(
        self,
        logits: torch.Tensor,
        sampled: torch.Tensor,
        specs: SamplingSpec | Sequence[SamplingSpec],
        kept_ids: torch.Tensor | None = None,
        *,
        split: Sequence[int] | None = None,
        estimators: Sequence[str] = ESTIMATORS,
        tie_policy: str = "gather",
        band_policy: str = "gather",
        faults: ParallelFaults | None = None,
        shards: int | None = None,
    ) -> dict[str, Any]:
        """Split the vocabulary, run the sharded estimators, gather the results.

        ``shards`` (default: the pool size) runs the job on the first ``shards`` ranks only, in their
        own subgroup, so one pool serves several shard counts.
        """
        shards = self.shards if shards is None else shards
        if not 1 <= shards <= self.shards:
            raise ValueError(f"shards={shards}: allowed 1..{self.shards} on this pool")
        if self.closed:
            raise RankFailure("the pool is closed")
        logits = check_logits(logits).to(torch.float32)
        n, vocab = logits.shape
        sampled = _check_sampled(sampled, n, vocab)
        row_specs = per_row(specs, n)
        if kept_ids is not None:
            kept_ids = _check_kept_ids(kept_ids, n, vocab)
        unknown = set(estimators) - set(ESTIMATORS)
        if unknown or tie_policy not in TIE_POLICIES or band_policy not in BAND_POLICIES:
            raise ValueError(
                f"estimators {sorted(unknown)} / tie_policy {tie_policy!r} / band_policy {band_policy!r}: "
                f"allowed {ESTIMATORS} / {TIE_POLICIES} / {BAND_POLICIES}"
            )
        sizes = split_vocab(vocab, shards, split)
        self._seq += 1
        seq = self._seq
        base = {
            "sampled": sampled.cpu(),
            "specs": [s.to_dict() for s in row_specs],
            "kept_ids": None if kept_ids is None else kept_ids.cpu(),
            "split": sizes,
            "estimators": list(estimators),
            "tie_policy": tie_policy,
            "band_policy": band_policy,
            "faults": asdict(faults or ParallelFaults()),
        }
        off = 0
        t0 = time.perf_counter()
        for r in range(self.shards):
            size = sizes[r] if r < shards else 0
            job = dict(base, logits=logits[:, off : off + size].contiguous().cpu())
            self._inboxes[r].put((seq, _dumps(job)))
            off += size
        try:
            parts = [_loads(b) for b in self._collect(seq, time.monotonic() + self.timeout_s)[:shards]]
        except RankFailure:
            self.close(force=True)
            raise
        wall = time.perf_counter() - t0
        out = _assemble(parts, sizes, n, self.backend, wall)
        out.update(tie_policy=tie_policy, band_policy=band_policy)
        return out

    def close(self, force: bool = False) -> list[int | None]:
        """Stop every rank (each destroys its process group), join with a deadline, then terminate."""
        if self.closed:
            return self.exitcodes
        self.closed = True
        if not force:
            for q in self._inboxes:
                try:
                    q.put(None)
                except Exception:  # pragma: no cover - queue already broken
                    pass
        deadline = time.monotonic() + (10.0 if not force else 0.0)
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5.0)
            if p.is_alive():  # pragma: no cover - a rank ignoring SIGTERM
                p.kill()
                p.join(timeout=5.0)
        for q in [*self._inboxes, self._outbox]:
            q.close()
            q.cancel_join_thread()
        self.exitcodes = [p.exitcode for p in self.procs]
        self._tmp.cleanup()
        return self.exitcodes


_REPLICATED = (
    "full",
    "replay",
    "replay_outside",
    "predicted_log_s",
    "recompute",
    "recompute_forced",
    "recompute_fallback",
    "recompute_ambiguous",
    "recompute_tie_split",
)


def _assemble(
    parts: list[dict[str, Any]], sizes: list[int], n: int, backend: str, wall: float
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "shards": len(sizes),
        "split": sizes,
        "backend": backend,
        "tokens": n,
        "vocab": sum(sizes),
        "seconds": wall,
    }
    disagree = []
    for key in _REPLICATED:
        if key in parts[0]:
            out[key] = parts[0][key]
            if any(not torch.equal(p[key], parts[0][key]) for p in parts[1:]):
                disagree.append(key)
    out["ranks_agree"] = not disagree
    out["ranks_disagree"] = disagree
    if "recompute_kept" in parts[0]:
        out["recompute_kept"] = torch.cat([p["recompute_kept"] for p in parts], dim=1)
    per: dict[str, dict[str, float]] = {}
    detail: dict[str, dict[str, float]] = {}
    for section, e in parts[0]["bytes"].items():  # identical control flow: rank 0 speaks for all
        est = section.split("/")[0]
        agg = per.setdefault(est, {"payload": 0.0, "wire": 0.0, "collectives": 0})
        for k2 in agg:
            agg[k2] += e[k2]
        detail[section] = {k2: e[k2] / max(n, 1) if k2 != "collectives" else e[k2] for k2 in e}
    out["bytes_per_token"] = {
        est: {
            "payload": v["payload"] / max(n, 1),
            "wire": v["wire"] / max(n, 1),
            "collectives": v["collectives"],
        }
        for est, v in per.items()
    }
    out["bytes_detail"] = detail
    out["rank_seconds"] = [p["seconds"] for p in parts]
    return out


def run_vocab_parallel(
    logits: torch.Tensor,
    sampled: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
    kept_ids: torch.Tensor | None,
    shards: int,
    backend: str = "gloo",
    *,
    split: Sequence[int] | None = None,
    estimators: Sequence[str] = ESTIMATORS,
    tie_policy: str = "gather",
    band_policy: str = "gather",
    faults: ParallelFaults | None = None,
    timeout_s: float = 120.0,
) -> dict[str, Any]:
    """Spawn ``shards`` local processes, split the vocabulary, run the sharded estimators, tear down.

    Returns the replicated per-token results (``full``, ``replay``, ``replay_outside``,
    ``predicted_log_s``, ``recompute``, ``recompute_forced``, ``recompute_fallback``, ...), the
    gathered ``recompute_kept`` ``[N, V]``, ``bytes_per_token`` per estimator (``payload`` and ring
    ``wire`` bytes per rank), ``ranks_agree``, the split, the timings and the ranks' ``exitcodes`` (all 0:
    every rank destroyed its process group). Compare with the unsharded
    estimators with :func:`check_parity`. ``kept_ids`` (padded ids, -1 = padding) may be None: replay
    and predicted log S are then skipped.
    """
    pool = VocabParallelPool(shards, backend, timeout_s=timeout_s)
    try:
        out = pool.run(
            logits,
            sampled,
            specs,
            kept_ids,
            split=split,
            estimators=estimators,
            tie_policy=tie_policy,
            band_policy=band_policy,
            faults=faults,
        )
    finally:
        codes = pool.close()
    out["exitcodes"] = codes
    return out


__all__ = ["RankFailure", "VocabParallelPool", "run_vocab_parallel"]
