"""TRL's real GRPOTrainer on the real checkpoint smollm2-135m at T=1.3, top_p=0.95 (TRL's top_k=0), as
shipped and under ``patch_grpo("replay")``, with no head flag.

Nuclei of up to ~18,000 tokens: the colocated engine's sampler rows prove every kept set (no position
unproven), and TRL's own sampling_logp_difference/mean falls from about -log of the kept mass
(log(1/0.95) = 0.051) to what the bf16 engine and the float32 trainer differ by anyway. Measured on a
2-core x86 machine: 0.0503 / 0.0539 shipped, 0.0245 / 0.0292 under replay (two steps). Asserted is what
the code guarantees: complete capture, finite metrics, and the patch lowering the metric. About two
minutes (two trainer and engine start-ups): marked slow.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("trl")

from parity.engines.trl_run import TRL_METRICS  # noqa: E402
from parity.repro.trl_grpo_top_p import run_config  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "sampling/sampling_logp_difference/mean"


def test_replay_at_a_hot_temperature_completes_and_lowers_trls_logp_difference(smollm2_dir, tmp_path) -> None:
    steps = 2
    res = run_config({"model": str(smollm2_dir), "temperature": 1.3, "top_p": 0.95, "phases": ["off", "replay"],
                      "steps": steps, "batch": 8, "num_generations": 4, "max_completion_length": 16}, tmp_path, 1200.0)
    assert "error" not in res, res.get("error", "") + "\n" + res.get("tail", "")
    shipped, patched = res["phases"]
    print("\n" + json.dumps({p["mode"]: [m[KEY] for m in p["metrics"]] for p in res["phases"]}))
    assert patched["counts"]["incomplete_positions"] == 0
    for plan in patched["capture_plans"]:
        assert plan["incomplete_positions"] == 0 and plan["row_mismatched"] == 0 and plan["rounds"] == 0
    assert max(p["largest_support"] for p in patched["capture_plans"]) > 4096
    for phase in (shipped, patched):
        assert len(phase["metrics"]) == steps
        assert all(math.isfinite(m[k]) for m in phase["metrics"] for k in TRL_METRICS)
    for before, after in zip(shipped["metrics"], patched["metrics"], strict=True):
        assert after[KEY] < before[KEY], (before[KEY], after[KEY])
