"""The power of a mean-bias verdict (parity.core.power): a PASS only where the gate could have failed the bias it
exists to catch (|log S|); else no verdict, naming the tokens that would resolve it.

The case it reproduces: a full-vocabulary trainer 0.016 nats off (log S at T=0.7 top_k=50 on SmolLM2-135M) over
64 tokens, judged with a resolution of 0.042, printed PASS. Records written by hand: the trainer's log-probs
are the sampler's plus log S plus a drift of spread 0.06 nats, with the trainer-side log S and a small bound.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from parity.analyze import analyze
from parity.cli.main import main
from parity.core.power import about, power_of, power_sentence, tokens_needed
from parity.records.write import write_records

LOG_S, SPREAD = -0.016, 0.06
SPEC = {"temperature": 0.7, "top_k": 50, "top_p": 1.0, "min_p": 0.0}


def rows(seqs: int, length: int = 16, *, bias: float = LOG_S, seed: int = 0, spec: dict = SPEC) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(seqs):
        sampler = -rng.uniform(0.5, 3.0, size=length)
        drift = rng.normal(0.0, SPREAD, size=length)
        out.append({"prompt_ids": [1, 2, i + 3], "completion_ids": rng.integers(0, 400, size=length).tolist(), **spec,
                    "sampler_logprobs": sampler.tolist(), "trainer_logprobs": (sampler + bias + drift).tolist(),
                    "trainer_replay_logprobs": (sampler + drift).tolist(), "trainer_log_s": [LOG_S if spec["top_k"] else 0.0] * length,
                    "trainer_bound": [1.0] * length, "trainer_systematic": [1e-3] * length})
    return out


def judged(tmp_path, name: str, seqs: int, **kw) -> dict:
    path = write_records(tmp_path / f"{name}.parquet", rows(seqs, **kw),
                         metadata={"dtype": "float32", "trainer_dtype": "float32", "vocab_size": 400})
    (sc,) = analyze(path, plots=False)["scenarios"]
    return sc


@given(c=st.floats(1e-4, 1.0), sys_frac=st.floats(0.0, 0.99), stat=st.floats(1e-6, 10.0), n=st.integers(1, 10**6))
def test_the_tokens_needed_are_the_fewest_that_resolve_the_class_bias(c, sys_frac, stat, n) -> None:
    sys_part = sys_frac * c
    need = tokens_needed(c, sys_part, stat, n)
    assert need is not None and need >= n

    def res(m: int) -> float:
        return sys_part + stat * math.sqrt(n / m)

    assert res(need) < c
    assert need == n or res(need - 1 - (need >> 30)) >= c * (1 - 1e-9)  # the fewest, to float rounding


def test_no_count_of_tokens_resolves_a_systematic_part_at_the_class_bias() -> None:
    assert tokens_needed(0.016, 0.0163, 0.03, 64) is None
    p = power_of("trainer_under_test_mean_bias", 0.0164, 0.0466, 0.0165, 1.0, 64)
    assert not p.resolved and "no count of tokens would resolve it" in power_sentence(p, "s")


def test_the_reported_case_is_no_verdict_naming_the_tokens_that_would_resolve_it(tmp_path, capsys) -> None:
    sc = judged(tmp_path, "full", 4)
    mb = sc["mean_bias"]["trainer_under_test"]
    # The case as it was: the gate passes (the bias lies within its resolution), which once printed PASS.
    assert sc["violations"] == [] and abs(mb["mean"]) < mb["limit"] and mb["limit"] > abs(LOG_S)
    p = sc["power"]
    assert sc["verdict"] == "none" and p["resolved"] is False and p["class_bias"] == pytest.approx(-LOG_S)
    assert p["tokens_needed"] > 64
    more = p["tokens_needed"] - p["tokens"]
    assert (f"bias -0.016 below resolution {p['resolution']:.3g}" in sc["no_verdict"]
            and f"about {about(more)} more tokens would resolve it" in sc["no_verdict"]), sc["no_verdict"]
    assert main(["analyze", str(tmp_path / "full.parquet"), "--out", str(tmp_path / "out"), "--no-plots"]) == 4
    out = capsys.readouterr().out
    assert "NO VERDICT" in out and "more tokens would resolve it" in out and "\nPASS" not in out


def test_with_the_tokens_it_named_the_full_vocabulary_trainer_fails_and_a_correct_one_passes(tmp_path) -> None:
    first = judged(tmp_path, "few", 4)["power"]
    seqs = math.ceil(first["tokens_needed"] * 1.5 / 16)
    sc = judged(tmp_path, "full", seqs)
    assert sc["power"]["resolved"] and sc["verdict"] == "fail"
    assert "trainer_under_test_mean_bias" in [v["gate"] for v in sc["violations"]]
    ok = judged(tmp_path, "replay", seqs, bias=0.0)
    assert ok["verdict"] == "pass" and ok["power"]["resolved"], ok["violations"]


def test_an_unfiltered_scenario_has_no_class_bias_to_resolve(tmp_path) -> None:
    sc = judged(tmp_path, "t1", 4, bias=0.0, spec={"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0})
    assert sc["verdict"] == "pass" and sc.get("power") is None


@pytest.mark.parametrize(("log_s", "has_power_check"), [(-1e-12, False), (-1.7e-17, False), (-1e-3, True)])
def test_a_filter_that_removed_less_than_float32_resolves_has_no_bias_to_resolve(tmp_path, log_s, has_power_check) -> None:
    """top_k >= V (log S a rounding -1.7e-17) or a 1e-12 tail of a peaked row: a full-vocabulary trainer computes the
    same float32 numbers as the exact one, so the scenario is judged as unfiltered; a log S of 1e-3 is not."""
    data = [{**r, "trainer_log_s": [log_s] * 16, "trainer_logprobs": r["trainer_replay_logprobs"]} for r in rows(4)]
    path = write_records(tmp_path / "tiny.parquet", data,
                         metadata={"dtype": "float32", "trainer_dtype": "float32", "vocab_size": 400})
    (sc,) = analyze(path, plots=False)["scenarios"]
    assert (sc.get("power") is not None) is has_power_check
    if not has_power_check:
        assert sc["verdict"] == "pass", sc["violations"]


def test_logs_without_log_s_say_their_power_was_not_assessed(tmp_path, capsys) -> None:
    """Two log-prob columns alone hold no log S: the gate's verdict stands, and the output says its power is
    unknown and what would give it."""
    data = [{k: v for k, v in r.items() if k in ("prompt_ids", "completion_ids", "temperature", "top_k", "top_p",
                                                  "min_p", "sampler_logprobs", "trainer_logprobs")} for r in rows(4)]
    path = write_records(tmp_path / "logs.parquet", data, metadata={"dtype": "float32", "trainer_dtype": "float32"})
    (sc,) = analyze(path, plots=False)["scenarios"]
    assert sc["power"]["resolved"] is None and sc["power"]["class_bias"] is None and sc["power"]["gate"] == "logprob_mean_bias"
    main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"])
    out = capsys.readouterr().out
    assert "POWER NOT ASSESSED T=0.7 top_k=50: power not assessed: the records hold no log S" in out, out


def test_parity_run_samples_again_until_resolved_within_the_cap(monkeypatch) -> None:
    """The resampling loop of parity run (:func:`parity.run.score_with_power`), its scoring replaced by the
    resolution the error model gives at each prompt count (spread 0.06, systematic 0.004, log S -0.016)."""
    from types import SimpleNamespace

    import parity.run as run_mod
    from parity.core.matrix import Scenario
    from parity.core.spec import SamplingSpec

    asked: list[int] = []

    def score(rollout, trainer, sc, cfg, raw):
        asked.append(sc.prompts)
        n = 16 * sc.prompts
        p = power_of("replay_mean_bias", 0.016, 0.004 + 4 * SPREAD / math.sqrt(n), 0.004, 1.0, n)
        verdict = "pass" if p.resolved else "none"
        return SimpleNamespace(verdict=SimpleNamespace(verdict=verdict, violations=[], entry={"power": p.to_json()}), seconds=1.0)

    monkeypatch.setattr(run_mod, "score_scenario", score)
    sc = Scenario("s", SamplingSpec(temperature=0.7, top_k=50), prompts=4, max_tokens=16)
    lines: list[str] = []
    res = run_mod.score_with_power(None, None, sc, run_mod.RunConfig(model="m"), None, lines.append)
    assert res.verdict.verdict == "pass" and asked[0] == 4 and len(asked) == 2 and 4 < asked[1] <= 64
    assert "sampling 's' again with" in lines[0] and res.seconds == 2.0
    asked.clear()
    res = run_mod.score_with_power(None, None, sc, run_mod.RunConfig(model="m", max_prompts=8), None, lines.append)
    assert res.verdict.verdict == "none" and asked == [4] and "above the cap of 8" in lines[-1]


PENALISED = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.1}


@pytest.mark.parametrize(("term", "resolved"), [(-0.016, False), (-0.5, True)])
def test_an_unfiltered_penalised_scenario_is_judged_against_the_penalty_term(tmp_path, capsys, term, resolved) -> None:
    """Unfiltered, so log S = 0; the penalty a trainer may leave out is the class bias (the records carry its
    term). A mean penalty term of 0.016 lies below this gate's resolution: no PASS; one of 0.5 is resolved."""
    data = [{**r, "trainer_log_s": [0.0] * 16, "trainer_logprobs": r["trainer_replay_logprobs"],
             "trainer_penalty_term": [term] * 16} for r in rows(4, spec=PENALISED)]
    path = write_records(tmp_path / "pen.parquet", data,
                         metadata={"dtype": "float32", "trainer_dtype": "float32", "vocab_size": 400})
    (sc,) = analyze(path, plots=False)["scenarios"]
    assert sc["power"]["class_bias"] == pytest.approx(abs(term)) and sc["power"]["resolved"] is resolved, sc["power"]
    assert sc["verdict"] == ("pass" if resolved else "none"), sc["no_verdict"]
    if not resolved:
        assert "could not have failed a full-vocabulary trainer that leaves the penalties out" in sc["no_verdict"]


