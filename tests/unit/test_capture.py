"""Capture planning, support reconstruction and the native-vs-top-K comparison (no engine)."""

from __future__ import annotations

import pytest
import torch

from parity.core.capture import (
    FULL_VOCAB,
    compare_supports,
    padded_ids,
    plan_capture,
    support_from_heads,
    support_mass,
    validate_native_mask,
)
from parity.core.spec import SamplingSpec


def test_plan_capture_rules() -> None:
    assert plan_capture(SamplingSpec(), 320).logprobs is None
    assert plan_capture(SamplingSpec(temperature=0.0, top_k=5), 320).logprobs is None  # greedy drops filters
    assert plan_capture(SamplingSpec(top_k=20), 32000).logprobs == 36  # top_k + tie margin
    assert plan_capture(SamplingSpec(top_k=20, top_p=0.9), 32000).logprobs == 36
    assert plan_capture(SamplingSpec(top_p=0.9), 320).logprobs == FULL_VOCAB
    assert plan_capture(SamplingSpec(top_k=310), 320).logprobs == FULL_VOCAB
    # top_p without top_k on a real vocabulary: adaptive, capped (no longer refused).
    wide = plan_capture(SamplingSpec(top_p=0.9), 32000)
    assert wide.adaptive and wide.logprobs == 4096 and wide.max_head == 4096
    with pytest.raises(ValueError, match="head=10 is smaller than top_k=20"):
        plan_capture(SamplingSpec(top_k=20), 32000, head=10)
    with pytest.raises(ValueError, match="head=0"):
        plan_capture(SamplingSpec(top_k=20), 32000, head=0)
    raised = plan_capture(SamplingSpec(top_p=0.9), 32000, max_head=40000)
    assert (raised.logprobs, raised.max_head) == (4096, FULL_VOCAB)  # the cap is the vocabulary


def test_support_from_heads_flags_full_heads_as_incomplete() -> None:
    inf = float("-inf")
    cap = support_from_heads(
        [3, 7, 1],
        [[3, 4, 5], [7, 2, 9], [1, 0, 2]],
        [[-0.1, -2.0, inf], [-0.5, -1.0, -2.0], [-1e-3, inf, inf]],
        requested=3,
        vocab_size=10,
    )
    assert cap.incomplete.tolist() == [False, True, False]
    assert cap.sampled_missing.tolist() == [False, False, False]
    assert cap.kept_ids.tolist() == [[3, 4, -1], [7, 2, 9], [1, -1, -1]]
    full = support_from_heads([1], [[1, 0]], [[-0.2, -1.7]], requested=FULL_VOCAB, vocab_size=2)
    assert not bool(full.incomplete[0])
    assert support_mass(torch.tensor([[-0.5, -0.9]]).log_softmax(-1)).item() == pytest.approx(1.0)


def test_native_mask_constraints_and_comparison() -> None:
    with pytest.raises(ValueError, match="temperature > 0"):
        validate_native_mask(SamplingSpec(temperature=0.0, top_k=5))
    with pytest.raises(ValueError, match="top_k > 0"):
        validate_native_mask(SamplingSpec(temperature=1.0, top_p=0.9))
    validate_native_mask(SamplingSpec(temperature=1.0, top_k=5))
    native = padded_ids([[5, 1, 3], [2], [9, 8]])
    topk = torch.tensor([[1, 3, 5, -1], [2, -1, -1, -1], [8, -1, -1, -1]])
    assert compare_supports(native, topk) == [2]
    assert compare_supports(native, topk, skip=torch.tensor([False, False, True])) == []


def test_engine_refuses_cuda_paths_up_front_on_cpu(tmp_path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here: the refusal paths are for CPU machines")
    from parity.engines.vllm_offline import VllmRollout

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        VllmRollout(tmp_path, device="cuda")
    with pytest.raises(ValueError, match="return_sampling_mask.*Model Runner V2"):
        VllmRollout(tmp_path, capture="native")
    with pytest.raises(ValueError, match="capture='bogus'"):
        VllmRollout(tmp_path, capture="bogus")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        VllmRollout(tmp_path / "missing")
