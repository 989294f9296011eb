"""A bfloat16 sampler with top_k keeps every token tied at the k-th value; a float32 recompute sees no tie there and
keeps k. Its kept set is then one-sidedly smaller than S_q, and its log-probs systematically higher. The case met
on a 16-expert MoE checkpoint (bf16 sampler, fp32 trainer, T=1 top_k=50) failed `recompute |mean bias|` with a
report that called support "equal" and blamed one forced include: here the support is reported one-sided and the
FAIL names the ties. Flat logits on a wide vocabulary, as a bf16 sampler sees them, no engine.
"""

from __future__ import annotations

import pytest
import torch
from judged import judged

from parity.core.capture import support_from_heads
from parity.core.filters import reference_filter
from parity.core.gates import Thresholds
from parity.core.metrics import boundary_only, top_k_count_differs
from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.core.token_table import build_table

V = 4096
SPEC = SamplingSpec(temperature=1.0, top_k=50)
BF16 = ("bfloat16", "float32")


def bf16_sampler(n_seq: int = 4, length: int = 16, seed: int = 3, dtype: torch.dtype = torch.bfloat16):
    """A sampler that computes its logits in ``dtype`` (the trainer's are the float32 ones they round from)."""
    g = torch.Generator().manual_seed(seed)
    records, logits = [], []
    for i in range(n_seq):
        z = torch.randn(length, V, generator=g)  # flat: logit scale 1
        zq = z.to(dtype).float()
        ref = reference_filter(zq, SPEC)
        y = torch.multinomial(ref.logprobs.exp(), 1, generator=g).squeeze(1)
        order = torch.argsort(ref.logprobs, dim=-1, descending=True)
        cap = support_from_heads(y.tolist(), order.tolist(), ref.logprobs.gather(1, order).tolist(), requested=-1,
                                 vocab_size=V)
        records.append(SequenceRecord(
            source="sampler", prompt_index=i, prompt_ids=[1, 2], completion_ids=y.tolist(), spec=SPEC, seed=i,
            logprobs=ref.logprobs.gather(1, y.unsqueeze(1)).squeeze(1), kept_ids=cap.kept_ids,
            kept_logprobs=cap.kept_logprobs, incomplete=cap.incomplete, extras={"sampled_missing": cap.sampled_missing}))
        logits.append(z)
    return records, logits


@pytest.fixture(scope="module")
def sampled():
    return bf16_sampler()


def test_a_top_k_set_of_another_count_is_not_a_moved_cutoff() -> None:
    a = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 1, 0]], dtype=torch.bool)
    b = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.bool)
    # top_k=2: four kept (ties) against two; three against two; three against three, one swapped (same count).
    assert top_k_count_differs(a, b, 2).tolist() == [True, True, False]
    assert top_k_count_differs(b, a, 2).tolist() == [True, True, False]
    assert not top_k_count_differs(a, b, 0).any()  # no top_k: a top_p cutoff may move by several tokens
    # The rule the table used alone: with a wide bound every difference read as a moved cutoff.
    assert boundary_only(a, b, torch.zeros(3, 5), torch.full((3,), 5.0)).all()


def test_a_bf16_sampler_with_top_k_fails_recompute_naming_the_ties(sampled) -> None:
    records, logits = sampled
    table = build_table(records, logits, SPEC, dtype=BF16)
    sc = judged(records, logits, table, Thresholds.for_dtype("bfloat16"), dtypes=BF16)
    sides = sc["support_sides"]
    assert sc["max_support_size"] > 50 and sides["ties_at_k_positions"] > 0
    assert sides["ties_dropped_positions"] == sides["ties_at_k_positions"]  # float32 keeps k where bf16 kept ties
    assert sides["smaller_positions"] == sides["ties_dropped_positions"] and sides["larger_positions"] == 0
    # Not "equal": the one-sided positions count against recompute's support.
    assert sc["recompute"]["support_equal_frac"] < 1.0
    rec = [v for v in sc["reference_violations"] + sc["violations"] if v.gate.startswith("recompute")]
    assert rec and all("tied at the k-th value" in v.message() for v in rec), [v.message() for v in rec]
    msg = rec[0].message()
    assert f"at {sides['ties_at_k_positions']} of " in msg and "--trainer replay" in msg
    assert "--recompute-precision sampler" in msg
    assert not [v for v in sc["reference_violations"] + sc["violations"] if v.gate.startswith("replay")]


def test_recompute_at_the_samplers_precision_keeps_the_ties(sampled) -> None:
    records, logits = sampled
    table = build_table(records, logits, SPEC, dtype=BF16, recompute_dtype="bfloat16")
    sc = judged(records, logits, table, Thresholds.for_dtype("bfloat16"), dtypes=BF16)
    sides = sc["support_sides"]
    assert sides["ties_at_k_positions"] > 0 and sides["ties_dropped_positions"] == 0
    assert sc["recompute"]["support_equal_frac"] == 1.0
    assert not [v for v in sc["reference_violations"] + sc["violations"] if v.gate.startswith("recompute")]


def test_a_float32_sampler_has_no_ties_to_drop() -> None:
    records, logits = bf16_sampler(n_seq=2, dtype=torch.float32)
    table = build_table(records, logits, SPEC)
    sc = judged(records, logits, table)
    assert sc["support_sides"]["ties_at_k_positions"] == 0 and sc["max_support_size"] == 50
    assert sc["verdict"] == "pass", [v.message() for v in sc["violations"]]
