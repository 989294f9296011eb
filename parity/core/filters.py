"""The reference filter pipeline of vLLM 0.32's v1 ``Sampler`` (PyTorch/CPU path), in pure torch.

Float32 logits ``[N, V]`` and one spec per row in; the kept set S_q and the processed log-probs out
(docs/internals.md, section 2)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from parity.core.penalties import penalise
from parity.core.spec import SAMPLING_EPS, SamplingSpec, per_row
from parity.errors import UsageError

NEG_INF = float("-inf")


@dataclass(frozen=True)
class FilterFaults:
    """Deliberate deviations from vLLM, used only by planted-fault tests to prove checks can fail."""

    drop_top_k_ties: bool = False  # keep exactly k tokens instead of every token tied with the k-th
    top_p_before_top_k: bool = False  # apply the nucleus cut on the unfiltered row, then top_k
    min_p_in_log_space: bool = False  # compare log-probs (rounds differently at the boundary)
    penalty_ignores_prompt: bool = False  # the repetition penalty reads the output's tokens only
    penalty_after_temperature: bool = False  # penalise z / T instead of z


@dataclass
class FilterResult:
    """What the sampler keeps and reports, per row."""

    kept: torch.Tensor  # bool [N, V]: the support S_q
    logprobs: torch.Tensor  # float32 [N, V]: processed log-probs, -inf off the support
    scaled: torch.Tensor  # float32 [N, V]: z / T before filtering (greedy rows: z)
    specs: list[SamplingSpec] = field(default_factory=list)

    @property
    def support_size(self) -> torch.Tensor:
        return self.kept.sum(dim=-1)



def check_logits(logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
    """Validate ``[N, V]`` logits: no NaN, no +inf, at least one finite value per row (one reduction, the
    row max, decides; only a failing row is searched for the place to name)."""
    if logits.dim() != 2:
        raise UsageError(f"{name} has shape {tuple(logits.shape)}: allowed a 2-D [N, V] tensor")
    if logits.shape[1] < 1:
        raise UsageError(f"{name} has vocabulary size 0: allowed V >= 1")
    if logits.is_floating_point() and bool(torch.isfinite(logits.amax(dim=-1)).all()):
        return logits
    for what, bad in (("NaN", torch.isnan), ("+inf", torch.isposinf)):
        if bad(logits).any():
            row, col = (bad(logits).nonzero()[0]).tolist()
            raise UsageError(f"{name} contain {what} (first at row {row}, token {col}): "
                             f"allowed finite values or -inf")
    dead = ~torch.isfinite(logits).any(dim=-1)
    if dead.any():
        row = int(dead.nonzero()[0])
        raise UsageError(f"{name} row {row} is all -inf: allowed rows with at least one finite value")
    return logits


def apply_temperature(logits: torch.Tensor, specs: list[SamplingSpec]) -> torch.Tensor:
    """z / T per row, greedy rows divided by 1, as ``Sampler.apply_temperature`` (vllm/v1/sample/sampler.py):
    in a batch that is not all random, temperatures below _SAMPLING_EPS become 1.0 before the division."""
    return logits / temperatures(specs, logits.dtype, logits.device).unsqueeze(1)


def temperatures(specs: list[SamplingSpec], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The divisor of each row in :func:`apply_temperature`: T, or 1.0 below SAMPLING_EPS."""
    return torch.tensor([1.0 if s.temperature < SAMPLING_EPS else s.temperature for s in specs], dtype=dtype, device=device)


