"""The standalone repro scripts must run without parity: they carry the core's filters and rounding bound
inlined at emit time (``# @inline``) and a few helpers of their own. This checks both against the core on
the same hard cases the sampler properties use, the emitted code as well as its source, so a rule changed
in the core cannot silently diverge in an emitted script.

``parity.repro.standalone_src`` is the text every emitted script is cut from, so checking its functions
checks every script.
"""

from __future__ import annotations

import random

import pytest
import torch

from parity.core import error_model, estimators
from parity.core.capture import support_from_heads
from parity.core.filters import reference_filter
from parity.core.spec import SamplingSpec
from parity.judge.streams import Ratios
from parity.repro import standalone_src as src
from parity.testing.cases import build_case, random_plan

CASES = 150


def _rows() -> list[tuple[torch.Tensor, SamplingSpec]]:
    """One-row batches of the random cases, for specs the scripts use (sampling, T >= 0.01)."""
    rng = random.Random(20)
    out = []
    while len(out) < CASES:
        case = build_case(random_plan(rng, max_vocab=2048, max_rows=3))
        for z, spec in zip(case.logits, case.specs, strict=True):
            if not spec.greedy and spec.temperature >= 0.01 and int(torch.isfinite(z).sum()) >= 1:
                out.append((z.unsqueeze(0), spec.without_penalties()))  # the scripts model no penalty
    return out


ROWS = _rows()


def _script_filter(z: torch.Tensor, spec: SamplingSpec) -> tuple[torch.Tensor, torch.Tensor]:
    return src.vllm_filter(z, temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p)


def test_the_scripts_filters_are_the_core_reference_filter() -> None:
    """Same scaled logits, same kept set (ties at the k-th value kept, min_p on probabilities, top_p over
    the ascending sort) as :func:`parity.core.filters.reference_filter`."""
    reached = set()
    for z, spec in ROWS:
        zs, kept = _script_filter(z, spec)
        ref = reference_filter(z, spec)
        assert torch.equal(zs, estimators.scale(z, spec)), f"z / T differs for {spec.label()}"
        assert torch.equal(kept, ref.kept), (
            f"standalone vllm_filter and the core disagree for {spec.label()} on V={z.shape[1]}: "
            f"{int((kept != ref.kept).sum())} tokens"
        )
        reached |= {name for name, on in (("top_k", spec.uses_top_k), ("top_p", spec.uses_top_p),
                                          ("min_p", spec.uses_min_p)) if on}
    assert reached == {"top_k", "top_p", "min_p"}, f"the cases never exercised {sorted({'top_k', 'top_p', 'min_p'} - reached)}"


def _emitted_prelude() -> dict:
    from parity.repro import standalone

    prelude = standalone.inline(standalone.sections()["prelude"])
    assert "inlined from parity.core.filters" in prelude and "from parity" not in prelude.replace("inlined from parity", "")
    ns: dict = {}
    exec(compile(prelude, "prelude", "exec"), ns)  # noqa: S102 - the emitted prelude, run as the script would
    return ns


