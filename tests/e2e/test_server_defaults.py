"""The server-default trap on spawned servers: fields a server fills from the checkpoint's generation_config.json.

A framework that omits a field samples with the checkpoint's default (vLLM's ``generation_config="auto"``); parity
finds which by omitting each field in turn. One server on qwen2-tiny as built (its generation config sets no
sampling field), one on a copy whose generation config sets a repetition penalty and top_k, as Qwen2.5-Instruct's do.
"""

from __future__ import annotations

import json
import shutil

import pytest

from parity.engines.vllm_server.client import ServerRollout, describe_generation_defaults
from parity.fixtures import resolve_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STARTUP_S = 300.0


def _probe(path) -> list[str]:
    server = ServerRollout(path, server="spawn", timeout_s=STARTUP_S)
    try:
        return server.probe_generation_defaults()
    finally:
        server.close()


def test_a_checkpoint_without_sampling_defaults_reports_nothing() -> None:
    filled = _probe(resolve_model("qwen2-tiny"))
    assert filled == []
    assert describe_generation_defaults(filled).startswith("server defaults: none")


def test_a_generation_config_repetition_penalty_is_detected(tmp_path) -> None:
    ckpt = tmp_path / "qwen2-tiny-genconfig"
    shutil.copytree(resolve_model("qwen2-tiny"), ckpt)
    cfg = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**cfg, "repetition_penalty": 1.3, "top_k": 20}))
    filled = _probe(ckpt)
    assert filled == ["top_k", "repetition_penalty"]
    line = describe_generation_defaults(filled)
    assert "fills top_k, repetition_penalty from the model's generation_config" in line
