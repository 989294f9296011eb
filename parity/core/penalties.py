"""The penalties of vLLM 0.32's v1 ``Sampler`` (PyTorch/CPU path), in pure torch: repetition over the prompt's
and the output's tokens, then frequency and presence over the output's, applied to float32 logits before
temperature and the filters (docs/penalties.md). Each row has its own history, so the result is position-dependent.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from parity.core.spec import SamplingSpec, per_row
from parity.errors import UsageError


def token_counts(histories: Sequence[Sequence[int]], vocab: int, device: torch.device | None = None) -> torch.Tensor:
    """``[N, V]`` long: how often each id occurs in each row's history, as ``get_token_bin_counts_and_mask``
    (vllm/model_executor/layers/utils.py) counts them; an id outside [0, V) is refused."""
    counts = torch.zeros(len(histories), vocab, dtype=torch.long, device=device)
    for r, ids in enumerate(histories):
        if not len(ids):
            continue
        t = torch.as_tensor(list(ids), dtype=torch.long, device=device)
        if int(t.min()) < 0 or int(t.max()) >= vocab:
            raise UsageError(f"history of row {r} holds token id {int(t.min()) if int(t.min()) < 0 else int(t.max())}: "
                             f"allowed ids in [0, {vocab})")
        counts[r].scatter_add_(0, t, torch.ones_like(t))
    return counts


def penalise(
    logits: torch.Tensor,
    specs: SamplingSpec | Sequence[SamplingSpec],
    prompt_ids: Sequence[Sequence[int]],
    output_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Penalised float32 logits ``[N, V]`` (a new tensor): row r's prompt is ``prompt_ids[r]`` and the tokens it
    generated so far are ``output_ids[r]``. Unpenalised rows come back bitwise unchanged."""
    n, vocab = logits.shape
    row_specs = per_row(specs, n)
    if len(prompt_ids) != n or len(output_ids) != n:
        raise UsageError(f"penalise got {len(prompt_ids)} prompts and {len(output_ids)} outputs for {n} logit rows: "
                         "allowed one of each per row")
    z = logits.to(torch.float32).clone()
    if not any(s.penalised for s in row_specs):  # SamplingMetadata.no_penalties: Sampler.apply_penalties returns
        return z
    dev = z.device
    out_counts = token_counts(output_ids, vocab, dev)
    seen = (token_counts(prompt_ids, vocab, dev) > 0) | (out_counts > 0)
    rep = torch.tensor([s.repetition_penalty for s in row_specs], dtype=torch.float32, device=dev).unsqueeze(1)
    freq = torch.tensor([s.frequency_penalty for s in row_specs], dtype=torch.float32, device=dev).unsqueeze(1)
    pres = torch.tensor([s.presence_penalty for s in row_specs], dtype=torch.float32, device=dev).unsqueeze(1)
    # Repetition (apply_repetition_penalties_torch, vllm/_custom_ops.py, the op's non-CUDA path): on ids seen in
    # the prompt or the output, a positive logit is multiplied by the float32 reciprocal 1/r (not divided by r,
    # which rounds differently), any other by r.
    factor = torch.where(seen, rep, torch.ones_like(rep))
    z = z * torch.where(z > 0, 1.0 / factor, factor)
    # Frequency then presence over the output only (apply_penalties, vllm/model_executor/layers/utils.py):
    # z -= f * count, z -= p * [count > 0], each product formed in float32 first.
    z = z - freq * out_counts
    return z - pres * (out_counts > 0)


def penalise_sequence(
    logits: torch.Tensor, spec: SamplingSpec, prompt_ids: Sequence[int], completion_ids: Sequence[int]
) -> torch.Tensor:
    """The logits ``[L, V]`` of one sampled sequence as the sampler saw them: position t is penalised with the
    prompt and the completion's first t tokens (the output the sampler had generated at that step)."""
    n = logits.shape[0]
    if len(completion_ids) < n:
        raise UsageError(f"penalise_sequence got {len(completion_ids)} completion ids for {n} positions: allowed >= {n}")
    if not spec.penalised:
        return logits.to(torch.float32)
    ids = list(completion_ids)
    return penalise(logits, spec, [prompt_ids] * n, [ids[:t] for t in range(n)])