@pytest.mark.parametrize("spec", [PENALISED, {**SPEC, "repetition_penalty": 1.1}], ids=["unfiltered", "top_k"])
def test_a_penalised_scenario_without_its_penalty_term_says_its_power_was_not_assessed(tmp_path, capsys, spec) -> None:
    """TRL's logs carry no trainer_penalty_term: a trainer that leaves the penalties out is off by log S minus that
    term, which may cancel log S or add to it, so |log S| alone does not measure the gate's power. The verdict stands
    and the output names the column that would assess it (with the term, the tests above resolve it)."""
    log_s = LOG_S if spec["top_k"] else 0.0
    data = [{**r, "trainer_log_s": [log_s] * 16, "trainer_logprobs": r["trainer_replay_logprobs"]} for r in rows(4, spec=spec)]
    path = write_records(tmp_path / "pen.parquet", data,
                         metadata={"dtype": "float32", "trainer_dtype": "float32", "vocab_size": 400})
    (sc,) = analyze(path, plots=False)["scenarios"]
    assert sc["power"] is not None and sc["power"]["resolved"] is None and sc["power"]["class_bias"] is None
    assert sc["verdict"] == "pass", sc["violations"]
    main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"])
    out = capsys.readouterr().out
    assert "power not assessed: the records hold no trainer_penalty_term on this penalised scenario" in out, out
