"""batch_invariant_mode without an engine: knobs on inside, previous state back on exit, honest reports.

Also the pure parts of the checks: record comparison, the 1-ulp nudge, the gate's messages.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
from ulp import nudge_one_ulp

from parity.core.sequence import SequenceRecord
from parity.core.spec import SamplingSpec
from parity.determinism import knobs as det
from parity.determinism.checks import compare_records
from parity.determinism.gate import determinism_section, invariance_gate
from parity.determinism.knobs import CUDA_KNOBS, OFF, ON, UNAVAILABLE, batch_invariant_mode


def snapshot() -> dict:
    mm = torch.backends.cuda.matmul
    return {
        "det": torch.are_deterministic_algorithms_enabled(),
        "warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
        "mkldnn": torch.backends.mkldnn.deterministic,
        "threads": torch.get_num_threads(),
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
        "fp32_precision": getattr(mm, "fp32_precision", None),
        "reduced": (mm.allow_fp16_reduced_precision_reduction, mm.allow_bf16_reduced_precision_reduction),
        "env": {k: os.environ.get(k) for k in ("VLLM_BATCH_INVARIANT", "CUBLAS_WORKSPACE_CONFIG")},
    }


class FakeModel:
    """Stands in for a transformers model: only the attention-implementation switch (no forward)."""

    def __init__(self, impl: str) -> None:
        self.config = type("Config", (), {"_attn_implementation": impl})()

    def set_attn_implementation(self, impl: str) -> None:
        self.config._attn_implementation = impl


@pytest.fixture(scope="module")
def tiny_model():
    """A real transformers causal LM built from a config (random weights, no checkpoint needed)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(cfg).eval()


def test_cpu_mode_turns_knobs_on_and_restores_them(tiny_model) -> None:
    from parity.determinism import attention_kernel

    before = snapshot()
    model = tiny_model
    prev = model.config._attn_implementation
    with batch_invariant_mode(device="cpu", models=[model]) as state:
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.mkldnn.deterministic is True
        assert model.config._attn_implementation == det.CPU_ATTENTION
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]))
        knobs = state.to_dict()["knobs"]
        assert knobs["torch.use_deterministic_algorithms"]["status"] == ON
        assert knobs["torch.backends.mkldnn.deterministic"]["status"] == ON
        assert knobs["trainer_attention"] == {
            "status": ON, "value": det.CPU_ATTENTION, "reason": attention_kernel.ATTENTION_KERNEL
        }
        assert knobs["torch_num_threads"]["status"] == ON
        kernels = knobs["cpu_kernels"]
        assert kernels["status"] == ON and "mm.default" in kernels["value"]["replaced"]
        assert kernels["value"]["calls"]["attention"] == 1 and kernels["value"]["other_ops"] == {}
    assert snapshot() == before
    assert model.config._attn_implementation == prev and "forward" not in model.__dict__
    # The report keeps what the forward ran after the mode is gone.
    assert state.to_dict()["knobs"]["cpu_kernels"]["value"]["calls"]["mm.default"] > 0


def test_restores_on_exception(tiny_model) -> None:
    before = snapshot()
    prev = tiny_model.config._attn_implementation
    with pytest.raises(KeyError, match="boom"):
        with batch_invariant_mode(device="cpu", models=[tiny_model]):
            assert torch.are_deterministic_algorithms_enabled()
            assert tiny_model.config._attn_implementation == det.CPU_ATTENTION
            raise KeyError("boom")
    assert snapshot() == before
    assert tiny_model.config._attn_implementation == prev and "forward" not in tiny_model.__dict__


def test_a_model_the_kernels_cannot_run_on_is_reported_unavailable() -> None:
    model = FakeModel("sdpa")
    with batch_invariant_mode(device="cpu", models=[model]) as state:
        knobs = state.to_dict()["knobs"]
    for name in ("trainer_attention", "cpu_kernels"):
        assert knobs[name]["status"] == UNAVAILABLE and "FakeModel is not a torch.nn.Module" in knobs[name]["reason"]
    assert model.config._attn_implementation == "sdpa"
    with batch_invariant_mode(device="cpu") as state:
        assert state.knobs["cpu_kernels"].status == OFF and "models=[trainer.model]" in state.knobs["cpu_kernels"].reason


