"""The mean-bias gate of two log-prob columns (``logprob_mean_bias``) and ``trainer_support``, on records
written the way a training run writes them: pyarrow, the README's minimal columns, no parity writer.

The sampler is simulated from its definition: logits (rounded to bfloat16 for a bfloat16 sampler), the
spec's filter, renormalisation over the kept set, a token drawn from it. A correct trainer scores the
same token over the same kept set from float32 logits; the seed bug scores it over the whole vocabulary.
Each gate gets its planted fault near its threshold: a per-token bias at 3x the resolution the report
states fails, at 0.3x passes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from parity.analyze import analyze
from parity.cli.main import main
from parity.core.error_model import MIN_SEQUENCES_FOR_SE, WIDEST_VOCAB

V = 512
SPECS = {
    "top_k": {"temperature": 1.0, "top_k": 20, "top_p": 1.0, "min_p": 0.0},
    "top_p": {"temperature": 1.0, "top_k": 0, "top_p": 0.9, "min_p": 0.0},
    "min_p": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.05},
    "unfiltered": {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
}
README = Path(__file__).resolve().parents[2] / "README.md"


def kept_mask(p: np.ndarray, spec: dict) -> np.ndarray:
    """The spec's kept set per row of probabilities ``p`` [L, V] (top_k, then top_p, then min_p)."""
    keep = np.ones_like(p, dtype=bool)
    if spec["top_k"] > 0:
        kth = np.sort(p, axis=1)[:, -spec["top_k"]][:, None]
        keep &= p >= kth
    if spec["top_p"] < 1.0:
        q = np.where(keep, p, 0.0)
        q = q / q.sum(1, keepdims=True)
        order = np.argsort(-q, axis=1)
        cum = np.cumsum(np.take_along_axis(q, order, 1), axis=1)
        first_over = (cum < spec["top_p"]).sum(1)  # the nucleus: the smallest prefix reaching top_p
        ranks = np.empty_like(order)
        np.put_along_axis(ranks, order, np.arange(p.shape[1])[None, :].repeat(p.shape[0], 0), 1)
        keep &= ranks <= first_over[:, None]
    if spec["min_p"] > 0:
        keep &= p >= spec["min_p"] * p.max(1, keepdims=True)
    return keep


def simulate(seed: int, spec: dict, *, dtype: str = "float32", seqs: int = 24, length: int = 32, scale: float = 3.0,
             trainer_noise: float = 1e-6) -> list[dict]:
    """Per sequence: tokens, the sampler's processed log-probs, a correct trainer's and the full-vocabulary one's."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(seqs):
        z = rng.normal(0.0, scale, size=(length, V)).astype(np.float32)
        zs = torch.from_numpy(z).to(torch.bfloat16).float().numpy() if dtype == "bfloat16" else z
        ps = np.exp(zs - zs.max(1, keepdims=True)).astype(np.float64)
        ps /= ps.sum(1, keepdims=True)
        keep = kept_mask(ps, spec)
        q = np.where(keep, ps, 0.0)
        q /= q.sum(1, keepdims=True)
        y = np.array([rng.choice(V, p=row) for row in q])
        t = np.arange(length)
        zt = z.astype(np.float64) + rng.normal(0.0, trainer_noise, size=z.shape) * np.abs(z)
        full = zt - np.log(np.exp(zt).sum(1, keepdims=True))
        over_kept = np.log(np.where(keep, np.exp(full), 0.0).sum(1))
        out.append({"completion_ids": y.tolist(), "sampler": np.log(q[t, y]).astype(np.float32),
                    "replay": full[t, y] - over_kept, "full": full[t, y]})
    return out


def write(path: Path, seqs: list[dict], spec: dict, trainer: str | None = "replay", *, bias: float = 0.0,
          meta: dict | None = None, edit=None) -> Path:
    """The README's minimal columns, written by pyarrow from Python lists."""
    rows = []
    # A bias > 0 lowers the sampler's side instead, so no log-prob passes 0; the float64 trainer column takes
    # back the float32 rounding of that shift, so trainer - sampler moves by the bias exactly.
    up = max(bias, 0.0)
    for s in seqs:
        sampler = (s["sampler"].astype(np.float64) - up).astype(np.float32)
        r = {"schema_version": 1, "prompt_ids": [1, 2, 3], "completion_ids": s["completion_ids"], **spec,
             "sampler_logprobs": sampler.tolist()}
        if trainer is not None:
            back = bias - (s["sampler"].astype(np.float64) - sampler.astype(np.float64))
            r["trainer_logprobs"] = (s[trainer] + back).tolist()
        rows.append(r)
    if edit is not None:
        edit(rows)
    md = {"schema_version": 1, "dtype": "float32", "trainer_dtype": "float32", "vocab_size": V, **(meta or {})}
    pq.write_table(pa.Table.from_pylist(rows).replace_schema_metadata({"parity.records": json.dumps(md)}), path)
    return path