def min_p_mask(scaled: torch.Tensor, min_p: torch.Tensor, *, log_space: bool = False) -> torch.Tensor:
    """Tokens min_p drops: probability below ``min_p * max probability`` under softmax(z / T), compared on
    probabilities (not log-probs) as ``MinPLogitsProcessor.apply`` (vllm/v1/sample/logits_processor/builtin.py)
    does, so the boundary rounds as the engine rounds."""
    if log_space:  # planted fault: the algebraically equal log-space rule
        logp = torch.log_softmax(scaled, dim=-1)
        return logp < (logp.amax(dim=-1, keepdim=True) + torch.log(min_p).unsqueeze(1))
    probs = torch.softmax(scaled, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs < threshold


def top_k_only(scaled: torch.Tensor, k: torch.Tensor, *, drop_ties: bool = False) -> torch.Tensor:
    """Drop ``z' < k-th largest z'``, keeping every token tied with the k-th value (rows with k == V keep all);
    ``apply_top_k_only`` (vllm/v1/sample/ops/topk_topp_sampler.py), used when no row of the batch sets top_p."""
    vocab = scaled.shape[1]
    kmax = int(k.max())
    kth = scaled.topk(kmax, dim=1).values.gather(1, (k - 1).unsqueeze(1))
    out = scaled.masked_fill(scaled < kth, NEG_INF)
    if drop_ties:  # planted fault: keep exactly k tokens, breaking ties by index
        order = scaled.topk(kmax, dim=1).indices
        keep = torch.zeros_like(scaled, dtype=torch.bool)
        ranks = torch.arange(kmax, device=scaled.device).unsqueeze(0) < k.unsqueeze(1)
        keep.scatter_(1, order, ranks)
        keep[k == vocab] = True
        out = scaled.masked_fill(~keep, NEG_INF)
    return out


def top_k_top_p_sorted(
    scaled: torch.Tensor, k: torch.Tensor, p: torch.Tensor, *, drop_ties: bool = False, p_first: bool = False
) -> torch.Tensor:
    """The sort-based top-k then top-p cut of ``apply_top_k_top_p`` (vllm/v1/sample/ops/topk_topp_sampler.py),
    used when any row of the batch sets top_p: sort ascending, drop values below position V - k (ties kept),
    then drop ``cumsum(softmax) <= 1 - p`` but the largest; ties at the top_p boundary fall on the same sort order."""
    vocab = scaled.shape[1]
    vals, idx = scaled.sort(dim=-1, descending=False)

    def cut_k(v: torch.Tensor) -> torch.Tensor:
        kth = v.gather(1, (vocab - k).unsqueeze(1))
        if drop_ties:  # planted fault: keep only the last k sorted positions
            pos = torch.arange(vocab, device=v.device).unsqueeze(0)
            return v.masked_fill(pos < (vocab - k).unsqueeze(1), NEG_INF)
        return v.masked_fill(v < kth, NEG_INF)

    def cut_p(v: torch.Tensor) -> torch.Tensor:
        cum = torch.cumsum(v.softmax(dim=-1), dim=-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False
        return v.masked_fill(drop, NEG_INF)

    vals = cut_k(cut_p(vals)) if p_first else cut_p(cut_k(vals))
    return torch.empty_like(scaled).scatter_(1, idx, vals)


def reference_filter(
    logits: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
    *,
    faults: FilterFaults | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
) -> FilterResult:
    """Run vLLM 0.32's sampling pipeline on float32 logits ``[N, V]``, in ``Sampler.forward``'s order
    (vllm/v1/sample/sampler.py): penalties (``apply_logits_processors``; each row's ``prompt_ids`` and
    ``output_ids``, needed only when a row is penalised) → greedy rows → temperature → argmax-invariant logits
    processors (min_p) → top_k/top_p → ``log_softmax`` over what survived."""
    faults = faults or FilterFaults()
    logits = check_logits(logits).to(torch.float32)
    n, vocab = logits.shape
    row_specs = per_row(specs, n)
    device = logits.device
    if any(s.penalised for s in row_specs):
        if prompt_ids is None or output_ids is None:
            raise UsageError("reference_filter: a spec sets a penalty but prompt_ids/output_ids were not given: "
                             "allowed both, one token history per row")
        prompts = [[] for _ in row_specs] if faults.penalty_ignores_prompt else prompt_ids
        if not faults.penalty_after_temperature:
            logits = penalise(logits, row_specs, prompts, output_ids)
        else:  # planted fault: the penalties on the scaled logits, then back to the logits' scale
            t = temperatures(row_specs, logits.dtype, device).unsqueeze(1)
            logits = penalise(logits / t, row_specs, prompts, output_ids) * t

    # Sampler.sample: an all-greedy batch reports log_softmax of the raw logits (compute_logprobs).
    if all(s.greedy for s in row_specs):
        logprobs = torch.log_softmax(logits, dim=-1)
        return FilterResult(torch.isfinite(logprobs), logprobs, logits.clone(), row_specs)

    scaled = apply_temperature(logits, row_specs)
    work = scaled.clone()

    # Sampling metadata carries min_p only when some row sets it (the processor is a no-op otherwise).
    if any(s.uses_min_p for s in row_specs):
        mp = torch.tensor([s.min_p if s.uses_min_p else 0.0 for s in row_specs], dtype=torch.float32, device=device)
        work = work.masked_fill(min_p_mask(work, mp, log_space=faults.min_p_in_log_space), NEG_INF)

    # InputBatch passes top_k / top_p as None when no row uses them; disabled rows get k = V, p = 1.
    any_k = any(s.uses_top_k for s in row_specs)
    any_p = any(s.uses_top_p for s in row_specs)
    k = torch.tensor([s.top_k_for_vocab(vocab) for s in row_specs], dtype=torch.long, device=device)
    p = torch.tensor([s.top_p if s.uses_top_p else 1.0 for s in row_specs], dtype=torch.float32, device=device)
    if any_p:
        work = top_k_top_p_sorted(
            work, k, p, drop_ties=faults.drop_top_k_ties and any_k, p_first=faults.top_p_before_top_k
        )
    elif any_k:
        work = top_k_only(work, k, drop_ties=faults.drop_top_k_ties)

    logprobs = torch.log_softmax(work, dim=-1)
    kept = work > NEG_INF
    return FilterResult(kept, logprobs, scaled, row_specs)
