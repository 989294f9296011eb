"""TRL's asynchronous trainer end to end on the CPU engine (qwen2-tiny): a real vLLM server started with TRL's
log-prob flags, TRL's own rollout worker, TRL's own collator and compute_loss at step 0, as shipped, under the
replay patch, and under a replay of the wrong step's kept sets (the planted fault). Every relation is judged
against the resolution computed from this run's logits, never a stored number. Slow: a server start and TRL's
worker start (a spawned process that imports TRL) take minutes on a loaded 2-core machine."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("trl.experimental.async_grpo")

from parity.repro import trl_async_grpo  # noqa: E402
from parity.repro.common import Check, Context  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def measured() -> Any:
    cfg = trl_async_grpo.settings(small=True)
    cfg["settings"] = [{"top_p": 1.0}, {"top_p": 0.8}]
    return trl_async_grpo.run(Context(timeout_s=1800.0, progress=lambda s: None), cfg)


def _check(m: Any, start: str) -> Check:
    (c,) = [c for c in m.checks if c.statement.startswith(start)]
    return c


def test_it_ran_with_trl_s_server_flags_and_a_complete_capture(measured: Any) -> None:
    for start in ("every setting ran", "the vLLM server was started with the log-prob flags", "the capture held S_q"):
        c = _check(measured, start)
        assert c.passed, (c.statement, c.detail)


def test_as_shipped_the_ratio_is_s(measured: Any) -> None:
    c = _check(measured, "as shipped, TRL's ratio = S")
    assert c.passed, c.detail
    (row,) = [r for r in measured.rows if r["setting"] == {"top_p": 0.8}]
    assert row["mean_s"] < 1.0 - 10 * row["resolution"]  # the bias is resolved, not noise
    assert abs(row["ratio_shipped"] - 1.0) > 100 * row["resolution"]


def test_the_replay_fix_brings_the_ratio_to_one_and_clips_nothing(measured: Any) -> None:
    c = _check(measured, "with the replay fix")
    assert c.passed, c.detail
    assert _check(measured, "control: top_p=1").passed


def test_replaying_the_wrong_step_s_kept_set_fails(measured: Any) -> None:
    c = _check(measured, "negative control")
    assert c.passed, c.detail
    (row,) = [r for r in measured.rows if r["setting"] == {"top_p": 0.8}]
    assert row["err_planted"] > row["resolution"]


def test_the_logs_alone_give_the_full_vocabulary_class(measured: Any) -> None:
    c = _check(measured, "from the logs alone")
    assert c.passed, c.detail
