"""End-to-end: the real vLLM CPU engine against a transformers trainer on fixture models."""

from __future__ import annotations

import json
import shutil

import pytest

from parity.core.gates import Thresholds
from parity.core.matrix import DEFAULT_PEAKED_FIXTURE, Matrix, Scenario, default_matrix
from parity.core.spec import SamplingSpec
from parity.core.token_table import TrainerFaults
from parity.engines.session import EnginePool, check_same_vocabulary
from parity.report.schema import SCHEMA_VERSION
from parity.run import RunConfig, run, score_scenario

pytestmark = pytest.mark.e2e

MODEL = "qwen2-tiny"


@pytest.fixture(scope="module")
def pool():
    p = EnginePool()
    yield p
    p.close()


def small_default() -> Matrix:
    """The default matrix, every scenario, at a size that fits the CI budget."""
    return default_matrix(prompts=4, max_tokens=8)


@pytest.fixture(scope="module")
def report(pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    rep = run(RunConfig(model=MODEL, matrix=small_default(), out=out), progress=lambda s: None, pool=pool)
    rep["_out"] = out
    return rep


def test_default_matrix_passes_every_gate(report) -> None:
    failures = [v["message"] for s in report["scenarios"] for v in s["violations"]]
    assert report["passed"], "\n".join(failures)
    assert [s["name"] for s in report["scenarios"]] == [s.name for s in small_default().scenarios]


def test_naive_trainer_is_biased_by_the_samplers_log_s(report) -> None:
    """The negative control: with filters on, full-vocabulary log-probs are off by log S < 0, and that
    log S is the sampler's own (its raw logits, a second pass with the same seeds), not the trainer's."""
    filtered = [s for s in report["scenarios"] if s["log_s"]["mean"] < -1e-3]
    assert len(filtered) >= 10
    for s in filtered:
        assert s["naive"]["bias_mean"] < -1e-3, s["name"]
        if s["model"] == DEFAULT_PEAKED_FIXTURE:  # 32k vocabulary under top_k: no sampler-side log S exists
            assert s["sampler_log_s"]["source"] == "none" and s["headroom"]["naive_vs_sampler_log_s"] is None
            continue
        if any(s["spec"].get(k, neutral) != neutral for k, neutral in PENALTIES):
            # vLLM's raw log-probs come before the penalties: no raw pass can rebuild the penalised row.
            assert "raw_logits_pass" not in s["sampler_log_s"] and s["sampler_log_s"]["source"] != "raw_logits", s["name"]
            continue
        assert s["sampler_log_s"]["source"] in ("raw_logits", "top_p_bracket"), s["name"]
        assert s["sampler_log_s"]["raw_logits_pass"]["redrawn_differently"] == [], s["name"]
        assert s["headroom"]["naive_vs_sampler_log_s"] <= 1.0, s["name"]
        assert s["is_ratio"]["naive"]["sequence"]["mean"] < 1.0, s["name"]
    unfiltered = [s for s in report["scenarios"] if s["name"] in ("baseline T=1", "greedy T=0", "T=0.7", "T=1.3")]
    for s in unfiltered:
        assert s["log_s"]["mean"] == 0.0 and abs(s["naive"]["bias_mean"]) <= 1e-5


PENALTIES = (("repetition_penalty", 1.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0))


def test_tie_fixture_reaches_the_top_k_boundary(report) -> None:
    ties = [s for s in report["scenarios"] if s["name"].startswith("ties")]
    assert ties and all(s["incomplete_positions"] == 0 for s in ties)
    # A tie at the k-th value keeps more than k tokens somewhere; the capture margin caught it.
    assert any(s.get("max_support_size", 0) > s["spec"]["top_k"] for s in ties), [s.get("max_support_size") for s in ties]


def test_report_files_and_schema(report) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from parity.report.schema import report_schema

    out = report["_out"]
    data = json.loads((out / "report.json").read_text())
    jsonschema.validate(data, report_schema())
    assert data["schema_version"] == SCHEMA_VERSION
    md = (out / "report.md").read_text()
    assert md.startswith("# parity report") and "PASS" in md
    for png in ("drift_hist.png", "log_s_bias.png"):
        assert (out / png).stat().st_size > 1000
    broken = dict(data)
    broken.pop("passed")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, report_schema())


