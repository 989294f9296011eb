"""parity budget end to end on the real vLLM CPU engine and transformers: cases whose largest cause is known by
construction, a planted fault against its noise, and the same shares from two runs with the same seeds."""

from __future__ import annotations

import json

import pytest
import torch

from parity.budget import BudgetConfig, SamplerCache, budget
from parity.core.matrix import Matrix, Scenario
from parity.core.spec import SamplingSpec
from parity.engines.session import EnginePool
from parity.report.budget_section import terminal

pytestmark = pytest.mark.e2e

MODEL = "qwen2-tiny"
TOP_P = Scenario("T=1 top_p=0.9", SamplingSpec(1.0, top_p=0.9), prompts=8, max_tokens=16)
PLAIN = Scenario("T=1 top_p=1", SamplingSpec(1.0), prompts=8, max_tokens=16)


@pytest.fixture(scope="module")
def engines():
    pool, samplers = EnginePool(), SamplerCache()
    yield pool, samplers
    samplers.close()
    pool.close()


def _budget(engines, tmp_path, sc: Scenario, **kw):
    pool, samplers = engines
    cfg = BudgetConfig(model=MODEL, matrix=Matrix("budget test", (sc,)), out=tmp_path, **kw)
    report = budget(cfg, progress=lambda s: None, pool=pool, samplers=samplers)
    (block,) = report["budget"]["scenarios"]
    report["_out"] = tmp_path
    return report, block


def _row(block, cause: str):
    return next(r for r in block["rows"] if r["cause"] == cause)


@pytest.fixture(scope="module")
def fp32_top_p(engines, tmp_path_factory):
    return _budget(engines, tmp_path_factory.mktemp("fp32"), TOP_P)


def test_fp32_top_p_truncation_is_the_largest_share_and_the_rest_is_within_its_bound(fp32_top_p) -> None:
    report, block = fp32_top_p
    assert block["largest_fixable"] == "truncation", block["fix_first"]
    assert _row(block, "truncation")["share"]["mean_abs_delta"] > 0.99
    assert _row(block, "sampler_precision")["status"] == "not_applicable"
    assert _row(block, "moe_routing")["reason"] == "dense model (no MoE router)"
    bound = block["remainder"]["bound"]
    assert bound is not None and bound["headroom"] <= 1.0, bound
    text = terminal(report["budget"])
    assert text.splitlines()[-1].startswith("fix first: truncation normalisation (") and text.endswith("replay)")


def test_the_report_holds_the_budget_and_its_waterfall(fp32_top_p) -> None:
    report, block = fp32_top_p
    out = report["_out"]
    written = json.loads((out / "report.json").read_text())
    assert written["budget"]["scenarios"][0]["fix_first"] == block["fix_first"]
    assert written["config"]["producer"] == "parity budget"
    md = (out / "report.md").read_text()
    assert "## Where the mismatch comes from (parity budget)" in md and f"**{block['fix_first']}**" in md
    if report.get("plots"):  # matplotlib (the report extra) installed
        assert "budget_T_1_top_p_0_9.png" in report["plots"] and (out / "budget_T_1_top_p_0_9.png").is_file()
        assert "(budget_T_1_top_p_0_9.png)" in md


def test_two_runs_with_the_same_seeds_give_the_same_shares(engines, tmp_path, fp32_top_p) -> None:
    _, again = _budget(engines, tmp_path, TOP_P)
    first = fp32_top_p[1]
    assert [(r["cause"], r["share"], r["noise"]) for r in again["rows"]] == \
        [(r["cause"], r["share"], r["noise"]) for r in first["rows"]]


@pytest.mark.slow
def test_bf16_sampler_at_top_p_1_sampler_precision_is_the_largest(engines, tmp_path) -> None:
    _, block = _budget(engines, tmp_path, PLAIN, dtype="bfloat16", trainer_dtype="float32")
    trunc = _row(block, "truncation")
    assert trunc["status"] == "not_applicable" and trunc["share"]["mean_abs_delta"] == 0.0
    assert block["largest_fixable"] == "sampler_precision", block["fix_first"]
    assert "at float32" in block["token_match"] and block["sequences"] >= 1


def left_pads_and_attends_to_padding(batch):
    """A trainer that left-pads its batch and passes no attention mask (and no position ids): each sequence attends
    to its padding, so its scores depend on what it is batched with. (Left padding without position ids alone
    shifts every position by the same amount, which rotary embeddings see only as rounding.)"""
    seqs = [batch.input_ids[i, : p + n] for i, (p, n) in enumerate(zip(batch.prompt_lengths, batch.completion_lengths, strict=True))]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = s
    with torch.no_grad():
        logits = batch.model(input_ids=ids).logits.float()
    out = []
    for i, (p, n) in enumerate(zip(batch.prompt_lengths, batch.completion_lengths, strict=True)):
        pad = width - len(seqs[i])
        z = logits[i, pad + p - 1 : pad + p - 1 + n] / batch.spec.temperature
        out.append(torch.log_softmax(z, -1).gather(1, batch.completion_ids[i][:, None]).squeeze(1))
    return out


