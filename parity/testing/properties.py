"""Properties of the reference filters against vLLM's own ``Sampler`` on one case. ``check_*`` functions
take tensors (so the planted-fault tests can hand them a faulty side) and raise ``AssertionError`` naming
the row, token, both values and the gap; :func:`run_properties` runs them all on one case
(:mod:`parity.testing.cases`). vLLM is never imported here."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from parity.core.error_model import log_softmax_bound
from parity.core.estimators import (
    RecomputeResult,
    full,
    mask_to_ids,
    predicted_log_s,
    recompute,
    replay,
    scale,
)
from parity.core.filters import FilterFaults, FilterResult, reference_filter
from parity.core.metrics import abs_difference
from parity.core.spec import SamplingSpec
from parity.testing.cases import Case

if TYPE_CHECKING:  # pragma: no cover
    from parity.engines.vllm_sampler import SamplerOutput

NEG_INF = float("-inf")
U32 = 2.0**-24  # float32 unit roundoff

# -- tolerances -------------------------------------------------------------------------------------
# Each tolerance is the error model's bound on the float32 log_softmax of the side(s) involved, per token,
# in whichever order the kernel sums (parity.core.error_model.log_softmax_bound; docs/error_model.md,
# section 10): never a constant that fits one machine's kernel.


_MEMO: OrderedDict[bytes, torch.Tensor] = OrderedDict()


def _bound(scaled: torch.Tensor, kept: torch.Tensor | None) -> torch.Tensor:
    """:func:`log_softmax_bound`, remembered for the last few (logits, kept set) by content: every property of a
    case asks for the same rows' bound."""
    h = hashlib.blake2b(str(tuple(scaled.shape)).encode())
    h.update(scaled.detach().contiguous().numpy().tobytes())
    if kept is not None:
        h.update(kept.contiguous().numpy().tobytes())
    key = h.digest()
    if key not in _MEMO:
        _MEMO[key] = log_softmax_bound(scaled, kept)
        while len(_MEMO) > 8:
            _MEMO.popitem(last=False)
    return _MEMO[key]