def judged(path: Path) -> tuple[dict, dict, list[str]]:
    (sc,) = analyze(path, plots=False)["scenarios"]
    return sc, sc["mean_bias"]["logprob"], [v["gate"] for v in sc["violations"]]


@settings(max_examples=16, deadline=None, derandomize=True)
@given(dtype=st.sampled_from(["float32", "bfloat16"]), kind=st.sampled_from(sorted(SPECS)),
       seed=st.integers(0, 2**31 - 1), sign=st.sampled_from([-1.0, 1.0]))
def test_a_planted_bias_fails_at_3x_the_resolution_and_passes_at_a_third(tmp_path_factory, dtype, kind, seed, sign):
    tmp = tmp_path_factory.mktemp("planted")
    spec, meta = SPECS[kind], {"dtype": dtype}
    seqs = simulate(seed, spec, dtype=dtype)
    sc, honest, failed = judged(write(tmp / "honest.parquet", seqs, spec, meta=meta))
    assert failed == [] and sc["verdict"] == "pass", sc["violations"]
    resolution = honest["limit"]
    assert 0 < honest["systematic"] < resolution and honest["standard_error_from"].startswith("between 24 sequences")
    _, big, failed = judged(write(tmp / "big.parquet", seqs, spec, bias=3 * sign * resolution, meta=meta))
    assert "logprob_mean_bias" in failed and abs(big["mean"] - honest["mean"] - 3 * sign * resolution) < 1e-9
    _, small, failed = judged(write(tmp / "small.parquet", seqs, spec, bias=0.3 * sign * resolution, meta=meta))
    assert failed == [], small


@pytest.mark.parametrize("kind", ["top_k", "top_p", "min_p"])
def test_the_seed_bug_fails_and_is_named_a_full_vocabulary_trainer(tmp_path, kind) -> None:
    spec = SPECS[kind]
    sc, m, failed = judged(write(tmp_path / "full.parquet", simulate(1, spec, dtype="bfloat16"), spec,
                                 trainer="full", meta={"dtype": "bfloat16"}))
    assert failed == ["logprob_mean_bias"] and m["negative_frac"] > 0.9
    (v,) = sc["violations"]
    assert "a full-vocabulary (log S) trainer" in v["message"] and f"resolution {m['limit']:.3g}" in v["message"]
    assert sc["trainer_under_test"]["diagnosis"].startswith("a full-vocabulary (log S) trainer")
    lo, hi = m["log_s_range"]
    assert lo - m["limit"] <= m["mean"] < -m["limit"] and hi == 0.0


def test_a_noisy_correct_trainer_passes_with_its_mean_at_minus_kl(tmp_path) -> None:
    """Logit noise of 0.3 nats: the plain mean of trainer - sampler sits at -KL (about -Var/2), far outside
    four standard errors of 0, while the log of the mean IS ratio sits at 0."""
    spec = SPECS["top_p"]
    seqs = simulate(2, spec, trainer_noise=0.1, seqs=32)
    sc, m, failed = judged(write(tmp_path / "noisy.parquet", seqs, spec))
    assert failed == [], sc["violations"]
    se_mean_diff = m["spread_sd"] / np.sqrt(m["effective_n"])
    assert m["mean_diff"] < -4 * se_mean_diff
    d = np.concatenate([s["replay"] - s["sampler"] for s in seqs])
    assert m["kl_estimate"] == pytest.approx(-d.mean() + np.log(np.exp(d).mean()), rel=1e-6)
    assert 0.5 * d.var() * 0.7 < m["kl_estimate"] < 0.5 * d.var() * 1.3