def test_a_trainer_whose_scores_depend_on_its_batch_has_batch_composition_largest(engines, tmp_path) -> None:
    _, block = _budget(engines, tmp_path, PLAIN, trainer=left_pads_and_attends_to_padding)
    assert block["trainer"].endswith("left_pads_and_attends_to_padding")
    assert block["largest_fixable"] == "batch_composition", block["fix_first"]
    assert _row(block, "batch_composition")["share"]["mean_abs_delta"] > 0.5


def offsets_in_batch(mean: float, sd: float = 0.02):
    """A trainer under test that scores like the reference alone, and in a batch adds per-sequence offsets
    ``mean + sd * g`` (g fixed, centred over the batch's tokens: their mean over tokens is ``mean``)."""

    def trainer(batch):
        out = []
        for z, y in zip(batch.logits, batch.completion_ids, strict=True):
            out.append(torch.log_softmax(z.double() / batch.spec.temperature, -1).gather(1, y[:, None]).squeeze(1))
        if len(out) == 1:
            return out
        n = torch.tensor(batch.completion_lengths, dtype=torch.float64)
        g = torch.randn(len(out), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        g = g - (g * n).sum() / n.sum()
        return [o + mean + sd * float(gi) for o, gi in zip(out, g, strict=True)]

    return trainer


@pytest.mark.slow
def test_a_planted_fault_at_three_times_its_noise_is_attributed_and_at_a_third_is_within_noise(engines, tmp_path) -> None:
    def row(mean: float):
        _, block = _budget(engines, tmp_path, PLAIN, trainer=offsets_in_batch(mean))
        return _row(block, "batch_composition")

    noise = row(0.0)["noise"]["mean_delta"]
    assert noise and noise > 0
    big = row(3 * noise)
    assert not big["within_noise"]["mean_delta"] and big["drop"]["mean_delta"] == pytest.approx(3 * noise, rel=1e-3)
    small = row(0.3 * noise)
    assert small["within_noise"]["mean_delta"], small


def forgets_temperature(batch):
    """A trainer under test that scores log_softmax(z) whatever the sampler's temperature."""
    return [torch.log_softmax(z.double(), -1).gather(1, y[:, None]).squeeze(1)
            for z, y in zip(batch.logits, batch.completion_ids, strict=True)]


def test_a_trainer_that_forgets_temperature_has_that_row_largest(engines, tmp_path) -> None:
    cold = Scenario("T=0.7 top_p=1", SamplingSpec(0.7), prompts=8, max_tokens=16)
    _, block = _budget(engines, tmp_path, cold, trainer=forgets_temperature)
    row = _row(block, "logits_processors")
    assert row["status"] == "measured" and row["reason"] == "skipped: the division by T = 0.7", row
    assert block["largest_fixable"] == "logits_processors", block["fix_first"]
    assert block["fix_first"].startswith("fix first: logits processors skipped (")


def test_a_repetition_penalty_the_trainer_skips_is_the_largest_row_and_applying_it_leaves_drift_in_its_bound(
        engines, tmp_path) -> None:
    """TRL's trainer side under GRPOConfig.repetition_penalty: the full-vocabulary trainer scores the unpenalised
    logits. Unfiltered, so truncation has nothing to remove; the penalty row carries the gap."""
    pen = Scenario("T=1 rep=1.3", SamplingSpec(1.0, repetition_penalty=1.3), prompts=8, max_tokens=16)
    _, block = _budget(engines, tmp_path, pen)
    row = _row(block, "logits_processors")
    assert row["status"] == "measured" and row["reason"] == "skipped: the penalties (repetition_penalty=1.3)", row
    assert _row(block, "truncation")["status"] == "not_applicable"
    assert block["largest_fixable"] == "logits_processors", block["fix_first"]
    bound = block["remainder"]["bound"]
    assert bound is not None and bound["headroom"] <= 1.0, bound


def test_moe_with_a_bf16_sampler_has_a_routing_row_that_routing_replay_removes(engines, tmp_path) -> None:
    """The MoE fixture: the bf16 sampler routes some tokens to other experts than the float32 trainer does.
    Routing replay (R3) forces the trainer to the sampler's experts, and the gap it leaves drops. Routing comes
    before sampler precision here: once the sampler runs float32 too, both route alike and R3 has nothing left."""
    pool, samplers = engines
    order = ("moe_routing", "sampler_precision")
    cfg = BudgetConfig(model="qwen3-moe-tiny", matrix=Matrix("budget test", (PLAIN,)), out=tmp_path,
                       dtype="bfloat16", trainer_dtype="float32", order=order)
    report = budget(cfg, progress=lambda s: None, pool=pool, samplers=samplers)
    (block,) = report["budget"]["scenarios"]
    row = _row(block, "moe_routing")
    assert row["status"] == "measured", row
    assert row["drop"]["mean_abs_delta"] > 0 and row["after"]["mean_abs_delta"] < row["before"]["mean_abs_delta"], row
    assert block["largest_fixable"] == "sampler_precision", block["fix_first"]
