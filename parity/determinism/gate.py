"""The report's ``determinism`` section, and the invariance checks (:mod:`parity.determinism.checks`) through
the gate table's ``invariance`` entry when invariance is required."""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

from parity.core.gates import Thresholds
from parity.core.violation import Violation
from parity.determinism.checks import RolloutInvariance, TrainerInvariance
from parity.determinism.knobs import ON, DeterminismState
from parity.errors import UsageError
from parity.judge.gate_table import GateCase, evaluate
from parity.report.blocks import JsonObject


def _results(result: Mapping[str, object]) -> list[Mapping[str, object]]:
    """A check result, or a dict of them (``{"rollout": ..., "trainer": ...}``)."""
    if "checks" in result:
        return [result]
    return [v for v in result.values() if isinstance(v, dict) and "checks" in v]


def _checks(result: Mapping[str, object]) -> list[Mapping[str, object]]:
    """A result's checks: a list of dicts (as ``check_*_invariance`` writes them)."""
    checks = result["checks"]
    if not isinstance(checks, list) or not all(isinstance(c, Mapping) for c in checks):
        raise UsageError(f"invariance_gate: 'checks' is {checks!r}: allowed a list of dicts (one per check)")
    return [c for c in checks if isinstance(c, Mapping)]


def invariance_gate(result: Mapping[str, object], *, required: bool) -> list[Violation]:
    """Violations when invariance is required and a measured check is not bitwise.

    A check reported unavailable (with its reason) is not a violation: it was not measured. The
    statistic is the check's largest difference (bitwise means a limit of 0); the worst record, where
    the check names one, is the position.
    """
    if not required:
        return []
    out = evaluate(GateCase("", None, None, Thresholds(), checks=[c for r in _results(result) for c in _checks(r)]), "run")
    if not out and not _results(result):
        raise UsageError(
            "invariance_gate: result has no 'checks' (pass a check_*_invariance result or a dict of them)"
        )
    return out


def guaranteed_sides(state: DeterminismState | None) -> dict[str, bool]:
    """Which side's batch invariance a knob in force guarantees.

    The rollout side: vLLM's own batch-invariant mode (``VLLM_BATCH_INVARIANT``, CUDA; it crashes vLLM's
    CPU engine, so on CPU no knob parity can turn makes vLLM's kernels invariant). The trainer side:
    parity's batch-invariant CPU kernels on the trainer model, or on CUDA the deterministic-algorithm
    knobs with eager attention.
    """
    if state is None or not state.enabled:
        return {"rollout": False, "trainer": False}
    on = set(state.names(ON))
    trainer = "cpu_kernels" in on if state.device == "cpu" else {"torch.use_deterministic_algorithms", "trainer_attention"} <= on
    return {"rollout": "VLLM_BATCH_INVARIANT" in on, "trainer": trainer}


def determinism_section(
    state: DeterminismState | None,
    *,
    rollout: RolloutInvariance | None = None,
    trainer: TrainerInvariance | None = None,
    required: bool | None = None,
    replay_max_abs_diff: float | None = None,
) -> JsonObject:
    """The report's ``determinism`` section: knobs, both sides' checks, the gate, and the cross-side view.

    ``required`` defaults to "batch-invariant mode is on". ``replay_max_abs_diff`` (from the end-to-end
    run) is shown next to the largest kernel-noise difference measured, so a reader sees how much of
    the rollout-vs-trainer drift batching alone could explain.
    """
    if required is None:
        required = bool(state and state.enabled)
    results: dict[str, RolloutInvariance | TrainerInvariance] = {
        k: v for k, v in (("rollout", rollout), ("trainer", trainer)) if v is not None
    }
    sides = guaranteed_sides(state) if required else {"rollout": False, "trainer": False}
    violations = [v for side, res in results.items() for v in invariance_gate(res, required=sides[side])]
    largest = {side: max((x for c in res["checks"] if (x := c.get("max_abs_diff")) is not None), default=None)
               for side, res in results.items()}
    section = {
        "mode": state.to_dict() if state is not None else None,
        **results,
        "required": required,
        # Only what a knob in force guarantees is required; the other side is measured and reported.
        "required_sides": sides,
        "not_required": {
            side: {"invariant": res["invariant"], "max_abs_diff": largest[side]}
            for side, res in results.items() if not sides[side]
        },
        "invariant": all(r["invariant"] for r in results.values()) if results else None,
        "cross_side": {
            "kernel_noise_max_abs_diff": max((x for x in largest.values() if x is not None), default=None),
            "replay_max_abs_diff": replay_max_abs_diff,
        },
        "violations": [v.to_dict() for v in violations],
    }
    return cast("JsonObject", section)  # TypedDicts of JSON values (ModeJson, the checks' results)
