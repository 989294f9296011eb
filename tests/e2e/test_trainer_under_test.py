"""Trainers under test: built-ins, deliberately wrong user trainers, and TRL's own helper."""

from __future__ import annotations

import pytest
import torch

from parity.core.spec import SamplingSpec
from parity.testing.asserts import assert_trainer_parity, check_trainer

pytestmark = pytest.mark.e2e

TOP_P = SamplingSpec(temperature=0.7, top_p=0.9)
PLAIN = SamplingSpec(temperature=0.7)


def _forward(batch) -> torch.Tensor:
    with torch.no_grad():
        return batch.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()


def good_trainer(batch):
    """What a correct trainer does when the sampler applies no filter: log_softmax(logits / T)."""
    logits = _forward(batch)
    out = []
    for i, (p, n) in enumerate(zip(batch.prompt_lengths, batch.completion_lengths, strict=True)):
        z = logits[i, p - 1 : p - 1 + n] / batch.spec.temperature
        out.append(torch.log_softmax(z, -1).gather(1, batch.completion_ids[i][:, None]).squeeze(1))
    return out


def forgets_temperature(batch):
    logits = _forward(batch)
    return [
        torch.log_softmax(logits[i, p - 1 : p - 1 + n], -1).gather(1, batch.completion_ids[i][:, None]).squeeze(1)
        for i, (p, n) in enumerate(zip(batch.prompt_lengths, batch.completion_lengths, strict=True))
    ]


def off_by_one(batch):
    """Labels not shifted: token t scored with the logits at its own position."""
    logits = _forward(batch)
    return [
        torch.log_softmax(logits[i, p : p + n] / batch.spec.temperature, -1).gather(1, batch.completion_ids[i][:, None]).squeeze(1)
        for i, (p, n) in enumerate(zip(batch.prompt_lengths, batch.completion_lengths, strict=True))
    ]


def replays_but_forgets_temperature(batch):
    """Renormalises over the sampler's kept set (right) but at T = 1 (wrong)."""
    logits = _forward(batch)
    out = []
    for i, (p, n) in enumerate(zip(batch.prompt_lengths, batch.completion_lengths, strict=True)):
        z = logits[i, p - 1 : p - 1 + n]
        kept = batch.kept_ids[i]
        vals = z.gather(1, kept.clamp(min=0)).masked_fill(kept < 0, float("-inf"))
        y = batch.completion_ids[i]
        out.append(z.gather(1, y[:, None]).squeeze(1) - torch.logsumexp(vals, -1))
    return out


def test_builtins_reproduce_the_end_to_end_results() -> None:
    assert assert_trainer_parity("replay", spec=TOP_P)["headroom"]["trainer_under_test"] <= 1.0
    assert assert_trainer_parity("recompute", spec=TOP_P)["headroom"]["trainer_under_test"] <= 1.0
    full = check_trainer("full", spec=TOP_P)
    assert full["violations"] and "full-vocabulary distribution" in str(full["violations"][0])
    assert abs(full["trainer_under_test"]["mean_diff"] - full["log_s"]["mean"]) <= full["bound"]["max"]


def test_a_correct_user_trainer_passes_without_filters() -> None:
    res = assert_trainer_parity(good_trainer, spec=PLAIN)
    assert res["trainer_under_test"]["diagnosis"].startswith("matches")


@pytest.mark.parametrize(
    ("fn", "spec", "problem"),
    [
        (good_trainer, TOP_P, "full-vocabulary distribution"),
        (forgets_temperature, PLAIN, "forgets to divide the logits by the sampling temperature"),
        (off_by_one, PLAIN, "one position late"),
        (replays_but_forgets_temperature, TOP_P, "forgets to divide the logits by the sampling temperature"),
        (forgets_temperature, TOP_P, "two bugs at once: it scores the full-vocabulary distribution"),
    ],
    ids=["full-vocab-under-top_p", "forgets-temperature", "off-by-one", "replay-forgets-T", "full-vocab-and-forgets-T"],
)
def test_wrong_user_trainers_fail_with_the_problem_class(fn, spec, problem) -> None:
    with pytest.raises(AssertionError) as err:
        assert_trainer_parity(fn, spec=spec)
    msg = str(err.value)
    assert problem in msg
    if "two bugs" in problem:
        assert "forgets to divide the logits" in msg
    for part in ("prompt ", "position ", "token ", "vllm=", "trainer_under_test=", "gap=", "bound="):
        assert part in msg


def test_trl_selective_log_softmax_shows_the_log_s_bias() -> None:
    trl_utils = pytest.importorskip("trl.trainer.utils", reason="TRL is not installed (pip install trl)")

    def trl_logprobs(batch):
        # TRL's GRPO path: logits / temperature, then its own selective_log_softmax over the vocabulary.
        logits = _forward(batch)
        out = []
        for i, (p, n) in enumerate(zip(batch.prompt_lengths, batch.completion_lengths, strict=True)):
            z = logits[i, p - 1 : p - 1 + n] / batch.spec.temperature
            out.append(trl_utils.selective_log_softmax(z[None], batch.completion_ids[i][None])[0])
        return out

    res = check_trainer(trl_logprobs, spec=TOP_P)
    assert res["violations"] and "full-vocabulary distribution" in str(res["violations"][0])
    assert assert_trainer_parity(trl_logprobs, spec=PLAIN)["headroom"]["trainer_under_test"] <= 1.0
