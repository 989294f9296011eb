"""TRL's real GRPOTrainer on the CPU engine, one config (top_p=0.8, one step), as shipped and under the patch.

The relations are checked against the bfloat16 rounding bound computed from this run's logits
(:func:`parity.core.error_model.logprob_rounding_bound`; TRL's engine runs bfloat16), never against a stored number. The same
capture is then scored by parity into a report, which must fail TRL as shipped (bias = log S) and
pass it under the replay patch.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from parity.engines.trl_grpo import load_sequences  # noqa: E402
from parity.repro.trl_grpo_top_p import CONFIG_TIMEOUT_S, logp_relation, run_config, step_stats  # noqa: E402

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("trl")
    res = run_config({"model": "qwen2-tiny", "top_p": 0.8, "steps": 1, "phases": ["observe", "replay"]}, out,
                     CONFIG_TIMEOUT_S)
    assert "error" not in res, res.get("error", "") + "\n" + res.get("tail", "")
    phases = {p["mode"]: (p, load_sequences(out / p["capture"])) for p in res["phases"]}
    return res, phases


def test_trl_metric_equals_abs_log_s_as_shipped_and_noise_under_the_patch(run) -> None:
    _, phases = run
    for mode, expect_log_s in (("observe", True), ("replay", False)):
        phase, seqs = phases[mode]
        [metric] = phase["metrics"]
        stats = step_stats(seqs)
        assert seqs[0]["sampler_dtype"] == phase["sampler_dtype"]
        rel = logp_relation(metric["sampling/sampling_logp_difference/mean"], stats, expect_log_s=expect_log_s)
        assert rel["holds"], f"{mode}: {rel}"
        # TRL's own per-sequence IS ratio: log of it is the sum of log S per token (as shipped) or 0 (patched)
        assert stats["is_dev_over_bound"] <= 1, f"{mode}: {stats}"
        assert stats["is_excluded"] == 0
    shipped = step_stats(phases["observe"][1])
    # the bias is distinguishable from bfloat16 noise at top_p=0.8: the check above could fail
    assert shipped["abs_log_s"] > 2 * shipped["bound"] and shipped["mean_s"] < 1.0
    counts = phases["replay"][0]["counts"]
    assert counts["incomplete_positions"] == 0 and counts["replay_fallbacks"] == 0 and counts["nan_sampler_logprobs"] == 0


def test_parity_report_of_the_trl_step(run) -> None:
    from parity.analyze.trl import score_capture

    _, phases = run
    shipped = score_capture(phases["observe"][1], label="trl-shipped")
    patched = score_capture(phases["replay"][1], label="trl-replay")
    [s], [p] = shipped["scenarios"], patched["scenarios"]
    assert s["verdict"] == "fail" and "full-vocabulary distribution" in s["trainer_under_test"]["diagnosis"]
    assert p["verdict"] == "pass", p["violations"]
    assert p["trainer_under_test"]["diagnosis"] == "matches the sampler's processed log-probs"
    assert s["tokens"] == p["tokens"] == sum(len(x["completion_ids"]) for x in phases["observe"][1])


def trl_output(seqs) -> dict:
    """TRL's per-token tensors of one generation batch, padded as ``_generate_and_score_completions`` returns
    them (prompts left-padded, completions right-padded), from the captured sequences."""
    import torch

    n = len(seqs)
    p_len = max(len(s["prompt_ids"]) for s in seqs)
    c_len = max(len(s["completion_ids"]) for s in seqs)
    out = {"prompt_ids": torch.zeros(n, p_len, dtype=torch.long), "prompt_mask": torch.zeros(n, p_len, dtype=torch.long),
           "completion_ids": torch.zeros(n, c_len, dtype=torch.long),
           "completion_mask": torch.zeros(n, c_len, dtype=torch.long),
           "sampling_per_token_logps": torch.zeros(n, c_len), "old_per_token_logps": torch.zeros(n, c_len)}
    for b, s in enumerate(seqs):
        lp, lc = len(s["prompt_ids"]), len(s["completion_ids"])
        out["prompt_ids"][b, p_len - lp:] = torch.tensor(s["prompt_ids"])
        out["prompt_mask"][b, p_len - lp:] = 1
        out["completion_ids"][b, :lc] = torch.tensor(s["completion_ids"])
        out["completion_mask"][b, :lc] = s["mask"].long()
        out["sampling_per_token_logps"][b, :lc] = s["sampling_logps"]
        out["old_per_token_logps"][b, :lc] = s["is_logps"]  # what TRL's IS correction used
    return out


def test_trls_logged_tensors_alone_judge_the_run(run, tmp_path) -> None:
    """The README's lines write TRL's per-token tensors as records; parity analyze judges them without the
    model: as shipped the mean-bias gate fails, named a full-vocabulary (log S) trainer; patched it passes.
    The repro's own verdict (judge_logged) is the same gate on the same tensors."""
    import re
    from pathlib import Path

    from parity.analyze import analyze
    from parity.analyze.trl import judge_logged

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"<!-- judge-logs:start -->\n```python\n(.*?)```\n<!-- judge-logs:end -->", text, re.S).group(1)
    _, phases = run
    for mode, fails in (("observe", True), ("replay", False)):
        seqs = phases[mode][1]
        ns: dict = {}
        exec(code, ns)  # noqa: S102 - the README's own lines
        ns["spec"].update(seqs[0]["spec"])
        for step in sorted({s["step"] for s in seqs}):
            ns["log_trl"](trl_output([s for s in seqs if s["step"] == step]), step)
        path = tmp_path / f"{mode}.parquet"
        ns["write"](str(path), {"schema_version": 1, "dtype": seqs[0]["sampler_dtype"], "trainer_dtype": "float32",
                                "vocab_size": int(seqs[0]["logits"].shape[-1])})
        (sc,) = analyze(path, plots=False)["scenarios"]
        gates = [v["gate"] for v in sc["violations"]]
        assert gates == (["logprob_mean_bias"] if fails else []), sc["violations"]
        if fails:
            assert "a full-vocabulary (log S) trainer" in sc["violations"][0]["message"]
        own = judge_logged(seqs)
        assert own["verdict"] == sc["verdict"] and own["mean_bias"]["logprob"]["mean"] == pytest.approx(
            sc["mean_bias"]["logprob"]["mean"], abs=1e-6)