def _tied_rows(seed: int, n: int = 6, vocab: int = 64) -> torch.Tensor:
    """Logits on a coarse grid: many tokens tie at the top_k and top_p boundaries."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-6, 7, (n, vocab), generator=g).float() * 0.5


def test_the_emitted_filters_are_the_cores_on_random_ties_and_combinations() -> None:
    """The emitted script's vllm_filter (parity's code, inlined) keeps what reference_filter keeps, with the
    same z / T, on random and tie-heavy rows under every top_k / top_p / min_p combination."""
    emitted = _emitted_prelude()["vllm_filter"]
    g = torch.Generator().manual_seed(7)
    ties = 0
    for i, (temperature, top_k, top_p, min_p) in enumerate(
        (t, k, p, m) for t in (0.7, 1.0, 1.3) for k in (0, 1, 5, 20) for p in (1.0, 0.9, 0.5) for m in (0.0, 0.05, 0.3)
    ):
        spec = SamplingSpec(temperature, top_k, top_p, min_p)
        for z in (_tied_rows(i), torch.randn(4, 300, generator=g) * 3):
            zs, kept = emitted(z, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
            ref = reference_filter(z, spec)
            assert torch.equal(zs, ref.scaled) and torch.equal(kept, ref.kept), f"emitted vllm_filter differs for {spec.label()}"
            ties += int(spec.uses_top_k and bool((ref.kept.sum(1) > top_k).any()))
    for z, spec in ROWS:
        zs, kept = emitted(z, temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p, min_p=spec.min_p)
        assert torch.equal(kept, reference_filter(z, spec).kept), f"emitted vllm_filter differs for {spec.label()}"
    assert ties > 0, "no case kept more than top_k tokens (ties at the k-th value)"


def test_the_scripts_estimators_are_the_cores() -> None:
    """log_prob_over is replay over a kept set, log_mass is predicted log S: equal to float32 rounding."""
    for i, (z, spec) in enumerate(ROWS):
        zs, kept = _script_filter(z, spec)
        finite = torch.isfinite(zs)
        ids = torch.where(kept)[1]
        y = ids[i % len(ids)].reshape(1)
        kept_ids = estimators.mask_to_ids(kept)
        want = estimators.replay(z, y, kept_ids, spec).logprobs.double()
        got = src.log_prob_over(zs, y, kept)
        assert torch.allclose(got, want, rtol=2**-22, atol=1e-6), f"replay {float(got)} vs {float(want)}, {spec.label()}"
        if bool(finite.all()):
            want_s = estimators.predicted_log_s(z, kept_ids, spec).double()
            got_s = src.log_mass(zs, kept)
            assert torch.allclose(got_s, want_s, rtol=2**-22, atol=1e-6), f"log S {float(got_s)} vs {float(want_s)}"
        outside = (~kept & finite).nonzero()
        if outside.numel():
            y_out = outside[0, 1].reshape(1)
            assert src.log_prob_over(zs, y_out, kept).item() == float("-inf")
            assert estimators.replay(z, y_out, kept_ids, spec).outside.item()


def test_strict_top_k_is_the_tie_dropping_trainer() -> None:
    """strict_top_k keeps exactly k tokens, all inside the core's kept set; with ties at the k-th value
    the core keeps more (the bug the ties repro shows)."""
    more = 0
    for z, spec in ROWS:
        k = spec.top_k
        if not spec.uses_top_k or k > int(torch.isfinite(z).sum()):
            continue
        zs = estimators.scale(z, spec)
        strict = src.strict_top_k(zs, k)
        ref = reference_filter(z, SamplingSpec(spec.temperature, top_k=k)).kept
        assert int(strict.sum()) == k and not bool((strict & ~ref).any())
        more += int(ref.sum()) > k
    assert more > 0, "no case had ties at the k-th value"


def test_kept_from_heads_and_seq_ratio_are_the_cores() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 50
    heads, sampled, ids_rows, lps_rows = [], [], [], []
    for t in range(12):
        ids = torch.randperm(vocab, generator=g)[: 3 + t % 5].tolist()
        lps = torch.randn(len(ids), generator=g).tolist()
        if t % 3 == 0:
            lps[-1] = float("-inf")  # a listed token off the support
        heads.append(dict(zip(ids, lps, strict=True)))
        ids_rows.append(ids)
        lps_rows.append(lps)
        sampled.append(ids[0])
    core = support_from_heads(sampled, ids_rows, lps_rows, requested=8, vocab_size=vocab)
    assert torch.equal(src.kept_from_heads(heads, vocab), estimators.ids_to_mask(core.kept_ids, vocab))
    per_token = torch.randn(12, generator=g, dtype=torch.float64) * 0.1
    lengths = [5, 4, 3]
    got = src.seq_ratio(per_token, lengths)
    want = Ratios()  # the records analysis' IS ratios, fed the per-sequence sums its map step computes
    want.add(per_token.numpy(), torch.stack([s.sum() for s in per_token.split(lengths)]).numpy())
    seq = want.to_report()["sequence"]
    assert (float(got.mean()), float(got.min()), float(got.max())) == pytest.approx((seq["mean"], seq["min"], seq["max"]), rel=1e-12)
    # The scripts' rounding bound is the core's own code, inlined at emit time (test_repro_cli checks it).
    assert src.logprob_bound is error_model.logprob_bound


@pytest.mark.parametrize("fault", ["drop_top_k_ties", "top_p_before_top_k"])
def test_a_changed_core_rule_is_caught(fault: str) -> None:
    """Negative control: the comparison above fails when the core's filter rule changes."""
    from parity.core.filters import FilterFaults

    faults = FilterFaults(**{fault: True})
    differ = sum(
        not torch.equal(_script_filter(z, spec)[1], reference_filter(z, spec, faults=faults).kept) for z, spec in ROWS
    )
    assert differ > 0, f"a core filter with {fault} still matched the scripts on every case"