def test_report_carries_the_rl_view(report) -> None:
    """Each framework's mismatch metric and each IS correction, per scenario and trainer, in both files."""
    from parity.core.rl_catalogue import METHODS, METRICS

    out = report["_out"]
    data = json.loads((out / "report.json").read_text())
    md = (out / "details.md").read_text()
    assert len((out / "report.md").read_text().splitlines()) <= 300
    assert [m["name"] for m in data["rl_view"]["metrics"]] == [m.name for m in METRICS]
    assert [m["name"] for m in data["rl_view"]["methods"]] == [m.name for m in METHODS]
    assert "## RL view: framework mismatch metrics and IS corrections" in md and "Assumption: " in md
    assert (out / "rl_methods.png").stat().st_size > 1000
    assert report["passed"]  # the gates held: replay and recompute are within 1e-5 nats per token
    gspo = "GSPO [1-3e-4, 1+4e-4]"
    for s in data["scenarios"]:
        rl = s["rl_view"]
        assert {"naive", "replay", "recompute"} <= set(rl), s["name"]
        assert f"### {s['name']}" in md
        # 1e-5 per token is far inside every drop band (the narrowest, GSPO's, is 3e-4 on the
        # geometric mean): after the fix no method masks, drops or vetoes anything.
        for trainer in ("replay", "recompute"):
            for m in METHODS:
                if m.action in ("mask", "drop", "veto"):
                    assert all(r["affected"] == 0 for r in rl[trainer]["methods"][m.name].values()), (s["name"], trainer, m.name)
        if s["log_s"]["mean"] < -1e-3:
            # Naive δ is log S: some sequence's mean is below -1e-3, so its geometric ratio is below
            # 1 - 3e-4 and GSPO drops it for negative advantages; the headline says so.
            assert rl["naive"]["methods"][gspo]["-"]["affected"] >= 1, s["name"]
            assert f"- Under {s['name']} with the naive trainer, GSPO" in md


def test_same_inputs_give_identical_report(pool, tmp_path) -> None:
    m = Matrix("two", (Scenario("top_p", SamplingSpec(0.8, 0, 0.9, 0.0), prompts=3, max_tokens=6),
                       Scenario("top_k", SamplingSpec(1.2, 7, 1.0, 0.05), prompts=3, max_tokens=6)))
    texts = []
    for i in range(2):
        run(RunConfig(model=MODEL, matrix=m, out=tmp_path / str(i), plots=False), progress=lambda s: None, pool=pool)
        data = json.loads((tmp_path / str(i) / "report.json").read_text())
        data.pop("timings")
        texts.append(json.dumps(data, sort_keys=True))
    assert texts[0] == texts[1]


@pytest.mark.parametrize(
    ("fault", "gate"),
    [
        (TrainerFaults(perturb_logits=0.05), "replay_drift"),
        (TrainerFaults(forget_temperature=True), "replay_drift"),
        (TrainerFaults(swap_token=True), "token_mismatch"),
        (TrainerFaults(drop_kept=True), "replay_support"),
        (TrainerFaults(shift_bounds=4.0), "replay_drift"),
        (TrainerFaults(shift_bounds=4.0), "naive_vs_sampler_log_s"),
    ],
    ids=["perturb-logits", "forget-temperature", "swap-token", "drop-kept", "4-bounds-replay", "4-bounds-naive"],
)
def test_planted_faults_fail_the_gates(pool, fault, gate) -> None:
    cfg = RunConfig(model=MODEL, faults=fault)
    rollout, trainer = pool.get(MODEL, cfg, lambda s: None)
    raw = pool.raw(MODEL, cfg, lambda s: None)
    sc = Scenario("planted", SamplingSpec(temperature=0.7, top_k=20, top_p=0.9), prompts=4, max_tokens=8)
    res = score_scenario(rollout, trainer, sc, cfg, raw)
    assert gate in {v.gate for v in res.verdict.violations}, [str(v) for v in res.verdict.violations]
    clean = score_scenario(rollout, trainer, sc, RunConfig(model=MODEL), raw)
    assert clean.verdict.violations == []