def test_nested_modes_restore_the_outer_state() -> None:
    before = snapshot()
    with batch_invariant_mode(device="cpu"):
        with batch_invariant_mode(False, device="cpu") as inner:
            # enabled=False changes nothing and reports what is in force: the outer mode's knobs.
            assert inner.knobs["torch.use_deterministic_algorithms"].status == ON
        assert torch.are_deterministic_algorithms_enabled()
    assert snapshot() == before


def test_disabled_mode_changes_nothing_and_reports_the_state() -> None:
    before = snapshot()
    with batch_invariant_mode(False, device="cpu") as state:
        assert snapshot() == before
    expected = ON if before["det"] else OFF
    assert state.knobs["torch.use_deterministic_algorithms"].status == expected
    assert state.knobs["torch_num_threads"].status == OFF
    assert state.to_dict()["enabled"] is False


def test_cpu_reports_gpu_knobs_unavailable_with_reasons() -> None:
    with batch_invariant_mode(device="cpu") as state:
        d = state.to_dict()
    for name in CUDA_KNOBS:
        assert d["knobs"][name]["status"] == UNAVAILABLE, name
        assert d["knobs"][name]["reason"], name
    assert set(d["unavailable"]) == set(CUDA_KNOBS)
    assert "crashes" in d["knobs"]["VLLM_BATCH_INVARIANT"]["reason"]
    assert "mean_dim" in d["knobs"]["VLLM_BATCH_INVARIANT"]["reason"]
    assert d["knobs"]["tf32_off"]["reason"] == det.NO_CUDA
    # Never set on CPU: the CPU engine would crash at its first forward.
    assert os.environ.get("VLLM_BATCH_INVARIANT") != "1"


def test_thread_count_under_vllm_binding_is_reported_pinned_by_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU worker swaps torch.set_num_threads for a no-op after binding its threads."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    with batch_invariant_mode(device="cpu") as state:
        assert state.knobs["torch_num_threads"].status == ON
        assert "pinned by vLLM" in state.knobs["torch_num_threads"].reason


def test_invalid_arguments_are_refused_before_anything_changes() -> None:
    before = snapshot()
    with pytest.raises(ValueError, match="device='tpu0' is invalid"):
        with batch_invariant_mode(device="tpu0"):
            pass
    assert snapshot() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_cuda_is_refused() -> None:
    with pytest.raises(RuntimeError, match="is_available"):
        with batch_invariant_mode(device="cuda"):
            pass


