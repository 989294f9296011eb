"""A recomputed kept set that differs from S_q only at the top_p cutoff: the support gate counts it as the
same filter, so recompute's drift bound carries the boundary token's mass (docs/error_model.md, section 1).
The two gates agree, and a planted fault at that position still fails at a few times the bound."""

from __future__ import annotations

import math

import pytest
import torch
from judged import failed, judged

from parity.core import estimators as E
from parity.core.filters import reference_filter
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec as S
from parity.core.token_table import build_table

V = 64
L = 4
AT = L // 2  # the straddling position
DRIFT = 5e-6  # the trainer's largest logit at AT sits this far above the sampler's: far inside the bound


def _straddle() -> tuple[torch.Tensor, torch.Tensor, S, int]:
    """Sampler and trainer logits ``[L, V]`` and a top_p whose cut falls, at position AT, between the two sides'
    cumulative masses of one token of about 1 % mass: the sampler keeps it, the trainer's filters drop it.
    Searched from the reference filter itself, not hard-coded."""
    g = torch.Generator().manual_seed(3)
    zs = torch.randn(L, V, generator=g) * 1.5
    zt = zs.clone()
    top = int(zs[AT].argmax())
    zt[AT, top] += DRIFT
    ps = torch.softmax(zs[AT].double(), -1)
    pt = torch.softmax(zt[AT].double(), -1)
    order = ps.argsort()  # ascending, as vLLM's top_p sorts
    cs, ct = ps[order].cumsum(0), pt[order].cumsum(0)
    for j in range(V // 2, V - 2):
        if not 0.005 < float(ps[order[j]]) < 0.05:
            continue
        cut = float(ct[j] + cs[j]) / 2  # 1 - top_p between the trainer's and the sampler's cumulative mass
        spec = S(1.0, top_p=1.0 - cut)
        b = int(order[j])
        if bool(reference_filter(zs, spec).kept[AT, b]) and not bool(reference_filter(zt, spec).kept[AT, b]):
            return zs, zt, spec, b
    raise AssertionError("no token whose cumulative mass the drift moves across a top_p cut")


def _table():
    zs, zt, spec, b = _straddle()
    ref = reference_filter(zs, spec)
    y = ref.logprobs.argmax(dim=-1)
    kept = E.mask_to_ids(ref.kept)
    lp = ref.logprobs.gather(1, kept.clamp(min=0)).masked_fill(kept < 0, -math.inf)
    rec = SequenceRecord("sampler", 0, [1], y.tolist(), spec, 0, ref.logprobs.gather(1, y.unsqueeze(1)).squeeze(1),
                         kept_ids=kept, kept_logprobs=lp)
    return rec, zt, spec, b, build_table([rec], [zt], spec)


def test_the_recomputed_set_loses_one_boundary_token_and_counts_as_equal() -> None:
    rec, zt, spec, b, t = _table()
    rec_kept = reference_filter(zt, spec).kept
    q = E.ids_to_mask(rec.kept_ids, V)
    assert (q[AT] & ~rec_kept[AT]).nonzero().squeeze(1).tolist() == [b]  # only the boundary token differs
    assert bool(t.recompute_support_equal.all())
    # The straddle moves recompute by the token's share of S_q, exactly: log(S_q / (S_q - p_b)).
    z = E.scale(zt, spec)[AT].double()
    mass = torch.softmax(z.masked_fill(~q[AT], -math.inf), -1)[b]
    assert float(t.recompute_boundary[AT]) == pytest.approx(-math.log1p(-float(mass)), rel=1e-9)
    assert float(t.recompute_boundary[AT]) > 100 * float(t.bound[AT])
    others = [i for i in range(L) if i != AT]
    assert t.recompute_boundary[others].tolist() == [0.0] * (L - 1)


def test_drift_and_support_agree_at_the_straddle() -> None:
    rec, zt, _, _, t = _table()
    gap = (t.recompute - t.vllm).abs()
    # Without the boundary term the drift gate would fail where the support gate passes...
    assert float(gap[AT] / t.bound[AT]) > 10
    # ...with it, the position sits inside recompute's bound, and replay (no recomputed boundary) is untouched.
    assert float(gap[AT]) <= float(t.bound[AT] + t.recompute_boundary[AT])
    assert float((t.replay - t.vllm).abs()[AT]) <= float(t.bound[AT])
    entry = judged([rec], [zt], t)
    assert "recompute_drift" not in failed(entry) and "recompute_support" not in failed(entry)
    assert entry["headroom"]["recompute"] <= 1.0


def _judge_planted(rec, zt, delta: float) -> tuple[bool, float]:
    planted = build_table([rec], [zt], rec.spec)
    planted.recompute[AT] += delta
    entry = judged([rec], [zt], planted)
    return "recompute_drift" in failed(entry), entry["headroom"]["recompute"]


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_fault_at_a_few_times_the_limit_fails_either_way(sign: float) -> None:
    """At the straddle recompute's limit is bound + boundary shift: three times it fails in either direction."""
    rec, zt, _, _, t = _table()
    limit = float(t.bound[AT] + t.recompute_boundary[AT])
    fails, head = _judge_planted(rec, zt, sign * 3.0 * limit)
    assert fails, head


@pytest.mark.parametrize(("times", "signs", "fails"), [(3.0, (1.0,), True), (0.1, (1.0, -1.0), False)])
def test_a_fault_beyond_the_straddle_is_sized_by_the_rounding_bound(times: float, signs: tuple[float, ...],
                                                                    fails: bool) -> None:
    """On top of the boundary shift (in its direction), the straddle leaves only the rounding bound: three times
    it fails, a tenth of it passes (either way)."""
    rec, zt, _, _, t = _table()
    shift = float(t.recompute[AT] - t.vllm[AT])
    direction = math.copysign(1.0, shift)
    for sign in signs:
        got, head = _judge_planted(rec, zt, sign * direction * times * float(t.bound[AT]))
        assert got is fails, (sign, head)