def processed_tolerance(scaled: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``[N, V]``: the reference and vLLM each take a float32 log_softmax over the same kept set."""
    return 2.0 * _bound(scaled, kept)


def log_s_tolerance(scaled: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``[N, V]``: ``full - processed`` holds two float32 log_softmax results (the whole row, the kept set);
    log S is float64."""
    return _bound(scaled, None) + _bound(scaled, kept)


def replay_tolerance(scaled: torch.Tensor, kept: torch.Tensor, replayed: torch.Tensor) -> torch.Tensor:
    """``[N, V]``: the sampler's float32 log_softmax over the kept set against replay, whose sum is float64 and
    whose result is stored in float32 (half an ulp of its own value)."""
    return _bound(scaled, kept) + U32 * replayed.double().abs().unsqueeze(1)


def _spec_label(specs: Sequence[SamplingSpec], row: int) -> str:
    return f"row {row} ({specs[row].label()})"


def _fail(title: str, lines: list[str], total: int) -> AssertionError:
    more = f"\n  ... {total - len(lines)} more" if total > len(lines) else ""
    return AssertionError(title + "\n  " + "\n  ".join(lines) + more)


def _raise_at(bad: torch.Tensor, title: str, show: int, describe: Callable[..., str],
              gap: torch.Tensor | None = None) -> None:
    """Raise naming the first ``show`` positions where ``bad`` holds (rows of ``[N]``, (row, token) of
    ``[N, V]``, each ``describe(*position)``), largest ``gap`` first when given (none: return); ``{n}`` in
    ``title`` counts them."""
    where = bad.nonzero().tolist()
    if gap is not None:
        where.sort(key=lambda p: -float(gap[tuple(p)]))
    if where:
        raise _fail(title.format(n=len(where)), [describe(*p) for p in where[:show]], len(where))


def check_kept_equal(ref: FilterResult, vllm: SamplerOutput, *, show: int = 5) -> None:
    """The reference keeps exactly the tokens vLLM keeps (ties included)."""
    if ref.kept.shape != vllm.kept.shape:
        raise AssertionError(f"kept masks differ in shape: reference {tuple(ref.kept.shape)} vs vLLM {tuple(vllm.kept.shape)}")

    def describe(r: int, t: int) -> str:
        side = "kept by vLLM, dropped by the reference" if vllm.kept[r, t] else "kept by the reference, dropped by vLLM"
        kv = ref.scaled[r][vllm.kept[r]]
        return (f"{_spec_label(ref.specs, r)}: token {t} {side}; "
                f"its scaled logit {float(ref.scaled[r, t]):.9g}, "
                f"smallest vLLM-kept {float(kv.min()) if kv.numel() else float('nan'):.9g}; "
                f"|S| reference {int(ref.kept[r].sum())} vs vLLM {int(vllm.kept[r].sum())}")

    _raise_at(ref.kept ^ vllm.kept, "kept sets differ (reference vs vLLM) at {n} token(s):", show, describe)


def check_processed_close(ref: FilterResult, vllm: SamplerOutput, *, show: int = 5) -> None:
    """Processed log-probs agree within :func:`processed_tolerance` on every token (-inf on both sides counts
    as equal; a token kept by one side only is infinitely far)."""
    a, b = ref.logprobs.double(), vllm.logprobs.double()
    gap = abs_difference(a, b)
    tol = processed_tolerance(ref.scaled, vllm.kept)
    bad = ~(gap <= tol)
    _raise_at(bad, "processed log-probs differ (reference vs vLLM) at {n} token(s):", show, lambda r, t: (
        f"{_spec_label(ref.specs, r)}: token {t}: reference {float(a[r, t]):.9g} vs vLLM {float(b[r, t]):.9g}, "
        f"gap {float(gap[r, t]):.3g} > tol {float(tol[r, t]):.3g}"), gap)


def check_log_s_identity(
    logits: torch.Tensor,
    specs: Sequence[SamplingSpec],
    kept: torch.Tensor,
    processed: torch.Tensor,
    sampled: torch.Tensor | None = None,
    *,
    show: int = 5,
) -> None:
    """``full - processed == log S`` on every kept token, log S = ``predicted_log_s`` over ``kept`` (tolerance:
    :func:`log_s_tolerance`). ``kept`` / ``processed``: the sampler's (vLLM's) support and processed log-probs; ``full``:
    ``log_softmax(z / T)``, also checked against the ``full`` estimator at ``sampled`` when given."""
    scaled = scale(logits, specs)
    full_all = torch.log_softmax(scaled, dim=-1)
    if sampled is not None:
        est = full(logits, sampled, specs)
        ref = full_all.gather(1, sampled.long().unsqueeze(1)).squeeze(1)
        if not torch.equal(est, ref):
            r = int((est != ref).nonzero()[0])
            raise AssertionError(
                f"the full estimator disagrees with log_softmax(z / T) at {_spec_label(specs, r)}, "
                f"token {int(sampled[r])}: {float(est[r]):.9g} vs {float(ref[r]):.9g}"
            )
    log_s = predicted_log_s(logits, kept, specs).double()
    gap = full_all.double() - processed.double()
    err = (gap - log_s.unsqueeze(1)).abs()
    tol = log_s_tolerance(scaled, kept)
    bad = kept & ~(err <= tol)  # NaN counts as bad
    _raise_at(bad, "full - processed != log S at {n} kept token(s):", show, lambda r, t: (
        f"{_spec_label(specs, r)}: token {t}: full {float(full_all[r, t]):.9g} - processed {float(processed[r, t]):.9g} "
        f"= {float(gap[r, t]):.9g} but log S = {float(log_s[r]):.9g}; "
        f"gap {float(err[r, t]):.3g} > tol {float(tol[r, t]):.3g}"), err)


def check_replay(
    logits: torch.Tensor,
    specs: Sequence[SamplingSpec],
    kept: torch.Tensor,
    processed: torch.Tensor,
    sampled: torch.Tensor,
    *,
    show: int = 5,
) -> None:
    """``replay`` over the sampler's kept set reproduces the sampler's processed log-prob of the sampled token.

    Checked with the kept set both as a dense mask and as padded ids (the capture format).
    """
    y = sampled.long()
    want = processed.gather(1, y.unsqueeze(1)).squeeze(1).double()
    scaled = scale(logits, specs)
    for form, k in (("mask", kept), ("ids", mask_to_ids(kept))):
        res = replay(logits, y, k, specs)
        got = res.logprobs.double()
        err = (got - want).abs()
        tol = replay_tolerance(scaled, kept, got).gather(1, y.unsqueeze(1)).squeeze(1)
        bad = res.outside | ~(err <= tol)
        if not bool(bad.any()):
            continue
        rows = bad.nonzero().squeeze(1).tolist()
        lines = [
            f"{_spec_label(specs, r)}: sampled token {int(y[r])}"
            + (" lies outside the kept set" if bool(res.outside[r]) else "")
            + f": replay ({form}) {float(got[r]):.9g} vs sampler {float(want[r]):.9g}, gap {float(err[r]):.3g} > tol {float(tol[r]):.3g}"
            for r in rows[:show]
        ]
        raise _fail(f"replay over the sampler's kept set misses the processed log-prob in {len(rows)} row(s):", lines, len(rows))


def check_recompute_finite(
    result: RecomputeResult, sampled: torch.Tensor, specs: Sequence[SamplingSpec], *, show: int = 5
) -> None:
    """``recompute`` never scores the sampled token ``-inf`` (force-include must rescue it)."""
    lp, forced = result.logprobs, result.forced
    title = "recompute returned a non-finite log-prob for the sampled token in {n} row(s):"
    _raise_at(~torch.isfinite(lp), title, show, lambda r: (
        f"{_spec_label(specs, r)}: sampled token {int(sampled[r])} scores {float(lp[r])}"
        + (" (it lies outside the recomputed support S_p)" if bool(forced[r]) else "")))


def check_top_p_mass(logits: torch.Tensor, specs: Sequence[SamplingSpec], kept: torch.Tensor, *, show: int = 5) -> None:
    """S >= top_p on rows where top_p is the only filter, to about V * 2**-24: the float32 cumsum's rounding
    over V terms (docs/error_model.md, section 7)."""
    vocab = logits.shape[1]
    mass = predicted_log_s(logits, kept, specs).double().exp()
    tol = vocab * 2.0**-24
    eff = [raw.effective() for raw in specs]
    only = torch.tensor([s.uses_top_p and not s.uses_min_p and not (s.uses_top_k and s.top_k < vocab)
                         for s in eff])
    top_p = torch.tensor([s.top_p for s in eff], dtype=torch.float64)
    title = "top_p-only rows keep less mass than top_p in {n} row(s):"
    _raise_at(only & ~(mass >= top_p - tol), title, show, lambda r: (
        f"{_spec_label(specs, r)}: kept mass S = {float(mass[r]):.9g} < top_p {eff[r].top_p:.9g} "
        f"(gap {eff[r].top_p - float(mass[r]):.3g}, tol {tol:.3g}); |S| = {int(kept[r].sum())}"))


def check_sampled_in_kept(vllm: SamplerOutput, specs: Sequence[SamplingSpec]) -> None:
    """vLLM's own sanity: the token it drew lies in the support it reported."""
    inside = vllm.kept.gather(1, vllm.sampled.long().unsqueeze(1)).squeeze(1)
    _raise_at(~inside, "vLLM sampled outside its own kept set:", len(specs), lambda r: (
        f"{_spec_label(specs, r)}: vLLM sampled token {int(vllm.sampled[r])}, outside its kept set"))


@dataclass
class PropertyRun:
    """The outcome of every property on one case."""

    failures: dict[str, str] = field(default_factory=dict)  # property name -> message

    @property
    def ok(self) -> bool:
        return not self.failures


PROPERTY_NAMES = ("sampled_in_kept", "kept_equal", "processed_close", "log_s_identity", "replay", "recompute_finite", "top_p_mass")


def run_properties(
    case: Case,
    vllm: SamplerOutput,
    *,
    faults: FilterFaults | None = None,
    force_include: bool = True,
    trainer_noise: float = 1e-3,
) -> PropertyRun:
    """Every property on one case; ``faults`` / ``force_include=False`` plant a deliberate error. recompute runs
    on *trainer* logits: the sampler's plus ``trainer_noise`` x N(0, 1), seeded by the case, so the recomputed
    boundary can move and force-include matters. The estimators read the penalised logits (the penalties come
    first in vLLM's sampler: the trainer applies them from the same histories)."""
    specs = case.specs
    prompts, outputs = case.histories
    ref = reference_filter(case.logits, specs, faults=faults, prompt_ids=prompts, output_ids=outputs)
    logits = case.penalised_logits()
    gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    trainer = logits + trainer_noise * torch.randn(logits.shape, generator=gen)
    checks: dict[str, Callable[[], None]] = {
        "sampled_in_kept": lambda: check_sampled_in_kept(vllm, specs),
        "kept_equal": lambda: check_kept_equal(ref, vllm),
        "processed_close": lambda: check_processed_close(ref, vllm),
        "log_s_identity": lambda: check_log_s_identity(logits, specs, vllm.kept, vllm.logprobs, vllm.sampled),
        "replay": lambda: check_replay(logits, specs, vllm.kept, vllm.logprobs, vllm.sampled),
        "recompute_finite": lambda: check_recompute_finite(
            recompute(trainer, vllm.sampled, specs, force_include=force_include, faults=faults), vllm.sampled, specs
        ),
        "top_p_mass": lambda: check_top_p_mass(logits, specs, vllm.kept),
    }
    run = PropertyRun()
    for name, check in checks.items():
        try:
            check()
        except AssertionError as exc:
            run.failures[name] = str(exc)
    return run