def test_a_fault_at_a_tenth_of_the_bound_passes_on_the_real_engine(pool) -> None:
    cfg = RunConfig(model=MODEL, faults=TrainerFaults(shift_bounds=0.1))
    rollout, trainer = pool.get(MODEL, cfg, lambda s: None)
    sc = Scenario("tenth", SamplingSpec(temperature=0.7, top_k=20, top_p=0.9), prompts=4, max_tokens=8)
    res = score_scenario(rollout, trainer, sc, cfg, pool.raw(MODEL, cfg, lambda s: None))
    assert res.verdict.violations == [], [str(v) for v in res.verdict.violations]


def test_mismatched_tokenizer_is_an_error_before_comparison(pool, tmp_path) -> None:
    from parity.engines.transformers_trainer import TransformersTrainer
    from parity.fixtures import resolve_model

    src = resolve_model(MODEL)
    dst = tmp_path / "swapped"
    shutil.copytree(src, dst)
    from parity.engines.session import SAMPLE_TEXT

    tok = json.loads((dst / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    rollout, trainer0 = pool.get(MODEL, RunConfig(model=MODEL), lambda s: None)
    used = list(dict.fromkeys(trainer0.tokenizer().encode(SAMPLE_TEXT, add_special_tokens=False)))
    by_id = {v: k for k, v in vocab.items()}
    a, b = by_id[used[0]], by_id[used[1]]  # two tokens the check's sample text really uses
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    trainer = TransformersTrainer(dst)
    with pytest.raises(ValueError, match="tokenizer/vocabulary mismatch"):
        check_same_vocabulary(rollout, trainer)


def test_cli_errors_are_one_readable_line(capsys, tmp_path) -> None:
    from parity.cli.main import main

    assert main(["run", "--model", str(tmp_path / "nope"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "error" in err
    bad = tmp_path / "m.toml"
    bad.write_text('[[scenario]]\nname = "x"\ntop_p = 1.5\n')
    assert main(["run", "--model", MODEL, "--matrix", str(bad)]) == 2
    assert "top_p=1.5" in capsys.readouterr().err
    assert main(["run", "--gate", "replay_max_abs_diff"]) == 2
    assert "NAME=VALUE" in capsys.readouterr().err
    assert main(["run", "--gate", "replay_max_abs_diff=1e-5"]) == 2
    err = capsys.readouterr().err
    assert "unknown threshold(s) ['replay_max_abs_diff']" in err and "max_headroom" in err


def test_strict_thresholds_fail_and_name_the_token(pool) -> None:
    """Float32 drift between the engines is real (~1e-6): a zero headroom must catch it."""
    cfg = RunConfig(model=MODEL, thresholds=Thresholds(max_headroom=0.0))
    rollout, trainer = pool.get(MODEL, cfg, lambda s: None)
    res = score_scenario(rollout, trainer, Scenario("strict", SamplingSpec(1.0, 0, 0.9, 0.0), prompts=4, max_tokens=8), cfg)
    v = next(v for v in res.verdict.violations if v.gate == "replay_drift")
    assert v.worst and v.worst[0].values["vllm"] != v.worst[0].values["trainer_replay"]
    line = v.message()
    assert "prompt " in line and "position " in line and "token " in line and "gap=" in line and "bound=" in line
