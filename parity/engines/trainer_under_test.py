"""Trainer under test: a function that scores sampled completions the way *your* trainer does. Given a
:class:`TrainerBatch`, it returns per sequence a float tensor ``[L]`` of its completion tokens' log-probs.
Built-ins ``full``, ``recompute``, ``replay``, or ``module:function`` (docs/internals.md, section 5)."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from parity.core import estimators
from parity.core.penalties import penalise_sequence
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.errors import UsageError
from parity.judge.diagnosis import BUGS
from parity.records.batch import right_pad


@dataclass
class TrainerBatch:
    """Everything a trainer's log-prob function sees for one batch of sampled sequences."""

    model: torch.nn.Module | None  # the transformers model the harness loaded (None if the function loads its own)
    model_path: str
    input_ids: torch.Tensor  # long [B, S]: prompt + completion, right-padded with 0
    attention_mask: torch.Tensor  # long [B, S]
    prompt_lengths: list[int]
    completion_lengths: list[int]
    spec: SamplingSpec  # what the sampler applied (temperature, top_k, top_p, min_p, the penalties)
    kept_ids: list[torch.Tensor | None]  # per sequence [L, K] (-1 padded) or None (= whole vocabulary)
    logits: list[torch.Tensor] | None = None  # the harness's float32 logits [L, V] per sequence, if computed

    @property
    def completion_ids(self) -> list[torch.Tensor]:
        return [self.input_ids[i, p : p + n] for i, (p, n) in enumerate(zip(self.prompt_lengths, self.completion_lengths, strict=True))]

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [self.input_ids[i, :p].tolist() for i, p in enumerate(self.prompt_lengths)]

    def penalised_logits(self) -> list[torch.Tensor]:
        """The harness's logits with the sampler's penalties applied per position (parity.core.penalties)."""
        return [penalise_sequence(z, self.spec, p, y.tolist())
                for z, p, y in zip(_needs_logits(self), self.prompt_ids, self.completion_ids, strict=True)]


TrainerFn = Callable[[TrainerBatch], Sequence[torch.Tensor]]


def _needs_logits(batch: TrainerBatch) -> list[torch.Tensor]:
    if batch.logits is None:
        raise UsageError("built-in trainers need the harness's logits (TrainerBatch.logits is None)")
    return batch.logits


def builtin_full(batch: TrainerBatch) -> list[torch.Tensor]:
    """Full-vocabulary log-softmax of logits / T, no penalties: what TRL and verl compute."""
    return [estimators.full(z, y, batch.spec) for z, y in zip(_needs_logits(batch), batch.completion_ids, strict=True)]


def builtin_recompute(batch: TrainerBatch) -> list[torch.Tensor]:
    return [estimators.recompute(z, y, batch.spec).logprobs for z, y in zip(batch.penalised_logits(), batch.completion_ids, strict=True)]


def _replay(logits: list[torch.Tensor], batch: TrainerBatch) -> list[torch.Tensor]:
    spec = batch.spec
    return [estimators.full(z, y, spec) if kept is None else estimators.replay(z, y, kept, spec).logprobs
            for z, y, kept in zip(logits, batch.completion_ids, batch.kept_ids, strict=True)]


def builtin_replay(batch: TrainerBatch) -> list[torch.Tensor]:
    return _replay(batch.penalised_logits(), batch)


def builtin_replay_ignoring_penalties(batch: TrainerBatch) -> list[torch.Tensor]:
    """replay over the kept set on logits without the sampler's penalties (a negative control)."""
    return _replay(_needs_logits(batch), batch)


BUILTINS: dict[str, TrainerFn] = {"full": builtin_full, "recompute": builtin_recompute, "replay": builtin_replay,
                                  "replay-ignoring-penalties": builtin_replay_ignoring_penalties}


def load_trainer(name: str | TrainerFn) -> tuple[str, TrainerFn]:
    """A built-in name, ``module:function`` or a callable → (name, callable)."""
    if callable(name):
        return getattr(name, "__qualname__", repr(name)), name
    if name in BUILTINS:
        return name, BUILTINS[name]
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise UsageError(f"--trainer {name!r} is invalid: allowed {', '.join(BUILTINS)} or module:function")
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:
        raise UsageError(f"--trainer {name!r}: cannot import module {module!r} ({exc})") from exc
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise UsageError(f"--trainer {name!r}: {module!r} has no callable {attr!r}")
    return name, fn


