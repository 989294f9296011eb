"""A run's own logs on the real checkpoint (smollm2-135m, V = 49,152), judged without the model.

The test is its own sampler and trainer: vLLM's ``LLM`` (processed log-probs, as RL frameworks request
them) samples, transformers scores in float32, and pyarrow writes the README's minimal columns. Nothing
of parity writes or scores these records; ``parity analyze`` only judges them.

* bfloat16 vLLM at T=1, top_p=0.9 (TRL's recipe), 16 prompts x 48 tokens: the full-vocabulary trainer
  (the seed bug) fails ``logprob_mean_bias``, named a full-vocabulary (log S) trainer; the recompute fix
  (the trainer's own nucleus with the sampled token forced in) passes.
* float32 vLLM at T=0.7, top_k=20 with the sampler's top-20 kept set in the records: the full-vocabulary
  trainer fails (it used to exit 0, its bias never judged).
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from parity.cli.main import main

pytestmark = pytest.mark.e2e

PROMPTS = [
    "The capital of France is", "Once upon a time, a small robot", "The best way to learn to cook is",
    "In 1969, astronauts", "My favourite season is autumn because", "To solve a quadratic equation, first",
    "The river wound through the valley and", "A good night's sleep helps", "The recipe calls for two cups of",
    "Scientists recently discovered that", "The old library at the end of the street", "When the train finally arrived,",
    "Photosynthesis is the process by which", "The football match ended with", "If you want to start running,",
    "The museum's newest exhibit shows",
]


def sample(model_dir: Path, dtype: str, *, temperature: float, top_p: float, top_k: int, prompts: int, tokens: int,
           kept: int = 0) -> list[dict]:
    """vLLM's own LLM: tokens, processed log-prob of each, and (``kept`` > 0) the top-``kept`` processed head."""
    from parity.engines.vllm_offline import configure_cpu_env

    configure_cpu_env()
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir), dtype=dtype, seed=0, logprobs_mode="processed_logprobs", max_logprobs=max(kept, 1),
              max_model_len=256, enforce_eager=True, enable_prefix_caching=False)
    try:
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=tokens, min_tokens=tokens,
                                logprobs=kept, seed=1)
        outs = llm.generate(PROMPTS[:prompts], params, use_tqdm=False)
        rows = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            row = {"prompt_ids": list(o.prompt_token_ids), "completion_ids": ids,
                   "sampler_logprobs": [float(lp[t].logprob) for lp, t in zip(c.logprobs, ids, strict=True)]}
            if kept:
                row["kept"] = [sorted(lp, key=lambda t: lp[t].rank)[:kept] for lp in c.logprobs]
                row["kept_logprobs"] = [[float(lp[t].logprob) for t in k] for lp, k in zip(c.logprobs, row["kept"],
                                                                                        strict=True)]
            rows.append(row)
        return rows
    finally:
        del llm
        gc.collect()


def score(model, rows: list[dict], *, temperature: float, top_p: float) -> None:
    """float32 transformers: the full-vocabulary log-prob and the recompute fix (own nucleus, sampled token in)."""
    for r in rows:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r["prompt_ids"]) - 1 : -1].double() / temperature
        y = torch.tensor(r["completion_ids"])
        full = torch.log_softmax(logits, -1)
        r["full"] = full.gather(1, y[:, None]).squeeze(1).tolist()
        p = full.exp()
        sp, order = p.sort(-1, descending=True)
        before = sp.cumsum(-1) - sp
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(1, order, before < top_p)
        keep[torch.arange(len(y)), y] = True
        masked = logits.masked_fill(~keep, float("-inf"))
        r["recompute"] = torch.log_softmax(masked, -1).gather(1, y[:, None]).squeeze(1).tolist()


def write(path: Path, rows: list[dict], trainer: str, spec: dict, meta: dict, *, kept: bool = False) -> Path:
    out = []
    for r in rows:
        row = {"schema_version": 1, "prompt_ids": r["prompt_ids"], "completion_ids": r["completion_ids"], **spec,
               "sampler_logprobs": r["sampler_logprobs"], "trainer_logprobs": r[trainer]}
        if kept:
            row["kept_ids"] = [t for k in r["kept"] for t in k]
            row["kept_offsets"] = [0, *torch.tensor([len(k) for k in r["kept"]]).cumsum(0).tolist()]
            row["kept_logprobs"] = [v for k in r["kept_logprobs"] for v in k]
        out.append(row)
    table = pa.Table.from_pylist(out).replace_schema_metadata({"parity.records": json.dumps({"schema_version": 1, **meta})})
    pq.write_table(table, path)
    return path


def analyse(path: Path, out: Path, capsys) -> tuple[int, dict, str]:
    code = main(["analyze", str(path), "--out", str(out), "--no-plots"])
    text = capsys.readouterr().out
    (sc,) = json.loads((out / "report.json").read_text())["scenarios"]
    print(text)
    return code, sc, text


@pytest.fixture(scope="module")
def trainer(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def top_p_rows(smollm2_dir, trainer):
    rows = sample(smollm2_dir, "bfloat16", temperature=1.0, top_p=0.9, top_k=0, prompts=16, tokens=48)
    score(trainer, rows, temperature=1.0, top_p=0.9)
    return rows


TOP_P = {"temperature": 1.0, "top_k": 0, "top_p": 0.9, "min_p": 0.0}
META = {"dtype": "bfloat16", "trainer_dtype": "float32", "vocab_size": 49152}


def test_the_seed_bug_in_a_bf16_top_p_run_fails_named(top_p_rows, tmp_path, capsys) -> None:
    code, sc, text = analyse(write(tmp_path / "full.parquet", top_p_rows, "full", TOP_P, META), tmp_path / "o", capsys)
    m = sc["mean_bias"]["logprob"]
    assert code == 1 and [v["gate"] for v in sc["violations"]] == ["logprob_mean_bias"], text
    assert "a full-vocabulary (log S) trainer" in sc["violations"][0]["message"]
    assert m["negative_frac"] > 0.9 and m["mean"] < -3 * m["limit"] and m["tokens"] == 16 * 48


def test_the_recompute_fix_passes(top_p_rows, tmp_path, capsys) -> None:
    code, sc, text = analyse(write(tmp_path / "fix.parquet", top_p_rows, "recompute", TOP_P, META), tmp_path / "o", capsys)
    m = sc["mean_bias"]["logprob"]
    assert code == 0 and sc["verdict"] == "pass", text
    # Its plain mean difference is negative (-KL), its bias estimate within the resolution.
    assert m["mean_diff"] < 0 and abs(m["mean"]) <= m["limit"]


def test_the_seed_bug_with_a_top20_kept_set_fails(smollm2_dir, trainer, tmp_path, capsys) -> None:
    spec = {"temperature": 0.7, "top_k": 20, "top_p": 1.0, "min_p": 0.0}
    rows = sample(smollm2_dir, "float32", temperature=0.7, top_p=1.0, top_k=20, prompts=8, tokens=24, kept=20)
    score(trainer, rows, temperature=0.7, top_p=1.0)
    meta = {"dtype": "float32", "trainer_dtype": "float32"}
    code, sc, text = analyse(write(tmp_path / "k.parquet", rows, "full", spec, meta, kept=True), tmp_path / "o", capsys)
    assert code == 1 and "logprob_mean_bias" in [v["gate"] for v in sc["violations"]], text
    assert sc["captured_positions"] == 8 * 24 and sc["mean_bias"]["logprob"]["sampler_support"] == 20