def test_a_sampled_token_outside_the_trainers_support_fails_naming_it(tmp_path) -> None:
    spec = SPECS["top_k"]

    def minus_inf(rows: list[dict]) -> None:
        rows[3]["trainer_logprobs"][5] = float("-inf")

    sc, m, failed = judged(write(tmp_path / "inf.parquet", simulate(3, spec), spec, edit=minus_inf))
    assert failed == ["trainer_support"] and m["outside_support"] == 1 and m["tokens"] == 24 * 32 - 1
    (v,) = sc["violations"]
    assert "sampled token outside the trainer's support: 1 tokens" in v["message"]
    assert (v["worst"][0]["prompt"], v["worst"][0]["position"]) == (3, 5)


def test_unstated_facts_take_the_widest_value_and_few_sequences_count_once(tmp_path) -> None:
    spec = SPECS["top_p"]
    seqs = simulate(4, spec)
    _, stated, _ = judged(write(tmp_path / "stated.parquet", seqs, spec))
    _, unstated, _ = judged(write(tmp_path / "unstated.parquet", seqs, spec,
                                  meta={"vocab_size": None, "dtype": None, "trainer_dtype": None}))
    assert stated["assumed"] == [] and stated["trainer_support"] == V
    assert unstated["trainer_support"] == WIDEST_VOCAB and unstated["systematic"] > stated["systematic"]
    assert any("vocab_size not stated" in a for a in unstated["assumed"])
    assert sum("dtype not stated" in a for a in unstated["assumed"]) == 2
    few = MIN_SEQUENCES_FOR_SE - 1
    _, m, _ = judged(write(tmp_path / "few.parquet", seqs[:few], spec))
    assert m["standard_error_from"].startswith(f"effective n = {few}") and m["effective_n"] == pytest.approx(few)


def test_merged_shards_give_the_one_files_numbers(tmp_path) -> None:
    spec = SPECS["top_k"]
    seqs = simulate(5, spec)
    _, one, _ = judged(write(tmp_path / "one.parquet", seqs, spec))
    (tmp_path / "shards").mkdir()
    write(tmp_path / "shards" / "a.parquet", seqs[:10], spec)
    write(tmp_path / "shards" / "b.parquet", seqs[10:], spec)
    _, two, _ = judged(tmp_path / "shards")
    for k in ("mean", "limit", "systematic", "mean_diff", "spread_sd"):
        assert two[k] == pytest.approx(one[k], rel=1e-9), k
    assert (two["tokens"], two["sequences"]) == (one["tokens"], one["sequences"])


def test_sampler_logprobs_alone_are_no_verdict_naming_the_column(tmp_path, capsys) -> None:
    spec = SPECS["top_p"]
    path = write(tmp_path / "sampler.parquet", simulate(6, spec), spec, trainer=None)
    assert main(["analyze", str(path), "--out", str(tmp_path / "out"), "--no-plots"]) == 4
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.startswith("NO VERDICT")]
    assert "no gate could be evaluated" in line and "the records lack trainer_logprobs" in line
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["verdict"] == "none" and not report["passed"] and report["scenarios"][0]["verdict"] == "none"
    assert "**NO VERDICT**" in (tmp_path / "out" / "report.md").read_text()
    # --accept-partial has nothing to accept where no gate judged anything.
    assert main(["analyze", str(path), "--out", str(tmp_path / "out2"), "--no-plots", "--accept-partial"]) == 4


def test_accept_partial_takes_the_support_gates_without_a_mean_gate(tmp_path, capsys) -> None:
    import records_synth

    path = records_synth.write_file(tmp_path / "r.parquet", 512, k=8, vocab=512, length=32)
    t = pq.read_table(path).drop_columns(["trainer_logprobs"])
    pq.write_table(t, path)
    assert main(["analyze", str(path), "--out", str(tmp_path / "a"), "--no-plots"]) == 4
    assert "NO VERDICT no mean-bias gate could be evaluated" in capsys.readouterr().out
    assert main(["analyze", str(path), "--out", str(tmp_path / "b"), "--no-plots", "--accept-partial"]) == 0
    assert "PARTIAL no mean-bias gate could be evaluated" in capsys.readouterr().out