def test_cuda_branch_restores_what_it_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch's bookkeeping, simulated on CPU: flags are set inside and restored after.

    This runs only the flag setting and restoring; whether these knobs make a GPU batch-invariant is
    not shown here (no GPU; the vLLM overrides are stood in for, they must not load on CPU).
    """
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    calls = []
    monkeypatch.setattr(
        det, "_enable_vllm_overrides", lambda: (ON, "stub", None, lambda: calls.append("undo"))
    )
    before = snapshot()
    with batch_invariant_mode(device="cuda") as state:
        assert os.environ["VLLM_BATCH_INVARIANT"] == "1"
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] in det.CUBLAS_DETERMINISTIC
        assert torch.backends.cudnn.deterministic is True and torch.backends.cudnn.benchmark is False
        assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction in (False, (False, False))
        if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
            assert torch.backends.cuda.matmul.fp32_precision == "ieee"
        # CUDA: a non-deterministic op warns instead of aborting the rollout.
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert all(state.knobs[n].status == ON for n in CUDA_KNOBS)
        assert "before the engine starts" in state.knobs["VLLM_BATCH_INVARIANT"].reason
    assert snapshot() == before
    assert calls == ["undo"]


def test_a_failing_knob_undoes_the_ones_already_set(monkeypatch: pytest.MonkeyPatch) -> None:
    before = snapshot()

    def broken(state, undo, enabled, models):
        raise RuntimeError("attention switch failed")

    monkeypatch.setattr(det, "_cpu_kernels", broken)
    with pytest.raises(RuntimeError, match="attention switch failed"):
        with batch_invariant_mode(device="cpu"):
            pass
    assert snapshot() == before


# -- the pure parts of the checks ------------------------------------------------------------------


def record(ids, lps, kept=None, kept_lp=None) -> SequenceRecord:
    return SequenceRecord(
        source="vllm",
        prompt_index=0,
        prompt_ids=[1, 2],
        completion_ids=list(ids),
        spec=SamplingSpec(),
        seed=0,
        logprobs=torch.tensor(lps, dtype=torch.float32),
        kept_ids=kept,
        kept_logprobs=kept_lp,
    )


def test_nudge_is_one_ulp_and_compare_catches_it() -> None:
    x = torch.tensor([-0.5, -1.25, float("-inf")])
    y = nudge_one_ulp(x, 1)
    assert not torch.equal(x, y) and y[1] < x[1]
    assert torch.equal(y[[0, 2]], x[[0, 2]])
    assert y[1] == torch.nextafter(x[1], torch.tensor(float("-inf")))
    a = record([5, 6, 7], [-0.5, -1.25, -2.0])
    c = compare_records(a, replace(a, logprobs=nudge_one_ulp(a.logprobs, 2)))
    assert c["tokens_equal"] and not c["bitwise"]
    assert 0 < c["max_abs_diff"] < 1e-6
    assert compare_records(a, a) == {
        "bitwise": True,
        "tokens_equal": True,
        "first_token_mismatch": None,
        "support_equal": None,
        "max_abs_diff": 0.0,
    }


def test_compare_stops_log_probs_at_the_first_token_mismatch() -> None:
    a = record([5, 6, 7], [-0.5, -1.0, -2.0])
    b = record([5, 9, 7], [-0.5, -3.0, -2.0])
    c = compare_records(a, b)
    assert c == {
        "bitwise": False,
        "tokens_equal": False,
        "first_token_mismatch": 1,
        "support_equal": None,
        "max_abs_diff": 0.0,
    }
    first = compare_records(a, record([4, 6, 7], [-0.5, -1.0, -2.0]))
    assert first["first_token_mismatch"] == 0 and first["max_abs_diff"] is None


def test_compare_checks_the_kept_set() -> None:
    kept = torch.tensor([[5, 3], [6, -1]])
    lp = torch.tensor([[-0.1, -2.4], [0.0, float("-inf")]])
    a = record([5, 6], [-0.1, 0.0], kept, lp)
    assert compare_records(a, record([5, 6], [-0.1, 0.0], kept.clone(), lp.clone()))["bitwise"]
    moved = record([5, 6], [-0.1, 0.0], torch.tensor([[5, 4], [6, -1]]), lp.clone())
    c = compare_records(a, moved)
    assert not c["bitwise"] and c["support_equal"] is False and c["tokens_equal"]
    nudged = record([5, 6], [-0.1, 0.0], kept.clone(), nudge_one_ulp(lp, 1))
    c = compare_records(a, nudged)
    assert not c["bitwise"] and c["support_equal"] and 0 < c["max_abs_diff"] < 1e-6


def rollout_result(bitwise_8: bool, unique: int) -> dict:
    checks = [
        {
            "name": "rollout greedy batch=4",
            "side": "rollout",
            "kind": "batch",
            "batch_size": 4,
            "position": 2,
            "bitwise": True,
            "tokens_equal": True,
            "first_token_mismatch": None,
            "max_abs_diff": 0.0,
        },
        {
            "name": "rollout greedy batch=8",
            "side": "rollout",
            "kind": "batch",
            "batch_size": 8,
            "position": 4,
            "bitwise": bitwise_8,
            "tokens_equal": True,
            "first_token_mismatch": None,
            "max_abs_diff": 0.0 if bitwise_8 else 5.96e-8,
        },
        {
            "name": "rollout greedy run-to-run x4",
            "side": "rollout",
            "kind": "run_to_run",
            "repeats": 4,
            "unique_outputs": unique,
            "bitwise": unique == 1,
            "tokens_equal": unique == 1,
            "max_abs_diff": 0.0,
        },
    ]
    return {"side": "rollout", "checks": checks, "invariant": all(c["bitwise"] for c in checks)}


def test_gate_names_the_check_the_batch_size_and_the_diff() -> None:
    assert invariance_gate(rollout_result(True, 1), required=True) == []
    broken = rollout_result(False, 2)
    assert invariance_gate(broken, required=False) == []
    objs = invariance_gate(broken, required=True)
    assert [o.gate for o in objs] == ["invariance", "invariance"] and objs[0].scenario == "rollout greedy batch=8"
    assert objs[0].statistic == broken["checks"][[c["name"] for c in broken["checks"]].index("rollout greedy batch=8")]["max_abs_diff"]
    assert objs[0].limit == 0.0 and objs[0].to_dict()["message"].startswith("[rollout greedy batch=8]")
    v = [o.detail for o in objs]
    assert len(v) == 2
    assert "rollout greedy batch=8" in v[0] and "batch size 8" in v[0] and "5.960e-08" in v[0]
    assert "2 unique outputs from 4 identical requests" in v[1]


def test_gate_skips_unavailable_checks_and_reads_both_sides() -> None:
    trainer = {
        "side": "trainer",
        "invariant": False,
        "checks": [
            {
                "name": "trainer left-padded",
                "side": "trainer",
                "layout": "left_padded",
                "status": "measured",
                "bitwise": False,
                "tokens_equal": True,
                "max_abs_diff": 3e-7,
                "records_not_bitwise": 3,
                "worst_record": 1,
            },
            {
                "name": "trainer packed",
                "side": "trainer",
                "layout": "packed",
                "status": UNAVAILABLE,
                "reason": "flash",
                "bitwise": None,
                "tokens_equal": None,
                "max_abs_diff": None,
            },
        ],
    }
    v = [o.detail for o in invariance_gate({"rollout": rollout_result(True, 1), "trainer": trainer}, required=True)]
    assert v == [
        "determinism: trainer left-padded: not bitwise equal to the sequence alone in left_padded: "
        "max |diff| 3.000e-07, 3 record(s), worst record 1"
    ]
    with pytest.raises(ValueError, match="no 'checks'"):
        invariance_gate({"something": 1}, required=True)


def test_report_section_requires_invariance_under_the_mode() -> None:
    with batch_invariant_mode(device="cpu") as state:
        pass
    sec = determinism_section(state, rollout=rollout_result(False, 1), replay_max_abs_diff=1e-6)
    # On CPU no knob makes vLLM's kernels invariant: the rollout side is measured and reported, not required.
    assert sec["mode"]["knobs"]["VLLM_BATCH_INVARIANT"]["status"] == UNAVAILABLE
    assert sec["required"] and sec["required_sides"] == {"rollout": False, "trainer": False}
    assert not sec["invariant"] and sec["violations"] == []
    assert sec["not_required"] == {"rollout": {"invariant": False, "max_abs_diff": 5.96e-8}}
    assert sec["cross_side"] == {"kernel_noise_max_abs_diff": 5.96e-8, "replay_max_abs_diff": 1e-6}
    relaxed = determinism_section(None, rollout=rollout_result(False, 1))
    assert not relaxed["required"] and relaxed["violations"] == []


def test_a_side_is_required_when_a_knob_in_force_guarantees_it() -> None:
    from parity.determinism.gate import guaranteed_sides
    from parity.determinism.knobs import ON, DeterminismState

    cpu = DeterminismState(enabled=True, device="cpu")
    cpu.add("cpu_kernels", ON)
    assert guaranteed_sides(cpu) == {"rollout": False, "trainer": True}
    broken = rollout_result(False, 1)
    sec = determinism_section(cpu, rollout=rollout_result(False, 1), trainer={**broken, "side": "trainer"})
    assert [v["scenario"] for v in sec["violations"]] == [c["name"] for c in broken["checks"] if not c["bitwise"]]
    assert list(sec["not_required"]) == ["rollout"]
    cuda = DeterminismState(enabled=True, device="cuda")
    cuda.add("VLLM_BATCH_INVARIANT", ON)
    assert guaranteed_sides(cuda) == {"rollout": True, "trainer": False}
    off = DeterminismState(enabled=False, device="cuda")
    off.add("VLLM_BATCH_INVARIANT", ON)
    assert guaranteed_sides(off) == {"rollout": False, "trainer": False}