def make_batch(records: Sequence[SequenceRecord], logits: list[torch.Tensor] | None, spec: SamplingSpec, model: torch.nn.Module | None, model_path: str) -> TrainerBatch:
    ids, mask = right_pad([list(r.prompt_ids) + list(r.completion_ids) for r in records])
    return TrainerBatch(model=model, model_path=model_path, input_ids=ids, attention_mask=mask,
                        prompt_lengths=[len(r.prompt_ids) for r in records],
                        completion_lengths=[len(r.completion_ids) for r in records], spec=spec,
                        kept_ids=[r.kept_ids for r in records], logits=logits)


def call_trainer(fn: TrainerFn, name: str, batch: TrainerBatch) -> torch.Tensor:
    """Run the trainer function and validate its output; returns the flat ``[T]`` float64 values."""
    out = fn(batch)
    if isinstance(out, torch.Tensor) and out.dim() == 2:  # [B, Lmax] padded form
        out = [out[i, :n] for i, n in enumerate(batch.completion_lengths)]
    out = list(out)
    if len(out) != len(batch.completion_lengths):
        raise UsageError(f"trainer {name!r} returned {len(out)} sequences for a batch of {len(batch.completion_lengths)}")
    flat = []
    for i, (v, n) in enumerate(zip(out, batch.completion_lengths, strict=True)):
        v = torch.as_tensor(v).detach().flatten()
        if v.numel() != n:
            raise UsageError(f"trainer {name!r} returned {v.numel()} log-probs for sequence {i}, which has {n} completion tokens")
        if torch.isnan(v).any():
            raise UsageError(f"trainer {name!r} returned NaN for sequence {i} at position {int(torch.isnan(v).nonzero()[0])}")
        flat.append(v.double().cpu())
    return torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)


def reference_views(
    logits: list[torch.Tensor], ys: list[torch.Tensor], spec: SamplingSpec, kept: Sequence[torch.Tensor | None],
    prompts: Sequence[Sequence[int]] | None = None,
) -> dict[frozenset[str], torch.Tensor]:
    """The trainer-side log-probs under every combination of :data:`BUGS` (the empty set is correct). ``kept``: the
    sampler's S_q per sequence (``None`` = unfiltered: ``full_vocabulary`` then changes nothing and is left out).
    ``off_by_one`` scores token t with row t + 1, so the last token's entry is NaN, left out of the comparison.
    ``logits`` are the model's; the correct view penalises them from ``prompts`` and the earlier tokens, and
    ``ignores_penalty`` (offered when ``spec`` sets a penalty) leaves that out."""
    filtered = any(k is not None for k in kept)
    names = [b for b in BUGS if (b != "full_vocabulary" or filtered) and (b != "ignores_penalty" or spec.penalised)]
    if spec.penalised and prompts is None:
        raise UsageError("reference_views: the spec sets a penalty, so the prompts are needed: allowed one prompt per sequence")
    penalised = logits if not spec.penalised else [
        penalise_sequence(z, spec, p, y.tolist()) for z, p, y in zip(logits, prompts or [], ys, strict=True)]
    one = replace(spec, temperature=1.0)
    views: dict[frozenset[str], torch.Tensor] = {}
    for mask in range(1 << len(names)):
        bugs = frozenset(n for j, n in enumerate(names) if mask >> j & 1)
        s = one if "forgets_temperature" in bugs and not spec.greedy else spec
        parts = []
        for z, y, k in zip(logits if "ignores_penalty" in bugs else penalised, ys, kept, strict=True):
            rows, labels = (z[1:], y[:-1]) if "off_by_one" in bugs else (z, y)
            if k is None or "full_vocabulary" in bugs:
                v = estimators.full(rows, labels, s).double()
            else:
                v = estimators.replay(rows, labels, k[1:] if "off_by_one" in bugs else k, s).logprobs.double()
            if "off_by_one" in bugs:
                v = torch.cat([v, torch.full((1,), math.nan, dtype=torch.float64)]) if len(y) else v
            parts.append(v)
        views[bugs] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)
    return views