def readme_code() -> str:
    text = README.read_text()
    block = re.search(r"<!-- judge-logs:start -->\n```python\n(.*?)```\n<!-- judge-logs:end -->", text, re.S)
    assert block, "README's judge-your-run's-logs code block"
    return block.group(1)


@pytest.mark.parametrize("trainer", ["replay", "full"])
def test_the_readme_verl_lines_write_records_parity_judges(tmp_path, trainer) -> None:
    """verl's key names (rollout_log_probs, old_log_probs, response_mask, responses) on right-padded
    tensors, as its DataProto batch holds them after compute_log_prob; the README's lines write them."""
    spec = SPECS["top_p"]
    seqs = simulate(7, spec, dtype="bfloat16")
    pad = 4
    n, width = len(seqs), len(seqs[0]["completion_ids"]) + pad
    batch = {"responses": torch.zeros(n, width, dtype=torch.long), "response_mask": torch.zeros(n, width),
             "rollout_log_probs": torch.zeros(n, width), "old_log_probs": torch.zeros(n, width)}
    for i, s in enumerate(seqs):
        m = len(s["completion_ids"]) - (i % 3)  # sequences of different lengths
        batch["responses"][i, :m] = torch.tensor(s["completion_ids"][:m])
        batch["response_mask"][i, :m] = 1
        batch["rollout_log_probs"][i, :m] = torch.from_numpy(s["sampler"][:m])
        batch["old_log_probs"][i, :m] = torch.from_numpy(s[trainer][:m]).float()
    ns: dict = {}
    exec(readme_code(), ns)  # noqa: S102 - the README's own lines
    ns["spec"].update(spec)
    ns["log_verl"](batch, 7)
    ns["write"](str(tmp_path / "verl.parquet"), {"schema_version": 1, "dtype": "bfloat16", "trainer_dtype": "float32",
                                                  "vocab_size": V})
    sc, m, failed = judged(tmp_path / "verl.parquet")
    assert m["tokens"] == sum(len(s["completion_ids"]) - (i % 3) for i, s in enumerate(seqs))
    assert failed == ([] if trainer == "replay" else ["logprob_mean_bias"]), sc["violations"]
    assert sc["verdict"] == ("pass" if trainer == "replay" else "fail")


def test_the_sign_test_fails_a_one_signed_shift_only() -> None:
    from parity.core.error_model import MEAN_BIAS_Z, NEARLY_ALL_NEGATIVE, sign_test

    def at(share: float, beyond: int = 400, *, tokens: int = 400, effective_n: float = 400.0, sd: float = 0.05) -> dict:
        neg = round(share * beyond)
        return sign_test(tokens=tokens, effective_n=effective_n, d_sum=0.0, d_sq=tokens * sd * sd, negative=neg,
                         positive=beyond - neg)

    honest = at(0.5)
    assert 0.5 < honest["honest_share"] < 0.51 and not honest["failed"]  # Phi(sd / 2): the -KL shift's share
    assert at(1.0)["failed"] and at(1.0)["z"] > 3 * MEAN_BIAS_Z
    assert not at(NEARLY_ALL_NEGATIVE - 0.01)["failed"]  # far above the honest share, but not nearly all
    # Correlated tokens: the design effect of the mean part widens the share's standard error.
    tight, loose = at(0.95), at(0.95, effective_n=8.0)
    assert tight["failed"] and not loose["failed"] and loose["z"] < tight["z"] / 5
    assert not at(1.0, beyond=0)["failed"]  # nothing beyond the allowance: a shift within rounding


@pytest.mark.parametrize(("factor", "fails"), [(3.0, True), (0.3, False)])
def test_a_constant_shift_at_float32_fails_at_3x_the_per_token_allowance_and_passes_at_a_third(tmp_path, factor, fails):
    from parity.core.error_model import stated_facts

    spec = SPECS["unfiltered"]
    seqs = simulate(8, spec, trainer_noise=1e-9)
    allowance = stated_facts(V, "float32", "float32", 0)["allowance"]
    sc, m, failed = judged(write(tmp_path / "shift.parquet", seqs, spec, bias=-factor * allowance))
    assert failed == (["logprob_mean_bias"] if fails else []), sc["violations"]
    assert m["sign_test"]["beyond_allowance"] == (m["tokens"] if fails else 0)
